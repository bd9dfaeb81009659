"""Building a model runner: backends bound, the KV cache sized and allocated, CUDA graphs
captured.

The engine core and every tensor-parallel worker build theirs here, from the same config
and in the same order, so the collectives inside (the warm-up forward that sizes the
cache, each graph capture) line up across the ranks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from infer.attention import Attention, set_attention_backend
from infer.attention.kv_dtype import FP8_KV, UNSCALED, kv_cache_torch_dtype
from infer.config import ModelConfig
from infer.distributed.group import SINGLE, TensorParallelGroup
from infer.engine.config import EngineConfig
from infer.engine.memory import plan_kv_cache
from infer.engine.model_runner import ModelRunner
from infer.engine.setup import pick_backend
from infer.kernels import cpu_attention, gluon_hopper
from infer.models.layers import set_cpu_norms, set_gate_up_activation, set_kernel_backend
from infer.models.linear import set_8bit_kernels, set_triton_gemv
from infer.quantization.gguf_gpu import set_gguf_int8_activations

log = logging.getLogger(__name__)


def build_runner(config: EngineConfig, model: nn.Module, model_config: ModelConfig,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 draft_config: ModelConfig | None = None, tp: TensorParallelGroup = SINGLE
                 ) -> ModelRunner:
    """The runner, with the backends `config` asks for on `device` (its
    `attention_backend` / `kernel_backend` say which) and its KV cache of `kv_cache_dtype`."""
    attention_backend = pick_backend("attention_backend", config.attention_backend, device)
    kernel_backend = pick_backend("kernel_backend", config.kernel_backend, device)
    # Bound before sizing the pool, so the warm-up forward measures the backends in use.
    set_attention_backend(model, attention_backend)
    set_decode_combine(config.decode_combine_at_once and attention_backend == "triton")
    cpu_attention.set_enabled(config.cpu_attention_kernel, device)
    set_kernel_backend(model, kernel_backend)
    set_layer_kernels(model, config, kernel_backend)
    set_dependent_launch(config.dependent_launch and kernel_backend == "triton", device)
    kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype)
    _log_kv_scales(model, kv_dtype)
    block_size, num_blocks = plan_kv_cache(config, model_config, max_model_len, model, device,
                                           kv_dtype, draft_config, tp.size)
    # Rank 0's scheduler hands out block ids for every rank's pool: all the same size.
    num_blocks = tp.min(num_blocks)
    return ModelRunner(model, model_config, num_blocks, block_size, device, kv_dtype,
                       attention_backend, kernel_backend)


def _log_kv_scales(model: nn.Module, kv_dtype: torch.dtype) -> None:
    """Whether a checkpoint's calibrated KV-cache scales are in use (attention/kv_dtype.py)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if all(m.kv_scales == UNSCALED for m in layers):
        return
    if kv_dtype == FP8_KV:
        log.info("FP8 KV cache with the checkpoint's calibrated scales (%d layers)",
                 len(layers))
    else:
        log.info("the checkpoint's calibrated KV-cache scales are unused by a %s cache "
                 "(kv_cache_dtype='fp8' uses them)", str(kv_dtype).removeprefix("torch."))


