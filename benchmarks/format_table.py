"""One table of decode steps by weight format from `decode.py`'s JSONs: each format's
ms a step, tok/s, GB read a step, % of the copy rate measured in its own run, and its
ratio to the first format's step at the same batch (issue 13's "x bf16"), with the JSON
and commit each row came from, so that rows measured apart say so.

    python benchmarks/format_table.py --batches 1 32 \
        --format bf16=benchmarks/results/decode_h100_80gb_hbm3_s70a_bf16.json \
        --format fp8=benchmarks/results/decode_h100_80gb_hbm3_s70a_fp8_def1.json,...

Each `--format label=path[,path...]`: a format and the runs that measured it (the first run holding
a batch gives that batch's row); a path ending `#MIX` names a `llamacpp_cuda.py` run and the
GGUF mix of its `llama-batched-bench` rows (our protocol), for the peer's rows beside
ours: `"llama.cpp Q4_K_M=benchmarks/results/llamacpp_cuda_h100_80gb_hbm3.json#Q4_K_M"`.
Prints a markdown table; reads, writes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

Run = tuple[str, dict, str]  # file name, its JSON, the llama.cpp mix ("": infer's rows)


def load(spec: str) -> tuple[str, list[Run]]:
    """`label=path[#MIX][,path[#MIX]...]` -> (label, its runs)."""
    label, sep, paths = spec.partition("=")
    if not sep or not label or not paths:
        raise ValueError(f"expected label=path[,path...], got {spec!r}")
    runs = []
    for item in paths.split(","):
        path, _, mix = item.partition("#")
        runs.append((Path(path).name, json.loads(Path(path).read_text()), mix))
    return label, runs


def row_at(runs: list[Run], batch: int, model: str) -> tuple[str, dict, dict] | None:
    """The first run's row for `batch` (infer's on `model`, or llama-batched-bench's of the
    run's mix), with the run's name and JSON."""
    for name, run, mix in runs:
        for row in run["rows"]:
            ours = (row.get("mix") == mix and row.get("tool") == "llama-batched-bench"
                    if mix else row.get("engine") == "infer" and row.get("model") == model)
            if ours and row["batch"] == batch:
                return name, run, row
    return None


def table(formats: list[tuple[str, list[Run]]], batches: list[int],
          model: str = "llama-3.1-8b") -> str:
    """The markdown table; the first format is the reference of the ratio column."""
    lines = ["| format | batch | ms / step | tok/s | GB / step | % copy | x "
             f"{formats[0][0]} | run (commit) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for batch in batches:
        ref = row_at(formats[0][1], batch, model)
        for label, runs in formats:
            found = row_at(runs, batch, model)
            if found is None:
                lines.append(f"| {label} | {batch} | - | - | - | - | - | not measured |")
                continue
            name, run, row = found
            ratio = f"{ref[2]['step_ms'] / row['step_ms']:.2f}" if ref else "-"
            gb = (row["weight_MB"] + row["kv_MB"]) / 1000
            tok_per_s = batch * 1000 / row["step_ms"]
            lines.append(
                f"| {label} | {batch} | {row['step_ms']:.2f} | {tok_per_s:,.0f} | "
                f"{gb:.2f} | {100 * row['frac_copy']:.1f} % | {ratio} | "
                f"`{name}` ({run['env'].get('infer_commit', '?')[:7]}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--model", default="llama-3.1-8b", help="decode.py's model name")
    parser.add_argument("--format", action="append", required=True, dest="formats",
                        help="label=path[,path...]; the first: the ratios' reference")
    args = parser.parse_args(argv)
    print(table([load(spec) for spec in args.formats], args.batches, args.model))


if __name__ == "__main__":
    main()
