"""Launch settings of the paged decode attention kernel (keys per tile, warps, pipeline
stages, keys a split takes at least, the partials combined one split at a time or several
at once) on the shapes that decide decode speed, bf16 on CUDA:
GB/s of KV read (and % of the copy bandwidth measured in the same run) per setting; the
first row is the default. Launched as the engine's graphs launch it: the splits combined
by the last of them (`split_counters`), inside a CUDA graph of many calls with dependent
launch on where the GPU has it, each call reading a KV cache of its own from a set larger
than the L2 cache three times over (as a decode step's layers find theirs: evicted by the
weights since the step before); a verify step's case brings k + 1 = 5 tokens a sequence.
(`do_bench`'s one launch at a time, timed before, gave 13-120 µs for launches that take
5-10 µs in a step.)

    PYTHONPATH=src python benchmarks/decode_attention_tuning.py [out.json] [--cases b1 ...]
        [--kv-cache-dtype fp8] [--default-only]

`--cases`: only the cases whose name contains one of these words. `--kv-cache-dtype fp8`:
the caches in e4m3 (`EngineConfig.kv_cache_dtype`), GB/s counted on their bytes (half).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_times import copy_bandwidth, paged_setup
from quantized_gemv import L2_BYTES, cycling, graph_time_us

from infer.attention.kv_dtype import FP8_KV, as_cache_values
from infer.kernels import dependent_launch, paged_attention
from infer.kernels.paged_attention import default_num_splits, paged_decode, split_keys

CASES = [  # name, batch, context (or a (low, high) range to draw from), heads, kv_heads,
    # head_dim, tokens a sequence
    ("qwen3-0.6b b256 ctx 600", 256, 600, 16, 8, 128, 1),
    # issue 15's protocol mid-run: prompts U[100, 1024] plus a few hundred tokens out
    ("qwen3-0.6b b256 ctx U[100,2000]", 256, (100, 2000), 16, 8, 128, 1),
    ("llama-3.1-8b b1 ctx 256", 1, 256, 32, 8, 128, 1),
    ("llama-3.1-8b verify k=4 b1 ctx 256", 1, 256, 32, 8, 128, 5),
    ("llama-3.1-8b verify k=4 b1 ctx 1024", 1, 1024, 32, 8, 128, 5),
    ("llama-3.2-1b b1 ctx 256", 1, 256, 32, 8, 64, 1),
    # a draft model's first forward of a round queued behind its verify step
    ("llama-3.2-1b 2 tokens b1 ctx 256", 1, 256, 32, 8, 64, 2),
    ("llama-3.1-8b b32 ctx 2048", 32, 2048, 32, 8, 128, 1),
]
SETTINGS = [(None, None, None), *itertools.product((32, 64, 128), (4, 8), (1, 2, 3, 4))]
SPLITS = (1, 2, 4, 8)  # tried at the default launch besides the policy's own
MIN_SPLIT_KEYS = (32, 64, 128, 256, 512)  # tried at the default launch besides the policy's
MAX_CALLS = 512  # calls a graph captures at most


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", type=Path,
                   default=Path(__file__).parent / "results" / "decode_attention_tuning.json")
    p.add_argument("--cases", nargs="+", default=None)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--default-only", action="store_true", help="time the default launch only")
    opts = p.parse_args()
    fp8 = opts.kv_cache_dtype == "fp8"
    cases = [c for c in CASES if opts.cases is None or any(w in c[0] for w in opts.cases)]
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_BYTES
    dependent_launch.set_enabled(dependent_launch.supported(torch.device("cuda")))
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, batch, ctx, heads, kvh, d, qlen in cases:
        lens = (torch.randint(ctx[0], ctx[1] + 1, (batch,), generator=gen).tolist()
                if isinstance(ctx, tuple) else [ctx] * batch)
        meta, kc, vc = paged_setup([qlen] * batch, lens, kvh, d)
        if fp8:
            kc, vc = (as_cache_values(c, FP8_KV) for c in (kc, vc))
        q = torch.randn(batch * qlen, heads, d, device="cuda", dtype=torch.bfloat16)
        counters = torch.zeros(batch * kvh, dtype=torch.int32, device="cuda")
        splits = default_num_splits(batch, kvh, max(lens), q.device)
        policy_keys = split_keys(batch, kvh, q.device)
        ref = paged_decode(q, kc, vc, meta.seq_lens, meta.block_tables, d ** -0.5,
                           num_splits=splits, query_len=qlen)
        nbytes = sum(lens) * kvh * d * 2 * kc.element_size()
        # Calls enough to pass the L2 three times, each with caches of its own.
        calls = max(20, min(MAX_CALLS, -(-3 * l2_bytes // (kc.nbytes + vc.nbytes))))
        caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(calls - 1)]
        # (splits, block_n, warps, stages, min_split_keys, partials combined at once);
        # None: the policy's
        launches = [(splits, *setting, None, False) for setting in SETTINGS]
        launches += [(n, *SETTINGS[0], None, False) for n in SPLITS if n != splits]
        launches += [(splits, *SETTINGS[0], keys, False) for keys in MIN_SPLIT_KEYS
                     if keys != policy_keys]
        launches += [(splits, *SETTINGS[0], keys, True) for keys in (None, *MIN_SPLIT_KEYS)
                     if keys != policy_keys]
        if opts.default_only:
            launches = launches[:1]
        for n_splits, block_n, warps, stages, keys, at_once in launches:
            paged_attention.set_combine_at_once(at_once)
            launch = dict(num_splits=n_splits, block_n=block_n, num_warps=warps,
                          num_stages=stages, split_counters=counters, min_split_keys=keys,
                          query_len=qlen)

            def run(k_cache, v_cache, q=q, meta=meta, scale=d ** -0.5, launch=launch):
                return paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables,
                                    scale, **launch)
            try:
                err = (run(kc, vc).float() - ref.float()).abs().max().item()
                us = graph_time_us(cycling([lambda c=c: run(*c) for c in caches]),
                                   replays=10, calls=calls)
            except Exception as e:  # out of resources etc.
                print(f"{name} {n_splits} {block_n} {warps} {stages} {keys}: "
                      f"{str(e).splitlines()[0][:80]}")
                continue
            rows.append(dict(case=name, kv_cache_dtype=str(kc.dtype), splits=n_splits,
                             block_n=block_n, num_warps=warps,
                             num_stages=stages, min_split_keys=keys or policy_keys,
                             combine_at_once=at_once, us=us,
                             GBps=nbytes / us / 1e3, frac_copy=nbytes / us / 1e3 / copy_gbs,
                             max_err=err, calls=calls))
        del caches
        paged_attention.set_combine_at_once(False)
        report(opts.out, copy_gbs, rows, name)  # each case as it ends: a time limit keeps it


def report(out: Path, copy_gbs: float, rows: list[dict], name: str) -> None:
    """Writes every row so far to `out`; prints case `name`'s default and best five."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_GBps=copy_gbs,
                                   rows=rows), indent=2))
    case = [r for r in rows if r["case"] == name]
    if not case:
        return
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; {name}: the default, then the best five",
          flush=True)
    for r in [case[0], *sorted(case[1:], key=lambda r: r["us"])[:5]]:
        print(f"{name:28s} BLOCK_N {r['block_n']!s:>4s} warps {r['num_warps']!s:>4s} "
              f"stages {r['num_stages']!s:>4s} splits {r['splits']:2d} keys "
              f"{r['min_split_keys']:3d} at once {r['combine_at_once']!s:5s}: "
              f"{r['us']:8.2f} us {r['GBps']:6.0f} GB/s "
              f"{100 * r['frac_copy']:5.1f}% err {r['max_err']:.1e}", flush=True)


if __name__ == "__main__":
    main()
