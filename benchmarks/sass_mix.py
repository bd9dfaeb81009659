"""What the GPU runs for each weight byte of infer's decode matmuls, without a GPU.

Each kernel is compiled for sm_90 (an H100 / H200) by Triton's own compiler and ptxas, as
its JIT would compile it for a decode step's launch (the same constexprs and launch; the
integer arguments that are multiples of 16 at run time marked so, as the JIT's
specialization marks them), then disassembled (`cuobjdump -sass`, shipped with Triton). For
the K loop (one weight tile per iteration: the longest loop that holds no other) it prints the
instruction mix and the instructions issued per weight and per weight byte, with the
registers per thread.

A memory-bound kernel issues its instructions while its loads are in flight; the more it
issues per byte, the more of the SMs' issue slots the copy rate needs (an H200 issues
~3.3e13 thread-instructions a second and copies ~4.2e12 bytes: ~8 instructions a byte at
full issue rate, fewer in practice), which is where an 8-bit weight's conversion to float
shows.

Compile with the device's Triton version: the layout Triton picks for a tile, and so
which thread loads which bytes, differs between versions (Triton 3.6, the device's, gave
each thread a whole Q4_K super-block where 3.9 spread it over 8 threads; docs/performance
.md). The table's first line says which version compiled it.

    pip install --target /tmp/t36 triton==3.6.0   # once: the device's version
    PYTHONPATH=/tmp/t36:src python benchmarks/sass_mix.py [--kernels gemv_bf16 ...] [--suffix S]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Case:
    """A kernel as one launch compiles it: argument types (pointers as `*dtype`, the rest
    `i32`), constexprs, which arguments are multiples of 16, the launch, and the weights one
    K-loop iteration of one program reads (for the per-weight figures)."""

    name: str
    kernel: str  # module:function under infer.kernels
    args: dict[str, str]
    constexprs: dict[str, object]
    multiple_of_16: list[str]
    weights_per_iteration: int
    weight_bytes: float  # bytes a weight takes as stored
    num_warps: int = 4
    num_stages: int = 2
    note: str = ""
    # (an opcode, how many of it one iteration issues a thread) where ptxas may unroll the
    # loop: the loop's count of that opcode then says how many iterations it holds
    unrolled: tuple[str, int] | None = None
    gluon: bool = False  # written in Gluon (triton.experimental.gluon)
    # an opcode the K loop holds where the kernel has longer innermost loops that are not it
    # (a rarely taken redo path's)
    loop_holds: str | None = None


def _cases() -> list[Case]:
    import torch
    from gguf import GGMLQuantizationType as QType

    from infer.kernels.gemv import default_launch
    from infer.kernels.gguf_gemv import gemv_launch
    from infer.kernels.rows_mma import block_rows

    i32 = "i32"
    cases = []
    gemv_args = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", skip_ptr="*i32",
                     y_ptr="*bf16", N=i32, K=i32, stride_xm=i32, stride_wn=i32, stride_ym=i32)
    for weights, pointer, size, form in (
            ("bf16", "*bf16", 2, "floats"), ("bf16 words", "*bf16", 2, "words"),
            ("int8", "*i8", 1, "floats"),
            ("int8 words", "*i8", 1, "words"), ("int8 units", "*i8", 1, "units"),
            ("fp8", "*fp8e4nv", 1, "floats"), ("fp8 words", "*fp8e4nv", 1, "words"),
            ("fp8 bits", "*fp8e4nv", 1, "floats"), ("fp8 bits words", "*fp8e4nv", 1, "words"),
            ("fp8 halves", "*fp8e4nv", 1, "halves"),
            ("fp8 bits halves", "*fp8e4nv", 1, "halves")):
        for shape, (n, k) in (("8B gate_up", (28672, 4096)), ("1B qkv", (3072, 2048))):
            launch = default_launch(n, k, size)
            cases.append(Case(
                f"gemv_{weights} ({shape})", "gemv:_gemv_kernel",
                {**gemv_args, "w_ptr": pointer},
                dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, ROWS=1, EVEN_K=True,
                     GATE_UP="", SCALED=size == 1, SKIPS=False, SKIPPED_WHOLE=False,
                     PTX=True, PDL=False, FORM=form, FP8_BITS="bits" in weights),
                ["x_ptr", "w_ptr", "s_ptr", "y_ptr", "N", "K", "stride_wn"],
                launch.block_n * launch.block_k, size, num_warps=launch.num_warps,
                note=f"one row, launch {tuple(launch)}",
                loop_holds="HFMA2" if form == "halves" else None))
    w8_args = dict(x_ptr="*bf16", w_ptr="", s_ptr="*fp32", y_ptr="*bf16", M=i32, N=i32, K=i32,
                   stride_xm=i32, stride_wn=i32, stride_ys=i32, stride_ym=i32, stride_sn=i32,
                   steps_per_split=i32)
    for dtype, pointer in (("int8", "*i8"), ("fp8", "*fp8e4nv")):
        # w8a16_matmul's one-row launch
        cases.append(Case(
            f"w8a16_{dtype} (one row, per-channel scales)", "w8a16_matmul:_w8a16_kernel",
            {**w8_args, "w_ptr": pointer},
            dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, IEEE=False, SCALE_ROWS=0, SCALE_COLS=0,
                 TILE_SCALE=False, SCALE_IN_X=False, PTX=True, PDL=False),
            ["x_ptr", "w_ptr", "s_ptr", "y_ptr", "N", "K", "stride_xm", "stride_wn",
             "stride_ym"],
            8 * 1024, 1, num_warps=4, num_stages=2, note="launch (8, 1024, 4 warps)"))
    mma_args = dict(x_ptr="*bf16", w_ptr="", s_ptr="*bf16", xs_ptr="*bf16", y_ptr="*bf16",
                    part_ptr="*fp32",
                    counts="*i32", M=i32, N=i32, K=i32, stride_xm=i32, stride_wn=i32,
                    stride_ym=i32, stride_sn=i32, steps_per_split=i32, splits=i32)
    mma_multiples = ["x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "N", "K", "stride_xm",
                     "stride_wn", "stride_ym"]

    def mma_case(what: str, rows: int, pointer: str, size: int, scales: str = "*bf16",
                 x: str = "*bf16", **constexprs) -> Case:
        """rows_mma's default launch on `rows` rows of x (`x` its type) times a `pointer`
        weight, `scales` its scales' type; `constexprs` in place of the plain case's."""
        return Case(
            f"rows_mma {what} ({rows} row{'s' if rows > 1 else ''}, tensor cores)",
            "rows_mma:_rows_mma_kernel",
            {**mma_args, "x_ptr": x, "w_ptr": pointer, "s_ptr": scales,
             "xs_ptr": "*fp32" if x == "*i8" else "*bf16"},
            {**dict(BLOCK_M=block_rows(rows), BLOCK_N=128, BLOCK_K=128, SCALE=size == 1,
                    SCALE_ROWS=1, SCALE_COLS=0, EVEN_K=True, ONE_ROW=rows == 1, PTX=True,
                    FP8_X=False, W_FIRST=False, GATE_UP="", BF16_W=False, PDL=False),
                 **constexprs},
            mma_multiples, 128 * 128, size, num_warps=4, num_stages=3,
            note="launch (128, 128, 4 warps)")

    for weights, pointer, size in (("bf16", "*bf16", 2), ("int8", "*i8", 1),
                                   ("fp8", "*fp8e4nv", 1)):
        cases += [mma_case(weights, rows, pointer, size)
                  for rows in ((1, 5) if size == 2 else (1, 5, 32, 64))]
    # 8-bit weights made bfloat16 by their bits, bfloat16 x (EngineConfig.mma_8bit_bf16)
    cases += [mma_case(f"{weights} as bf16", rows, pointer, 1, BF16_W=True)
              for weights, pointer in (("int8", "*i8"), ("fp8", "*fp8e4nv"))
              for rows in (1, 32, 64)]
    # FP8 x FP8: x quantized per row before the kernel (its bytes)
    cases += [mma_case("fp8 x fp8", rows, "*fp8e4nv", 1, "*fp32", x="*i8", FP8_X=True,
                       ONE_ROW=False, W_FIRST=True)
              for rows in (1, 5, 32, 64)]
    cases.append(mma_case("fp8 with 128 x 128 scale tiles", 1, "*fp8e4nv", 1, "*fp32",
                          SCALE_ROWS=128, SCALE_COLS=128))
    # GGUF Q4_K at one row (144 bytes a super-block of 256): the exact float path's launch
    # (gguf_gemv.gemv_launch, 128 rows a program) and x rounded to int8 for dp4a
    launch = gemv_launch(QType.Q4_K, 28672, 4096, "cpu")
    cases.append(Case(
        "gguf_gemv q4_k (one row, floats)", "gguf_gemv:_gguf_gemv_kernel",
        dict(xs="*fp32", q_ptr="*i32", y_ptr="*bf16", part_ptr="*fp32", counts="*i32", N=i32,
             K=i32, nv=i32, stride_qw=i32, splits=i32, units_per_split=i32, magic=i32),
        dict(QTYPE=int(QType.Q4_K), UNIT_K=256, UNIT_WORDS=36, UNIT_DATA=32, GROUPS=4,
             UNITS=launch["units"], BLOCK_N=launch["block_n"], PDL=False),
        ["xs", "q_ptr", "y_ptr", "part_ptr", "counts", "stride_qw"],  # 8B rows: 16 x 36 words
        launch["block_n"] * launch["units"] * 256, 144 / 256, num_warps=launch["num_warps"],
        note=f"launch ({launch['block_n']} rows, {launch['num_warps']} warps)"))
    # x rounded to int8, dp4a: Q4_K (144-byte super-blocks of 256; 8B rows 16 x 36 words, a
    # multiple of 16), Q6_K (210 bytes of 256; rows 16 x 52.5 words, not) and Q8_0 (pairs
    # of 34-byte blocks, 64 weights; rows 64 x 17 words, not)
    int8x_args = dict(words="*i32", xq="*i32", side="*fp32", y_ptr="*bf16", part_ptr="*fp32",
                      counts="*i32", N=i32, units=i32, stride_w=i32, splits=i32,
                      per_split=i32)
    for qtype, module, unit_k, stored, strides, launches in (
            ("q4_k", "gguf_q4k_int8x:_q4k", 256, 144, ["stride_w"],
             ((16, 2), (32, 2), (64, 2), (64, 1))),
            ("q6_k", "gguf_q6k_int8x:_q6k", 256, 210, [], ((16, 2), (32, 2), (64, 2))),
            ("q8_0", "gguf_q8_0_int8x:_q8_0", 64, 68, [], ((16, 4), (32, 4), (64, 2)))):
        for block_n, units in launches:
            cases.append(Case(
                f"gguf {qtype} x int8 (one row, dp4a, {block_n} rows x {units} units)",
                f"{module}_int8x_kernel", int8x_args,
                dict(BLOCK_N=block_n, UNITS=units, EVEN=True, PTX=True, PDL=False),
                ["words", "xq", "side", "y_ptr", *strides], block_n * units * unit_k,
                stored / unit_k, num_warps=4,
                note=f"launch ({block_n} rows, {units} units of {unit_k}, 4 warps)"))
    # GGUF Q4_K at 16-64 rows of bf16 x (gguf_gemm.py, its launch's 64 rows of W a program,
    # one super-block a step), the decoded pieces fed to tl.dot; and the same through
    # Hopper's wgmma, the decoded weights its register operand (gguf_wgmma.py, Q4_K and
    # Q6_K; Gluon, where this Triton has Gluon's Hopper calls)
    try:
        import infer.kernels.gguf_wgmma  # noqa: F401
        wgmma = True
    except (ImportError, AttributeError):
        wgmma = False
    gemm_args = dict(x_ptr="*bf16", q_ptr="*i32", y_ptr="*fp32", M=i32, N=i32, K=i32,
                     stride_xm=i32, stride_qn=i32, stride_ys=i32, stride_ym=i32,
                     units_per_split=i32)
    aligned = ["x_ptr", "q_ptr", "y_ptr", "N", "K", "stride_xm", "stride_qn"]
    for rows in (16, 32, 64):
        cases.append(Case(
            f"gguf_gemm q4_k ({rows} rows, tensor cores)", "gguf_gemm:_gguf_gemm_kernel",
            dict(gemm_args, magic=i32),
            dict(QTYPE=int(QType.Q4_K), UNIT_K=256, UNIT_WORDS=36, UNITS=1, BLOCK_M=rows,
                 BLOCK_N=64, IEEE=False),
            ["M", *aligned], 64 * 256, 144 / 256, num_warps=4,
            note="launch (64 rows of W, one super-block a step)"))
        for qtype, words, weight_bytes in ((QType.Q4_K, "*i32", 144),
                                           (QType.Q6_K, "*i16", 210)) if wgmma else ():
            cases.append(Case(
                f"gguf_wgmma {qtype.name.lower()} ({rows} rows, Gluon)",
                "gguf_wgmma:_gguf_wgmma_kernel",
                dict(x_ptr="*bf16", q_ptr=words, y_ptr="*bf16", part_ptr="*fp32",
                     counts="*i32", M=i32, N=i32, K=i32, pairs_xm=i32, stride_qn=i32,
                     stride_ym=i32, units_per_split=i32, splits=i32, one=i32),
                dict(QTYPE=int(qtype), BLOCK_M=rows, num_warps=4),
                ["x_ptr", "q_ptr", "y_ptr", "part_ptr", "N", "K", "pairs_xm", "stride_qn",
                 "stride_ym"], 64 * 256, weight_bytes / 256, num_warps=4, gluon=True,
                note="64 rows of W, one super-block a step"))
    # 8-bit weights by 8-bit x through Hopper's async wgmma, TMA filling a ring of tiles
    # (w8_wgmma.py, Gluon): FP8 by FP8, INT8 by x's two int8 halves
    try:
        importlib.import_module("infer.kernels.w8_wgmma")
        w8 = True
    except (ImportError, AttributeError):
        w8 = False
    for name, dtype, rows in (("FP8 x FP8", torch.float8_e4m3fn, 32),
                              ("INT8 x halves", torch.int8, 32)) if w8 else ():
        cases.append(Case(
            f"w8_wgmma {name} ({rows} rows, Gluon)", "w8_wgmma:_w8_wgmma_kernel",
            dict(w_desc=_tma_type(dtype, [64, 128]), x_desc=_tma_type(dtype, [rows, 128]),
                 ws_ptr="*fp32", xs_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32",
                 counts="*i32", M=i32, N=i32, stride_ym=i32, tiles_per_split=i32, tiles=i32,
                 splits=i32),
            dict(INT8=dtype == torch.int8, STAGES=4, num_warps=4),
            ["ws_ptr", "xs_ptr", "y_ptr", "part_ptr", "N", "stride_ym"],
            64 * 128 * (1 if dtype == torch.int8 else 2), 1.0, num_warps=4, gluon=True,
            note="64 channels by 128 of K a tile (FP8: two a loop), 4 stages"))
    # FP8 weights by bfloat16 x, each weight made a bfloat16 in registers by its bits and
    # fed to Hopper's async wgmma as its register operand (fp8_wgmma.py, Gluon)
    for rows, gated in ((8, ""), (32, ""), (8, "silu")) if w8 else ():
        cases.append(Case(
            f"fp8_wgmma ({rows} rows{', ' + gated if gated else ''}, Gluon)",
            "fp8_wgmma:_fp8_wgmma_kernel",
            dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", y_ptr="*bf16",
                 part_ptr="*fp32", counts="*i32", M=i32, N=i32, K=i32, pairs_xm=i32,
                 stride_wn=i32, stride_ym=i32, steps_per_split=i32, steps=i32, splits=i32),
            dict(BLOCK_M=rows, EVEN_K=True, GATED=gated, num_warps=4),
            ["x_ptr", "w_ptr", "y_ptr", "N", "K", "pairs_xm", "stride_wn"], 64 * 128, 1.0,
            num_warps=4, gluon=True, note="64 channels by 128 of K a step"))
    # one row of INT8 weights by dp4a on x's two int8 halves (int8_x16_gemv.py)
    from infer.kernels import int8_x16_gemv

    for shape, (n, k) in (("8B gate_up", (28672, 4096)), ("8B down", (4096, 14336))):
        launch = int8_x16_gemv.default_launch(n, k)
        cases.append(Case(
            f"int8_x16_gemv ({shape})", "int8_x16_gemv:_int8_x16_gemv_kernel",
            dict(q_ptr="*i32", xs_ptr="*fp32", w_ptr="*i32", ws_ptr="*bf16", y_ptr="*bf16",
                 N=i32, KW=i32, stride_wn=i32),
            dict(BLOCK_N=launch.block_n, BLOCK_W=launch.block_k // 4, EVEN_K=True,
                 GATE_UP="", PTX=True, PDL=False),
            ["q_ptr", "w_ptr", "y_ptr", "N", "KW", "stride_wn"],
            launch.block_n * launch.block_k, 1, num_warps=launch.num_warps,
            note=f"one row, launch {tuple(launch)}",
            unrolled=("IDP", launch.block_n * launch.block_k // 2 // (32 * launch.num_warps))))
    # weight-only INT4, eight values a word, 16-bit scale and zero a group of 128
    from infer.kernels import int4_gemv

    # (the 1B's down: its qkv's K fits one step of the default launch, no loop)
    for shape, (n, k) in (("8B gate_up", (28672, 4096)), ("1B down", (2048, 8192))):
        launch = int4_gemv.default_launch(n, k)
        cases.append(Case(
            f"int4_gemv ({shape})", "int4_gemv:_int4_gemv_kernel",
            dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", skip_ptr="*i32",
                 y_ptr="*bf16", N=i32, groups=i32, blocks=i32, stride_xm=i32, stride_wb=i32,
                 stride_sb=i32, stride_ym=i32),
            dict(BLOCK_N=launch.block_n, B=8, STRIPES=launch.block_k // 128, SW=128 // 8,
                 ROWS=1, EVEN_K=True, GATE_UP="", SKIPS=False, PTX=True, PDL=False),
            ["x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "groups", "blocks",
             "stride_wb", "stride_sb"],
            launch.block_n * launch.block_k, 0.5, num_warps=launch.num_warps,
            note=f"one row, launch {tuple(launch)}"))
    # 3 to 64 rows of x on the tensor cores (TF32), 4-bit weights made float in registers
    for rows in (5, 32):
        cases.append(Case(
            f"int4_matmul (8B gate_up, {rows} rows)", "int4_matmul:_int4_matmul_kernel",
            dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*bf16", y_ptr="*bf16",
                 M=i32, N=i32, K=i32, groups=i32, stride_xm=i32, stride_wb=i32,
                 stride_sb=i32, stride_ym=i32),
            dict(BLOCK_M=max(16, rows), BLOCK_N=64, B=8, STRIPES=2, SW=16, PTX=True, PDL=False),
            ["x_ptr", "w_ptr", "s_ptr", "z_ptr", "y_ptr", "N", "K", "groups", "stride_xm",
             "stride_wb", "stride_sb", "stride_ym"],
            64 * 256, 0.5, num_warps=4, note="launch (64 channels, 256 of K, 4 warps)"))
    return cases


def _triton_bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _tma_type(dtype: object, block: list[int]) -> str:
    """The signature type of a Gluon TMA descriptor of `block` tiles of `dtype` (torch's)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    gl_dtype = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return mangle_type(TensorDescriptor.from_tensor(torch.zeros(256, 256, dtype=dtype),
                                                    block, layout))


