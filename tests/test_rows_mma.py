"""The tensor-core kernel for a few rows (`kernels/rows_mma.py`; the Triton interpreter on
the CPU, the GPU with INFER_TEST_DEVICE=cuda) against float64: 16-bit weights, and 8-bit
ones from their integers and scales; one row and several, a gated MLP's rows, K slices
added by the last program, inputs beyond float16's range, tiny inputs, and the counters
left at 0."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
# the output's rounding, relative to the largest output
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
# The interpreter's bfloat16 dot is not faithful (numpy has no bfloat16): 16-bit weights
# in bfloat16 on the GPU only.
DTYPES_16 = [torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, generator=gen) * 0.02 + 1e-3).to(dtype)
    return x, w, scale


def _reference(x, w, scale):
    return x.double() @ (w.double() * scale.double()[:, None]).T


def _run(x, w, scale, scale_block=None, **launch):
    from infer.kernels.rows_mma import rows_mma

    return rows_mma(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), scale_block,
                     **launch).cpu()


@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("dtype", DTYPES_16)
@pytest.mark.parametrize(("m", "n", "k", "splits"), [
    (2, 200, 300, 1), (5, 130, 640, 3), (16, 40, 256, 2), (1, 64, 384, 1), (33, 72, 256, 2)])
def test_16bit_weights_match_float64(dtype, m, n, k, splits, weight_first):
    """Ragged N and K, a row stride wider than K."""
    from infer.kernels.rows_mma import rows_mma

    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k + 6, generator=gen).to(dtype)[:, :k]
    w = torch.randn(n, k, generator=gen).to(dtype)
    y = rows_mma(x.to(DEVICE), w.to(DEVICE), splits=splits, weight_first=weight_first).cpu()
    ref = x.double() @ w.double().T
    assert y.dtype == dtype and y.shape == (m, n)
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "splits"), [
    (1, 200, 300, 1), (1, 200, 512, 3), (3, 40, 256, 2), (16, 130, 384, 1), (5, 64, 1000, 4),
    (17, 130, 384, 2), (32, 64, 256, 1), (64, 140, 384, 3)])
def test_matches_float64_from_the_integers(dtype, m, n, k, splits, weight_first):
    x, w, scale = _case(m, n, k, dtype, seed=m * 1000 + n + k)
    y = _run(x, w, scale, splits=splits, weight_first=weight_first)
    ref = _reference(x, w, scale)
    assert y.dtype == dtype and y.shape == (m, n)
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "block", "splits", "big"), [
    (1, 200, 300, (128, 128), 1, False), (4, 300, 640, (256, 128), 3, False),
    (1, 130, 384, (128, 256), 2, True), (24, 300, 640, (128, 128), 2, True)])
def test_a_scale_per_tile_matches_float64(m, n, k, block, splits, big, weight_first):
    """Block-wise scales (HF fine-grained FP8's 128 x 128): each K step's sums scaled by
    its tile's; also on the float32 path an |x| past 65504 takes."""
    x, w, _ = _case(m, n, k, torch.bfloat16, seed=n + k)
    if big:
        x[0, 3] = 1.0e5
    rows, cols = block
    gen = torch.Generator().manual_seed(5)
    tiles = torch.rand(-(-n // rows), -(-k // cols), generator=gen) * 0.02 + 1e-3
    y = _run(x, w, tiles, scale_block=block, splits=splits, weight_first=weight_first)
    dense = tiles.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    ref = x.double() @ (w.double() * dense.double()).T
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[torch.bfloat16], error


@pytest.mark.parametrize(("act", "m", "inter", "k", "splits", "weight_first", "eight_bit"), [
    ("silu", 5, 100, 256, 1, True, False), ("gelu_tanh", 3, 72, 384, 3, True, False),
    ("silu", 16, 40, 256, 2, False, False), ("silu", 2, 130, 300, 1, True, True),
    ("gelu_tanh", 17, 64, 512, 2, True, True)])
def test_a_gated_mlps_activation_is_the_product_then_the_activation_kernel(
        act, m, inter, k, splits, weight_first, eight_bit):
    """`gate_up`: `act(gate) * up` stored by the programs that multiplied each channel's
    gate and up rows, bit for bit rows_mma's `[gate | up]` at the same launch then
    `gated_rows` (ragged channels, K slices, 8-bit weights scaled per channel; in Triton's
    interpreter within one float16 step, on a few values at most: numpy's float32 `exp`
    on an AVX2 CPU can differ by a unit in the last place between the two kernels'
    layouts), and the float64 activation of the float64 product within the output's
    rounding."""
    from infer.kernels.activation import gated_rows
    from infer.kernels.rows_mma import rows_mma

    gen = torch.Generator().manual_seed(m + inter + k)
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    if eight_bit:
        w = torch.randint(-128, 128, (2 * inter, k), dtype=torch.int8, generator=gen)
        scale = (torch.rand(2 * inter, generator=gen) * 0.01 + 1e-3).to(torch.float16)
        dense = w.double() * scale.double()[:, None]
    else:
        w = (torch.randn(2 * inter, k, generator=gen) * 0.1).to(torch.float16)
        scale, dense = None, w.double()
    args = [t.to(DEVICE) if t is not None else None for t in (x, w, scale)]
    launch = dict(splits=splits, weight_first=weight_first, block_n=64, block_k=128)
    fused = rows_mma(*args, gate_up=act, **launch).cpu()
    apart = gated_rows(rows_mma(*args, **launch), act).cpu()
    assert fused.shape == (m, inter) and fused.dtype == torch.float16
    if INTERPRETED:
        torch.testing.assert_close(fused, apart, rtol=2 ** -10, atol=2 ** -24)
        assert (fused != apart).sum() <= max(1, fused.numel() // 200)
    else:
        assert torch.equal(fused, apart)
    gate, up = (x.double() @ dense.T).chunk(2, dim=1)
    ref = (torch.nn.functional.silu(gate) if act == "silu"
           else torch.nn.functional.gelu(gate, approximate="tanh")) * up
    error = (fused.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < 4 * TOLERANCE[torch.float16], error


def test_counters_are_left_at_zero_and_a_second_launch_agrees():
    from infer.kernels import launch_counters
    from infer.kernels.rows_mma import MAX_BLOCKS

    x, w, scale = _case(1, 300, 1024, torch.float16, seed=7)
    first = _run(x, w, scale, splits=4)
    device = torch.empty(0, device=DEVICE).device  # cuda:0, not cuda
    assert int(launch_counters("rows_mma", device, MAX_BLOCKS).abs().sum()) == 0
    assert torch.equal(_run(x, w, scale, splits=4), first)


@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("m", [1, 4, 50])
def test_inputs_beyond_float16_are_multiplied_in_float32(m, weight_first):
    """An |x| past 65504 would be inf in float16: its row block is multiplied on the CUDA
    cores instead, and the result is the float64 one (bf16's rounding aside)."""
    x, w, scale = _case(m, 150, 384, torch.bfloat16, seed=11)
    x[m - 1, 5] = 3.0e5
    y = _run(x, w, scale, splits=2, weight_first=weight_first)
    ref = _reference(x, w, scale)
    assert torch.isfinite(y).all()
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[torch.bfloat16], error


def test_tiny_inputs_move_a_sum_by_no_more_than_half_a_float16_subnormal_step():
    """|x| below float16's normal range (2^-14) keeps an absolute error of at most 2^-25 an
    input: the sums stay within 2^-25 * sum |w| * scale (plus the output's rounding)."""
    x, w, scale = _case(1, 64, 512, torch.float32, seed=3)
    x = (x * 1e-6).to(torch.bfloat16)
    y = _run(x, w, scale.to(torch.bfloat16))
    ref = _reference(x, w, scale.to(torch.bfloat16))
    bound = 2.0**-25 * (w.double().abs() * scale.to(torch.bfloat16).double()[:, None]).sum(1)
    rounding = ref.abs() * 2.0**-8
    assert ((y.double() - ref).abs() <= bound + rounding).all()
    assert (y != 0).any()  # not flushed away


@pytest.mark.parametrize(("knob", "attribute", "on_value"), [
    ("w8a16_tensor_cores", "w8a16_tensor_core_rows", 16),
    ("triton_gemv", "w8a16_gemv_rows", 2)])
@pytest.mark.parametrize(("on", "backend", "wanted"), [
    (True, "triton", True), (False, "triton", False), (True, "torch", False)])
def test_the_engine_knobs_reach_every_linear_layer_and_the_lm_head(knob, attribute, on_value,
                                                                   on, backend, wanted):
    from tiny_model import tiny_model_dir

    from infer import LLM
    from infer.models.linear import LinearBase, ParallelLMHead

    llm = LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
              kernel_backend=backend, cuda_graphs=False, **{knob: on})
    layers = [m for m in llm.engine.core.runner.model.modules()
              if isinstance(m, (LinearBase, ParallelLMHead))]
    off_value = 0  # rows
    assert layers and all(getattr(m, attribute) == (on_value if wanted else off_value)
                          for m in layers)


@pytest.mark.skipif(DEVICE != "cuda", reason="the layers take the kernel on CUDA only")
@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize(("rows", "width"), [(1, 16384), (1, 384), (2, 384), (7, 384), (40, 384)])
@pytest.mark.parametrize("gemv_rows", [0, 1, 2])
def test_8bit_layers_with_the_knob_match_float64(method, rows, width, gemv_rows):
    from infer.models.linear import ColumnParallelLinear
    from infer.quantization.fp8 import Fp8LinearMethod
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    gen = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(512, width, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(width, 512, generator=gen))
    layer = layer.to(DEVICE, torch.bfloat16)
    (Int8WeightOnlyLinearMethod() if method == "int8" else Fp8LinearMethod()).quantize(layer)
    layer.w8a16_tensor_core_rows = 64
    layer.w8a16_gemv_rows = gemv_rows
    x = torch.randn(rows, 512, generator=gen).to(DEVICE, torch.bfloat16)
    y = layer(x).double()
    ref = x.double() @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T
    assert (y - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 weights need a GPU (the interpreter has none)")
@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [1, 5])
def test_fp8_weights_match_float64(block, rows, weight_first):
    x, w, scale = _case(rows, 384, 640, torch.bfloat16, seed=rows)
    w8 = (w.float() * 3.0).to(torch.float8_e4m3fn)  # up to 384: e4m3's range
    if block is not None:
        gen = torch.Generator().manual_seed(9)
        scale = torch.rand(3, 5, generator=gen) * 0.02 + 1e-3
        dense = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        dense = scale.double()[:, None].expand(384, 640)
    y = _run(x, w8, scale, block, weight_first=weight_first)
    ref = x.double() @ (w8.double() * dense.double()).T
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[torch.bfloat16], error


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_a_captured_graph_replays_with_its_counters_left_at_zero():
    """K slices under graph replay: every replay gives the eager result, and the counters
    the last program of each row block resets are at 0 after each."""
    from infer.kernels import launch_counters
    from infer.kernels.rows_mma import MAX_BLOCKS, rows_mma

    x, w, scale = _case(3, 640, 2048, torch.bfloat16, seed=21)
    x, w, scale = x.cuda(), w.cuda(), scale.cuda()
    w16 = torch.randn(640, 2048, generator=torch.Generator().manual_seed(2)).to(
        torch.bfloat16).cuda()
    eager = [rows_mma(x, w, scale, splits=4), rows_mma(x, w16, splits=3)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        rows_mma(x, w, scale, splits=4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = [rows_mma(x, w, scale, splits=4), rows_mma(x, w16, splits=3)]
    for _ in range(3):
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager))
        assert int(launch_counters("rows_mma", x.device, MAX_BLOCKS).abs().sum()) == 0


@pytest.mark.parametrize(("rows", "width", "most", "gemv_rows", "wanted"), [
    (1, 256, 16, 0, "w8a16"), (1, 512, 16, 0, "rows_mma"), (1, 512, 16, 1, "gemv"),
    (1, 256, 0, 1, "gemv"), (2, 256, 16, 1, "rows_mma"), (16, 256, 16, 1, "rows_mma"),
    (2, 256, 16, 2, "gemv"), (3, 512, 16, 2, "rows_mma"), (2, 256, 0, 2, "gemv"),
    (2, 4096, 16, 2, "rows_mma"),
    (17, 256, 16, 1, "w8a16"), (17, 256, 64, 1, "rows_mma"),
    (64, 256, 64, 1, "rows_mma"), (65, 256, 64, 1, "w8a16"), (3, 256, 0, 1, "w8a16"),
    (1, 512, 0, 0, "w8a16")])
def test_8bit_weights_go_to_tensor_cores_where_they_gained(monkeypatch, rows, width, most,
                                                          gemv_rows, wanted):
    """Up to `gemv_rows` rows to the GEMV (two on narrow layers only); past them from 2 to
    `most` rows rows_mma, and one row there too on a wide layer (the threshold lowered to 512
    here); none with `most` 0."""
    from infer.kernels import gemv, rows_mma, w8a16_matmul

    calls = []
    for module, name in ((rows_mma, "rows_mma"), (gemv, "gemv")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k:
                            calls.append(name) or real(*a, **k))
    monkeypatch.setattr(w8a16_matmul, "TENSOR_CORES_ONE_ROW_MIN_N", 512)
    x, w, scale = _case(rows, width, 128, torch.float16, seed=rows)
    y = w8a16_matmul.w8a16_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE),
                                  tensor_core_rows=most, gemv_rows=gemv_rows)
    assert calls == ([] if wanted == "w8a16" else [wanted])
    ref = _reference(x, w, scale)
    assert (y.double().cpu() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 needs a GPU (the interpreter has none)")
@pytest.mark.parametrize(("rows", "k", "splits"), [(1, 640, 1), (1, 4096, 4), (5, 640, 1),
                                                   (16, 4096, 3), (40, 640, 2),
                                                   (64, 4096, 3)])
def test_fp8_by_fp8_matches_float64_on_fp8_quants_values(rows, k, splits):
    """x quantized by `fp8_quantize_rows`, multiplied FP8 by FP8: the float64 product of
    the same FP8 values and scales (a float16 output: a value off by one FP8 step would
    show), rows of zeros and of large |x| too."""
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.rows_mma import rows_mma

    x, _, scale = _case(rows, 384, k, torch.float16, seed=rows + k)
    x[0, :7] *= 3000.0  # a few large |x|: the row's scale follows its largest
    if rows > 1:
        x[1] = 0.0
    gen = torch.Generator().manual_seed(k)
    w8 = (torch.randn(384, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    xq, xs = fp8_quantize_rows(x.cuda())
    y = rows_mma(xq, w8.cuda(), scale.float().cuda(), x_scale=xs, splits=splits,
                 out_dtype=torch.float16).cpu()
    ref = ((xq.cpu().double() * xs.cpu().double()[:, None])
           @ (w8.double() * scale.double()[:, None]).T)
    assert y.dtype == torch.float16
    assert ((y.double() - ref).abs() <= 2e-3 * ref.abs() + 1e-3 * ref.abs().max()).all()
    if rows > 1:
        assert (y[1] == 0).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 needs a GPU (the interpreter has none)")
@pytest.mark.parametrize(("rows", "n", "k"), [(17, 384, 4096), (32, 6144, 640),
                                              (32, 16384, 512), (64, 4096, 14336)])
def test_fp8_by_fp8_at_the_engines_launches_matches_float64(rows, n, k):
    """The launches FP8 layers take (`fp8_x_launch`: 64 x 256 tiles in K slices or not,
    128 x 128 tiles for wide layers) give the float64 product of the same FP8 values."""
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.rows_mma import fp8_x_launch, rows_mma

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w8 = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    launch = fp8_x_launch(n, k, torch.device("cuda"))
    xq, xs = fp8_quantize_rows(x.cuda())
    y = rows_mma(xq, w8.cuda(), scale.cuda(), x_scale=xs, out_dtype=torch.bfloat16,
                 **launch).cpu()
    ref = ((xq.cpu().double() * xs.cpu().double()[:, None])
           @ (w8.double() * scale.double()[:, None]).T)
    assert ((y.double() - ref).abs() <= 8e-3 * ref.abs() + 1e-3 * ref.abs().max()).all(), launch


def _fp8_layer_and_rows(rows: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A 512 -> 384 layer made FP8 per channel on the device, and `rows` bf16 rows for it."""
    from infer.models.linear import ColumnParallelLinear
    from infer.quantization.fp8 import Fp8LinearMethod

    gen = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(512, 384, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(384, 512, generator=gen))
    layer = layer.to(DEVICE, torch.bfloat16)
    Fp8LinearMethod().quantize(layer)
    return layer, torch.randn(rows, 512, generator=gen).to(DEVICE, torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 needs a GPU (the interpreter has none)")
@pytest.mark.parametrize("rows", [17, 32, 64])
def test_fp8_layers_with_mma_rows_match_the_scaled_mm_path(rows, monkeypatch):
    """With `fp8_mma_rows`, an FP8 by FP8 step of up to that many rows gives what
    `torch._scaled_mm` gives on the same rows, without calling it."""
    from infer.quantization import fp8

    layer, x = _fp8_layer_and_rows(rows)
    reference = layer(x).float()  # fp8_mma_rows unset: torch._scaled_mm
    layer.fp8_mma_rows = 64
    calls = []
    monkeypatch.setattr(fp8, "_scaled_mm", lambda *args: calls.append(args))
    y = layer(x).float()
    assert calls == []
    assert (y - reference).abs().max().item() <= 1e-2 * reference.abs().max().item()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 needs a GPU (the interpreter has none)")
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_fp8_layers_with_decode_activations_match_the_scaled_mm_path(rows):
    """With the knob, a decode-sized step gives what a large step's `torch._scaled_mm`
    gives on the same rows (both quantize x per token)."""
    from infer.quantization.fp8 import WEIGHT_ONLY_ROWS

    layer, x = _fp8_layer_and_rows(rows)
    layer.fp8_decode_activations = True
    y = layer(x).float()
    padded = torch.cat([x, x.new_zeros(WEIGHT_ONLY_ROWS + 1 - rows, 512)])
    large = layer(padded).float()[:rows]  # the _scaled_mm path
    assert (y - large).abs().max().item() <= 1e-2 * large.abs().max().item()


def test_the_fp8_activations_knob_reaches_the_layers_only_where_fp8_mma_runs(caplog):
    from tiny_model import tiny_model_dir

    from infer import LLM
    from infer.models.linear import LinearBase

    llm = LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
              quantization="fp8", kernel_backend="triton", fp8_decode_activations=True,
              fp8_mma_rows=32, cuda_graphs=False)
    layers = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, LinearBase)]
    runs = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    assert layers and all(m.fp8_decode_activations is runs for m in layers)
    assert all(m.fp8_mma_rows == (32 if runs else 0) for m in layers)
    assert runs or "fp8_decode_activations needs a GPU" in caplog.text


def test_weight_first_launches_fit_the_kernel_and_match_float64():
    """`weight_first_launch`'s tiles for narrow, deep and wide layers give the float64
    product (shapes cut down; the rule reads only N, K and the SM count)."""
    from infer.kernels.rows_mma import rows_mma, weight_first_launch

    device = torch.empty(0, device=DEVICE).device
    for n, k in [(200, 4096), (300, 640), (16400, 256)]:
        launch = weight_first_launch(n, k, device)
        assert launch["weight_first"] and launch["block_n"] == 64
        gen = torch.Generator().manual_seed(n + k)
        x = torch.randn(3, k, generator=gen).to(torch.float16)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.float16)
        y = rows_mma(x.to(DEVICE), w.to(DEVICE), **launch).cpu()
        ref = x.double() @ w.double().T
        error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
        assert error < TOLERANCE[torch.float16], (n, k, launch, error)


def test_the_weight_first_knob_reaches_the_16bit_layers_kernel(monkeypatch):
    """`mma_weight_first` sets the engine's launch; a 16-bit layer's step of a few rows
    then takes rows_mma with the weight first, and gives the float64 product."""
    from tiny_model import tiny_model_dir

    from infer import LLM
    from infer.kernels import rows_mma
    from infer.models.linear import matmul

    try:
        LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
            kernel_backend="triton", cuda_graphs=False)
        assert rows_mma._weight_first  # the default
        launches = []
        real = rows_mma.rows_mma
        monkeypatch.setattr(rows_mma, "rows_mma",
                            lambda *a, **k: launches.append(k) or real(*a, **k))
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(5, 256, generator=gen).to(torch.float16)
        w = (torch.randn(96, 256, generator=gen) * 0.05).to(torch.float16)
        y = matmul(x.to(DEVICE), w.to(DEVICE), None, gemv_rows=8).cpu()
        assert [k.get("weight_first") for k in launches] == [True]
        ref = x.double() @ w.double().T
        assert (y.double() - ref).abs().max() <= TOLERANCE[torch.float16] * ref.abs().max()
        LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
            kernel_backend="triton", mma_weight_first=False, cuda_graphs=False)
        assert not rows_mma._weight_first  # set again by the next engine
    finally:
        rows_mma.set_weight_first(True)  # the default


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's 16-bit layers take it on CUDA only")
def test_a_bfloat16_engines_few_row_steps_match_cublas(monkeypatch):
    """The default engine sends its 2-16-row steps of 16-bit weights to rows_mma with the
    weight first; its logprobs are cuBLAS's (`gemv_max_rows=1`) within bfloat16 rounding,
    token by token while the two agree."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams
    from infer.kernels import rows_mma

    prompts = [[5 + i, 9, 14 + 3 * i, 2 + i, 40] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    launches: dict[int, list[dict]] = {16: [], 1: []}
    real = rows_mma.rows_mma
    outs = {}
    for rows, seen in launches.items():
        monkeypatch.setattr(rows_mma, "rows_mma",
                            lambda *a, _seen=seen, **k: _seen.append(k) or real(*a, **k))
        llm = LLM(str(tiny_model_dir()), device=DEVICE, dtype="bfloat16", num_blocks=64,
                  max_model_len=128, cuda_graphs=False, gemv_max_rows=rows)
        outs[rows] = llm.generate(prompts, params, use_tqdm=False)
    assert launches[16] and not launches[1]
    assert all(k.get("weight_first") for k in launches[16])
    compared = 0
    for got, want in zip(outs[16], outs[1]):
        for token, lp, ref_lp, ref_token in zip(
                got.outputs[0].token_ids, got.outputs[0].logprobs,
                want.outputs[0].logprobs, want.outputs[0].token_ids):
            if token != ref_token:
                break
            assert lp[token].logprob == pytest.approx(ref_lp[token].logprob, abs=3e-2)
            compared += 1
    assert compared >= 8


@pytest.fixture
def bf16_8bit():
    """rows_mma's BF16_W form on for the test (`EngineConfig.mma_8bit_bf16`, the default)."""
    from infer.kernels import rows_mma

    rows_mma.set_bf16_8bit(True)
    yield
    rows_mma.set_bf16_8bit(True)


@pytest.fixture(autouse=True)
def _float16_form_unless_asked(request):
    """The other tests take the float16 form (BF16_W off), which they were written for;
    the `bf16_8bit` ones the engine's default."""
    from infer.kernels import rows_mma

    if "bf16_8bit" not in request.fixturenames:
        rows_mma.set_bf16_8bit(False)
    yield
    rows_mma.set_bf16_8bit(True)


@pytest.mark.skipif(DEVICE != "cuda", reason="the BF16_W form's bit conversions are PTX")
@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "splits", "block"), [
    (2, 200, 300, 1, None), (3, 40, 256, 2, None), (17, 130, 384, 2, None),
    (32, 64, 256, 1, None), (64, 140, 384, 3, None), (24, 300, 640, 2, (128, 128))])
def test_int8_weights_as_bfloat16_match_float64(m, n, k, splits, block, weight_first,
                                                bf16_8bit):
    """The BF16_W form: int8 weights made bfloat16 by their bits, bfloat16 x as it is."""
    x, w, scale = _case(m, n, k, torch.bfloat16, seed=m + n + k)
    if block is not None:
        gen = torch.Generator().manual_seed(5)
        scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 0.02 + 1e-3
        dense = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        ref = x.double() @ (w.double() * dense.double()).T
    else:
        ref = _reference(x, w, scale)
    y = _run(x, w, scale, block, splits=splits, weight_first=weight_first)
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[torch.bfloat16], error


def _every_weight_value(dtype: torch.dtype) -> torch.Tensor:
    """Each value an 8-bit weight can hold (FP8: but NaN), one a row, 256 columns."""
    codes = torch.arange(-128, 128, dtype=torch.int8)
    if dtype == torch.float8_e4m3fn:
        codes = codes[~torch.isnan(codes.view(torch.float8_e4m3fn).float())]
        return codes.view(torch.float8_e4m3fn)[:, None].expand(-1, 256).contiguous()
    return codes[:, None].expand(-1, 256).contiguous()


@pytest.mark.skipif(DEVICE != "cuda", reason="the BF16_W form's bit conversions are PTX")
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [2, 5, 32, 64])
def test_every_8bit_value_as_bfloat16_is_exact(dtype, rows, bf16_8bit):
    """Every int8 and e4m3 value (FP8 subnormals too) times an x of one nonzero column
    (1, -2.5, 2^-20, 2^70: past X_UP's range, the float32 path) comes out as the exact
    product rounded to bfloat16."""
    w = _every_weight_value(dtype)
    x = torch.zeros(rows, 256, dtype=torch.bfloat16)
    values = [1.0, -2.5, 2.0 ** -20, 2.0 ** 70]
    for r in range(rows):
        x[r, (7 * r) % 256] = values[r % len(values)]
    scale = torch.ones(len(w), dtype=torch.bfloat16)
    y = _run(x, w, scale, splits=1)
    want = (x.double() @ w.double().T).to(torch.bfloat16)  # one exact product, rounded
    assert torch.equal(y, want), (y.double() - want.double()).abs().max()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 weights need a GPU (the interpreter has none)")
@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("rows", [2, 5, 32])
def test_fp8_weights_as_bfloat16_match_float64(block, rows, weight_first, bf16_8bit):
    test_fp8_weights_match_float64(block, rows, weight_first)


def test_the_bf16_8bit_knob_is_each_engines():
    """`mma_8bit_bf16` sets the form for the engine made with it, and the next engine's
    default sets it back (on)."""
    from tiny_model import tiny_model_dir

    from infer import LLM
    from infer.kernels import rows_mma

    try:
        LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
            kernel_backend="triton", cuda_graphs=False, mma_8bit_bf16=False)
        assert not rows_mma._bf16_8bit
        LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
            kernel_backend="triton", cuda_graphs=False)
        assert rows_mma._bf16_8bit
    finally:
        rows_mma.set_bf16_8bit(True)
