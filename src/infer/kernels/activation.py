"""Gated activations on the fused gate_up projection: `[T, 2*I]` (gate | up) -> `[T, I]`.

With `fp8_rows`, each row of the output also in FP8 with its scale
(`fp8_quant.fp8_quantize_rows`'s values, bit for bit) for the FP8 x FP8 down projection,
one program a row. (The same for INT8's int8 halves, `int8_act_rows`, lost in the 8B step
on an H100 and was removed: docs/performance.md, session 73.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.fp8_quant import ROW_IN_REGISTERS, store_fp8_row


@triton.jit
def _tanh(z):
    # exp of a non-positive argument never overflows.
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z >= 0, t, -t)


@triton.jit
def gated(gate, up, ACT: tl.constexpr):
    """`act(gate) * up` in float32; ACT: "silu" or "gelu_tanh" (the tanh approximation)."""
    gate = gate.to(tl.float32)
    if ACT == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    else:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + _tanh(z))
    return act * up.to(tl.float32)


@triton.jit
def _gated_act_kernel(
    gu_ptr, out_ptr, q_ptr, s_ptr, stride_gu, stride_out, inter,
    ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, FP8_ROWS: tl.constexpr = False,
):
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    y = gated(gate, up, ACT).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if FP8_ROWS:  # the whole row in this program: in FP8 `[rows, inter]` at q_ptr, its
        # scale at s_ptr + row
        store_fp8_row(y, q_ptr + row * inter + cols, s_ptr + row, mask)


def gated_rows(gate_up: torch.Tensor, act: str, fp8_rows: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`act(gate) * up` of each row `[gate | up]` of `gate_up [T, 2*I]`, computed in
    float32; `act`: the kernels' name ("silu" or "gelu_tanh"), as `gated` takes it. With
    `fp8_rows` (a GPU, `I` at most `fp8_quant.ROW_IN_REGISTERS`) also that output's rows
    in FP8 `[T, I]` and their scales `[T]`."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    # Rows are addressed as base + row * stride(0) + col: columns must be unit-stride.
    assert gate_up.stride(1) == 1, "gate_up must have unit stride in its last dim"
    assert gate_up.dtype in (torch.float16, torch.bfloat16, torch.float32), gate_up.dtype
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    q = scale = out
    if fp8_rows:
        assert gate_up.is_cuda, "FP8 rows: a GPU's (Triton's interpreter has no FP8)"
        assert inter <= ROW_IN_REGISTERS, (inter, ROW_IN_REGISTERS)
        q = torch.empty(tokens, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
        scale = torch.empty(tokens, dtype=torch.float32, device=gate_up.device)
    if tokens:
        block = triton.next_power_of_2(inter) if fp8_rows else min(
            triton.next_power_of_2(inter), 1024)
        grid = (tokens, triton.cdiv(inter, block))
        _gated_act_kernel[grid](gate_up, out, q, scale, gate_up.stride(0), out.stride(0),
                                inter, ACT=act, BLOCK=block, FP8_ROWS=fp8_rows,
                                num_warps=16 if block > 4096 else 4 if block <= 1024 else 8,
                                **dependent_launch.launch_options())
    return (out, (q, scale)) if fp8_rows else out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, computed in float32."""
    return gated_rows(gate_up, "silu")


def geglu_tanh(gate_up: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (Gemma's `gelu_pytorch_tanh`), computed in float32."""
    return gated_rows(gate_up, "gelu_tanh")
