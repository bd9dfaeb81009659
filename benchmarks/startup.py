"""Start-up: process launch to first token, llama-3.2-1b shape (random weights, bf16).

The checkpoint is written first (not timed). Then, --repeats times, a fresh
`python -c` subprocess imports infer, builds `LLM(checkpoint, **engine flags)` and generates
one token from a 16-token prompt; the parent stamps the launch, the child stamps each
phase with the same monotonic clock (system-wide on Linux), so the table gives:
  launch -> interpreter up -> `import infer` done -> LLM built -> first token -> exit.
The first run may pay one-off costs (kernel compilation caches, file cache); later runs
show the warm start. Whatever timing the engine itself exposes is printed too: keys of
`llm.engine.stats()` that look like times (load, capture, compile, warm-up, ..., seconds)
and engine attributes named like startup timings, if any exist.

The copy bandwidth and the matmul rate are measured in the parent process (for the
record); "load GB/s" = checkpoint bytes / LLM build time, as a fraction of the copy
bandwidth (a load is bound by the host and the disk, so expect a small fraction).

    PYTHONPATH=src python benchmarks/startup.py [--engine cuda_graphs=true ...]
    python benchmarks/startup.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

CHILD = r"""
import json, sys, time
t_up = time.monotonic()
a = json.loads(sys.argv[1])
if a["cpu_threads"]:
    import torch
    torch.set_num_threads(1)
from infer import LLM, SamplingParams
t_import = time.monotonic()
llm = LLM(a["path"], **a["flags"])
t_built = time.monotonic()
out = llm.generate([a["prompt"]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                   use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 1
t_token = time.monotonic()
eng = llm.engine
try:
    stats = eng.stats()
except Exception as exc:
    stats = {"error": repr(exc)}
words = ("time", "load", "capture", "compile", "warm", "startup", "_s", "sec", "graph")
timing = {k: v for k, v in stats.items() if any(w in k.lower() for w in words)}
attrs = {}
for name in dir(eng):
    low = name.lower()
    if not name.startswith("__") and any(w in low for w in ("startup", "timing", "load_time",
                                                              "capture_time", "compile_time")):
        value = getattr(eng, name)
        if not callable(value):
            attrs[name] = value
metrics = getattr(out[0], "metrics", None) or {}
print("@@RESULT " + json.dumps(dict(up=t_up, imported=t_import, built=t_built, token=t_token,
                                    engine_timing=timing, engine_attrs=attrs, stats=stats,
                                    request_metrics=metrics), default=str), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="per child, seconds")
    args = parser.parse_args()
    user_flags = common.parse_engine_flags(args.engine)
    common.setup_cpu_threads()
    ceil = common.ceilings()
    path = common.get_checkpoint(args.model, args.tiny, args.ckpt_root)
    ckpt_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    common.free_memory()
    flags = common.merged_flags(dict(max_model_len=2048), user_flags)
    child_arg = json.dumps(dict(path=str(path), flags=flags,
                                prompt=[(7 * i + 11) % 500 + 3 for i in range(16)],
                                cpu_threads=not common.torch.cuda.is_available()))
    env = dict(os.environ)
    src = str(common.ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), src) if p)
    rows: list[dict] = []
    out = None
    for run in range(1, args.repeats + 1):
        launch = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", CHILD, child_arg], env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        exited = time.monotonic()
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            rows.append(dict(run=run, error=f"child exited {proc.returncode}"))
            continue
        r = json.loads(line[len("@@RESULT "):])
        row = dict(run=run, model=args.model,
                   interpreter_s=r["up"] - launch, import_s=r["imported"] - r["up"],
                   build_s=r["built"] - r["imported"], first_token_s=r["token"] - r["built"],
                   launch_to_token_s=r["token"] - launch, launch_to_exit_s=exited - launch,
                   load_GBps=ckpt_bytes / (r["built"] - r["imported"]) / 1e9,
                   engine_timing=r["engine_timing"], engine_attrs=r["engine_attrs"],
                   stats=r["stats"], request_metrics=r["request_metrics"])
        row["frac_copy_load"] = row["load_GBps"] / ceil["copy_GBps"]
        rows.append(row)
        print(f"[startup] run {run}: launch -> first token {row['launch_to_token_s']:.2f} s "
              f"(import {row['import_s']:.2f}, build {row['build_s']:.2f}, token "
              f"{row['first_token_s']:.3f})", flush=True)
        out = common.write_results("startup", args, dict(
            ceilings=ceil, checkpoint_GB=ckpt_bytes / 1e9, engine_flags=flags, rows=rows))
    out = common.write_results("startup", args, dict(
        ceilings=ceil, checkpoint_GB=ckpt_bytes / 1e9, engine_flags=flags, rows=rows))
    print(f"\nwrote {out}")
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['matmul_TFLOPs']:.1f} "
          f"TFLOP/s; checkpoint {ckpt_bytes / 1e9:.2f} GB; flags {flags}")
    for row in rows:
        if "error" in row:
            print(f"run {row['run']}: {row['error']}")
            continue
        found = {**row["engine_timing"], **row["engine_attrs"]}
        print(f"run {row['run']} engine-reported timings: "
              + (json.dumps(found, default=str) if found else
                 "none (stats() has no load/capture/compile times; keys: "
                 + ", ".join(sorted(row["stats"])) + ")"))
    common.print_table(
        "startup (seconds from subprocess launch)", [r for r in rows if "error" not in r],
        [("model", "model", ""), ("run", "run", "d"), ("interp", "interpreter_s", ".2f"),
         ("import", "import_s", ".2f"), ("build LLM", "build_s", ".2f"),
         ("1st token", "first_token_s", ".3f"), ("launch->token", "launch_to_token_s", ".2f"),
         ("launch->exit", "launch_to_exit_s", ".2f"), ("load GB/s", "load_GBps", ".2f"),
         ("%copyBW", "frac_copy_load", ".2%")])
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
