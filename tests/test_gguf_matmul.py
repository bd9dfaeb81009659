"""The GGUF Triton matmul and dequantizer (in the interpreter on the CPU; on the GPU with
INFER_TEST_DEVICE=cuda) against gguf's own dequantize of the same blocks: the matmul
against float64, the dequantizer bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from infer.kernels import triton_available

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf_models import random_kquant_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
# The interpreter's bfloat16 dot is not faithful (numpy has no bfloat16); the GPU run
# covers bfloat16.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1]  # 32 weights a block: gguf can quantize them
KQUANT_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # 256 a super-block: random bytes, sane scales


def quantized(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Valid `[n, bytes per row]` blocks of `qtype` for an `[n, k]` weight."""
    rng = np.random.default_rng(seed)
    if qtype in BLOCK_TYPES:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    return random_kquant_blocks(n * k, qtype, rng).reshape(n, -1)


def check_matmul(qtype: Q, dtype: torch.dtype, m: int, n: int, k: int, x_stride: int) -> None:
    from infer.kernels.gguf_matmul import gguf_matmul

    raw = quantized(qtype, n, k, seed=m * 1000 + n + k)
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, x_stride, generator=gen).to(dtype)[:, :k]  # rows x_stride apart
    y = gguf_matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), qtype, k).cpu()
    ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double().T
    assert y.dtype == dtype and y.shape == (m, n)
    assert torch.isfinite(y).all()
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


# n: not a multiple of the 32-row block; m: within one 16-row block, and across two.
SHAPES = [(1, 40, 256, 256), (3, 70, 512, 512), (17, 40, 512, 640)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "x_stride"), SHAPES)
@pytest.mark.parametrize("qtype", KQUANT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_matmul_matches_float64_from_gguf_dequantize(qtype, m, n, k, x_stride, dtype):
    check_matmul(qtype, dtype, m, n, k, x_stride)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_gguf_matmul_rows_of_32_block_types_ending_mid_unit(qtype, dtype):
    check_matmul(qtype, dtype, 5, 33, 288, 288)  # 9 blocks: a unit of 8, then 1


@pytest.mark.parametrize(("units", "split"), [(1, 3), (4, 2)])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q4_0], ids=lambda t: t.name)
def test_gguf_matmul_steps_and_splits_of_k(qtype, m, units, split):
    from infer.kernels.gguf_matmul import _matmul

    raw = quantized(qtype, 24, 1280, seed=m)  # 5 units: the last step or split is short
    x = torch.randn(m, 1280, generator=torch.Generator().manual_seed(m))
    y = _matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), qtype, 1280,
                block_n=16, units=units, split=split).cpu()
    ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double().T
    assert y.shape == (m, 24)
    assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


# One row of Q4_K and Q6_K with word-aligned rows takes the one-row kernel (gguf_gemv.py):
# K ending mid step, splits of K that end mid step (added by the last program of a row
# block), rows not a multiple of the program's.
@pytest.mark.parametrize(("block_n", "units", "split", "maxnreg"),
                         [(8, 1, 1, None), (16, 2, 3, None), (32, 4, 2, None), (64, 1, 8, 128)])
@pytest.mark.parametrize(("qtype", "k"), [(Q.Q4_K, 1280), (Q.Q6_K, 2560)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_gemv_one_row(qtype, k, block_n, units, split, maxnreg):
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_matmul import _matmul

    n = 37
    raw = torch.from_numpy(quantized(qtype, n, k, seed=k + block_n)).to(DEVICE)
    assert gemv_words(raw, qtype) is not None
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(block_n)) * 3
    y = _matmul(x.to(DEVICE), raw, qtype, k, block_n=block_n, units=units, split=split,
                maxnreg=maxnreg)
    ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(raw.cpu().numpy(), qtype)).double().T
    assert y.shape == (1, n) and torch.isfinite(y.cpu()).all()
    assert (y.cpu().double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_gguf_gemv_one_row_writes_every_output(qtype, dtype):
    from infer.kernels.gguf_matmul import gguf_matmul

    n, k = 70, 1024
    raw = torch.from_numpy(quantized(qtype, n, k, seed=7)).to(DEVICE)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(raw.cpu().numpy(), qtype)).double().T
    for _ in range(2):  # over a poisoned allocation: the caching allocator reuses it
        torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
        y = gguf_matmul(x.to(DEVICE), raw, qtype, k).cpu()
        assert y.dtype == dtype and torch.isfinite(y).all()
        error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
        assert error < TOLERANCE[dtype], error


