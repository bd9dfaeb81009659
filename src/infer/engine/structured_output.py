"""Constrained decoding through a grammar library (llguidance; docs/architecture.md says why).

A constraint (JSON schema, any JSON object, regex, choice, grammar) becomes the library's
grammar once per distinct constraint (cached here), each constrained sequence gets a
`GrammarMatcher`, and every step fills one next-token bitmask row per constrained sequence
(in the library's threads) and applies them to the logits in one batched operation.
Nothing else of the engine touches the library: four calls (compile, matcher, fill,
apply) and the matcher's `accept`, so another library could take its place here.

A bad constraint (invalid schema, a schema feature the library cannot handle, an invalid
regex, an unparsable grammar, an empty choice, two constraints at once) is a ValueError
naming the field and the library's reason.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from typing import Any

import torch

from infer.kernels import triton_available
from infer.kernels.reference import apply_token_bitmask_ref
from infer.loader.tokenizer import Tokenizer
from infer.structured_outputs import StructuredOutputsParams
from infer.transfer import to_device

GRAMMAR_CACHE_SIZE = 256
# A constraint whose grammar takes longer to compile fails its request (the compile runs
# on; only its result goes unused).
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


class CompileThread:
    """Where grammars compile, off the caller's thread, under a time limit (`timeout_s`).
    A compile cannot be stopped: one past the limit is left to its thread (`abandon`) and
    later compiles get a new thread, so one slow grammar holds up no other."""

    def __init__(self, timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pool = self._new_pool()

    @staticmethod
    def _new_pool() -> futures.ThreadPoolExecutor:
        return futures.ThreadPoolExecutor(1, thread_name_prefix="infer-grammar")

    def submit(self, fn: Callable[[], str]) -> futures.Future:
        with self._lock:
            return self._pool.submit(fn)

    def abandon(self) -> None:
        with self._lock:
            self._pool.shutdown(wait=False)
            self._pool = self._new_pool()

    def timeout_message(self) -> str:
        return f"compiling the constraint took longer than {self.timeout_s:g} s"


class GrammarError(ValueError):
    """A constraint the grammar library cannot take; `reason`: the library's, in short."""

    def __init__(self, kind: str, error: str) -> None:
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        # the library's first line, and its "error: ..." detail where it gives one
        detail = next((line for line in lines[1:] if line.startswith("error:")), None)
        self.reason = lines[0] + (f" {detail.removeprefix('error:').strip()}" if detail else "")
        super().__init__(f"structured_outputs.{kind}: {self.reason}")


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    def accept_all(self, token_ids: list[int]) -> bool:
        """Advance by several tokens (a verified row's); False if one is not allowed."""
        return self._matcher.consume_tokens(token_ids)

    def allowed_prefix(self, token_ids: list[int]) -> int:
        """How many of the first `token_ids` the grammar allows in a row, stopping before
        one that would finish it (a draft's row after it would have no mask); the
        matcher is left where it was."""
        n = self._matcher.try_consume_tokens(token_ids)
        if n and self._matcher.is_stopped():
            n -= 1
            self._matcher.rollback(1)
        if n:
            self._matcher.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        """The grammar is finished: it took the stop token, or allows nothing but it."""
        return self._matcher.is_stopped()


def import_grammar_library() -> None:
    """Import the grammar library now, in the calling thread, if it is installed (a missing
    one is reported by the first constrained request): before a process freezes its
    start-up heap, so that the library's modules are frozen with it."""
    with contextlib.suppress(ImportError):
        import llguidance.gbnf_to_lark  # noqa: F401


