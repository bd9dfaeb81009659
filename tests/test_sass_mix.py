"""benchmarks/sass_mix.py reads a kernel's K loop out of a SASS listing: of the spans from a
backward branch's target to the branch that hold no other, the longest (of those with an
MMA, in a tensor-core kernel)."""

from __future__ import annotations

import benchmark_script

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/                   PRMT R9, R4, 0x7540, R9 ;
        /*0040*/               @!P0 BRA 0x10 ;
        /*0050*/                   SHFL.BFLY PT, R3, R8, 0x1, 0x1f ;
        /*0060*/               @P1 BRA 0x0 ;
        /*0070*/                   FADD R3, R3, R8 ;
        /*0080*/               @P2 BRA 0x70 ;
        /*0090*/                   BRA 0x90;
        /*00a0*/                   EXIT ;
"""


def _sass_mix():
    return benchmark_script.load("sass_mix")


def test_the_k_loop_is_the_longest_loop_holding_no_other():
    # 0x10-0x40 and 0x70-0x80 hold no other loop, 0x0-0x60 holds the first; the branch to
    # itself at 0x90 is the end's trap, no loop.
    assert _sass_mix().innermost_loop(SASS) == ["LDG.E.128", "FFMA", "PRMT", "BRA"]


def test_a_listing_without_a_loop_has_none():
    straight = "\n".join(line for line in SASS.splitlines() if "BRA" not in line)
    assert _sass_mix().innermost_loop(straight) == []


def test_of_a_tensor_core_kernels_loops_the_k_loop_is_the_one_with_the_mma():
    sass = """
        /*0000*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0010*/                   HGMMA.64x16x16.F32 R24, gdesc[UR8], R24 ;
        /*0020*/               @P0 BRA 0x0 ;
        /*0030*/                   LDG.E R8, desc[UR4][R6.64] ;
        /*0040*/                   FADD R9, R9, R8 ;
        /*0050*/                   FADD R10, R10, R8 ;
        /*0060*/                   FADD R11, R11, R8 ;
        /*0070*/               @P1 BRA 0x30 ;
        /*0080*/                   EXIT ;
"""
    assert _sass_mix().innermost_loop(sass) == [
        "LDGSTS.E.BYPASS.128", "HGMMA.64", "BRA"]  # the opcode as far as its shape


def _loop_with(middle: str) -> str:
    """A K loop (0x10 to its backward branch) whose wgmma reads R28..R31 as its A operand
    and whose next iteration starts by writing R29, with `middle` between the wgmma and the
    branch."""
    lines = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;",
             "        /*0010*/                   PRMT R29, R12, 0x9180, RZ ;",
             "        /*0020*/                   WARPGROUP.ARRIVE ;",
             "        /*0030*/                   HGMMA.64x8x16.F32.BF16 R24, R28, gdesc[UR4],"
             " R24, gsb0 ;"]
    address = 0x40
    for instruction in filter(None, middle.split(";")):
        lines.append(f"        /*{address:04x}*/                   {instruction.strip()} ;")
        address += 0x10
    lines.append(f"        /*{address:04x}*/               @P2 BRA 0x10 ;")
    lines.append(f"        /*{address + 0x10:04x}*/                   EXIT ;")
    return "\n".join(lines) + "\n"


def test_a_wgmma_register_written_before_its_wait_is_found():
    sass_mix = _sass_mix()
    # left in flight across the back edge: the next iteration's PRMT writes R29
    assert sass_mix.register_operand_hazards(_loop_with("IADD3 R40, R40, 0x1, RZ")) == [
        "0010 PRMT R29, R12, 0x9180, RZ"]
    # in the same iteration, a 64-bit result over R30..R31
    assert sass_mix.register_operand_hazards(_loop_with(
        "IMAD.WIDE R30, R4, 0x2, R6; WARPGROUP.DEPBAR.LE gsb0, 0x0")) == [
        "0040 IMAD.WIDE R30, R4, 0x2, R6"]
    # waited for before anything is written: none; nor are reads of them, or stores
    assert sass_mix.register_operand_hazards(_loop_with(
        "STS [R28], R29; FADD R40, R28, R31; WARPGROUP.DEPBAR.LE gsb0, 0x0; "
        "MOV R28, R12")) == []
