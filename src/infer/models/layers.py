"""Building blocks shared by the model files: norms, rotary embeddings, activations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from infer.config import RopeConfig
from infer.distributed.group import TensorParallelGroup
from infer.kernels import cpu_extension, cpu_norm
from infer.models.linear import MergedColumnParallelLinear, RowParallelLinear


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype `model` computes in: its norms' (a linear layer's weight may be stored
    quantized, beside scales in another dtype)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, nn.LayerNorm)):
            return module.weight.dtype
    return next(model.parameters()).dtype


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `offset=1.0` gives Gemma's `x * (1 + w)` form.

    Called as `norm(x, residual)` it first adds `x` to the residual stream and returns
    `(norm(x + residual), x + residual)` (the sum rounded to x's dtype first), which the
    Triton kernel does in one pass; the caller must not reuse `residual` afterwards.
    With `reduce_input` (a tensor-parallel group, set by `reduce_in_norm`) `x` is each
    rank's partial sum, all-reduced first: in the same kernel where the group has the
    fused one (`kernels/all_reduce_norm.py`). With `int8_rows` (set with the GGUF int8-x
    kernels, `set_gguf_int8_activations`) a one-row output carries its rounding to int8
    for the projections it goes into (`kernels/int8_rows.py`); an output of as many rows
    as `x16_rows` holds (set for INT8 models, `set_x16_norms`), its rows' two int8 halves
    (`kernels/int8_x16.py`); as many as `fp8_rows` holds (set for FP8 models,
    `set_fp8_norms`), its rows in FP8 with their scales (`kernels/fp8_quant.py`'s). All
    only where `feeds_projection` (the model's say: not the
    per-head q / k norms, whose rows go to RoPE, nor Gemma 3's norms before the residual
    adds). With `cpu_kernel` (set by `set_cpu_norms`) float32 rows on a CPU take infer's C++
    kernel (`kernels/cpu_norm.cpp`).
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0,
                 feeds_projection: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset
        self.use_triton = False
        self.reduce_input: TensorParallelGroup | None = None
        self.int8_rows = False
        self.x16_rows = range(0)  # set_x16_norms
        self.fp8_rows = range(0)  # set_fp8_norms
        self.feeds_projection = feeds_projection
        self.cpu_kernel = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.reduce_input is not None:
            fused = self.reduce_input.add_rmsnorm
            if self.use_triton and fused is not None and fused.takes(x, residual):
                return fused(x, residual, self.weight, self.eps, self.offset)
            x = self.reduce_input.all_reduce(x)
        if self.use_triton:
            from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm, takes_int8_rows

            if self.int8_rows and takes_int8_rows(x):
                return self._with_rounding(x, residual, int8_rows=True)
            if x.is_cuda and x.numel() // x.shape[-1] in self.x16_rows:
                return self._with_rounding(x, residual, x16_rows=True)
            if x.is_cuda and x.numel() // x.shape[-1] in self.fp8_rows:
                return self._with_rounding(x, residual, fp8_rows=True)
            if residual is None:
                return rmsnorm(x, self.weight, self.eps, self.offset)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps, self.offset)
        if self.cpu_kernel and self._cpu_kernel_takes(x, residual):
            if residual is None:
                return cpu_norm.rms_norm(x, self._scale(), self.eps)
            return cpu_norm.add_rms_norm(x, residual, self._scale(), self.eps)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _cpu_kernel_takes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32
                and x.is_contiguous()
                and (residual is None or (residual.dtype == torch.float32
                                          and residual.is_contiguous()))
                and cpu_extension.available())

    def _scale(self) -> torch.Tensor:
        """What the normalized x is multiplied by: the weight, or Gemma's `offset + w`."""
        return self.weight + self.offset if self.offset else self.weight

    def _with_rounding(self, x: torch.Tensor, residual: torch.Tensor | None,
                       **rounding: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm carrying its rounding (`rounding`: `int8_rows=True`, `x16_rows=True` or
        `fp8_rows=True`, as the kernels take them)."""
        from infer.kernels.fp8_quant import attach_fp8_rows
        from infer.kernels.int8_rows import attach
        from infer.kernels.int8_x16 import attach_halves
        from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

        attached = (attach_halves if rounding.get("x16_rows") else
                    attach_fp8_rows if rounding.get("fp8_rows") else attach)
        if residual is None:
            out, rounded = rmsnorm(x, self.weight, self.eps, self.offset, **rounding)
            return attached(out, rounded)
        out, residual, rounded = fused_add_rmsnorm(x, residual, self.weight, self.eps,
                                                   self.offset, **rounding)
        return attached(out, rounded), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' rounding (LlamaRMSNorm, Gemma3RMSNorm), which the Triton kernel
        # (kernels/rmsnorm.py) matches bit for bit in bf16.
        dtype = x.dtype
        if dtype == self.weight.dtype == torch.float32 and x.device.type == "cpu":
            # The same float32 operations in one call (torch's CPU composite), bit-equal.
            weight = self._scale()
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


def reduce_in_norm(pairs: list[tuple[RowParallelLinear, RMSNorm]]) -> None:
    """Under tensor parallelism, each linear of `pairs` hands its partial sum on unreduced
    and the (add +) RMSNorm it feeds all-reduces it (one kernel where the group fuses
    them). Each norm must only ever be called on its linear's output (or on a partial sum
    alike: every pair of a model is wired or none is). If any linear has a bias (added
    after the sum), none is wired."""
    if any(linear.bias is not None for linear, _ in pairs):
        return
    for linear, norm in pairs:
        if linear.tp.size > 1:
            linear.reduce_output = False
            norm.reduce_input = linear.tp


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies `[rotary_dim // 2]` (float64) after the configured scaling."""
    inv_freq = 1.0 / rope.theta ** (
        torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    )
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
        # between the two cut-offs is interpolated smoothly.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(middle, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate the two halves of each head) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        self.use_triton = False
        # (positions, cos, sin) of the forward pass under way (`begin`): every layer
        # rotates by the same rows, gathered once.
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def begin(self, positions: torch.Tensor) -> None:
        """A forward pass over `positions` starts (its layers share this module)."""
        if not self.use_triton:
            self._rows = (positions, *self._gather(positions))

    def end(self) -> None:
        self._rows = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: `[tokens, heads, head_dim]`, k: `[tokens, kv_heads, head_dim]`. The Triton
        path rotates them in place."""
        if self.use_triton:
            from infer.kernels.rope import rope_

            return rope_(q, k, self.cos, self.sin, positions)
        if self._rows is not None and self._rows[0] is positions:
            _, cos, sin = self._rows
        else:
            cos, sin = self._gather(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, cos)` and `(-sin, sin)` of `positions`, `[tokens, 1, head_dim]` each."""
        cos, sin = self.cos[positions], self.sin[positions]
        return (torch.cat((cos, cos), dim=-1).unsqueeze(1),
                torch.cat((-sin, sin), dim=-1).unsqueeze(1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`(x1 cos - x2 sin, x2 cos + x1 sin)` of x's halves, as `x cos + swap(x) signed_sin`
    (`_gather`'s tables): four operations, the same float32 results (a - b = a + (-b))."""
    xf = x if x.dtype == torch.float32 else x.float()
    out = xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * signed_sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


# Gated activations the Triton kernels compute (`act(gate) * up` in one pass: the
# activation kernel's, or the down projection's GEMV's), by the kernels' name for each.
_TRITON_ACT = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}"
        ) from None


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up fused into one matmul (shards 0, 1).
    A step of as many rows as `fp8_rows` holds (set for FP8 down projections,
    `set_fp8_activations`) whose activation has its own launch hands the down projection
    its rows in FP8 with their scales, made by that launch (`kernels/activation.py`)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act = activation(act)
        self.act_name = act
        self.use_triton = False
        self.act_in_gate_up = False  # set_gate_up_activation
        self.fp8_rows = range(0)  # set_fp8_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton and self.act_in_gate_up and self.act_name in _TRITON_ACT:
            h = self.gate_up_proj.forward_gate_up(x, _TRITON_ACT[self.act_name])
            if h is not None:  # few rows: the activation in the gate_up matmul's launch
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)
        if self.use_triton and self.act_name in _TRITON_ACT:
            act = _TRITON_ACT[self.act_name]
            y = self.down_proj.forward_gated(gate_up, act)
            if y is not None:  # few rows: activation and matmul in one launch
                return y
            from infer.kernels import activation as kernels

            rows = gate_up.reshape(-1, gate_up.shape[-1])
            if rows.is_cuda and len(rows) in self.fp8_rows:
                from infer.kernels.fp8_quant import attach_fp8_rows

                out, fp8_rows = kernels.gated_rows(rows, act, fp8_rows=True)
                return self.down_proj(attach_fp8_rows(out, fp8_rows))
            return self.down_proj(kernels.gated_rows(rows, act))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def set_gate_up_activation(model: nn.Module, on: bool) -> None:
    """Whether `model`'s gated MLPs ask their gate_up projection for `act(gate) * up`
    (`forward_gate_up`: its weight's method stores it from the matmul's own launch where it
    can) before launching the activation apart."""
    for m in model.modules():
        if isinstance(m, GatedMLP):
            m.act_in_gate_up = on


def set_cpu_norms(model: nn.Module, on: bool) -> None:
    """Whether `model`'s RMSNorms take infer's C++ kernel on float32 CPU rows
    (`RMSNorm.cpu_kernel`)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.cpu_kernel = on


def set_kernel_backend(model: nn.Module, name: str) -> None:
    """Run the norms, RoPE and gated activations of `model` on `name` (torch | triton)."""
    if name not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be torch or triton, got {name!r}")
    for m in model.modules():
        if isinstance(m, (RMSNorm, RotaryEmbedding, GatedMLP)):
            m.use_triton = name == "triton"
