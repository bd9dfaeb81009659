"""EngineConfig: every engine knob, each optimisation an independent toggle.

Plain values only: building one reads no file. Conflicting fields fail here, at
construction, with a message naming them.

Each field's help text (and its choices, where it takes one of a few strings) lives in its
metadata: the CLI's flags (`infer serve --help`) are made from it, so what a field means is
written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from infer.engine.batch_defaults import CPU_DEFAULTS, GPU_DEFAULTS, LARGE_GPU_DEFAULTS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # cuda:N for any device index N
BATCHING_MODES = ("static", "continuous")
KV_CACHES = ("paged", "contiguous")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # attention/kv_dtype.py
BACKENDS = ("auto", "torch", "triton")
MIXED_STEP_GRAPHS = ("full", "piecewise", "off")
# the choices infer.quantization takes
QUANTIZATIONS = ("auto", "none", "int8", "fp8", "int4", "gguf")
SPECULATIVE_METHODS = ("none", "ngram", "self", "draft")
GEMV_FORMS = ("floats", "words", "units")  # kernels/gemv.py form_of


def knob(default: Any, text: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field with its help text; `choices`: the only values it takes."""
    return field(default=default, metadata={"help": text, "choices": choices})


def is_device(text: str) -> bool:
    """One of DEVICES, N an index."""
    return text in DEVICES[:3] or (text.startswith("cuda:") and text[5:].isdigit())


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = knob(
        None, "the model: a GGUF file, an HF model directory (config.json + *.safetensors) "
        "or a hub id (org/name); default: the embedded SmolLM2-135M-Instruct")
    dtype: str = knob("auto", "weights' and activations' dtype; auto: bfloat16 on a GPU, "
                      "float32 on a CPU", DTYPES)
    device: str = knob("auto", "auto: cuda if a GPU is available, else cpu; or cpu, cuda, "
                       "cuda:N")
    seed: int = knob(0, "seed of the global random generator, which samples the requests "
                     "that bring no seed of their own")
    max_model_len: int | None = knob(
        None, "most tokens (prompt + output) per sequence; default: the model's context "
        "length, capped at 8192")
    max_num_seqs: int | None = knob(
        None, "most sequences in one batch; default: sized to the device "
        f"(engine/batch_defaults.py): {CPU_DEFAULTS[0]} on a CPU, {LARGE_GPU_DEFAULTS[0]} "
        "on a GPU")
    max_num_batched_tokens: int | None = knob(
        None, "token budget per step; default: sized to the device (engine/batch_defaults.py):"
        f" {CPU_DEFAULTS[1]} on a CPU, {LARGE_GPU_DEFAULTS[1]} on a GPU of 70 GiB or more, "
        f"{GPU_DEFAULTS[1]} on a smaller one")
    batching_mode: str = knob("continuous", "continuous: sequences join and leave the "
                              "running batch at every step; static: admit only when the "
                              "running batch has drained", BATCHING_MODES)
    kv_cache: str = knob("paged", "paged: blocks of block_size tokens, allocated as "
                         "sequences grow; contiguous: one max_model_len block per sequence "
                         "(needs --no-prefix-caching)", KV_CACHES)
    block_size: int = knob(16, "tokens per KV-cache block")
    kv_cache_dtype: str = knob(
        "auto", "the KV cache's element type: auto = the model's dtype; fp8 (or fp8_e4m3) = "
        "one e4m3 byte a value, scale 1, saturating at +-448 (attention/kv_dtype.py): half "
        "of bfloat16's memory, so twice the tokens in the same budget and half the bytes a "
        "decode step's attention reads, each key and value rounded to 3 significant bits",
        KV_CACHE_DTYPES)
    num_blocks: int | None = knob(
        None, "KV-cache blocks; default: sized from memory (on a GPU, what "
        "gpu_memory_utilization leaves after the weights and a warm-up step; on a CPU, a "
        "quarter of the available memory), at most twice what max_num_seqs full-length "
        "sequences need")
    gpu_memory_utilization: float = knob(
        0.9, "share of the GPU's memory for weights, activations and the KV cache")
    chunked_prefill: bool = knob(True, "split long prompts over steps, so the running "
                                 "sequences keep decoding while they are read")
    prefill_chunk_size: int | None = knob(
        None, "most prompt tokens per request per step (needs chunked_prefill); default: the "
        "step's token budget")
    prefix_caching: bool = knob(True, "reuse the KV blocks of prompt prefixes seen before "
                                "(least recently used evicted first)")
    attention_backend: str = knob(
        "auto", "paged attention and the KV-cache store: auto is triton on CUDA (when Triton "
        "is installed), torch elsewhere; torch is the reference", BACKENDS)
    kernel_backend: str = knob(
        "auto", "norms, RoPE and gated activations: the same choice as attention_backend",
        BACKENDS)
    decode_combine_at_once: bool = knob(
        False, "with attention_backend triton, the last split of a decode attention launch "
        "(a graph's, which combines the splits' partials itself) loads several splits' "
        "partials at once instead of one split at a time, one round trip to memory "
        "instead of one a split (kernels/paged_attention.py combine_block); off: no faster "
        "on an H200 (batch-1 INT8 1B / 8B 0.591 / 2.590 -> 0.592 / 2.597 ms, "
        "docs/performance.md)")
    triton_gemv: bool = knob(
        True, "one-row matmuls of 16-bit weights (batch-1 decode: projections without a "
        "bias, LM head) through infer's Triton GEMV (kernels/gemv.py) instead of cuBLAS, "
        "and those of INT8 / FP8 weights scaled per channel instead of the W8A16 kernel or "
        "rows_mma (an H200's 8B INT8 batch-1 step 2.86 -> 2.63 ms); with kernel_backend "
        "triton only")
    gemv_8bit_max_rows: int = knob(
        2, "with triton_gemv, the most rows (1 or 2, kernels/gemv.py MAX_ROWS) a matmul of "
        "INT8 / FP8 weights scaled per channel sends to the GEMV, each weight made float32 "
        "once for both rows, before the tensor-core kernels (int8_mma_rows, "
        "w8a16_tensor_cores); two rows only on layers at most 3,072 wide, where they gained "
        "(w8a16_matmul.gemv_takes): on an H200 the 1B INT8 batch-2 decode step 0.84 ms "
        "against 0.95 with 1, and a 1B INT8 draft's speculative step (its round's first "
        "forward has two rows) 7.07-7.08 against 7.15-7.17 (docs/performance.md)")
    gemv_form: str = knob(
        "floats", "with triton_gemv, how the GEMV reads bfloat16 x and multiplies "
        "(compiled for sm_90, instructions a weight for bfloat16 / INT8 / FP8 weights): "
        "floats, x through shared memory into the tile, each weight made float32 (3.7 / "
        "4.8 / 4.1); words, x read as 32-bit words straight into the tile, a shift and a "
        "mask a word, bfloat16 weights read so too (3.1 / 4.5 / 3.8; exact); units, words "
        "and each INT8 weight q the float 1 + (q + 128) / 2^15 by one byte permute, x's "
        "sum taken away once at the end (INT8 3.5), its float32 sums rounding about 1e-4 "
        "of a row's sums (1e-7 otherwise); on an H100 the 8B INT8 batch-1 step 3.162 ms "
        "floats, 3.144 words, 3.236 units (docs/performance.md; not yet timed on an H200, "
        "where the instruction counts matter more) (kernels/gemv.py form_of)", GEMV_FORMS)
    fp8_weight_bits: bool = knob(
        True, "with triton_gemv, FP8 weights in the one-row GEMV become float32 by their "
        "bits (sign to bit 31, exponent and mantissa to bits 26..20: the value times "
        "2^-120, subnormals as denormals, the sum scaled back once) instead of the "
        "hardware's FP8 -> float16 -> float32 converts (kernels/weight_cast.py "
        "to_float_times): 5.6 instructions a weight against 4.1, but none on the convert "
        "pipe; on an H100 the 8B FP8 batch-1 step 3.19 ms against 3.23 (twice each, "
        "alternated on one machine, session 64; the words form 3.18) (docs/performance.md)")
    fp8_gemv_halves: bool = knob(
        False, "with triton_gemv on a GPU, one row of FP8 weights through the GEMV's form "
        "'halves' instead (kernels/gemv.py _half_rows): each weight made float16 by the "
        "hardware's convert, multiplied by x times 2^-8 in float16 by packed multiply-adds "
        "(with fp8_weight_bits the weight made float16 times 2^-8 by its bits, "
        "weight_cast.to_f16_times, and x taken as it is: the same products, 3.9 "
        "instructions a weight and 8 converts in 124 compiled for sm_90; not yet timed) "
        "into runs of 8 steps' float16 sums, each run added into float32, a program redone "
        "in float32 where a run overflowed (|x| past ~4,600); its sums within 2^-8 of the "
        "sum of |products| instead of float32's rounding. Off: fewer instructions (3.1 a "
        "weight against 5.6) but 24 of its 100 loop instructions are converts, which an "
        "H100 issues at 16 values a cycle per SM; the 8B batch-1 step 3.97 ms against 3.13 "
        "(docs/performance.md)")
    gemv_gate_up_activation: bool = knob(
        True, "with triton_gemv, a gated MLP's rows that go to the GEMV (one of 16-bit "
        "weights; those gemv_8bit_max_rows sends of INT8 / FP8 ones) get act(gate) * up "
        "from the gate_up projection's own launch, each program storing it for the "
        "channels whose gate and up rows it multiplied (kernels/gemv.py gemv_gate_up), "
        "instead of after the activation's own launch: on an H200 batch-1 decode of the "
        "1B / 8B INT8 0.634 -> 0.615 / 2.633 -> 2.600 ms a step, 1B bf16 0.850 -> 0.843, "
        "8B bf16 4.044 -> 4.053 (docs/performance.md)")
    mma_gate_up_activation: bool = knob(
        False, "with triton_gemv and gemv_gate_up_activation, a gated MLP's steps of 2 to "
        "gemv_max_rows rows of 16-bit weights (a verify step's k + 1 positions, small "
        "batches) get act(gate) * up from the gate_up projection's tensor-core launch "
        "(kernels/rows_mma.py gate_up), each program multiplying the gate and up rows of "
        "its channels, instead of after the activation's own launch; off: an H200's "
        "speculative step no faster with it (queued step 6.715 ms against 6.719 without, "
        "two leases; docs/performance.md)")
    gate_up_rows_apart: bool = knob(
        False, "with triton_gemv and gemv_gate_up_activation, the two rows of a gated MLP "
        "of INT8 / FP8 weights too wide for the two-row GEMV, in a draft round's first "
        "forward (the token before the verdict's, then the verdict's), go to two one-row "
        "GEMV launches, the first doing nothing where the device found that token done "
        "(kernels/row_skip.py), instead of the tensor cores and the activation's own launch; "
        "off: not yet measured alone (with the four other session-51 switches an H200's "
        "speculative step was slower, docs/performance.md)")
    gemv_max_rows: int = knob(
        16, "with triton_gemv, the most rows a matmul of 16-bit weights sends to infer's "
        "kernels instead of cuBLAS: one row to the GEMV, 2 to 16 (a verify step's k + 1 "
        "positions, small batches) to a tensor-core kernel with K split over programs "
        "(kernels/rows_mma.py); 1: batch-1 decode only. With mma_weight_first, 2 to 16 "
        "rows ran 5-10 % faster than cuBLAS on an H200 (docs/performance.md)")
    mma_weight_first: bool = knob(
        True, "gemv_max_rows' 16-bit steps of 2 or more rows (kernels/rows_mma.py) take each "
        "weight tile as the MMA's first operand and x's rows as the second's columns, as "
        "its FP8 x FP8 products do (Hopper's warp-group MMA wants 64 rows on the first), in "
        "tiles by the layer's width (rows_mma.weight_first_launch); off: x's rows first "
        "(slower than cuBLAS from 5 rows on, an H200's 8B batch-16 step 5.25 against 4.94 "
        "ms)")
    w8a16_tensor_cores: bool = knob(
        True, "INT8 / FP8 weight-only matmuls of 2 to w8a16_tensor_core_rows rows, and "
        "one-row ones by a layer at least 16,384 wide such as the LM head (16-bit "
        "activations; scales per 128 x 128 tile, or per channel with triton_gemv off), on "
        "tensor cores, the "
        "weights made float16 exactly (kernels/rows_mma.py), instead of CUDA cores in "
        "float32 (kernels/w8a16_matmul.py); "
        "CUDA with kernel_backend triton only; on an H200, 8B shape: batch 8 decode 1.37x "
        "(INT8) / 1.74x (FP8) faster, batch 1 2-3 % (docs/performance.md)")
    w8a16_tensor_core_rows: int = knob(
        16, "with w8a16_tensor_cores, the most rows an 8-bit weight-only matmul sends to "
        "the tensor cores (2 to 64, kernels/rows_mma.py MAX_ROWS); past it INT8 takes "
        "kernels/w8a16_matmul.py up to 64 rows, then cuBLAS over a dequantized copy, FP8 x "
        "quantized per token for torch._scaled_mm; 16: on an H200 (8B shape) 64 lost at batch "
        "32 and 64 (INT8 9.35 vs 7.31 ms at 64, docs/performance.md)")
    mma_8bit_bf16: bool = knob(
        True, "w8a16_tensor_cores' 8-bit weights by 2 or more rows of bfloat16 x made "
        "bfloat16 by their bits (int8 exactly; FP8 times 2^-120, x times 2^64), x multiplied "
        "as it is (kernels/rows_mma.py BF16_W), instead of both made float16 by the GPU's "
        "convert instructions (16 a cycle per SM on an H100; 4.80 instructions a weight at "
        "32 rows against 4.15); on an H100, 8B FP8 decode at batch 4 / 8 / 16: 3.78 / 3.96 / "
        "4.35 ms against 3.86 / 4.08 / 4.54, twice each (docs/performance.md)")
    fp8_decode_activations: bool = knob(
        False, "FP8 layers (quantization=fp8, per-channel FP8 checkpoints) quantize x per "
        "token at decode-sized steps too (those that read the weight as stored: up to 16 "
        "rows, or w8a16_tensor_core_rows; larger steps always do) and "
        "multiply FP8 by FP8 on tensor cores (kernels/rows_mma.py, x quantized by "
        "kernels/fp8_quant.py), instead of reading the FP8 weights into x's precision "
        "(W8A16); vLLM's FP8 quantizes x at every size. CUDA (compute capability 8.9+) with "
        "kernel_backend triton only; off: on an H200 its first form (x quantized inside the "
        "matmul) lost at batch 1 (8B shape 3.48 vs 2.83 ms) and to w8a16_tensor_cores at 2 "
        "to 16 rows (docs/performance.md)")
    fp8_mma_rows: int = knob(
        32, "FP8 layers' steps of up to this many rows (at most 64) that multiply FP8 by FP8 "
        "(those past the weight-only rows) go through infer's FP8 x FP8 tensor-core kernel "
        "(kernels/rows_mma.py; x quantized once per step) instead of torch._scaled_mm, "
        "whose FP8 GEMM reads its weights slowly at a few rows; 0: always torch._scaled_mm. "
        "Where the GPU has FP8 tensor cores (compute capability 8.9+), with kernel_backend "
        "triton; on an H200, 8B shape, batch 32 decode 4.89 vs 5.08 ms, batch 64 6.46 vs "
        "5.36 with 64 (docs/performance.md)")
    fp8_norm_rows: bool = knob(
        True, "the FP8 x FP8 steps of fp8_mma_rows rows: an RMSNorm whose output goes into "
        "a projection also stores that output's rows in FP8 with their scales "
        "(kernels/rmsnorm.py FP8_ROWS; kernels/fp8_quant.py's values, bit for bit), so the "
        "q/k/v and gate_up projections need no quantizing launch of their own (on an H100 "
        "the 8B batch-32 step spends 128 x 2.2 us in them, half before those two): with "
        "fp8_act_rows, that step 4.21-4.22 vs 4.36-4.37 ms (docs/performance.md)")
    fp8_act_rows: bool = knob(
        True, "the FP8 x FP8 steps of fp8_mma_rows rows: a gated activation (SiLU / GELU "
        "times up) before an FP8 down projection also stores its output's rows in FP8 with "
        "their scales, one launch a row (kernels/activation.py; kernels/fp8_quant.py's "
        "values, bit for bit), so the down projection needs no quantizing launch of its "
        "own (a quarter of the quantizing launches fp8_norm_rows counts; the two together "
        "timed in fp8_norm_rows' text)")
    int8_mma_rows: int = knob(
        64, "weight-only INT8 layers' steps of 2 to this many rows (at most 64) multiply on "
        "the int8 tensor cores, each row of x carried as 16-bit fixed point in two int8 "
        "halves (kernels/int8_x16.py), instead of making every weight a float16 "
        "(w8a16_tensor_cores) or a float32 (kernels/w8a16_matmul.py); x's rounding is a "
        "16-bit step of its row's range, the RMSNorm before a projection splitting its rows "
        "in its own launch. CUDA with kernel_backend triton; on an H200, 8B shape, decode at "
        "batch 8 / 32 / 64: 3.24 / 3.71 / 4.73 ms against 3.57 / 5.35 / 7.35; on an H100 "
        "batch 32 4.16 ms, 1.59x bf16 (docs/performance.md); 0: off")
    fp8_wgmma_rows: int = knob(
        0, "FP8 layers' steps of 1 to this many rows (at most 64) multiply the FP8 weights by "
        "x as it is (bfloat16, not rounded to FP8) on Hopper's tensor cores through "
        "kernels/fp8_wgmma.py (Triton's Gluon dialect: each weight made a bfloat16 in "
        "registers by its bits, two instructions a weight, and fed to the wgmma as its "
        "register operand) instead of the GEMV (3.4 against 5.6 instructions a weight "
        "compiled for sm_90), the W8A16 kernel or rows_mma's FP8 x FP8; a gated MLP's "
        "activation then in its own launch. Needs a Hopper GPU and a Triton with Gluon; 0: "
        "off until timed on the device (docs/performance.md)")
    w8_wgmma: bool = knob(
        False, "on a Hopper GPU, the FP8 by FP8 steps of fp8_mma_rows and the INT8 ones of "
        "int8_mma_rows go through kernels/w8_wgmma.py (Triton's Gluon dialect: TMA fills a "
        "ring of tiles, each K tile's wgmma issued asynchronously and only the one before "
        "waited for) instead of rows_mma.py / int8_x16.py, whose tl.dot waits for every "
        "wgmma; each FP8 tile's sums added in float32, two tiles in flight. Needs a "
        "Triton with Gluon; off until timed on the device (docs/performance.md)")
    int8_x16_gemv: bool = knob(
        True, "one-row weight-only INT8 steps (batch-1 decode) whose row the RMSNorm made "
        "multiply by dp4a: the norm's launch splits x into two int8 halves of 16-bit fixed "
        "point as int8_mma_rows splits it, then two integer instructions for four weights "
        "(kernels/int8_x16_gemv.py; 0.88 instructions a weight compiled for sm_90 against "
        "the float GEMV's 3.5-4.8), x's rounding a 16-bit step of its row's range; a gated "
        "MLP's activation in the same launch. The o and down projections, whose rows no "
        "norm makes, keep the float GEMV (a split launch of their own cost more than it "
        "gained). CUDA with kernel_backend triton; on an H100, 8B shape, batch-1 decode "
        "2.94-2.95 ms against 3.10-3.11 with the float GEMV everywhere (docs/performance.md); "
        "off: that GEMV")
    gguf_int8_activations: bool = knob(
        True, "one-row matmuls by GGUF Q4_K, Q6_K and Q8_0 weights kept in their blocks "
        "(quantization=gguf) round x to int8 per 32 values and multiply with dp4a, as "
        "llama.cpp does on a GPU (kernels/gguf_q4k_int8x.py, gguf_q6k_int8x.py, "
        "gguf_q8_0_int8x.py), for x's "
        "rounding error; CUDA with kernel_backend triton only; on an H200 the 8B Q4_K_M "
        "batch-1 step 2.48 ms, 4.24 without; the real Gemma 3 270M Q4_K_M's greedy text "
        "the same either way (docs/performance.md)")
    gguf_q4k_wgmma: bool = knob(
        True, "matmuls of 2-64 rows of bfloat16 x by GGUF Q4_K blocks kept in them "
        "(quantization=gguf) on a Hopper GPU go through Hopper's wgmma with the decoded "
        "weights as its register operand and the next super-block's bytes loading while one "
        "is decoded (kernels/gguf_wgmma.py, written in Triton's Gluon dialect; needs a "
        "Triton with it, else gguf_gemm.py) instead of gguf_gemm.py's tl.dot, which stages "
        "them through shared memory; on an H100 the 8B Q4_K_M step at batch 8 / 32 / 64 5.21 "
        "/ 6.65 / 9.18 ms against 6.65 / 7.67 / 9.56 (docs/performance.md)")
    gguf_q6k_wgmma: bool = knob(
        True, "the same for GGUF Q6_K blocks (a Q4_K_M file's LM head and half its "
        "ffn_down and attn_v), through the same kernel (its Q6_K decode in "
        "kernels/gguf_q6k_wgmma.py), instead of gguf_gemm.py; on an H100 the 8B Q4_K_M "
        "step at batch 8 / 32 4.88 / 6.14 ms against 5.21 / 6.64 (docs/performance.md)")
    gguf_fused_x_rounding: bool = knob(
        True, "with gguf_int8_activations, x rounded to int8 by the launch that makes x (the "
        "one-row RMSNorm before the q/k/v, gate/up and LM-head matmuls; the gated "
        "activation before down, kernels/int8_rows.py) instead of a launch of its own; on "
        "an H200 the 8B Q4_K_M batch-1 step 2.46 ms, 2.48 without (twice each, "
        "docs/performance.md)")
    cpu_int8_activations: bool | None = knob(
        None, "on a CPU, a GGUF file's 4-bit layers (Q4_0, Q4_1, Q4_K) and Q8_0 embedding "
        "table / LM head kept as stored in blocks of 32 and multiplied by infer's kernels "
        "(kernels/cpu_block_linear.cpp, built at first use), x rounded to int8 per 32 values "
        "as llama.cpp does, instead of PyTorch's INT4 kernel (x in bfloat16) and INT8 per row; "
        "default: on where torch's CPU kernels are AVX2 ones (SmolLM2 batch-1 decode 60-70 "
        "tok/s against 38-44, llama.cpp 88-125; docs/performance.md), off on AVX-512 CPUs, "
        "where PyTorch's INT4 kernel is as fast at one row and faster at eight")
    cpu_attention_kernel: bool = knob(
        True, "on a CPU, a decode step's attention (float32 or FP8 cache; sliding windows "
        "and softcaps included) in one call a layer of infer's C++ kernel "
        "(kernels/cpu_attention.cpp, built with the CPU block kernels at start-up, once per "
        "machine) instead of the "
        "torch reference's dozen operations, and every step's RoPE + KV store in one call "
        "a layer (kernels/cpu_rope_store.cpp) instead of about twenty; where the kernels "
        "cannot be built, the torch path")
    cpu_norm_kernel: bool = knob(
        True, "on a CPU, the RMSNorms (and the residual add before them) of float32 rows in "
        "one call of infer's C++ kernel (kernels/cpu_norm.cpp) instead of torch's composite "
        "of a handful of operations (~25 us a call at SmolLM2's width, most of it dispatch); "
        "where the kernels cannot be built, torch's")
    cpu_int8_kernel: bool = knob(
        True, "on a CPU, layers with INT8 weights (quantization=int8, a GGUF file's 8-, 6- "
        "and 5-bit layers and quantized embedding / LM head without cpu_int8_activations) "
        "multiplied by infer's C++ kernel (kernels/cpu_int8_linear.cpp, x in float32) "
        "instead of PyTorch's _weight_int8pack_mm (x rounded to bfloat16); SmolLM2's LM "
        "head at one row 0.7-0.9 ms against 1.9-2.1 on a Zen 4 (docs/performance.md); where "
        "the kernels cannot be built, PyTorch's")
    dependent_launch: bool = knob(
        True, "launch infer's decode kernels (GEMV, norms, RoPE + KV store, attention, "
        "W8A16) with programmatic dependent launch, so that each one's launch and first "
        "weight reads overlap the kernel before it (CUDA, compute capability 9+; with "
        "kernel_backend triton only)")
    cuda_graphs: bool = knob(True, "replay captured decode steps (CUDA with triton attention "
                             "only; ignored elsewhere)")
    logits_in_graphs: bool = knob(
        True, "with cuda_graphs, decode graphs end with the LM head and its float32 cast, "
        "which then cost the host nothing a step (they are launched by the replay)")
    mixed_step_graphs: str = knob(
        "full", "with cuda_graphs, the steps that carry prompt tokens: full = whole-step "
        "graphs (and piecewise ones for steps with a sequence too long for their attention "
        "launch), piecewise = graphs cut where each layer attends (attention eager), "
        "off = eager", MIXED_STEP_GRAPHS)
    async_scheduling: bool = knob(
        True, "launch the next decode step before this one's tokens reach the host (stop "
        "checks run one step behind), so the GPU does not idle during the host's bookkeeping")
    grammar_process: bool | None = knob(
        None, "hold constrained sequences' grammar matchers in a process of their own that "
        "feeds them each step's tokens and fills the next masks while the device waits for "
        "them (the step loop only queues the wait; the worker spins on a core of its own "
        "while constrained steps come); not with speculative decoding; default: on with CUDA "
        "(a constrained step then costs the loop ~0.07 ms, docs/performance.md), off on a "
        "CPU, where the loop would wait for the worker anyway")
    grammar_worker_apart: bool = knob(
        False, "keep the grammar worker's threads (its spinning one and the library's) off "
        "the physical core the step loop runs on when the worker starts (Linux, a host "
        "with CPUs to spare): a loop that shares its core with them runs every phase "
        "slower; off until a device run times it (structured_output.py --cpus-apart)")
    grammar_workers: int | None = knob(
        None, "grammar worker processes with `grammar_process`, each holding the matchers "
        "of its share of the constrained sequences and filling their rows' masks (the "
        "grammar library's feeding of a step's tokens does not spread over its threads; "
        "over processes it does); default: 2 where the engine may run on 8 CPUs or more, "
        "else 1 (each spins on a core while constrained steps come)")
    grammar_threads: int = knob(
        0, "threads the grammar library fills a step's token masks on (and a grammar "
        "worker feeds tokens on, from FEED_PAR_ROWS rows), in each grammar worker: 0 = the "
        "library's default (80 % of the CPUs, at most 32) with one worker or none, and with "
        "more half of that shared out among them (3 each for two on 16 CPUs)")
    max_waiting_requests: int | None = knob(
        None, "most requests waiting to be scheduled (the server answers 503 beyond); "
        "default: unbounded")
    core_process: bool = knob(
        False, "run the core (scheduler, model, sampler) in a process of its own, apart from "
        "tokenizing and detokenizing; off for LLM (no IPC in the way), on for `infer serve`")
    quantization: str = knob(
        "auto", "the weights' format: auto = the checkpoint's own (FP8 / INT8 checkpoints as "
        "stored; a GGUF file's quantized weights stay quantized on the CPU, dequantized on "
        "CUDA, faster for prefill and large batches); none = dequantized at load; int8 = "
        "weight-only, per output channel, made at load; fp8 = e4m3 per output channel, made "
        "at load (FP8 activations per token in large steps); int4 = weight-only, groups of up "
        "to 128 inputs with a scale and zero each, made at load; gguf = a GGUF file's blocks "
        "kept as stored on any device (3-4x less memory); infer/quantization/ says more",
        QUANTIZATIONS)
    threads: int | None = knob(
        None, "on a CPU, the threads the model's kernels use; default: one per usable core "
        "less one (engine/cpu_threads.py says why: more collapses beside any other busy "
        "process). With CUDA, the threads of torch's host operations; default: torch's own")
    speculative_method: str = knob(
        "none", "speculative decoding: none = off; ngram = drafts looked up in the sequence's own "
        "earlier tokens (spec/ngram.py); self = the model's own first self_draft_layers "
        "layers; draft = draft_model, a small model with the same vocabulary. Drafts are "
        "verified in one forward of the model, the output distributed exactly as without "
        "them (penalties, logprobs and grammar masks at every drafted position). A step "
        "with drafts is not launched ahead (async_scheduling): steps above "
        "speculative_max_batch are", SPECULATIVE_METHODS)
    num_speculative_tokens: int = knob(4, "k: most drafts per sequence per step")
    ngram_min: int = knob(1, "n-gram drafts: the shortest suffix looked up")
    ngram_max: int = knob(4, "n-gram drafts: the longest suffix looked up")
    self_draft_layers: int | None = knob(
        None, "self drafts: the layers that draft; default: half the model's layers")
    draft_model: str | None = knob(
        None, "the draft model of speculative_method=draft (which needs one): a model "
        "directory or GGUF file, as for model; default: none")
    draft_quantization: str = knob(
        "auto", "the draft model's weights, as quantization says for the model's (auto: its "
        "checkpoint's own format); a draft's rounding changes which drafts are accepted, "
        "never the output", QUANTIZATIONS)
    speculative_max_batch: int = knob(16, "no drafts in steps of more running sequences")
    verify_decode_attention: bool = knob(
        True, "a verify step's attention (k + 1 tokens of every sequence, in the verify "
        "graphs) through the split-K decode kernel, its rows every token of a GQA group, "
        "instead of the prefill kernel, which walks each sequence's keys in one program per "
        "KV head (8B target, k = 4, on an H200: a verify step 5.03-5.23 ms against "
        "5.23-5.26, a drafted step 8.03-8.21 against 8.24-8.28); Triton attention only")
    speculative_drafts_on_device: bool = knob(
        True, "a draft model's (or self-draft's) drafts stay on the device when no sequence "
        "needs their values on the host (no grammar, penalty or multi-token bad word): the "
        "step verifying them is planned and queued while the proposal round runs instead "
        "of after reading the drafts back (8B target, 1B draft, on an H200: a drafted step "
        "3-4 % shorter)")
    speculative_round_ahead: bool = knob(
        True, "with drafts on the device, a model's next proposal round is queued right "
        "behind the step verifying the last one, its inputs gathered on the device from "
        "that step's verdict, instead of after the host has read the verdict and accounted "
        "the step (the GPU then waits for the host between them; 8B target, INT8 1B draft "
        "on an H200: a drafted step 7.94 ms, 8.02-8.30 in six runs without); needs the "
        "draft's CUDA graphs")
    tensor_parallel_size: int = knob(
        1, "N: shard the model over N ranks (one process per GPU, or per CPU rank), each "
        "with its part of every layer's heads and features and of the KV cache; NCCL on "
        "GPUs, gloo on CPUs (distributed/ says more)")
    custom_all_reduce: bool = knob(
        False, "tensor parallelism on one host's GPUs: all-reduces up to 1 MiB (decode "
        "steps') over peer memory in one kernel (torch symmetric memory, one-shot) instead "
        "of NCCL; NCCL where the GPUs cannot read each other's memory. A rank that dies "
        "then ends rank 0's process too (its GPU may wait in that kernel for good)")
    fuse_all_reduce_norm: bool = knob(
        True, "tensor parallelism on one host's GPUs, Llama-family and Gemma 3 models: each "
        "all-reduce of a decode step of up to 32 sequences that feeds a (residual add +) "
        "RMSNorm runs in the same kernel as them, over peer memory "
        "(kernels/all_reduce_norm.py), one launch where there were two; NCCL and the "
        "unfused kernels where the GPUs cannot read each other's memory. A rank that dies "
        "then ends rank 0's process too")

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata["choices"] is not None:
                self._check_choice(f.name, f.metadata["choices"])
        if not is_device(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("block_size", "num_speculative_tokens", "ngram_min", "ngram_max",
                     "speculative_max_batch", "tensor_parallel_size"):
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
        if self.draft_quantization != "auto" and self.draft_model is None:
            raise ValueError(f"draft_quantization={self.draft_quantization!r} is set but there "
                             "is no draft_model")
        if self.self_draft_layers is not None and self.speculative_method != "self":
            raise ValueError("self_draft_layers is set but speculative_method is "
                             f"{self.speculative_method!r}, not 'self'")
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.grammar_process is True and self.speculative_method != "none":
            raise ValueError(f"grammar_process=True with speculative_method="
                             f"{self.speculative_method!r} is not supported: drafts are "
                             "checked against grammars on the step loop")
        if not 0 <= self.fp8_mma_rows <= 64:
            raise ValueError(f"fp8_mma_rows must be in [0, 64] (kernels/rows_mma.py "
                             f"MAX_ROWS), got {self.fp8_mma_rows}")
        if not 0 <= self.fp8_wgmma_rows <= 64:
            raise ValueError(f"fp8_wgmma_rows must be in [0, 64] (kernels/fp8_wgmma.py "
                             f"MAX_ROWS), got {self.fp8_wgmma_rows}")
        if not 0 <= self.int8_mma_rows <= 64:
            raise ValueError(f"int8_mma_rows must be in [0, 64] (kernels/int8_x16.py "
                             f"MAX_ROWS), got {self.int8_mma_rows}")
        if not 2 <= self.w8a16_tensor_core_rows <= 64:
            raise ValueError(f"w8a16_tensor_core_rows must be in [2, 64] (kernels/rows_mma.py "
                             f"MAX_ROWS), got {self.w8a16_tensor_core_rows}")
        if not 1 <= self.gemv_8bit_max_rows <= 2:
            raise ValueError(f"gemv_8bit_max_rows must be in [1, 2] (kernels/gemv.py "
                             f"MAX_ROWS), got {self.gemv_8bit_max_rows}")
        if not 1 <= self.gemv_max_rows <= 16:
            raise ValueError(f"gemv_max_rows must be in [1, 16], "
                             f"got {self.gemv_max_rows}")
        if self.grammar_workers is not None and self.grammar_workers < 1:
            raise ValueError(f"grammar_workers must be at least 1, got {self.grammar_workers}")
        if self.grammar_threads < 0:
            raise ValueError(f"grammar_threads must be 0 (the grammar library's default) or "
                             f"more, got {self.grammar_threads}")
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

    def _check_tensor_parallel(self) -> None:
        if self.speculative_method != "none":
            raise ValueError(f"speculative_method={self.speculative_method!r} with "
                             f"tensor_parallel_size={self.tensor_parallel_size} is not "
                             "supported yet; use one or the other")
        if self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: rank r runs on cuda:r; choose the "
                             "GPUs with CUDA_VISIBLE_DEVICES and set device='cuda'")

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
