"""gguf_q6k_wgmma.py: Q6_K at 2..64 rows through Hopper's wgmma (Gluon).

As for gguf_q4k_wgmma: the kernel runs only on a Hopper GPU (`INFER_TEST_DEVICE=cuda`
there); on the CPU its decode is redone step by step in torch (the same 16-bit words,
shifts, masks, scales and multiply-adds, joined and permuted as the kernel does) against
the `gguf` package's dequantization in x's gather order, and its compile for sm_90 is in
test_kernels_compile_for_sm90.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.kernels import gluon_hopper, triton_available

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf_matmul import quantized  # noqa: E402

ONE = 0x3F800000


def _words(halves: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit words of the 16-bit words at `index` and `index + 1` of each row."""
    lo = halves[:, index] & 0xFFFF
    hi = halves[:, index + 1] & 0xFFFF
    return lo | (hi << 16)


def _decoded_in_register_order(halves: np.ndarray, k: int) -> torch.Tensor:
    """The kernel's decode of `halves [N, k / 256 * 105]` (int16), redone in torch: `[N, k]`
    float64, each super-block's 256 values in the kernel's order k'."""
    all_halves = torch.from_numpy(halves.astype(np.int64))
    g = torch.arange(8)[:, None]  # [8, 1] against t [1, 4]
    t = torch.arange(4)[None, :]
    ql_at = 2 * (4 * g + t)
    qh_at = 64 + 2 * (4 * (2 * (g // 4) + g % 2) + t)
    sc_at = 96 + 4 * (g // 4) + g % 4 // 2  # [8, 1]
    shift = 2 * (g // 2 % 2)
    out = []
    for u in range(k // 256):
        unit = all_halves[:, u * 105:(u + 1) * 105]
        ql = _words(unit, ql_at)  # [N, 8, 4]
        qh = _words(unit, qh_at)
        d = torch.from_numpy((unit[:, 104].numpy() & 0xFFFF).astype(np.uint16)
                             .view(np.float16)).double()[:, None, None]
        values = []
        for h in range(2):
            word = unit[:, (sc_at + 2 * h)[:, 0]] & 0xFFFF  # [N, 8]
            s = ((word[:, :, None] << (24 - 8 * (g % 2))) & 0xFFFFFFFF)
            s = torch.where(s >= 2**31, s - 2**32, s) >> 24  # arithmetic: the signed byte
            a = 256.0 * d * s.double()
            b = -288.0 * d * s.double()
            if h == 0:
                v = (ql & 0x0F0F0F0F) | (((qh << (4 - shift)) & 0xFFFFFFFF) & 0x30303030)
            else:
                v = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> shift) & 0x30303030)
            shifted = [(v << 15) & 0xFFFFFFFF, (v << 7) & 0xFFFFFFFF, v >> 1, v >> 9]
            f = [((s_ & (0x3F << 15)) | ONE).to(torch.int32).view(torch.float32).double()
                 * a + b for s_ in shifted]
            values.append(torch.stack([torch.stack([f[0], f[1]], -1),
                                       torch.stack([f[2], f[3]], -1)], -1))
        tile = torch.stack(values, -1).permute(0, 5, 1, 4, 2, 3)  # as the kernel's
        out.append(tile.reshape(len(unit), 256))
    return torch.cat(out, 1)


def _x_order(k: int) -> torch.Tensor:
    """The kernel's gather of x: column k' of a super-block's tile is x's column kx[k']."""
    kp = torch.arange(256)
    kx = 128 * (kp // 64 % 2) + 16 * (kp // 16 % 4) + 4 * (kp // 2 % 4) \
        + 2 * (kp // 8 % 2) + kp % 2 + 64 * (kp // 128)
    return torch.cat([u * 256 + kx for u in range(k // 256)])


def test_the_register_order_is_a_permutation_of_k_that_decodes_like_gguf():
    n, k = 24, 768
    raw = quantized(Q.Q6_K, n, k, seed=11)
    order = _x_order(k)
    assert sorted(order.tolist()) == list(range(k))
    want = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K)).double()
    got = _decoded_in_register_order(raw.view(np.int16), k)
    # each value a float32 multiply-add of numbers about 256 d |sc| large away
    scale = want.abs().amax(1, keepdim=True)
    assert ((got - want[:, order]).abs() / scale).max().item() < 1e-5
    assert not torch.allclose(got, want, atol=1e-3)  # the order is not k's own


def _available() -> bool:
    return (torch.cuda.is_available() and triton_available()
            and gluon_hopper(torch.device("cuda"), "gguf_q6k_wgmma"))


@pytest.mark.skipif(not _available(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize(("m", "n", "k", "split"),
                         [(2, 37, 512, 1), (17, 130, 1280, 2), (32, 64, 768, 3),
                          (64, 200, 4096, 4), (5, 64, 256, 1), (8, 96, 3584, 4)])
def test_the_kernel_matches_dequantized_matmul(m, n, k, split):
    from infer.kernels.gguf_gemm import gemm_words
    from infer.kernels.gguf_q6k_wgmma import q6k_wgmma

    raw = torch.from_numpy(quantized(Q.Q6_K, n, k, seed=m + n + k)).cuda()
    gen = torch.Generator().manual_seed(m * k)
    # rows only 4-byte aligned (a view of wider rows); odd super-blocks 2-byte aligned
    x = (torch.randn(m, k + 2, generator=gen) * 3).to(torch.bfloat16).cuda()[:, :k]
    ref = x.double() @ torch.from_numpy(
        gguf.quants.dequantize(raw.cpu().numpy(), Q.Q6_K)).double().cuda().T
    words = gemm_words(raw, Q.Q6_K, k)
    y = q6k_wgmma(x, words, k, split=split)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < 2e-2, error
    assert torch.equal(q6k_wgmma(x, words, k, split=split), y)  # counters left as found


@pytest.mark.skipif(not _available(), reason="needs a Hopper GPU and Triton's Gluon")
def test_gguf_matmul_takes_the_kernel_when_asked(monkeypatch):
    from infer.kernels import gguf_matmul

    raw = torch.from_numpy(quantized(Q.Q6_K, 64, 512, seed=5)).cuda()
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(gguf_matmul, "_q6k_wgmma", False)
    off = gguf_matmul.gguf_matmul(x, raw, Q.Q6_K, 512)
    monkeypatch.setattr(gguf_matmul, "_q6k_wgmma", True)
    calls = []
    import infer.kernels.gguf_q6k_wgmma as wgmma

    real = wgmma.q6k_wgmma
    monkeypatch.setattr(wgmma, "q6k_wgmma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on = gguf_matmul.gguf_matmul(x, raw, Q.Q6_K, 512)
    assert calls == [1]
    assert (on.float() - off.float()).abs().max() <= 2e-2 * off.float().abs().max()


def test_the_knob_is_set_with_each_engines_kernels(monkeypatch):
    """`gguf_q6k_wgmma`: the runner's set-up of each engine's kernels sets it for
    gguf_matmul (one built after another does not inherit it)."""
    import infer.kernels.gguf_matmul as gguf_matmul
    from infer.engine.config import EngineConfig
    from infer.engine.runner_setup import set_layer_kernels

    monkeypatch.setattr(gguf_matmul, "_q6k_wgmma", None)
    for on in (True, False):
        set_layer_kernels(torch.nn.Linear(2, 2), EngineConfig(model="m", gguf_q6k_wgmma=on),
                          "triton")
        assert gguf_matmul._q6k_wgmma is on
