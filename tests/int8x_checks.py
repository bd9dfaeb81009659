"""Test helper: what a GGUF kernel that rounds x to int8 must give for weights without a min
term (Q6_K, Q8_0): the product with the x it rounded (to float32 sums), and the exact
product within the rounding's bound."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def assert_rounded_product(y: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor],
                           w: torch.Tensor, x: torch.Tensor) -> None:
    """`y [1, n]` (x's dtype) from `x [1, k]` rounded as `quantized` (quantize_x's int8
    values and side array) times the float64 weight `w [n, k]`."""
    n, k = w.shape
    assert y.shape == (1, n) and y.dtype == x.dtype and torch.isfinite(y).all()
    xq, side = (t.cpu().double() for t in quantized)
    steps = side[:, :2].reshape(-1)
    rounded = (xq.reshape(-1, 32) * steps[:, None]).reshape(1, k)
    ref = rounded @ w.T  # no min term: the product with the rounded x
    tolerance = TOLERANCE[x.dtype]
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= tolerance * scale
    # Against the exact product: within the rounding's bound, sum_i |w_i| step_i / 2.
    exact = x.double() @ w.T
    bound = (steps.repeat_interleave(32)[None, :] / 2) @ w.abs().T
    assert ((y.double() - exact).abs() <= bound + tolerance * scale).all()
    assert (y.double() - exact).abs().max() > 0  # x was rounded: not the exact product