def set_layer_kernels(model: nn.Module, config: EngineConfig, kernel_backend: str) -> None:
    """Whether `model`'s RMSNorms take infer's C++ kernel on a CPU (`cpu_norm_kernel`), and
    which kernels its decode-sized matmuls take: infer's GEMV for 16-bit weights
    (`triton_gemv`, `gemv_max_rows`, a gated MLP's activation stored by the gate_up
    projection's with `gemv_gate_up_activation`, past one row with
    `mma_gate_up_activation`) and for up to `gemv_8bit_max_rows` rows
    of per-channel 8-bit ones (`triton_gemv`), in the form `gemv_form` says (FP8 ones
    made floats by their bits with `fp8_weight_bits`, or float16 products with
    `fp8_gemv_halves`),
    tensor cores for 8-bit ones past those
    (`w8a16_tensor_cores`, `w8a16_tensor_core_rows`; made bfloat16 by their bits with
    `mma_8bit_bf16`), FP8 by FP8 in infer's kernel for FP8 ones
    (`fp8_decode_activations`, `fp8_mma_rows`; x quantized by the norm before with
    `fp8_norm_rows`, by the gated activation with `fp8_act_rows`), either operand first there
    (`mma_weight_first`), the int8 tensor cores for INT8 ones (`int8_mma_rows`), both
    through the Gluon wgmma kernel on Hopper with `w8_wgmma`, FP8 ones by bfloat16 x through
    another up to `fp8_wgmma_rows` rows, dp4a for
    one row of INT8 ones (`int8_x16_gemv`) and for GGUF Q4_K, Q6_K and Q8_0 blocks
    (`gguf_int8_activations`, x rounded where it is made with `gguf_fused_x_rounding`), 2-64
    rows of Q4_K ones through Hopper's wgmma with `gguf_q4k_wgmma` (Q6_K ones with
    `gguf_q6k_wgmma`); on
    a CPU, INT8 ones through infer's C++ kernel (`cpu_int8_kernel`)."""
    set_cpu_norms(model, config.cpu_norm_kernel)
    triton = kernel_backend == "triton"
    set_triton_gemv(model, config.triton_gemv and triton, config.gemv_max_rows,
                    config.gemv_max_rows if config.mma_gate_up_activation else 1)
    set_gate_up_activation(model, config.gemv_gate_up_activation and config.triton_gemv
                           and triton)
    if triton:
        from gguf import GGMLQuantizationType as QType

        from infer.kernels import gemv, gguf_matmul, rows_mma

        rows_mma.set_weight_first(config.mma_weight_first)
        rows_mma.set_bf16_8bit(config.mma_8bit_bf16)
        gemv.set_form(config.gemv_form)
        gemv.set_fp8_bits(config.fp8_weight_bits)
        gemv.set_fp8_halves(config.fp8_gemv_halves)
        gguf_matmul.set_wgmma(QType.Q4_K, config.gguf_q4k_wgmma)
        gguf_matmul.set_wgmma(QType.Q6_K, config.gguf_q6k_wgmma)
    fp8_mma = triton and _has_fp8_mma()
    fp8_x = config.fp8_decode_activations and fp8_mma
    if config.fp8_decode_activations and triton and not fp8_x:
        log.warning("fp8_decode_activations needs a GPU with FP8 tensor cores (compute "
                    "capability 8.9+); left off")
    fp8_rows = config.fp8_mma_rows if fp8_mma else 0
    tensor_cores = config.w8a16_tensor_cores and triton
    # fp8_wgmma.py imports w8_wgmma.py: one check for both
    gluon = (triton and (config.w8_wgmma or config.fp8_wgmma_rows > 0)
             and torch.cuda.is_available() and gluon_hopper(torch.device("cuda"), "fp8_wgmma"))
    if triton and (config.w8_wgmma or config.fp8_wgmma_rows > 0) and not gluon:
        log.warning("w8_wgmma and fp8_wgmma_rows need a Hopper GPU and a Triton with Gluon; "
                    "left off")
    set_8bit_kernels(model, config.w8a16_tensor_core_rows if tensor_cores else 0, fp8_x,
                     fp8_rows, config.int8_mma_rows if triton else 0,
                     config.gemv_8bit_max_rows if config.triton_gemv and triton else 0,
                     config.gate_up_rows_apart, config.cpu_int8_kernel,
                     config.int8_x16_gemv and triton, config.w8_wgmma and gluon,
                     config.fp8_wgmma_rows if gluon else 0,
                     config.fp8_norm_rows and fp8_mma, config.fp8_act_rows and fp8_mma)
    set_gguf_int8_activations(model, config.gguf_int8_activations and triton,
                              config.gguf_fused_x_rounding)


def set_decode_combine(at_once: bool) -> None:
    """How the decode attention's last split combines the partials
    (`paged_attention.set_combine_at_once`); set for every engine, so that one built after
    another in the process does not inherit it."""
    from infer.kernels import triton_available

    if triton_available():
        from infer.kernels import paged_attention

        paged_attention.set_combine_at_once(at_once)


def _has_fp8_mma() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def set_dependent_launch(on: bool, device: torch.device) -> None:
    """Programmatic dependent launch for infer's decode kernels, where the device has it
    (kernels/dependent_launch.py); off in every other case, so that an engine built after
    another in one process does not inherit the setting."""
    from infer.kernels import triton_available

    if not triton_available():
        return
    from infer.kernels import dependent_launch

    on = on and dependent_launch.supported(device)
    dependent_launch.set_enabled(on)
    if on:
        log.info("programmatic dependent launch on for infer's decode kernels")


def uses_graphs(config: EngineConfig, device: torch.device, attention_backend: str) -> bool:
    if not (config.cuda_graphs and device.type == "cuda"):
        return False
    if attention_backend != "triton":
        log.warning("cuda_graphs needs attention_backend='triton'; running eagerly")
        return False
    return True


def capture_graphs(runner: ModelRunner, config: EngineConfig, max_model_len: int,
                   verify: bool = False) -> float:
    """Capture the graphs `config` asks for: decode steps, steps that verify k drafts of
    every sequence (`verify`), mixed steps (whole or cut at attention). Seconds spent."""
    seconds = runner.enable_decode_graphs(config.max_num_seqs, max_model_len,
                                          logits=config.logits_in_graphs).capture_seconds
    if verify:
        seconds += runner.enable_decode_graphs(
            min(config.speculative_max_batch, config.max_num_seqs), max_model_len,
            tokens_per_seq=config.num_speculative_tokens + 1,
            split_keys=config.verify_decode_attention).capture_seconds
    budget = config.max_num_batched_tokens
    if config.mixed_step_graphs == "full":
        seconds += runner.enable_mixed_graphs(budget, config.max_num_seqs,
                                              max_model_len).capture_seconds
    if config.mixed_step_graphs != "off":
        seconds += runner.enable_piecewise_graphs(budget).capture_seconds
    return seconds
