"""gguf_wgmma.py: Q4_K and Q6_K at 2..64 rows through Hopper's wgmma (Gluon).

The kernel runs only on a Hopper GPU (`INFER_TEST_DEVICE=cuda` there); on the CPU the order
each type's decode puts the weights in is checked by redoing it step by step in torch (the
same words, shifts, masks, scales, multiply-adds, joins and permutation, and x's gather
index) against the `gguf` package's dequantization, and the kernel's compile for sm_90 is in
test_kernels_compile_for_sm90.py (the conversion into the wgmma operand asserted free)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.kernels import gluon_hopper, triton_available

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf_matmul import quantized  # noqa: E402

ONE = 0x3F800000


def _float_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _q4k_decoded(words: np.ndarray, k: int) -> torch.Tensor:
    """The kernel's decode of `words [N, k / 256 * 36]` (int32), redone in torch: `[N, k]`
    float32, each super-block's 256 values in the kernel's order k'."""
    w_all = torch.from_numpy(words.astype(np.int64) & 0xFFFFFFFF)
    n = w_all.shape[0]
    g = torch.arange(8)
    c = (g // 2)[None, :]  # [1, 8]
    out = []
    for u in range(k // 256):
        unit = w_all[:, u * 36:(u + 1) * 36]
        head, s0, s1, s2 = (unit[:, i:i + 1] for i in range(4))  # [N, 1]
        w = unit[:, 4:36].reshape(n, 8, 4)  # word 4g + t
        sh = c % 2 * 16
        sc = torch.where(c < 2, s0 >> sh, ((s2 >> sh) & 0x0F0F) | ((s0 >> (sh + 2)) & 0x3030))
        mn = torch.where(c < 2, s1 >> sh,
                         ((s2 >> (sh + 4)) & 0x0F0F) | ((s1 >> (sh + 2)) & 0x3030))
        d = torch.from_numpy((head & 0xFFFF).numpy().astype(np.uint16).view(np.float16)).float()
        dmin = torch.from_numpy((head >> 16).numpy().astype(np.uint16).view(np.float16)).float()
        halves = []
        for h in range(2):
            a = d * ((sc >> (h * 8)) & 0x3F).float() * (256.0 if h == 0 else 16.0)
            b = -(a + dmin * ((mn >> (h * 8)) & 0x3F).float())
            a, b = a[:, :, None], b[:, :, None]
            shifted = [(w << 15) & 0xFFFFFFFF, (w << 7) & 0xFFFFFFFF, w >> 1, w >> 9]
            f = [_float_bits((s & (0xF << (15 + 4 * h))) | ONE).double() * a.double()
                 + b.double() for s in shifted]
            halves.append(torch.stack([torch.stack([f[0], f[1]], -1),
                                       torch.stack([f[2], f[3]], -1)], -1))
        tile = torch.stack(halves, -1).permute(0, 5, 1, 4, 2, 3)  # as the kernel's
        out.append(tile.reshape(n, 256))
    return torch.cat(out, 1)


def _q4k_x_order(kp: torch.Tensor) -> torch.Tensor:
    """The kernel's gather of x: column k' of a super-block's tile is x's column kx[k']."""
    return 64 * (kp // 32 % 4) + 32 * (kp // 128) + 16 * (kp // 16 % 2) + 4 * (kp // 2 % 4) \
        + 2 * (kp // 8 % 2) + kp % 2


def _words(halves: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit words of the 16-bit words at `index` and `index + 1` of each row."""
    lo = halves[:, index] & 0xFFFF
    hi = halves[:, index + 1] & 0xFFFF
    return lo | (hi << 16)


def _q6k_decoded(halves: np.ndarray, k: int) -> torch.Tensor:
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


def _q6k_x_order(kp: torch.Tensor) -> torch.Tensor:
    return 128 * (kp // 64 % 2) + 16 * (kp // 16 % 4) + 4 * (kp // 2 % 4) \
        + 2 * (kp // 8 % 2) + kp % 2 + 64 * (kp // 128)


@pytest.mark.parametrize(("qtype", "decoded", "x_order", "words"),
                         [(Q.Q4_K, _q4k_decoded, _q4k_x_order, np.int32),
                          (Q.Q6_K, _q6k_decoded, _q6k_x_order, np.int16)])
def test_the_register_order_is_a_permutation_of_k_that_decodes_like_gguf(
        qtype, decoded, x_order, words):
    n, k = 24, 768
    raw = quantized(qtype, n, k, seed=7)
    order = torch.cat([u * 256 + x_order(torch.arange(256)) for u in range(k // 256)])
    assert sorted(order.tolist()) == list(range(k))
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    got = decoded(raw.view(words), k)
    # Each value a float32 multiply-add away from the exact one: its error is that
    # rounding of a number about 128 (Q4_K) / 256 (Q6_K) steps large.
    scale = want.abs().amax(1, keepdim=True)
    assert ((got - want[:, order]).abs() / scale).max().item() < 1e-5
    assert not torch.allclose(got, want, atol=1e-3)  # the order is not k's own


def _available() -> bool:
    return (torch.cuda.is_available() and triton_available()
            and gluon_hopper(torch.device("cuda"), "gguf_wgmma"))


@pytest.mark.skipif(not _available(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize(("m", "n", "k", "split"),
                         [(2, 37, 512, 1), (17, 130, 1280, 2), (32, 64, 768, 3),
                          (64, 200, 4096, 4), (5, 64, 256, 1), (8, 96, 3584, 4)])
def test_the_kernel_matches_dequantized_matmul(qtype, m, n, k, split):
    from infer.kernels.gguf_gemm import gemm_words
    from infer.kernels.gguf_wgmma import gguf_wgmma

    raw = torch.from_numpy(quantized(qtype, n, k, seed=m + n + k)).cuda()
    gen = torch.Generator().manual_seed(m * k)
    # rows only 4-byte aligned (a view of wider rows); Q6_K's odd super-blocks 2-byte
    x = (torch.randn(m, k + 2, generator=gen) * 3).to(torch.bfloat16).cuda()[:, :k]
    ref = x.double() @ torch.from_numpy(
        gguf.quants.dequantize(raw.cpu().numpy(), qtype)).double().cuda().T
    words = gemm_words(raw, qtype, k)
    y = gguf_wgmma(x, words, qtype, k, split=split)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < 2e-2, error
    # the slices' counters left as found: a second launch adds its parts alike
    assert torch.equal(gguf_wgmma(x, words, qtype, k, split=split), y)


@pytest.mark.skipif(not _available(), reason="needs a Hopper GPU and Triton's Gluon")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_gguf_matmul_takes_the_kernel_when_asked(monkeypatch, qtype):
    from infer.kernels import gguf_matmul

    raw = torch.from_numpy(quantized(qtype, 64, 512, seed=3)).cuda()
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setitem(gguf_matmul._wgmma, qtype, False)
    off = gguf_matmul.gguf_matmul(x, raw, qtype, 512)
    monkeypatch.setitem(gguf_matmul._wgmma, qtype, True)
    calls = []
    import infer.kernels.gguf_wgmma as wgmma

    real = wgmma.gguf_wgmma
    monkeypatch.setattr(wgmma, "gguf_wgmma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on = gguf_matmul.gguf_matmul(x, raw, qtype, 512)
    assert calls == [1]
    assert (on.float() - off.float()).abs().max() <= 2e-2 * off.float().abs().max()


@pytest.mark.parametrize(("knob", "qtype"), [("gguf_q4k_wgmma", Q.Q4_K),
                                             ("gguf_q6k_wgmma", Q.Q6_K)])
def test_the_knobs_are_set_with_each_engines_kernels(monkeypatch, knob, qtype):
    """The runner's set-up of each engine's kernels sets them for gguf_matmul (one built
    after another does not inherit them)."""
    import infer.kernels.gguf_matmul as gguf_matmul
    from infer.engine.config import EngineConfig
    from infer.engine.runner_setup import set_layer_kernels

    monkeypatch.setitem(gguf_matmul._wgmma, qtype, None)
    for on in (True, False):
        set_layer_kernels(torch.nn.Linear(2, 2), EngineConfig(model="m", **{knob: on}),
                          "triton")
        assert gguf_matmul._wgmma[qtype] is on