# The interpreter truncates float32 to bfloat16 (the GPU rounds to nearest, as torch does).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([] if INTERPRETED else [torch.bfloat16]))
@pytest.mark.parametrize(("qtype", "n", "k"), [(t, 40, 512) for t in KQUANT_TYPES + BLOCK_TYPES]
                         + [(t, 3, 288) for t in BLOCK_TYPES],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_dequantize_is_gguf_dequantize(qtype, n, k, dtype):
    from infer.kernels.gguf_matmul import gguf_dequantize

    raw = quantized(qtype, n, k, seed=n + k)
    w = gguf_dequantize(torch.from_numpy(raw).to(DEVICE), qtype, k, dtype).cpu()
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).to(dtype)
    assert w.dtype == dtype and torch.equal(w, ref)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.F16], ids=lambda t: t.name)
def test_types_without_a_kernel_are_refused_by_name(qtype):
    from infer.kernels.gguf_matmul import gguf_dequantize, gguf_matmul

    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    data = torch.zeros(4, 256 // block * size, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=qtype.name):
        gguf_matmul(torch.zeros(1, 256, device=DEVICE), data, qtype, 256)
    with pytest.raises(ValueError, match=qtype.name):
        gguf_dequantize(data, qtype, 256)


# 2..64 rows of Q4_K, Q6_K and Q8_0 take gguf_gemm.py: rows of x not a multiple of the
# program's (16, 32, 64), rows of W not a multiple of BLOCK_N, K split over programs and
# in steps of two units (Q4_K, Q6_K: 3 units, the last split or step short; Q8_0: 9
# blocks, K ending mid unit).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([] if INTERPRETED else [torch.bfloat16]))
@pytest.mark.parametrize(("m", "block_n", "split", "units"),
                         [(2, 16, 1, 2), (23, 32, 2, 2), (45, 16, 3, 1)])
@pytest.mark.parametrize(("qtype", "k"), [(Q.Q4_K, 768), (Q.Q6_K, 768), (Q.Q8_0, 288)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_gguf_gemm_rows(qtype, k, m, block_n, split, units, dtype):
    from infer.kernels.gguf_matmul import _gemm

    n = 37
    seed = m * 100 + block_n + k
    raw = torch.from_numpy(quantized(qtype, n, k, seed=seed)).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k + 64, generator=gen) * 3).to(dtype)[:, :k]  # rows k + 64 apart
    ref = x.double() @ torch.from_numpy(gguf.quants.dequantize(raw.cpu().numpy(), qtype)).double().T
    torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # poisons what is reused
    y = _gemm(x.to(DEVICE), raw, qtype, k, block_n=block_n, split=split, num_warps=4,
              units=units).cpu()
    assert y.dtype == dtype and y.shape == (m, n) and torch.isfinite(y).all()
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_gguf_matmul_takes_gemm_from_two_rows(qtype, monkeypatch):
    from infer.kernels import gguf_matmul

    calls = []
    monkeypatch.setattr(gguf_matmul, "gguf_gemm", lambda *a, **kw: calls.append(a[0].shape[0]))
    raw = torch.from_numpy(quantized(qtype, 8, 512, seed=1)).to(DEVICE)
    for m in (2, gguf_matmul.GEMM_ROWS):
        gguf_matmul.gguf_matmul(torch.zeros(m, 512, device=DEVICE), raw, qtype, 512)
    assert calls == [2, gguf_matmul.GEMM_ROWS]