class StructuredOutputs:
    """The grammar library bound to one tokenizer and one logits width (`vocab_size`, the
    model's, which may exceed the tokenizer's: ids past the tokenizer's are never allowed).
    Masks are filled in the library's own threads (`threads` of them; 0: its default),
    without the GIL."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, threads: int = 0) -> None:
        # Not llguidance.torch: its import compiles a function with torch.compile, which
        # brings in sympy and ~80k objects that every full garbage collection then walks
        # (0.2-0.5 s a collection, a decode step's stall).
        import llguidance
        import llguidance.gbnf_to_lark

        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(library_tokenizer_json(tokenizer),
                                                 n_vocab=vocab_size,
                                                 eos_token=list(tokenizer.eos_token_ids))
        self._executor = llguidance.LLExecutor(threads or None)
        self.vocab_size = vocab_size
        self._grammars: OrderedDict[tuple[str, ...], str] = OrderedDict()
        # A server compiles in its tokenizer threads while its event loop looks up.
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        # Recorded after the buffer's last copy to the device was queued.
        self._buffer_copied: torch.cuda.Event | None = None

    def cached(self, params: StructuredOutputsParams) -> str | None:
        """The constraint's grammar if it is compiled already, else None."""
        key = _cache_key(params)
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
            return grammar

    def compile(self, params: StructuredOutputsParams) -> str:
        """The library's grammar for a constraint, checked against the vocabulary (the
        last GRAMMAR_CACHE_SIZE are kept); ValueError naming the field if it is not one."""
        grammar = self.cached(params)
        if grammar is not None:
            return grammar
        key = _cache_key(params)
        kind, text = params.key
        try:
            grammar = self._grammar(kind, text)
            if params.reasoning_tags is not None:
                grammar = _after_reasoning(grammar, *params.reasoning_tags)
            error = self._llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        except Exception as exc:
            error = str(exc).strip() or repr(exc)
        if error:
            raise GrammarError(kind, error)
        with self._lock:
            self._grammars[key] = grammar
            if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def _grammar(self, kind: str, text: str) -> str:
        matcher = self._llg.LLMatcher
        if kind in ("json", "json_object"):
            # No free whitespace between tokens: a small model can loop on it forever.
            return matcher.grammar_from_json_schema(
                text or '{"type": "object"}', defaults={"whitespace_flexible": False})
        if kind == "regex":
            return matcher.grammar_from_regex(text)
        if kind == "choice":
            return matcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(text)))
        # Lark, or GBNF-style EBNF converted to Lark
        return matcher.grammar_from_lark(self._llg.gbnf_to_lark.any_to_lark(text))

    def matcher(self, grammar: str) -> GrammarMatcher:
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def allocate_masks(self, rows: int) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 bitmasks on the CPU: bit j of word i set means
        token 32 i + j is allowed."""
        return torch.zeros((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)

    def step_masks(self, rows: int) -> torch.Tensor:
        """`allocate_masks(rows)` for one step, from a buffer kept between steps (pinned
        where CUDA is, so the copy to the device can be queued): rows not filled this
        step hold stale bits and must be left out of `apply_masks`."""
        if self._buffer_copied is not None:
            # The previous step's copy may still be queued behind its forward: refilling
            # the buffer now would change what it copies. The engine has waited for that
            # step's tokens (sampled after the copy) before it fills again, so this waits
            # only where it did not (e.g. every constrained row of it was aborted).
            self._buffer_copied.synchronize()
            self._buffer_copied = None
        have = 0 if self._buffer is None else len(self._buffer)
        if have < rows:
            self._buffer = self.allocate_masks(max(rows, 2 * have))
            if torch.cuda.is_available():
                self._buffer = self._buffer.pin_memory()
        return self._buffer[:rows]

    def fill_masks(self, matchers: list[GrammarMatcher], masks: torch.Tensor,
                   rows: list[int] | None = None) -> None:
        """Row rows[i] (default: i) of `masks` := the tokens `matchers[i]` allows next,
        filled in parallel."""
        rows = rows if rows is not None else list(range(len(matchers)))
        _check_mask_buffer(masks)
        self._executor.unsafe_compute_mask_ptr(
            [(m._matcher, row) for m, row in zip(matchers, rows)], masks.data_ptr(),
            masks.shape[1] * 4, masks.shape[0])

    def fill_masks_with_drafts(self, entries: list[tuple[int, GrammarMatcher, list[int]]],
                               masks: torch.Tensor) -> None:
        """For each (row, matcher, drafts): row `row` := what the matcher allows next, row
        `row + j` := what it allows after the first j drafts (each allowed), in parallel;
        matchers are left where they were."""
        _check_mask_buffer(masks)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            [(m._matcher, row, drafts) for row, m, drafts in entries], masks.data_ptr(),
            masks.shape[1] * 4, masks.shape[0])

    def apply_masks(self, logits: torch.Tensor, masks: torch.Tensor,
                    rows: list[int] | None = None) -> None:
        """Disallowed tokens -> -inf, in place: mask row i on logits row i, for the rows
        in `rows` (default: every row; unconstrained rows are left out of `rows`), in one
        batched operation on whatever device the logits live. Logits past the mask's
        32 * words columns are disallowed. Queued without waiting for the device."""
        device = logits.device
        index = None
        if rows is not None and rows != list(range(len(masks))):
            index = to_device(torch.tensor(rows, dtype=torch.int64), device)
        apply_token_masks(logits, self._on_device(masks, device), index)

    def sampler_masks(self, rows: int, masked: list[tuple[int, GrammarMatcher]],
                      device: torch.device) -> torch.Tensor:
        """A step's `[rows, words]` bitmasks on `device`, for the sampler (which applies
        them in its own pass): each (row, matcher) of `masked` what its matcher allows
        next, every other row every token. Queued without waiting for the device."""
        masks = self.step_masks(rows)
        constrained = [row for row, _ in masked]
        if len(constrained) < rows:
            # In numpy, not torch: a torch CPU op large enough to run in parallel (or an
            # empty boolean index) leaves torch's threads spinning for milliseconds, on
            # the cores the library's parallel fill needs (measured 2-3x slower fills).
            masks.numpy()[sorted(set(range(rows)) - set(constrained))] = -1
        self.fill_masks([matcher for _, matcher in masked], masks, constrained)
        return self._on_device(masks, device)

    def _on_device(self, masks: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`masks` on `device`; a copy of the step buffer (pinned: no staging copy) is
        recorded, so that the next step's `step_masks` waits for it before refilling."""
        words = to_device(masks, device)
        if (device.type == "cuda" and self._buffer is not None
                and masks.data_ptr() == self._buffer.data_ptr()):
            if self._buffer_copied is None:
                self._buffer_copied = torch.cuda.Event()
            self._buffer_copied.record()
        return words


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor,
                      rows: torch.Tensor | None = None) -> None:
    """Disallowed tokens -> -inf in place (`masks` and the row index `rows`, if any, on
    the logits' device): infer's kernel on CUDA, the torch reference elsewhere."""
    with torch.inference_mode():  # the logits are inference tensors
        if logits.is_cuda and triton_available():
            from infer.kernels.token_bitmask import apply_token_bitmask

            apply_token_bitmask(logits, masks, rows)
        else:
            apply_token_bitmask_ref(logits, masks, rows)


