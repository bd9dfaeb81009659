"""infer's CPU matmuls by GGUF-style blocks of 32 weights (`cpu_block_linear.cpp`): 4-bit
`{fp16 d, fp16 m, 16 bytes of nibbles}` and 8-bit `{fp16 d, 32 int8}` blocks, x rounded to
int8 per 32 values and each block's dot product taken in integers, as llama.cpp's CPU
kernels do (AVX2; `_mm256_dpbusd` where the compiler targets AVX-512 VNNI).

Built with the machine's C++ compiler at first use (about 10 s; torch's extension cache
keeps it, per source and flags) for the instruction set torch's own CPU kernels use
(`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY=avx2` lowers), and
run on torch's intra-op threads (the same extension carries `cpu_attention.cpp` and
`cpu_rope_store.cpp`, the decode attention and the RoPE + KV store of `cpu_attention.py`;
`cpu_int8_linear.cpp`, INT8 weights times float32 x; `cpu_norm.cpp`, the RMSNorms).
`available()` says whether it loaded; where it cannot be built (no compiler, not x86, a
CPU without AVX2) the reason is logged once and callers take PyTorch's kernels.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
# Built into the same extension: the decode attention over the paged cache and the RoPE + KV
# store before it (cpu_attention.py), INT8 weights times float x and the RMSNorms (below).
SOURCES = [SOURCE, *(Path(__file__).with_name(name) for name in (
    "cpu_attention.cpp", "cpu_rope_store.cpp", "cpu_int8_linear.cpp", "cpu_norm.cpp"))]
BLOCK = 32
Q4_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
Q8_BLOCK_BYTES = 34  # fp16 d, 32 int8


AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512_VNNI = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]


def isa_flags(capability: str, machine: str, cpu_flags: set[str]) -> list[str] | None:
    """The compiler's instruction-set flags for torch's CPU `capability` ("AVX2",
    "AVX512", "DEFAULT", ...) on `machine` whose CPU has `cpu_flags` (/proc/cpuinfo's);
    None where the kernels have no code. Named flags, not -march=native: a build cached
    on a shared disk may meet another CPU of the same capability."""
    if machine.lower() not in ("x86_64", "amd64"):
        return None
    if capability == "AVX2":
        return AVX2
    if capability.startswith("AVX512"):
        return AVX2 + AVX512_VNNI if "avx512_vnni" in cpu_flags else AVX2
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def on_by_default() -> bool:
    """Whether GGUF models on this CPU take these kernels unless told (
    `EngineConfig.cpu_int8_activations`): where torch's own CPU kernels are AVX2 ones; with
    AVX-512 PyTorch's INT4 kernel is as fast at one row and faster at eight."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


@functools.cache
def available() -> bool:
    """Whether the kernels are built and loaded (built at the first call)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = isa_flags(capability, platform.machine(), _cpu_flags())
    if flags is None:
        log.info("infer's CPU block kernels need an x86 CPU with AVX2 (torch reports %s on "
                 "%s); PyTorch's kernels instead", capability, platform.machine())
        return False
    try:
        from torch.utils import cpp_extension

        log.info("Building infer's CPU block kernels for %s (once per machine)", capability)
        cpp_extension.load(
            "infer_cpu_block_linear_" + ("vnni" if AVX512_VNNI[-1] in flags else "avx2"),
            [str(source) for source in SOURCES],
            extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: say so, go on
        log.warning("infer's CPU block kernels could not be built (%s); PyTorch's kernels "
                    "instead", str(error).strip().splitlines()[-1] if str(error) else error)
        return False
    return True


def q4_1_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """float32 `x [rows, in]` times the 4-bit `blocks [out, in / 32 * 20]` (uint8)
    transposed: float32 `[rows, out]`."""
    return torch.ops.infer_cpu.q4_1_linear(x, blocks)


def q8_0_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """float32 `x [rows, in]` times the 8-bit `blocks [out, in / 32 * 34]` (uint8)
    transposed: float32 `[rows, out]`."""
    return torch.ops.infer_cpu.q8_0_linear(x, blocks)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 `x [rows, in]` times the int8 `weight [out, in]` transposed, each output
    channel times its `scale [out]` (float32 or bfloat16): float32 `[rows, out]`, each row
    the same whatever rows share the call (`cpu_int8_linear.cpp`)."""
    return torch.ops.infer_cpu.int8_linear(x, weight, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of contiguous float32 `x [..., dim]` by float32 `weight [dim]`
    (`cpu_norm.cpp`)."""
    return torch.ops.infer_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)`, float32, in one call (`cpu_norm.cpp`)."""
    return torch.ops.infer_cpu.add_rms_norm(x, residual, weight, eps)
