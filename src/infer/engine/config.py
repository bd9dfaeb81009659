"""EngineConfig: every engine knob, each optimisation an independent toggle.

Plain values only: building one reads no file. Conflicting fields fail here, at
construction, with a message naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "triton")
MIXED_STEP_GRAPHS = ("full", "piecewise", "off")
QUANTIZATIONS = ("auto", "none", "int8", "fp8", "gguf")  # the choices infer.quantization takes
SPECULATIVE_METHODS = ("none", "ngram", "self", "draft")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    # Most sequences in one batch, and the token budget per step. None: sized to the device
    # (engine/batch_defaults.py: 64 and 2,048 on a CPU; 256 and 16,384 on a large GPU).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    batching_mode: str = "continuous"  # static | continuous
    kv_cache: str = "paged"  # paged | contiguous (one max_model_len block per sequence)
    block_size: int = 16
    num_blocks: int | None = None  # None: size the pool from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # device memory share: weights + activations + KV
    chunked_prefill: bool = True
    prefill_chunk_size: int | None = None  # most prompt tokens per request per step
    prefix_caching: bool = True
    # auto: triton on CUDA (when Triton is installed), torch elsewhere; torch is the reference.
    attention_backend: str = "auto"
    # Norms, RoPE and gated activations: the same choice as attention_backend.
    kernel_backend: str = "auto"
    cuda_graphs: bool = True  # replay captured decode steps (CUDA + triton attention only)
    # With cuda_graphs, the steps that carry prompt tokens: full = whole-step graphs
    # (and piecewise ones for steps with a sequence too long for their attention launch),
    # piecewise = graphs cut where each layer attends (attention eager), off = eager.
    mixed_step_graphs: str = "full"
    # Launch the next decode step before this one's tokens reach the host (stop checks run
    # one step behind), so the GPU does not idle during the host's bookkeeping.
    async_scheduling: bool = True
    max_waiting_requests: int | None = None  # None: unbounded queue
    # The core (scheduler, model, sampler) in a process of its own, apart from tokenizing
    # and detokenizing. Off for LLM (no IPC in the way); `infer serve` turns it on.
    core_process: bool = False
    # The weights' format: auto (the checkpoint's own: FP8 / INT8 checkpoints as stored;
    # a GGUF file's quantized weights stay quantized on the CPU, dequantized on CUDA,
    # faster for prefill and large batches) | none (dequantized at load) | int8
    # (weight-only, per output channel, made at load) | fp8 (e4m3 per output channel,
    # made at load; FP8 activations per token in large steps) | gguf (a GGUF file's
    # blocks kept as stored on any device: 3-4x less memory); quantization/ says more.
    quantization: str = "auto"
    # On a CPU, the threads the model's kernels use; None: one per usable core less one
    # (engine/cpu_threads.py says why: more collapses beside any other busy process).
    threads: int | None = None
    # Speculative decoding: none | ngram (drafts looked up in the sequence's own earlier
    # tokens, spec/ngram.py) | self (the model's own first self_draft_layers layers) |
    # draft (draft_model, a small model with the same vocabulary). Drafts are verified in
    # one forward of the model, the output distributed exactly as without them (penalties,
    # logprobs and grammar masks at every drafted position). A step with drafts is not
    # launched ahead (async_scheduling): steps above speculative_max_batch are.
    speculative_method: str = "none"
    num_speculative_tokens: int = 4  # k: most drafts per sequence per step
    ngram_min: int = 1  # n-gram drafts: the shortest and longest suffix looked up
    ngram_max: int = 4
    self_draft_layers: int | None = None  # None: half the model's layers
    draft_model: str | None = None  # a model directory or GGUF file, as `model`
    speculative_max_batch: int = 16  # no drafts in steps of more running sequences

    def __post_init__(self) -> None:
        self._check_choice("dtype", DTYPES)
        self._check_choice("batching_mode", ("static", "continuous"))
        self._check_choice("kv_cache", ("paged", "contiguous"))
        self._check_choice("attention_backend", BACKENDS)
        self._check_choice("kernel_backend", BACKENDS)
        self._check_choice("mixed_step_graphs", MIXED_STEP_GRAPHS)
        self._check_choice("quantization", QUANTIZATIONS)
        self._check_choice("speculative_method", SPECULATIVE_METHODS)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("block_size", "num_speculative_tokens", "ngram_min", "ngram_max",
                     "speculative_max_batch"):
            self._check_positive(name)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks",
                     "prefill_chunk_size",
                     "max_waiting_requests", "threads", "self_draft_layers"):
            if getattr(self, name) is not None:
                self._check_positive(name)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max "
                             f"({self.ngram_max})")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model goes with speculative_method='draft' (and that method "
                             f"needs one); got speculative_method={self.speculative_method!r}, "
                             f"draft_model={self.draft_model!r}")
        if self.self_draft_layers is not None and self.speculative_method != "self":
            raise ValueError("self_draft_layers is set but speculative_method is "
                             f"{self.speculative_method!r}, not 'self'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache == "contiguous" and self.prefix_caching:
            raise ValueError(
                "kv_cache='contiguous' conflicts with prefix_caching=True: a contiguous cache "
                "gives each sequence one private max_model_len block, so nothing can be shared; "
                "set prefix_caching=False or kv_cache='paged'"
            )
        if self.prefill_chunk_size is not None and not self.chunked_prefill:
            raise ValueError(
                "prefill_chunk_size is set but chunked_prefill=False: enable chunked_prefill "
                "or drop prefill_chunk_size"
            )
        if (not self.chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"chunked_prefill=False needs max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) >= max_model_len ({self.max_model_len}), "
                "or a long prompt could never be scheduled; raise the budget or enable "
                "chunked_prefill"
            )

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")

    def _check_positive(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
