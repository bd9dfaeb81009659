"""Decode speed at batch 1, 8 and 32: infer vs HF transformers (static cache) and gpt-fast,
bf16, random weights in the llama-3.2-1b and llama-3.1-8b shapes.

Workload: per sequence a 128-token random prompt and 256 new tokens, greedy, ignore_eos.

infer: decode is timed apart from prefill. After a warm-up at the same batch size, one
`generate` with max_tokens=1 (prefill + first token) and one with max_tokens=1+N (N=256)
are timed on fresh random prompts (so the prefix cache never hits); the decode step time
is (T(1+N) - T(1)) / N (median over --repeats such pairs, one by default).

HF peer: `model.generate(..., cache_implementation="static", do_sample=False,
min_new_tokens=max_new_tokens=1+N)` on the same prompts, after a warm-up call; a streamer
stamps the host clock (after a device sync) as each token arrives, and the decode step time
is (last stamp - first-token stamp) / N. By default (`--hf-compile auto`) HF's automatic
torch.compile of static-cache decoding stays on, as its users get it (one compile per
batch size, in the warm-up); `off` passes disable_compile=True (about 5x slower).

gpt-fast peer (gpt_fast_peer.py): pytorch-labs/gpt-fast's model.py from `--gpt-fast DIR`
(default .peers/gpt-fast, exported from its repository; skipped when absent), on the same
checkpoint converted as its convert_hf_checkpoint.py does, driven as `generate.py --compile`
drives it (decode_one_token under torch.compile(mode="reduce-overhead", fullgraph=True), its
sampler at top_k=200 and a temperature of 1e-5, greedy in effect), timed like infer: the step
time is (T(1+N) - T(1)) / N after a warm-up generate whose time, compile included, is
`compile_s` (compiled on a CPU too, where inductor makes C++ and CUDA graphs are skipped).
`--skip-peer` skips both peers.

Metric, per decode step (same formula for every engine):
  bytes = weight bytes + KV bytes read
  weight bytes = (all parameters but the embedding table, plus the LM head) x dtype bytes;
                 a tied embedding is counted once, as the LM head read
  KV bytes     = 2 x layers x kv_heads x head_dim x the cache's bytes a value (infer's
                 `kv_cache_dtype`: 1 for fp8) x context, summed over the batch, at the
                 mean context of the N steps (prompt + (N+1)/2)
  GB/s = bytes / step time, reported as a fraction of the copy bandwidth measured in the
  same run; FLOP/s = (2 x step weight params + attention FLOPs) x batch / step time, as a
  fraction of the measured bf16 matmul rate.

    PYTHONPATH=src python benchmarks/decode.py [--engine attention_backend=triton ...]
    python benchmarks/decode.py --gguf Q4_K_M     # the same shapes as random GGUF files
    python benchmarks/decode.py --tiny            # CPU check, tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import gguf_checkpoint
import gpt_fast_peer

try:
    from transformers.generation.streamers import BaseStreamer
except ImportError:  # an older or newer layout: generate only calls put() and end()
    BaseStreamer = object


class StepClock(BaseStreamer):
    """A transformers streamer that stamps the time of every put (prompt, then a token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        common.sync()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def step_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads, as the model stores them (quantized weights
    and their scales included): everything but an untied embedding table, of which a
    step gathers a few rows."""
    lm_head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None:
        embed = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    skip = set()
    if embed is not None and (lm_head is None or lm_head.weight is not embed.weight):
        skip = {id(p) for p in embed.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def step_metrics(row: dict, counts: common.ShapeCounts, nbytes: int, batch: int,
                 mean_ctx: float, ceil: dict, weight_bytes: int | None = None,
                 kv_nbytes: int | None = None) -> None:
    """`weight_bytes`: what a step reads of the weights (default: the shape's in `nbytes`
    per parameter); `kv_nbytes`: bytes a cached value (default `nbytes`)."""
    step = row["step_ms"] / 1e3
    w = counts.step_weight_params * nbytes if weight_bytes is None else weight_bytes
    kv = counts.kv_bytes_per_token(kv_nbytes or nbytes) * mean_ctx * batch
    flops = 2.0 * counts.step_weight_params * batch + counts.attn_flops(batch, mean_ctx)
    row.update(
        tok_per_s=batch / step, weight_MB=w / 1e6, kv_MB=kv / 1e6,
        GBps=(w + kv) / step / 1e9, frac_copy=(w + kv) / step / 1e9 / ceil["copy_GBps"],
        TFLOPs=flops / step / 1e12, frac_matmul=flops / step / 1e12 / ceil["matmul_TFLOPs"],
    )


def run_infer(llm, batches, prompt_len, new_tokens, vocab, rng, repeats, emit):
    from infer import SamplingParams

    def timed(batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
        prompts = common.random_prompts(rng, batch, prompt_len, vocab)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        common.sync()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        common.sync()
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt, prompts

    rows = []
    for batch in batches:
        timed(batch, 8)  # warm-up at this batch size (kernels, graphs, allocator)
        pairs = []
        for _ in range(repeats):
            t1, _ = timed(batch, 1)
            tn, _ = timed(batch, 1 + new_tokens)
            pairs.append((t1, tn, max(tn - t1, 1e-9) / new_tokens * 1e3))
        t1, tn, step_ms = sorted(pairs, key=lambda p: p[2])[len(pairs) // 2]
        row = dict(engine="infer", batch=batch, prefill_s=t1, total_s=tn, step_ms=step_ms,
                   step_ms_all=[p[2] for p in pairs])
        emit(row)
        rows.append(row)
    return rows


def run_hf(model, batches, prompt_len, new_tokens, vocab, rng, compile_mode, repeats,
           emit):
    dev = common.device()
    rows = []
    for batch in batches:
        def gen(n: int, clock: StepClock | None, batch=batch) -> None:
            prompts = common.random_prompts(rng, batch, prompt_len, vocab)
            ids = torch.tensor(prompts, device=dev)
            kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          cache_implementation="static", pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
            if compile_mode == "off":
                kwargs["disable_compile"] = True
            with torch.inference_mode():
                out = model.generate(ids, streamer=clock, **kwargs)
            assert out.shape[1] == prompt_len + n, out.shape

        # auto: the warm-up must reach the same cache shape to trigger the compile
        gen(1 + new_tokens if compile_mode == "auto" else 8, None)
        runs = []
        for _ in range(repeats):
            clock = StepClock()
            t = time.perf_counter()
            gen(1 + new_tokens, clock)
            total = time.perf_counter() - t
            stamps = clock.times[1:]  # [0] is the prompt
            assert len(stamps) == 1 + new_tokens, len(stamps)
            runs.append((stamps[0] - t, total, (stamps[-1] - stamps[0]) / new_tokens * 1e3))
        first, total, step_ms = sorted(runs, key=lambda r: r[2])[len(runs) // 2]
        row = dict(engine="hf-static", batch=batch, prefill_s=first, total_s=total,
                   step_ms=step_ms, step_ms_all=[r[2] for r in runs])
        emit(row)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="default 1 8 32 (tiny: 1 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny 16)")
    parser.add_argument("--hf-compile", choices=["off", "auto"], default="auto")
    default_gpt_fast = common.ROOT / ".peers" / "gpt-fast"
    parser.add_argument("--gpt-fast", type=Path, metavar="DIR",
                        default=default_gpt_fast if default_gpt_fast.is_dir() else None,
                        help="a gpt-fast tree (its model.py) to run as a second peer "
                        "(default: .peers/gpt-fast when present)")
    parser.add_argument("--peer-batches", type=int, nargs="+", default=None,
                        help="the batch sizes the peers run (default: --batches); their "
                        "compiles take minutes per batch size")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per batch size; the median step time is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", choices=gguf_checkpoint.MIXES, default=None,
                        help="serve a random GGUF file of the shape in this mix instead of "
                        "the bf16 checkpoint (gguf_checkpoint.py; the HF peer still runs "
                        "the bf16 one)")
    args = parser.parse_args()
    tiny = args.tiny
    args.batches = args.batches or ([1, 4] if tiny else [1, 8, 32])
    args.peer_batches = args.peer_batches or args.batches
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.new_tokens = args.new_tokens or (16 if tiny else 256)
    user_flags = common.parse_engine_flags(args.engine)
    if args.gpt_fast is None and not args.skip_peer:
        print("[gpt-fast] skipped: no --gpt-fast DIR and no .peers/gpt-fast", flush=True)
    common.setup_cpu_threads()
    ceil = common.ceilings()
    rows: list[dict] = []
    out = None

    def save() -> None:
        nonlocal out
        out = common.write_results("decode", args, {"ceilings": ceil, "rows": rows})

    for name in args.models:
        # the bf16 checkpoint is served, or read by the peers; a GGUF run without peers
        # needs neither (writing an 8B one takes a minute of device time)
        path = None if args.gguf and args.skip_peer else \
            common.get_checkpoint(name, tiny, args.ckpt_root)
        shape = common.load_shape(name, tiny)
        counts = common.shape_counts(shape)
        vocab = shape["vocab_size"]
        mean_ctx = args.prompt_len + (args.new_tokens + 1) / 2
        defaults = dict(max_model_len=args.prompt_len + args.new_tokens + 16,
                        max_num_seqs=max(args.batches))
        flags = common.merged_flags(defaults, user_flags)
        served = path if args.gguf is None else \
            gguf_checkpoint.get_gguf(name, args.gguf, tiny, args.ckpt_root)
        llm, build_s = common.build_llm(served, flags)
        dtype = llm.engine.dtype
        nbytes = common.dtype_bytes(dtype)
        info = common.engine_info(llm)
        ours = step_weight_bytes(llm.engine.model)  # quantized formats read fewer bytes
        kv_ours = common.dtype_bytes(getattr(torch, llm.engine.info.kv_cache_dtype))

        def emit(row, name=name, counts=counts, nbytes=nbytes, mean_ctx=mean_ctx, dtype=dtype,
                 ours=ours, kv_ours=kv_ours):
            row.update(model=name, dtype=str(dtype).replace("torch.", ""),
                       weights=args.gguf if row["engine"] == "infer" and args.gguf else
                       "bf16 checkpoint")
            mine = row["engine"] == "infer"
            step_metrics(row, counts, nbytes, row["batch"], mean_ctx, ceil,
                         ours if mine else None, kv_ours if mine else None)
            rows.append(row)
            print(f"[{row['engine']}] {name} batch {row['batch']}: {row['step_ms']:.2f} ms/step "
                  f"{row['tok_per_s']:.0f} tok/s {100 * row['frac_copy']:.1f}% copy BW",
                  flush=True)
            save()

        rng = random.Random(args.seed)
        run_infer(llm, args.batches, args.prompt_len, args.new_tokens, vocab, rng, args.repeats,
                  lambda r, info=info, build_s=build_s: emit(
                      {**r, "engine_build_s": build_s, "engine": "infer"}))
        rows[-1]["engine_info"] = info
        del llm
        common.free_memory()
        if not args.skip_peer:
            try:
                model = common.load_hf(path, dtype)
                rng = random.Random(args.seed)
                run_hf(model, args.peer_batches, args.prompt_len, args.new_tokens, vocab, rng,
                       args.hf_compile, args.repeats, emit)
                del model
            except Exception as exc:  # the peer must not sink the run; say why
                print(f"[hf] FAILED on {name}: {type(exc).__name__}: {exc}", flush=True)
                rows.append(dict(engine="hf-static", model=name, error=repr(exc)))
                save()
            common.free_memory()
        if not args.skip_peer and args.gpt_fast is not None:
            try:
                rng = random.Random(args.seed)
                gpt_fast_peer.run_gpt_fast(
                    args.gpt_fast, shape, path, dtype, args.peer_batches, args.prompt_len,
                    args.new_tokens, vocab, rng, args.repeats, emit)
            except Exception as exc:  # the peer must not sink the run; say why
                print(f"[gpt-fast] FAILED on {name}: {type(exc).__name__}: {exc}", flush=True)
                rows.append(dict(engine="gpt-fast", model=name, error=repr(exc)))
                save()
            common.free_memory()

    for r in rows:
        if r.get("engine") == "infer":
            for engine, key in (("hf-static", "speedup_vs_hf"),
                                ("gpt-fast", "speedup_vs_gpt_fast")):
                peer = next((p for p in rows if p.get("engine") == engine
                             and p.get("model") == r["model"] and p.get("batch") == r["batch"]
                             and "step_ms" in p), None)
                r[key] = peer["step_ms"] / r["step_ms"] if peer else None
    save()
    print(f"\nwrote {out}")
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, matmul {ceil['matmul_TFLOPs']:.1f} "
          f"TFLOP/s; prompt {args.prompt_len}, {args.new_tokens} decode steps timed, "
          f"engine flags {user_flags or '{}'}, hf compile {args.hf_compile}, "
          f"gpt-fast {args.gpt_fast or 'skipped'}")
    common.print_table(
        "decode (per step; bytes = weights + KV read at the mean context)",
        [r for r in rows if "step_ms" in r],
        [("model", "model", ""), ("engine", "engine", ""), ("batch", "batch", "d"),
         ("ms/step", "step_ms", ".2f"), ("tok/s", "tok_per_s", ".0f"),
         ("W MB", "weight_MB", ".0f"), ("KV MB", "kv_MB", ".1f"), ("GB/s", "GBps", ".0f"),
         ("%copyBW", "frac_copy", ".1%"), ("TFLOP/s", "TFLOPs", ".2f"),
         ("%matmul", "frac_matmul", ".2%"), ("x HF", "speedup_vs_hf", ".2f"),
         ("x gpt-fast", "speedup_vs_gpt_fast", ".2f")])


if __name__ == "__main__":
    main()
