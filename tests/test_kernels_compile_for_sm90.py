"""The decode path's Triton kernels compile for an H100 (sm_90), here, without a GPU.

Triton's interpreter runs every kernel's tests on the CPU, but it is not the compiler: a
kernel can run there and be refused by the compiler (session 59: a loop re-typing a
variable first set in a constexpr branch that returns), and the refusal then shows only on
a lent GPU. Each case is compiled to a cubin by Triton's own CUDA backend (its `ptxas`
ships in the wheel): the projections' kernels as `benchmarks/sass_mix.py` analyses them,
and the modes those cases leave out (dependent launch on; the constexpr branches of the
split, FP8 quantize, norm, activation and dp4a GEMV kernels). One child process compiles
them all, with Triton's interpreter off (the tests run under it, and it replaces the
kernels' functions).
Each K loop is also read for writes to a register-operand wgmma's registers before its wait
(session 68: ptxas made them, and a warp's sums came out garbage at random on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from test_sass_mix import _sass_mix

SASS_MIX = _sass_mix()
Case = SASS_MIX.Case
I32 = "i32"


def _modes() -> list:
    """Constexpr modes of the kernels beside the projections, with dependent launch on."""
    cases = []
    for one_pass in (True, False):
        cases.append(Case(
            f"split_rows (one pass {one_pass})", "int8_x16:_split_rows_kernel",
            dict(x_ptr="*bf16", q_ptr="*i8", s_ptr="*fp32", M=I32, K=I32, stride_x=I32),
            dict(BLOCK=4096 if one_pass else 16384, ONE_PASS=one_pass, PDL=True), [], 1, 1,
            num_warps=8))
    for one_pass in (True, False):
        cases.append(Case(
            f"fp8_quantize_rows (one pass {one_pass})", "fp8_quant:_fp8_rows_kernel",
            dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", K=I32, stride_x=I32,
                 stride_q=I32),
            dict(BLOCK=4096 if one_pass else 16384, ONE_PASS=one_pass), [], 1, 1,
            num_warps=8 if one_pass else 16))
    norm_args = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                     xq_ptr="*i8", side_ptr="*fp32", stride_x=I32, stride_res=I32,
                     stride_out=I32, n_cols=I32, eps="fp32", lo_offset=I32)
    for residual in (False, True):
        for rows in ("", "INT8_ROWS", "X16_ROWS", "FP8_ROWS"):
            buffers = (dict(xq_ptr="*bf16", side_ptr="*bf16") if not rows else
                       dict(xq_ptr="*fp8e4nv") if rows == "FP8_ROWS" else {})
            cases.append(Case(
                f"rmsnorm (residual {residual}, {rows or 'plain'})", "rmsnorm:_rmsnorm_kernel",
                {**norm_args, **buffers},
                dict(OFFSET=0.0, HAS_RESIDUAL=residual, BLOCK=4096,
                     INT8_ROWS=rows == "INT8_ROWS", PDL=True, X16_ROWS=rows == "X16_ROWS",
                     FP8_ROWS=rows == "FP8_ROWS"),
                [], 1, 1, num_warps=8))
    for fp8_rows in (False, True):
        cases.append(Case(
            f"gated activation (silu, FP8 rows {fp8_rows})", "activation:_gated_act_kernel",
            dict(gu_ptr="*bf16", out_ptr="*bf16", q_ptr="*fp8e4nv" if fp8_rows else "*bf16",
                 s_ptr="*fp32" if fp8_rows else "*bf16", stride_gu=I32, stride_out=I32,
                 inter=I32),
            dict(ACT="silu", BLOCK=16384 if fp8_rows else 1024, PDL=True, FP8_ROWS=fp8_rows),
            [], 1, 1, num_warps=16 if fp8_rows else 4))
    for act in ("", "silu"):
        cases.append(Case(
            f"int8_x16_gemv (gate_up {act or 'none'}, uneven K, PDL)",
            "int8_x16_gemv:_int8_x16_gemv_kernel",
            dict(q_ptr="*i32", xs_ptr="*fp32", w_ptr="*i32", ws_ptr="*bf16", y_ptr="*bf16",
                 N=I32, KW=I32, stride_wn=I32),
            dict(BLOCK_N=8, BLOCK_W=256, EVEN_K=False, GATE_UP=act, PTX=True, PDL=True),
            [], 1, 1, num_warps=4))
    cases.append(Case(
        "int8_x16 matmul (32 rows, split K, PDL)", "int8_x16:_int8_x16_kernel",
        dict(q_ptr="*i8", xs_ptr="*fp32", w_ptr="*i8", ws_ptr="*bf16", y_ptr="*bf16",
             part_ptr="*fp32", counts="*i32", M=I32, N=I32, K=I32, stride_ym=I32,
             steps_per_split=I32, splits=I32),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, EVEN_K=False, PDL=True),
        ["q_ptr", "w_ptr", "K"], 1, 1, num_warps=4, num_stages=3))
    cases += _kv_cache_modes()
    return cases


def _kv_cache_modes() -> list:
    """The KV store (plain, and fused with RoPE and the q/k norms) and the decode attention
    (8B heads: 128 keys a tile, the last split combining) on a bfloat16 and an FP8 cache
    (`kv_cache_dtype`)."""
    cases = []
    for cache in ("*bf16", "*fp8e4nv"):
        cases.append(Case(
            f"kv_store ({cache[1:]} cache)", "kv_store:_kv_store_kernel",
            dict(k_ptr="*bf16", v_ptr="*bf16", kc_ptr=cache, vc_ptr=cache, slot_ptr="*i64",
                 stride_kt=I32, stride_kh=I32, stride_vt=I32, stride_vh=I32, n_heads=I32,
                 head_dim=I32, k_inverse="fp32", v_inverse="fp32"),
            dict(BLOCK_H=8, BLOCK_D=128), [], 1, 1, num_warps=4))
        cases.append(Case(
            f"rope_kv_store (q/k norm, {cache[1:]} cache, PDL)",
            "rope_kv_store:_rope_kv_store_kernel",
            dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", kc_ptr=cache, vc_ptr=cache,
                 cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64",
                 qw_ptr="*bf16", kw_ptr="*bf16", stride_qt=I32, stride_qh=I32, stride_kt=I32,
                 stride_kh=I32, stride_vt=I32, stride_vh=I32, stride_cs=I32, n_q_heads=I32,
                 n_kv_heads=I32, half=I32, eps="fp32", k_inverse="fp32", v_inverse="fp32"),
            dict(NORM=True, OFFSET=0.0, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_D=64, PDL=True),
            [], 1, 1, num_warps=4))
        cases.append(Case(
            f"paged decode attention ({cache[1:]} cache, split, last combines, PDL)",
            "paged_attention:_decode_kernel",
            dict(q_ptr="*bf16", kc_ptr=cache, vc_ptr=cache, bt_ptr="*i32",
                 seq_lens_ptr="*i32", out_ptr="*bf16", part_o_ptr="*fp32",
                 part_lse_ptr="*fp32", counter_ptr="*i32",
                 **{name: I32 for name in (
                     "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                     "stride_vb", "stride_vt", "stride_vh", "stride_bt", "stride_ot",
                     "stride_oh", "num_heads", "num_kv_heads", "num_splits",
                     "min_split_keys", "window", "head_dim", "group")},
                 scale="fp32", softcap="fp32"),
            dict(QLEN=1, BLOCK_G=16, BLOCK_R=16, BLOCK_N=128, BLOCK_D=128, CAUSAL=False,
                 ROW_WINDOW=False, BLOCK_SIZE=16, SPLIT=True, LAST_COMBINES=True,
                 SOFTCAP=False, WINDOW=False, PRECISION="tf32", BLOCK_S=4, PDL=True),
            [], 1, 1, num_warps=4))
    return cases


def _cases() -> list:
    return SASS_MIX._cases() + _modes()


CASES = _cases()


def _compile_all() -> None:
    """In the child: each case's registers a thread and the writes to a register-operand
    wgmma's registers while it runs (`sass_mix.register_operand_hazards`), or the
    compiler's error."""
    results = {}
    for case in _cases():
        try:
            sass, registers = SASS_MIX.compile_case(case)
            results[case.name] = dict(registers=registers,
                                      hazards=SASS_MIX.register_operand_hazards(sass))
        except Exception as exc:  # the compiler's refusal, reported by the test
            cause = exc
            while cause.__cause__ is not None:  # a refusal inside a called function
                cause = cause.__cause__
            results[case.name] = f"{type(exc).__name__}: {exc}\n... {cause!r}"
    print(json.dumps(results))


@pytest.fixture(scope="module")
def compiled() -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", "import test_kernels_compile_for_sm90 as t; t._compile_all()"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_compiles_for_sm90(case, compiled):
    result = compiled[case.name]
    assert isinstance(result, dict), result  # else the compiler's refusal
    assert isinstance(result["registers"], int) and 0 < result["registers"] <= 255, result
    # no wgmma multiplies registers the loop has written since it was issued
    assert result["hazards"] == [], result["hazards"][:8]
