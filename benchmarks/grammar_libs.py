"""xgrammar vs llguidance on our tokenizers: what a grammar costs to set up and per token.

For each tokenizer (the real SmolLM2 and Gemma 3 vocabularies from their GGUF packages):
the time to build each library's view of the vocabulary; for each constraint (JSON
schemas, a regex, a choice) the time from the constraint to a matcher ready for its
first mask ("compile", cold: nothing cached); and the time to fill one next-token mask,
over the tokens of a valid answer written by hand (both libraries walk the same tokens,
and must accept them).

    python benchmarks/grammar_libs.py [--tokenizers smollm2 gemma3 | NAME=DIR ...]

Needs both libraries (`pip install xgrammar llguidance`; only llguidance is a dependency).

Prints one table and writes benchmarks/results/grammar_libs_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age"],
}
CONSTRAINTS: list[tuple[str, str, object, str]] = [
    # (name, kind, constraint, a valid answer)
    ("object", "json", PERSON,
     '{"name": "Ada Lovelace", "age": 36, "email": "ada@math.uk", "tags": ["math", "code"]}'),
    ("nested", "json", {
        "type": "object",
        "properties": {"owner": PERSON, "pets": {"type": "array", "items": {
            "type": "object", "properties": {
                "kind": {"enum": ["cat", "dog", "fish"]},
                "weight": {"type": "number", "minimum": 0}},
            "required": ["kind"]}}},
        "required": ["owner", "pets"]},
     '{"owner": {"name": "Bo", "age": 7}, "pets": [{"kind": "cat", "weight": 4.5}, '
     '{"kind": "fish"}]}'),
    ("anyOf", "json", {"anyOf": [
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3}]},
     '{"city": "Paris"}'),
    ("any JSON", "json", {}, '{"answer": [1, 2.5, "three", null, true], "ok": false}'),
    ("regex", "regex", r"\d{3}-\d{3}-\d{4}", "555-123-4567"),
    ("choice", "choice", ["positive", "negative", "neutral"], "negative"),
]


def _hf_tokenizer(tokenizer):
    """transformers' fast-tokenizer wrapper around our `tokenizers` backend (both
    libraries read the vocabulary through it)."""
    from transformers import PreTrainedTokenizerFast

    eos = tokenizer.eos_token
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=eos)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int, eos_ids: list[int]) -> None:
        import xgrammar

        self.xg = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                            stop_token_ids=eos_ids)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab_size = vocab_size

    def matcher(self, kind: str, constraint):
        if kind == "json":
            compiled = self.compiler.compile_json_schema(json.dumps(constraint))
        elif kind == "regex":
            compiled = self.compiler.compile_regex(constraint)
        else:
            compiled = self.compiler.compile_regex("|".join(map(_escape, constraint)))
        return self.xg.GrammarMatcher(compiled)

    def bitmask(self):
        return self.xg.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepts_end(self, matcher) -> bool:
        return matcher.is_terminated() or matcher.accept_token(self.info.stop_token_ids[0])


    def batch_fill(self, matchers, bitmask) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xg.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def matcher(self, kind: str, constraint):
        m = self.llg.LLMatcher
        if kind == "json":
            grammar = m.grammar_from_json_schema(json.dumps(constraint))
        elif kind == "regex":
            grammar = m.grammar_from_regex(constraint)
        else:
            grammar = m.grammar_from_regex("|".join(map(_escape, constraint)))
        matcher = m(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def bitmask(self):
        return self.llg_torch.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, matcher, bitmask) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def batch_fill(self, matchers, bitmask) -> None:
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor()
        self.llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accepts_end(self, matcher) -> bool:
        return matcher.is_accepting()


def _escape(text: str) -> str:
    return "".join("\\" + c if not c.isalnum() else c for c in text)


def _allowed(bitmask, token: int) -> bool:
    word = int(bitmask[0, token // 32])
    return bool((word >> (token % 32)) & 1)


def measure(lib, tokenizer, kind: str, constraint, answer: str) -> dict:
    t = time.perf_counter()
    matcher = lib.matcher(kind, constraint)
    compile_ms = (time.perf_counter() - t) * 1e3
    bitmask = lib.bitmask()
    fills = []
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    rejected_at = None
    for i, token in enumerate(tokens):
        t = time.perf_counter()
        lib.fill(matcher, bitmask)
        fills.append(time.perf_counter() - t)
        if not _allowed(bitmask, token) or not lib.accept(matcher, token):
            rejected_at = i
            break
    return {"compile_ms": compile_ms, "tokens": len(tokens),
            "mask_us_mean": statistics.mean(fills) * 1e6 if fills else None,
            "mask_us_max": max(fills) * 1e6 if fills else None,
            "rejected_at": rejected_at,
            "accepts_end": rejected_at is None and lib.accepts_end(matcher)}


def measure_batch(lib, tokenizer, batch: int) -> dict:
    """One next-token mask for each of `batch` requests under the same schema, each at a
    different point of its answer: the library's own parallel batch fill, and one row at
    a time."""
    _, kind, constraint, answer = CONSTRAINTS[1]
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    matchers = []
    for i in range(batch):
        matcher = lib.matcher(kind, constraint)
        for token in tokens[:i % len(tokens)]:
            lib.accept(matcher, token)
        matchers.append(matcher)
    bitmask = lib.xg.allocate_token_bitmask(batch, lib.vocab_size) if hasattr(lib, "xg") \
        else lib.llg_torch.allocate_token_bitmask(batch, lib.vocab_size)
    lib.batch_fill(matchers, bitmask)  # warm: threads started, first masks cached
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        lib.batch_fill(matchers, bitmask)
        runs.append(time.perf_counter() - t)
    one = lib.bitmask()
    t = time.perf_counter()
    for matcher in matchers:
        lib.fill(matcher, one)
    serial = time.perf_counter() - t
    return {"batch": batch, "batch_fill_ms": statistics.median(runs) * 1e3,
            "serial_fill_ms": serial * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizers", nargs="+", default=["smollm2", "gemma3"],
                   help="smollm2 and gemma3 (from their model packages), or NAME=DIR for a "
                   "tokenizer directory (tokenizer.json + tokenizer_config.json)")
    p.add_argument("--batches", type=int, nargs="*", default=[32, 256])
    common.add_common_args(p)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from real_models import gemma3_gguf, smollm2_gguf

    from infer.loader.tokenizer import Tokenizer

    def ours(name: str) -> Tokenizer:
        if "=" in name:
            return Tokenizer.from_hf_dir(name.split("=", 1)[1])
        return Tokenizer.from_gguf(smollm2_gguf() if name == "smollm2" else gemma3_gguf())

    rows, batches = [], []
    for spec in args.tokenizers:
        tokenizer, name = ours(spec), spec.split("=", 1)[0]
        vocab = tokenizer.vocab_size
        hf = _hf_tokenizer(tokenizer)
        for cls in (XGrammar, LLGuidance):
            t = time.perf_counter()
            lib = cls(hf, vocab, list(tokenizer.eos_token_ids))
            setup_s = time.perf_counter() - t
            for cname, kind, constraint, answer in CONSTRAINTS:
                row = {"tokenizer": name, "vocab": vocab, "library": lib.name,
                       "vocab_setup_s": setup_s, "constraint": cname,
                       **measure(lib, tokenizer, kind, constraint, answer)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            for batch in args.batches:
                row = {"tokenizer": name, "library": lib.name,
                       **measure_batch(lib, tokenizer, batch)}
                batches.append(row)
                print(json.dumps(row), flush=True)
    print("| tokenizer (vocab) | library | vocab setup s | constraint | compile ms | mask µs "
          "mean / max | tokens | accepted |\n|---|---|---:|---|---:|---:|---:|---|")
    for r in rows:
        ok = "yes" if r["accepts_end"] else f"no (at {r['rejected_at']})"
        print(f"| {r['tokenizer']} ({r['vocab']:,}) | {r['library']} | {r['vocab_setup_s']:.2f} "
              f"| {r['constraint']} | {r['compile_ms']:.1f} | {r['mask_us_mean']:.0f} / "
              f"{r['mask_us_max']:.0f} | {r['tokens']} | {ok} |")
    print("\n| tokenizer | library | batch | batch fill ms (parallel) | one row at a time ms |"
          "\n|---|---|---:|---:|---:|")
    for r in batches:
        print(f"| {r['tokenizer']} | {r['library']} | {r['batch']} | {r['batch_fill_ms']:.2f} "
              f"| {r['serial_fill_ms']:.2f} |")
    common.write_results("grammar_libs", args, {"rows": rows, "batches": batches})


if __name__ == "__main__":
    main()
