"""Each Triton kernel vs its torch reference on CUDA, bf16: median time, GB/s or TFLOP/s,
error against a float32 reference on the same inputs, and the device-to-device copy
bandwidth measured in the same run. Prints a table last; writes
benchmarks/results/kernels_<device>.json.

    PYTHONPATH=src python benchmarks/kernel_times.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from infer.attention import torch_backend
from infer.attention.metadata import AttentionMetadata
from infer.attention.triton_backend import paged_attention_kernels as paged_attention
from infer.kernels import reference as ref
from infer.kernels.activation import geglu_tanh, swiglu
from infer.kernels.kv_store import store_kv
from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm
from infer.kernels.rope import rope_

DT = torch.bfloat16
DEV = "cuda"
ROWS: list[dict] = []


def bench(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=50, rep=200, return_mode="median")


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    """‖out - ref‖ / ‖ref‖ in float64; NaN anywhere gives inf."""
    if not torch.isfinite(out).all():
        return float("inf")
    d = out.double() - expected.double()
    return (d.norm() / expected.double().norm()).item()


def record(name: str, shape: str, tri: Callable, torch_ref: Callable, out: torch.Tensor,
           torch_out: torch.Tensor, exact: torch.Tensor, *, nbytes: float = 0.0,
           flops: float = 0.0, copy_gbs: float) -> None:
    err, terr = rel_err(out, exact), rel_err(torch_out, exact)
    t_ms, r_ms = bench(tri), bench(torch_ref)
    row = dict(kernel=name, shape=shape, triton_ms=t_ms, torch_ms=r_ms,
               speedup=r_ms / t_ms, rel_err=err, torch_rel_err=terr,
               max_abs_err=(out.double() - exact.double()).abs().max().item(),
               ok=bool(err < 1e-2))
    if nbytes:
        row["GB/s"] = nbytes / t_ms / 1e6
        row["frac_copy_bw"] = row["GB/s"] / copy_gbs
    if flops:
        row["TFLOP/s"] = flops / t_ms / 1e9
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def copy_bandwidth() -> float:
    x = torch.randn(1 << 29, device=DEV, dtype=DT)  # 1 GiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e6  # read + write, GB/s


def bench_norms(copy_gbs: float) -> None:
    for tokens, hidden, offset in [(8192, 4096, 0.0), (8192, 1152, 1.0)]:
        x, w = torch.randn(tokens, hidden, device=DEV, dtype=DT), torch.randn(hidden,
                                                                              device=DEV, dtype=DT)
        exact = ref.rmsnorm_ref(x.float(), w.float(), 1e-6, offset)
        nbytes = 2 * x.numel() * 2
        record(f"rmsnorm off={offset:g}", f"{tokens}x{hidden}",
               lambda x=x, w=w, o=offset: rmsnorm(x, w, 1e-6, o),
               lambda x=x, w=w, o=offset: ref.rmsnorm_ref(x, w, 1e-6, o),
               rmsnorm(x, w, 1e-6, offset), ref.rmsnorm_ref(x, w, 1e-6, offset), exact,
               nbytes=nbytes, copy_gbs=copy_gbs)
    tokens, hidden = 8192, 4096
    x = torch.randn(tokens, hidden, device=DEV, dtype=DT)
    res, w = torch.randn_like(x), torch.randn(hidden, device=DEV, dtype=DT)
    exact = ref.rmsnorm_ref((x.float() + res.float()), w.float(), 1e-6)
    t_out, _ = ref.fused_add_rmsnorm_ref(x, res, w, 1e-6)
    out, _ = fused_add_rmsnorm(x, res.clone(), w, 1e-6)
    record("fused_add_rmsnorm", f"{tokens}x{hidden}",
           lambda: fused_add_rmsnorm(x, res, w, 1e-6),
           lambda: ref.fused_add_rmsnorm_ref(x, res, w, 1e-6), out, t_out, exact,
           nbytes=4 * x.numel() * 2, copy_gbs=copy_gbs)


def bench_rope(copy_gbs: float) -> None:
    tokens, heads, kv_heads, d, max_pos = 8192, 32, 8, 128, 8192
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=DEV, dtype=DT)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    ang = torch.rand(max_pos, d // 2, device=DEV) * 6.3
    cos, sin = ang.cos(), ang.sin()
    pos = torch.randint(0, max_pos, (tokens,), device=DEV)
    eq, ek = ref.rope_ref(q.float(), k.float(), cos, sin, pos)
    tq, tk = ref.rope_ref(q, k, cos, sin, pos)
    oq, ok = rope_(q.clone(), k.clone(), cos, sin, pos)
    record("rope (q,k in place)", f"T{tokens} H{heads}/{kv_heads} D{d}",
           lambda: rope_(q, k, cos, sin, pos), lambda: ref.rope_ref(q, k, cos, sin, pos),
           torch.cat([oq.flatten(), ok.flatten()]), torch.cat([tq.flatten(), tk.flatten()]),
           torch.cat([eq.flatten(), ek.flatten()]),
           nbytes=2 * tokens * (heads + kv_heads) * d * 2, copy_gbs=copy_gbs)


def bench_act(copy_gbs: float) -> None:
    tokens, inter = 4096, 14336
    gu = torch.randn(tokens, 2 * inter, device=DEV, dtype=DT) * 2
    for name, kern, r in [("swiglu", swiglu, ref.swiglu_ref),
                          ("geglu_tanh", geglu_tanh, ref.geglu_tanh_ref)]:
        record(name, f"{tokens}x2*{inter}", lambda k=kern: k(gu), lambda r=r: r(gu),
               kern(gu), r(gu), r(gu.float()), nbytes=3 * tokens * inter * 2,
               copy_gbs=copy_gbs)


def bench_kv_store(copy_gbs: float) -> None:
    tokens, kv_heads, d, blocks, bs = 8192, 8, 128, 4096, 16
    k = torch.randn(tokens, kv_heads, d, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    slots = torch.randperm(blocks * bs, device=DEV)[:tokens]
    slots[::97] = -1
    kc = torch.randn(blocks, bs, kv_heads, d, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    rk, rv = kc.clone(), vc.clone()
    torch_backend.write_kv(rk, rv, k, v, slots)
    ok_, ov = kc.clone(), vc.clone()
    store_kv(ok_, ov, k, v, slots)
    out, exact = torch.stack([ok_, ov]), torch.stack([rk, rv])
    record("kv_store", f"T{tokens} KvH{kv_heads} D{d}", lambda: store_kv(kc, vc, k, v, slots),
           lambda: torch_backend.write_kv(kc, vc, k, v, slots), out, exact, exact,
           nbytes=2 * 2 * k.numel() * 2, copy_gbs=copy_gbs)


def paged_setup(query_lens: list[int], seq_lens: list[int], kv_heads: int, d: int,
                bs: int = 16):
    need = [(s + bs - 1) // bs for s in seq_lens]
    order = torch.randperm(sum(need) + 8).tolist()
    tables = []
    for n in need:
        tables.append(order[:n])
        order = order[n:]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, DEV)
    nb = sum(need) + 8
    kc = torch.randn(nb, bs, kv_heads, d, device=DEV, dtype=DT)
    return meta, kc, torch.randn_like(kc)


def bench_attention(copy_gbs: float) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [
        # name, query_lens, seq_lens, heads, kv_heads, d, window, softcap
        ("decode b1", [1], [32768], 32, 8, 128, None, None),
        ("decode b32", [1] * 32,
         torch.randint(1024, 4097, (32,), generator=gen).tolist(), 32, 8, 128, None, None),
        ("decode b128", [1] * 128,
         torch.randint(256, 2049, (128,), generator=gen).tolist(), 32, 8, 128, None, None),
        ("decode b32 D256 win+cap", [1] * 32, [4096] * 32, 8, 2, 256, 1024, 50.0),
        ("prefill 4x2048", [2048] * 4, [2048] * 4, 32, 8, 128, None, None),
        ("extend 512 after 3584", [512] * 4, [4096] * 4, 32, 8, 128, None, None),
        ("prefill 2x2048 D256 win", [2048] * 2, [2048] * 2, 8, 2, 256, 512, None),
    ]
    for name, qls, sls, heads, kvh, d, win, cap in cases:
        meta, kc, vc = paged_setup(qls, sls, kvh, d)
        q = torch.randn(sum(qls), heads, d, device=DEV, dtype=DT)
        scale = d ** -0.5
        exact = torch_backend.paged_attention(q.float(), kc.float(), vc.float(), meta, scale,
                                              win, cap)
        out = paged_attention(q, kc, vc, meta, scale, win, cap)
        t_out = torch_backend.paged_attention(q, kc, vc, meta, scale, win, cap)
        visible = 0
        for ql, sl in zip(qls, sls):
            for p in range(sl - ql, sl):
                visible += min(p + 1, win) if win else p + 1
        flops = 4 * heads * d * visible
        kv_tokens = sum(min(s, win) if win else s for s in sls)
        nbytes = kv_tokens * kvh * d * 2 * 2 + 2 * q.numel() * 2
        decode = all(x == 1 for x in qls)
        record(f"attn {name}", f"H{heads}/{kvh} D{d}",
               lambda q=q, kc=kc, vc=vc, m=meta, s=scale, w=win, c=cap:
                   paged_attention(q, kc, vc, m, s, w, c),
               lambda q=q, kc=kc, vc=vc, m=meta, s=scale, w=win, c=cap:
                   torch_backend.paged_attention(q, kc, vc, m, s, w, c),
               out, t_out, exact, nbytes=nbytes if decode else 0.0,
               flops=0.0 if decode else flops, copy_gbs=copy_gbs)


def main() -> None:
    assert torch.cuda.is_available(), "this benchmark needs CUDA"
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)", flush=True)
    for part in (bench_norms, bench_rope, bench_act, bench_kv_store, bench_attention):
        part(copy_gbs)
    slug = name.lower().replace("nvidia ", "").replace(" ", "_")
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        Path(__file__).parent / "results" / f"kernels_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=name, torch=torch.__version__,
                                   triton=triton.__version__, dtype="bfloat16",
                                   copy_GBps=copy_gbs, rows=ROWS), indent=2))
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s; errors are ‖out-ref‖/‖ref‖ vs a float32 "
          f"reference on the same bf16 inputs; wrote {out}")
    head = (f"{'kernel':30s} {'shape':22s} {'triton ms':>9s} {'torch ms':>9s} {'x':>6s} "
            f"{'GB/s':>7s} {'%copy':>6s} {'TFLOP/s':>8s} {'rel err':>8s} {'torch err':>9s} ok")
    print(head)
    for r in ROWS:
        gbs = f"{r['GB/s']:7.0f}" if "GB/s" in r else f"{'':7s}"
        frac = f"{100 * r['frac_copy_bw']:5.0f}%" if "GB/s" in r else f"{'':6s}"
        tf = f"{r['TFLOP/s']:8.1f}" if "TFLOP/s" in r else f"{'':8s}"
        print(f"{r['kernel']:30s} {r['shape']:22s} {r['triton_ms']:9.4f} {r['torch_ms']:9.4f} "
              f"{r['speedup']:6.1f} {gbs} {frac} {tf} {r['rel_err']:8.1e} "
              f"{r['torch_rel_err']:9.1e} {'yes' if r['ok'] else 'NO'}")
    sys.exit(0 if all(r["ok"] for r in ROWS) else 1)


if __name__ == "__main__":
    main()
