"""How a core comes to be: the model (a rank's part of it) and its tokenizer loaded and
quantized, the batch fitted to the device, the draft model loaded, the core built
(`load_core`, which the in-process engine and the core process both call), and what the
request side needs to know of it (`CoreInfo`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from infer.config import ModelConfig
from infer.distributed.checks import check_tensor_parallel
from infer.distributed.group import SINGLE, TensorParallelGroup, tensor_parallel
from infer.distributed.workers import Workers
from infer.engine.batch_defaults import fit_batch_to_device
from infer.engine.config import EngineConfig
from infer.engine.cpu_threads import set_cpu_threads
from infer.engine.engine_core import EngineCore
from infer.engine.setup import (
    gguf_blocks_of,
    load_model_and_tokenizer,
    model_config_of,
    pick_device_and_dtype,
)
from infer.loader.tokenizer import Tokenizer
from infer.quantization import quantize_model
from infer.spec.draft_model import load_draft_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the request side needs to know of a core it may not share a process with."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    attention_backend: str
    kernel_backend: str
    graph_capture_seconds: float
    quantization: str = "none"
    max_num_seqs: int = 0  # as the core chose them (engine/batch_defaults.py)
    max_num_batched_tokens: int = 0
    kv_cache_dtype: str = ""  # the cache's element type, as torch names it: float8_e4m3fn

    @classmethod
    def of(cls, core: EngineCore, model_name: str) -> CoreInfo:
        return cls(model_name, core.max_model_len, core.model_config.vocab_size,
                   core.kv.pool.num_blocks, core.block_size, str(core.device),
                   str(core.dtype).removeprefix("torch."), core.attention_backend,
                   core.kernel_backend, core.graph_capture_seconds,
                   core.quantization, core.config.max_num_seqs,
                   core.config.max_num_batched_tokens, core.kv_cache_dtype)


def load_core(config: EngineConfig) -> tuple[EngineCore, Tokenizer, str]:
    """Load the model and its tokenizer, and build the core: (core, tokenizer, model name).
    The tokenizer gives the EOS ids; the core itself never decodes. Logs what was chosen
    once it is ready (both the in-process engine and the core process come here)."""
    start = time.perf_counter()
    device, dtype = pick_device_and_dtype(config.device, config.dtype)
    if device.type == "cpu":
        log.info("CPU: %d threads for the model's kernels%s", set_cpu_threads(config.threads),
                 "" if config.threads else " (one per usable core less one; --threads)")
    elif config.threads is not None:
        log.info("%d threads for torch's host operations", set_cpu_threads(config.threads))
    tp, workers = SINGLE, None
    if config.tensor_parallel_size > 1:
        check_tensor_parallel(config, model_config_of(config.model), device)
        workers = Workers.start(config, device)
        tp = workers.group
    try:
        core, tokenizer, model_name, quantization = _load_core(config, device, dtype, tp,
                                                               workers)
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    core.quantization = quantization
    config = core.config
    log.info("ready in %.1f s: %s on %s, %s, quantization %s; KV cache %d tokens (%d blocks x "
             "%d, %s); attention %s, kernels %s; CUDA graphs %s; max_num_seqs=%d, "
             "max_num_batched_tokens=%d, max_model_len=%d%s%s",
             time.perf_counter() - start, model_name, device, str(dtype).removeprefix("torch."),
             quantization, core.kv.pool.num_blocks * core.block_size,
             core.kv.pool.num_blocks, core.block_size, core.kv_cache_dtype,
             core.attention_backend,
             core.kernel_backend,
             f"on (captured in {core.graph_capture_seconds:.1f} s)" if core.graphs_on
             else "off", config.max_num_seqs, config.max_num_batched_tokens,
             core.max_model_len,
             "" if config.speculative_method == "none" else
             f"; speculative {config.speculative_method}, k={config.num_speculative_tokens}",
             "" if tp.size == 1 else f"; tensor parallel over {tp.size} ranks")
    return core, tokenizer, model_name


def load_model_shard(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                     tp: TensorParallelGroup) -> tuple[nn.Module, ModelConfig, Tokenizer, str, str]:
    """The model (this rank's part of it), its config, its tokenizer, its name, and the
    quantization in effect: what every rank loads, rank 0 here and the others in
    distributed/worker.py."""
    with tensor_parallel(tp):
        model, mc, tokenizer, model_name = load_model_and_tokenizer(config.model, dtype,
                                                                    device, config.quantization)
        quantization = quantize_model(model, config.quantization,
                                      gguf_blocks_of(config.model, mc, config.quantization),
                                      config.cpu_int8_activations)
    return model, mc, tokenizer, model_name, quantization


def _load_core(config: EngineConfig, device: torch.device, dtype: torch.dtype,
               tp: TensorParallelGroup, workers: Workers | None
               ) -> tuple[EngineCore, Tokenizer, str, str]:
    """load_core's work on rank 0 (the workers make the same calls: distributed/worker.py);
    also the quantization in effect."""
    model, mc, tokenizer, model_name, quantization = load_model_shard(config, dtype, device,
                                                                      tp)
    if quantization != "none":
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the full-precision weights' memory, for the KV cache
        log.info("quantization: %s", quantization)
    torch.manual_seed(config.seed)
    max_model_len = config.max_model_len or min(mc.max_position_embeddings, 8192)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's context length "
            f"({mc.max_position_embeddings})"
        )
    config = fit_batch_to_device(config, device, max_model_len)
    if not config.chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"chunked_prefill=False needs max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) >= max_model_len ({max_model_len})"
        )
    tp.broadcast_object((config, max_model_len))  # the workers build their runners from it
    eos_token_ids = tuple(tokenizer.eos_token_ids) or mc.eos_token_ids
    draft = None
    if config.draft_model is not None:
        draft = load_draft_model(config.draft_model, tokenizer, mc, dtype, device,
                                 config.draft_quantization, config.cpu_int8_activations)
    core = EngineCore(config, model, mc, device, dtype, max_model_len, eos_token_ids,
                      tokenizer, draft, tp, workers)
    return core, tokenizer, model_name, quantization
