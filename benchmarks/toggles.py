"""Toggle progression: the serving workloads with one optimisation switched on per row.

    static -> + continuous batching -> + paged KV cache -> + chunked prefill
           -> + prefix caching -> + CUDA graphs

Each row launches `infer serve` on a random-weight checkpoint in a real shape (by default
Llama-3.2-3B) that carries a real BPE tokenizer, so the text prompts of
`workloads.py` tokenize as for a real model (and the shared prefix is a real prefix);
the vocabulary, and with it the LM head, is the tokenizer's. Every row runs every
workload (serve_bench.py's client); the table shows each row on all of them, the
featured workload of a row in bold, with the change against the row before.

The KV budget is fixed in tokens for every row (`--kv-tokens`, like the seed's 2048
blocks of 16): with the contiguous cache that is `kv_tokens / max_model_len` sequences,
with the paged cache as many as their actual lengths allow (up to `--max-num-seqs`).
The Triton kernels are on in every row (the backend is not part of the progression).

    # once, on a machine with the default model installed: export its tokenizer
    python benchmarks/toggles.py --export-tokenizer .assets/smollm2
    # on the GPU (carry .assets/); --rows picks a subset, e.g. to split the run in two
    python benchmarks/toggles.py --tokenizer .assets/smollm2 --rows 1 2 3 --suffix _a
    python benchmarks/toggles.py --merge results/toggles_*_a.json results/toggles_*_b.json

Writes benchmarks/results/toggles_<device><suffix>.json (every row's full serve_bench
results) and prints the progression table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common
import serve_bench
from workloads import NAMES

FEATURED = ("paged_attention", "continuous_batching", "paged_attention", "chunked_prefill",
            "prefix_caching", "baseline")


def rows(max_model_len: int, kv_tokens: int, max_num_seqs: int, chunk: int
         ) -> list[tuple[str, list[str]]]:
    """(label, `infer serve` flags) per row; each row adds one flag set to the one before."""
    contiguous = ["--kv-cache", "contiguous", "--num-blocks", str(kv_tokens // max_model_len)]
    paged = ["--kv-cache", "paged", "--block-size", "16", "--num-blocks",
             str(kv_tokens // 16)]
    unchunked = ["--no-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
    chunked = ["--chunked-prefill", "--prefill-chunk-size", str(chunk),
               "--max-num-batched-tokens", str(max(2048, chunk))]
    base = ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--no-cuda-graphs", "--no-prefix-caching"]
    steps = [
        ("static batching, contiguous KV", ["--batching-mode", "static", *contiguous,
                                            *unchunked]),
        ("+ continuous batching", ["--batching-mode", "continuous", *contiguous, *unchunked]),
        ("+ paged KV cache", ["--batching-mode", "continuous", *paged, *unchunked]),
        ("+ chunked prefill", ["--batching-mode", "continuous", *paged, *chunked]),
        ("+ prefix caching", ["--batching-mode", "continuous", *paged, *chunked,
                              "--prefix-caching"]),
        ("+ CUDA graphs", ["--batching-mode", "continuous", *paged, *chunked,
                           "--prefix-caching", "--cuda-graphs"]),
    ]
    return [(label, base + flags) for label, flags in steps]


def export_tokenizer(dest: Path) -> None:
    """tokenizer.json + tokenizer_config.json of the embedded default model (SmolLM2)."""
    from infer.loader.default_model import default_model_path
    from infer.loader.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    dest.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(tok.special_tokens))
    print(f"wrote {dest}/tokenizer.json ({tok.vocab_size} tokens)")


def cell(result: dict, before: dict | None) -> str:
    tps, ttft, itl = (result["output_tok_per_s"], result["ttft_s"]["p50"],
                      result["itl_s"]["p99"])
    text = f"{tps:,.0f} tok/s, TTFT {ttft * 1000:,.0f} ms, ITL p99 {itl * 1000:,.0f} ms"
    if before is not None:
        text += f" ({tps / before['output_tok_per_s'] - 1:+.0%})"
    return text + (f", {result['errors']} ERRORS" if result["errors"] else "")


def table(done: list[dict]) -> str:
    lines = ["| row | flags added | " + " | ".join(NAMES) + " |",
             "|---|---|" + "---|" * len(NAMES)]
    prev: dict[str, dict] | None = None
    for row in done:
        by_name = {r["workload"]: r for r in row["results"]}
        cells = []
        for name in NAMES:
            text = cell(by_name[name], prev and prev.get(name)) if name in by_name else "-"
            cells.append(f"**{text}**" if name == row["featured"] else text)
        lines.append(f"| {row['index']} | {row['label']} | " + " | ".join(cells) + " |")
        prev = by_name
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--export-tokenizer", type=Path, help="write the tokenizer there and stop")
    p.add_argument("--merge", type=Path, nargs="+",
                   help="print one table from the JSON of runs of different --rows and stop")
    p.add_argument("--tokenizer", type=Path, help="directory with tokenizer.json")
    p.add_argument("--shape", default="llama-3.2-3b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--workload", nargs="+", default=list(NAMES), choices=NAMES)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-tokens", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=24)
    p.add_argument("--prefill-chunk-size", type=int, default=512)
    p.add_argument("--tiny", action="store_true", help="tiny shape, a CPU check of the script")
    p.add_argument("--ckpt-root")
    p.add_argument("--suffix", default="")
    p.add_argument("--results-dir", default=str(common.RESULTS))
    args = p.parse_args()
    if args.export_tokenizer:
        export_tokenizer(args.export_tokenizer)
        return 0
    if args.merge:
        runs = [json.loads(f.read_text()) for f in args.merge]
        print(table(sorted((row for run in runs for row in run["rows"]),
                           key=lambda row: row["index"])))
        return 0
    if args.tokenizer is None:
        p.error("--tokenizer is required (make one with --export-tokenizer)")
    path = common.get_checkpoint(args.shape, args.tiny, args.ckpt_root, args.tokenizer)
    extra = ["--device", "cpu", "--dtype", "float32"] if args.tiny else []
    all_rows = rows(args.max_model_len, args.kv_tokens, args.max_num_seqs,
                    args.prefill_chunk_size)
    out = Path(args.results_dir) / f"toggles_{common.device_slug()}{args.suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = []
    for index in args.rows:
        label, flags = all_rows[index - 1]
        flags = ["--model", str(path), *flags, *extra]
        bench_args = serve_bench.parse_args(["--launch", "--workload", *args.workload,
                                             "--scale", str(args.scale), "--", *flags])
        log = Path(tempfile.gettempdir()) / f"toggles_row{index}.log"
        print(f"[row {index}] {label}: infer serve {' '.join(flags)}", flush=True)
        with serve_bench.launched(flags, None, log, bench_args.launch_timeout) as url:
            _, results = asyncio.run(serve_bench.bench(bench_args, url))
        print(serve_bench.table(results), flush=True)
        done.append({"index": index, "label": label, "flags": flags,
                     "featured": FEATURED[index - 1], "results": results})
        payload = {"shape": args.shape, "tokenizer": str(args.tokenizer), "scale": args.scale,
                   "kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "rows": done, "env": common.env_info()}
        out.write_text(json.dumps(payload, indent=1))  # after every row: a cut run keeps it
    print(f"\n{args.shape} (random weights, {args.tokenizer.name} tokenizer), scale "
          f"{args.scale}, KV budget {args.kv_tokens} tokens; JSON in {out}")
    print(table(done))
    errors = sum(r["errors"] for row in done for r in row["results"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