def library_tokenizer_json(tokenizer: Tokenizer) -> str:
    """The tokenizer as the grammar library reads it: its JSON, without padding or
    truncation."""
    backend = copy.copy(tokenizer.backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _cache_key(params: StructuredOutputsParams) -> tuple[str, ...]:
    """The constraint's own key, and the reasoning tags that wrap it."""
    return (*params.key, *(params.reasoning_tags or ()))


def _after_reasoning(grammar: str, start: str, end: str) -> str:
    """`grammar` preceded by an optional free-text part from `start` to `end` (a
    mandatory one up to `end` if `start` is empty) and whitespace: the library's grammar
    list, whose first entry refers to `grammar`'s."""
    if grammar.lstrip().startswith("{"):  # the library's JSON form: a list of grammars
        inner = json.loads(grammar)["grammars"]
    else:  # Lark text
        inner = [{"name": "constrained", "lark_grammar": grammar, "json_schema": None}]
    inner[0]["name"] = "constrained"
    rules = ["start: reasoning_text _ws @constrained"] if not start else [
        "start: reasoning? _ws @constrained", f"reasoning: {json.dumps(start)} reasoning_text"]
    rules += [f"reasoning_text[suffix={json.dumps(end)}]: /(?s:.*)/", "_ws: /[ \\t\\r\\n]*/"]
    lark = "\n".join(rules) + "\n"
    first = {"name": "after_reasoning", "lark_grammar": lark, "json_schema": None}
    return json.dumps({"grammars": [first, *inner], "max_tokens": None})


def _check_mask_buffer(masks: torch.Tensor) -> None:
    """The library writes `masks` through its pointer: it must be a whole CPU int32
    matrix laid out row after row."""
    if not (masks.dtype == torch.int32 and masks.device.type == "cpu" and masks.dim() == 2
            and masks.is_contiguous()):
        raise ValueError(f"token masks must be a contiguous 2-D int32 CPU tensor, not "
                         f"{masks.dtype} {tuple(masks.shape)} on {masks.device}")