def compile_case(case: Case) -> tuple[str, int | None]:
    """The case's SASS and registers per thread."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    module, name = case.kernel.split(":")
    fn = getattr(importlib.import_module(f"infer.kernels.{module}"), name)
    signature = dict(case.args)
    signature.update({key: "constexpr" for key in case.constexprs})
    names = list(fn.arg_names)
    missing = set(names) - set(signature)
    if missing:
        raise SystemExit(f"{case.name}: no type for {sorted(missing)}")
    signature = {key: signature[key] for key in names}
    if case.gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    source = ASTSource(
        fn=fn, signature=signature,
        constexprs={(names.index(k),): v for k, v in case.constexprs.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in case.multiple_of_16})
    kernel = compile(source, target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=case.num_warps, num_stages=case.num_stages))
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"sass_mix_{os.getpid()}.cubin"
    work.write_bytes(kernel.asm["cubin"])
    try:
        sass = subprocess.run([_triton_bin("cuobjdump"), "-sass", str(work)], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([_triton_bin("cuobjdump"), "-res-usage", str(work)],
                               check=True, capture_output=True, text=True).stdout
    finally:
        work.unlink()
    registers = re.search(r"REG:(\d+)", usage)
    return sass, int(registers.group(1)) if registers else None


_INSTRUCTION = re.compile(
    r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction of a SASS listing."""
    found = []
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            found.append((int(match.group(1), 16), match.group(2), match.group(3)))
    return found


