"""w8_wgmma.py: 8-bit weights times 8-bit x (FP8 by FP8, INT8 by x's int8 halves) on
Hopper's async wgmma (Gluon), TMA filling a ring of tiles.

The kernel runs only on a Hopper GPU (`INFER_TEST_DEVICE=cuda` there): each case against the
float64 product of the same quantized operands, with rows, channels and K that are not
multiples of the tiles (TMA's zero fill at every edge) and K split over programs (the last
one adding the parts). Its compile for sm_90 is in test_kernels_compile_for_sm90.py."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gluon_hopper, triton_available


def _hopper() -> bool:
    return (torch.cuda.is_available() and triton_available()
            and gluon_hopper(torch.device("cuda"), "w8_wgmma"))


pytestmark = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (wgmma, TMA)")
DEVICE = torch.device("cuda")


def _launch(splits: int, block_n: int = 64, stages: int = 4) -> dict:
    return dict(block_n=block_n, block_k=128, stages=stages, splits=splits)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 4096), (5, 64, 272), (32, 4160, 1024),
                                           (64, 96, 640)])
@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_by_fp8_matches_float64(m, n, k, splits):
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.w8_wgmma import w8_wgmma

    gen = torch.Generator(device="cpu").manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(DEVICE,
                                                                      torch.float8_e4m3fn)
    scale = (torch.rand(n, generator=gen) * 1e-3 + 1e-4).to(DEVICE)
    xq, x_scale = fp8_quantize_rows(x)
    want = (xq.double() * x_scale.double()[:, None]) @ (w.double() * scale.double()[:, None]).T
    got = w8_wgmma(xq, x_scale, w, scale, torch.float32, **_launch(splits))
    # Hopper's FP8 MMA keeps ~14 bits of its running sum within a K tile (the docstring),
    # the tiles added in float32: well under 1e-3 of the sum of |products|.
    bound = (xq.double().abs() * x_scale.double()[:, None]) @ \
        (w.double().abs() * scale.double()[:, None]).T
    assert ((got.double() - want).abs() <= 1e-3 * bound + 1e-6).all()
    assert got.shape == (m, n)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 4096), (7, 64, 272), (32, 4160, 1024),
                                           (64, 96, 640)])
@pytest.mark.parametrize("splits", [1, 4])
def test_int8_by_halves_is_exact_before_rounding(m, n, k, splits):
    from infer.kernels.int8_x16 import split_rows
    from infer.kernels.w8_wgmma import w8_wgmma

    gen = torch.Generator(device="cpu").manual_seed(m * 5 + n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    scale = (torch.rand(n, generator=gen) * 1e-3 + 1e-4).to(DEVICE)
    halves, x_scale = split_rows(x)
    q = halves.double()
    want = ((256 * q[0] + q[1]) @ w.double().T) * x_scale.double()[:, None] \
        * scale.double()[None, :]
    got = w8_wgmma(halves, x_scale, w, scale, torch.float32, **_launch(splits, 128, 3))
    error = (got.double() - want).abs()
    if splits == 1:  # int32 sums exact; one float32 rounding of each sum and its scalings
        assert (error <= 1e-6 * want.abs() + 1e-9).all()
        return
    # each K slice's int32 sums made one float32 (three roundings), the slices added in
    # float32 (three more), each rounding at most 2^-24 of the sum of |products|
    magnitude = ((256 * q[0].abs() + q[1].abs()) @ w.double().abs().T) \
        * x_scale.double()[:, None] * scale.double()[None, :]
    assert (error <= 1e-6 * want.abs() + 2.0**-21 * magnitude).all()


def test_bfloat16_output_and_the_default_launch():
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.w8_wgmma import default_launch, w8_wgmma

    m, n, k = 32, 6144, 4096
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) * 50).to(torch.float8_e4m3fn)
    scale = torch.full((n,), 1e-3, device=DEVICE)
    xq, x_scale = fp8_quantize_rows(x)
    assert default_launch(n, k, DEVICE)["splits"] >= 1
    got = w8_wgmma(xq, x_scale, w, scale, torch.bfloat16)
    want = torch._scaled_mm(xq, w.t(), scale_a=x_scale[:, None], scale_b=scale[None, :],
                            out_dtype=torch.float32)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().mean())
