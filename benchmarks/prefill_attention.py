"""Prefill attention: our paged Triton kernel vs torch's fused SDPA (flash / cuDNN /
memory-efficient), Llama-3.1-8B heads (32 query, 8 KV, head_dim 128), bf16, on CUDA.

The engine's prefill reads keys and values from the paged cache. SDPA needs them
contiguous, so its timing includes gathering each sequence's blocks (for a chunk after a
cached prefix) and its causal mask is aligned to the bottom right (query i sees keys up to
prefix + i). Cases: one prompt without a prefix (512 / 2048 / 8192 tokens), 2048-token
chunks after 2048 / 6144 cached tokens (the engine's chunked prefill of 8192 tokens), and
many short prompts in one step (SDPA then loops over sequences). TFLOP/s counts the causal
half only (4 x heads x head_dim x visible query-key pairs).

    PYTHONPATH=src python benchmarks/prefill_attention.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_times import paged_setup, rel_err

from infer.attention import torch_backend
from infer.attention.triton_backend import paged_attention_kernels as paged_attention

HEADS, KV_HEADS, D = 32, 8, 128
SCALE = D ** -0.5
CASES = [  # name, query lens, seq lens
    ("1x512", [512], [512]),
    ("1x2048", [2048], [2048]),
    ("1x8192", [8192], [8192]),
    ("2048 after 2048", [2048], [4096]),
    ("2048 after 6144", [2048], [8192]),
    ("16x512", [512] * 16, [512] * 16),
    ("64x128", [128] * 64, [128] * 64),
]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_prefill(q, k_cache, v_cache, meta, scale, backend):
    """Per sequence: gather its keys/values, SDPA with a bottom-right causal mask."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        blocks = meta.block_tables[i, :(s_len + bs - 1) // bs]
        k = k_cache[blocks].flatten(0, 1)[:s_len].transpose(0, 1)[None]
        v = v_cache[blocks].flatten(0, 1)[:s_len].transpose(0, 1)[None]
        qi = q[start:start + q_len].transpose(0, 1)[None]
        if q_len == s_len:
            mask, causal = None, True
        else:  # keys 0..prefix+i visible to query i (bool mask: True = attend)
            pos = torch.arange(s_len, device=q.device)
            mask = pos[None, :] <= (pos[s_len - q_len:, None])
            causal = False
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=causal,
                                               scale=scale, enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def main() -> None:
    assert torch.cuda.is_available(), "this benchmark needs CUDA"
    torch.manual_seed(0)
    rows = []
    for name, qls, sls in CASES:
        meta, kc, vc = paged_setup(qls, sls, KV_HEADS, D)
        q = torch.randn(sum(qls), HEADS, D, device="cuda", dtype=torch.bfloat16)
        visible = sum(sum(p + 1 for p in range(s - ql, s)) for ql, s in zip(qls, sls))
        flops = 4 * HEADS * D * visible
        exact = torch_backend.paged_attention(q.float(), kc.float(), vc.float(), meta, SCALE)
        row = {"case": name, "query_lens": qls[0], "num_seqs": len(qls), "seq_len": sls[0]}
        fns = {"triton": lambda q=q, kc=kc, vc=vc, m=meta: paged_attention(q, kc, vc, m, SCALE)}
        for label, backend in BACKENDS.items():
            fns[f"sdpa-{label}"] = (lambda q=q, kc=kc, vc=vc, m=meta, b=backend:
                                    sdpa_prefill(q, kc, vc, m, SCALE, b))
        for label, fn in fns.items():
            try:
                err = rel_err(fn(), exact)
                ms = do_bench(fn, warmup=20, rep=100, return_mode="median")
            except RuntimeError as e:  # this SDPA backend refuses the inputs
                row[label] = {"error": str(e).splitlines()[0][:120]}
                continue
            row[label] = {"ms": ms, "TFLOP/s": flops / ms / 1e9, "rel_err": err}
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name()
    slug = name.lower().replace("nvidia ", "").replace(" ", "_")
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        Path(__file__).parent / "results" / f"prefill_attention_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=name, torch=torch.__version__, heads=HEADS,
                                   kv_heads=KV_HEADS, head_dim=D, rows=rows), indent=2))
    labels = ["triton", *(f"sdpa-{b}" for b in BACKENDS)]
    print(f"\n{name}; TFLOP/s (ms), causal FLOPs; wrote {out}")
    print(f"{'case':18s}" + "".join(f"{x:>22s}" for x in labels))
    for r in rows:
        cells = []
        for x in labels:
            c = r[x]
            cells.append(f"{'refused':>22s}" if "error" in c else
                         f"{c['TFLOP/s']:9.1f} ({c['ms']:8.3f})".rjust(22))
        print(f"{r['case']:18s}" + "".join(cells))


if __name__ == "__main__":
    main()