def _innermost_loop(sass: str, holds: str | None = None) -> list[tuple[int, str, str]]:
    """The K loop's instructions: of the loops (a backward branch's target to the branch)
    that hold no other loop, the longest (a kernel's rarely taken paths have shorter ones)
    of those with a matrix multiply-add, if any has one (a tensor-core kernel's loop that
    adds K slices' parts may be longer than its K loop), or of those holding the opcode
    `holds`."""
    instructions = _instructions(sass)
    loops = []
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    innermost = [(lo, hi) for lo, hi in loops
                 if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops)]
    if not innermost:
        return []

    def body(span: tuple[int, int]) -> list[tuple[int, str, str]]:
        return [ins for ins in instructions if span[0] <= ins[0] <= span[1]]

    def marked(op: str) -> bool:  # HMMA, QGMMA, ...: not HFMA2.MMA (a move)
        return op == holds if holds else op.endswith("MMA")

    preferred = [span for span in innermost
                 if any(marked(op.split(".")[0]) for _, op, _ in body(span))]
    return body(max(preferred or innermost, key=lambda span: span[1] - span[0]))


def innermost_loop(sass: str, holds: str | None = None) -> list[str]:
    """The opcodes of the K loop (`_innermost_loop`)."""
    return [opcode for _, opcode, _ in _innermost_loop(sass, holds)]


