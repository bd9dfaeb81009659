"""infer's C++ kernels for the CPU, one extension built from this folder's `.cpp` files
(`SOURCES`) with the machine's C++ compiler at first use (about 10 s; torch's extension
cache keeps it, per source and flags) for the instruction set torch's own CPU kernels use
(`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY=avx2` lowers), and
run on torch's intra-op threads. Each file has its Python side: `cpu_block_linear.py`
(GGUF-style blocks, x in int8), `cpu_attention.py` (decode attention; RoPE + KV store),
`cpu_int8_linear.py` (INT8 weights, float x), `cpu_norm.py` (RMSNorm). `available()` says
whether it loaded; where it cannot be built (no compiler, not x86, a CPU without AVX2) the
reason is logged once and callers take PyTorch's kernels.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in (
    "cpu_block_linear.cpp", "cpu_attention.cpp", "cpu_rope_store.cpp", "cpu_int8_linear.cpp",
    "cpu_norm.cpp")]

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


@functools.cache
def available() -> bool:
    """Whether infer's CPU kernels are built and loaded (built at the first call)."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = isa_flags(capability, platform.machine(), _cpu_flags())
    if flags is None:
        log.info("infer's CPU kernels need an x86 CPU with AVX2 (torch reports %s on "
                 "%s); PyTorch's kernels instead", capability, platform.machine())
        return False
    try:
        from torch.utils import cpp_extension

        log.info("Building infer's CPU kernels for %s (once per machine)", capability)
        cpp_extension.load(
            "infer_cpu_kernels_" + ("vnni" if AVX512_VNNI[-1] in flags else "avx2"),
            [str(source) for source in SOURCES],
            extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: say so, go on
        log.warning("infer's CPU kernels could not be built (%s); PyTorch's kernels "
                    "instead", str(error).strip().splitlines()[-1] if str(error) else error)
        return False
    return True