def _written(opcode: str, operands: str) -> set[int]:
    """The general registers an instruction writes: its first operand where that is one
    (two for a .64 / .WIDE result, four for .128); stores, branches and the like none."""
    first = operands.split(",")[0].strip()
    match = re.fullmatch(r"R(\d+)", first)
    if not match or opcode.startswith(("ST", "RED", "BRA", "BAR")):
        return set()
    width = 4 if ".128" in opcode else 2 if (".64" in opcode or ".WIDE" in opcode) else 1
    return set(range(int(match.group(1)), int(match.group(1)) + width))


def register_operand_hazards(sass: str) -> list[str]:
    """Instructions of the K loop that write a register a register-operand wgmma (`HGMMA
    R acc, R a, gdesc...`) reads before the wait for it (`WARPGROUP.DEPBAR.LE gsb0, 0x0`),
    the loop run twice so that a wgmma left in flight across the back edge counts. The
    PTX calls such a write undefined; ptxas makes it where nothing keeps the registers
    live (triton-lang/triton#9433), and the wgmma then multiplies whatever they hold."""
    loop = _innermost_loop(sass)
    in_flight: set[int] = set()
    hazards = []
    for address, opcode, operands in loop + loop:
        if opcode.startswith("HGMMA"):
            a = re.fullmatch(r"R(\d+)", operands.split(",")[1].strip())
            if a:  # an m64nNk16 A fragment of 16-bit values: four registers a thread
                in_flight |= set(range(int(a.group(1)), int(a.group(1)) + 4))
        elif opcode.startswith("WARPGROUP.DEPBAR") and operands.rstrip().endswith("0x0"):
            in_flight.clear()
        elif in_flight & _written(opcode, operands):
            hazards.append(f"{address:04x} {opcode} {operands.strip()}")
    return sorted(set(hazards))


def analyse(case: Case) -> dict:
    sass, registers = compile_case(case)
    loop = innermost_loop(sass, case.loop_holds)
    threads = 32 * case.num_warps
    mix = collections.Counter(opcode.split(".")[0] for opcode in loop)
    iterations = mix[case.unrolled[0]] / case.unrolled[1] if case.unrolled and loop else 1
    per_thread = case.weights_per_iteration * iterations / threads
    loads = collections.Counter(opcode for opcode in loop if opcode.startswith("LDG"))
    return dict(
        kernel=case.name, note=case.note, registers=registers,
        loop_instructions=len(loop), weights_per_thread=per_thread,
        per_weight=len(loop) / per_thread if loop else None,
        per_weight_byte=len(loop) / (per_thread * case.weight_bytes) if loop else None,
        mix=dict(mix.most_common()), loads=dict(loads),
        register_operand_hazards=register_operand_hazards(sass))


def main() -> None:
    import common

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="*", default=None,
                        help="names (prefixes) of the cases to compile; default all")
    parser.add_argument("--suffix", default="", help="appended to the results file name")
    parser.add_argument("--results-dir", default=str(common.RESULTS))
    # An H200's: the "issue share" column is the share of the SMs' issue slots (4 a cycle,
    # 32 lanes each) that reading weights at the copy rate would take.
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--clock-ghz", type=float, default=1.98)
    parser.add_argument("--copy-tbs", type=float, default=4.2,
                        help="copy bandwidth, TB/s (an H200's measured: ~4.2)")
    args = parser.parse_args()
    issue_rate = args.sms * 4 * 32 * args.clock_ghz * 1e9  # thread-instructions a second
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the JIT does
    cases = [case for case in _cases()
             if not args.kernels or any(case.name.startswith(k) for k in args.kernels)]
    rows = [analyse(case) for case in cases]
    import triton

    print(f"[sass_mix] Triton {triton.__version__}, sm_90")
    print("| kernel | launch | regs | loop instr. | weights / thread | instr. / weight "
          "| instr. / weight byte | issue share at the copy rate | main opcodes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        top = ", ".join(f"{op} {n}" for op, n in list(row["mix"].items())[:6])
        per_weight = row["per_weight"]
        per_byte = row["per_weight_byte"]
        if per_byte:
            row["issue_share"] = per_byte * args.copy_tbs * 1e12 / issue_rate
        print(f"| {row['kernel']} | {row['note']} | {row['registers']} | "
              f"{row['loop_instructions']} | {row['weights_per_thread']:g} | "
              f"{per_weight:.2f} | {per_byte:.2f} | {row['issue_share']:.0%} | {top} |"
              if per_weight else
              f"| {row['kernel']} | {row['note']} | {row['registers']} | no loop | | | | | |")
    for row in rows:
        if row["register_operand_hazards"]:
            print(f"\n[sass_mix] {row['kernel']}: a register-operand wgmma's registers "
                  f"written before its wait: {row['register_operand_hazards'][:4]}")
    # Named for the target, whatever machine compiled it.
    args.tiny, args.suffix = False, "_sm90" + args.suffix
    out = common.write_results("sass_mix", args, dict(target="sm_90", triton=triton.__version__,
                                                       rows=rows))
    print(f"\n{out}")


if __name__ == "__main__":
    main()
