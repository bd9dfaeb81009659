"""One row times INT8 weights by dp4a on x's two int8 halves (`kernels/int8_x16_gemv.py`),
against float64: equal to float64's product on the rounded row to float32 rounding (the
integer sums are exact), within x's rounding of the exact product, and the gated form bit
for bit the plain one followed by the activation kernel. Shapes off the launch's blocks,
K not a multiple of the step, weights at -128. Then the RMSNorm's halves (bit for bit
`split_rows` of its output), the engine's routing, and the rounding's effect on a real
model (SmolLM2's perplexity). Triton's interpreter on the CPU; `INFER_TEST_DEVICE=cuda`
runs the compiled kernels."""

import os

import pytest
import torch

pytest.importorskip("triton")

from infer.kernels import int8_halves, int8_x16, int8_x16_gemv
from infer.kernels.activation import gated_rows
from infer.kernels.gemv import Launch

DEVICE = torch.device(os.environ.get("INFER_TEST_DEVICE", "cpu"))
QMAX = int8_halves.QMAX.value


def _row(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g) * torch.logspace(-2, 1, k)[None, :]
    x[0, k // 3] = -9.0 * x.abs().max()  # an outlier sets the row's scale
    return x


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    w[0, :] = -128  # the extreme the sums' bound allows for
    return w, torch.rand(n, generator=g) * 0.01 + 1e-4


@pytest.mark.parametrize("n,k,launch", [
    (70, 256, Launch(block_n=16, block_k=64, num_warps=4)),  # rows past N, K in 4 steps
    (33, 1000, Launch(block_n=8, block_k=128, num_warps=4)),  # K not a multiple of a step
    (130, 4096, None),  # the default launch
])
def test_matches_float64_on_the_rounded_row(n, k, launch):
    x = _row(k, n)
    w, w_scale = _weights(n, k, n)
    y = int8_x16_gemv.int8_x16_gemv(x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE),
                                    launch=launch).cpu()
    assert y.shape == (1, n) and y.dtype == torch.float32
    q, scale = int8_x16.split_rows(x.to(DEVICE))
    rounded = (256 * q[0].double() + q[1].double()).cpu() * scale.cpu().double()[:, None]
    weights = w.double() * w_scale.double()[:, None]
    want = rounded @ weights.T
    magnitude = rounded.abs() @ weights.abs().T
    assert ((y.double() - want).abs() <= 1e-6 * magnitude).all()
    # against x itself: each value moved by at most half its row's step
    bound = (scale.cpu().double() / 2) * weights.abs().sum(dim=1)[None, :]
    exact = x.double() @ weights.T
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-6 * magnitude).all()


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_form_is_the_plain_one_then_the_activation(act):
    inter, k = 37, 512
    x = _row(k, 5).to(torch.bfloat16)
    w, w_scale = _weights(2 * inter, k, 5)
    launch = Launch(block_n=8, block_k=128, num_warps=4)
    args = (x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE))
    fused = int8_x16_gemv.int8_x16_gemv(*args, act=act, launch=launch).cpu()
    plain = int8_x16_gemv.int8_x16_gemv(*args, launch=launch)
    assert fused.shape == (1, inter) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, gated_rows(plain, act).cpu())


def test_takes_only_whole_words_of_int8():
    x = torch.zeros(1, 8)
    assert int8_x16_gemv.takes(x, torch.zeros(3, 8, dtype=torch.int8))
    assert not int8_x16_gemv.takes(x[:, :6], torch.zeros(3, 6, dtype=torch.int8))
    assert not int8_x16_gemv.takes(torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.int8))
    assert not int8_x16_gemv.takes(x, torch.zeros(8, 3, dtype=torch.int8).T)
    assert not int8_x16_gemv.takes(x, torch.zeros(3, 8, dtype=torch.bfloat16))


def test_which_steps_take_the_kernel():
    """The CUDA routing rule (`quantization/int8.py`): with `int8_x16_gemv`, one row that
    comes split already (the RMSNorm's halves) by a layer whose weight the kernel takes;
    never a row without its halves, never more rows, never with the knob off."""
    from infer.models.linear import ColumnParallelLinear
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod, _to_x16_gemv

    layer = ColumnParallelLinear(64, 96, bias=False)
    Int8WeightOnlyLinearMethod().quantize(layer)
    halves = int8_x16.split_rows(torch.ones(1, 64, device=DEVICE))
    assert not _to_x16_gemv(layer, torch.ones(1, 64), halves)  # the knob unset
    layer.int8_x16_gemv = True
    assert _to_x16_gemv(layer, torch.ones(1, 64), halves)
    assert not _to_x16_gemv(layer, torch.ones(1, 64), None)  # a split launch of its own
    assert not _to_x16_gemv(layer, torch.ones(2, 64), halves)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="INT8 layers take the kernel on CUDA only")
@pytest.mark.parametrize("act", ["", "silu"])
def test_one_row_by_an_int8_layer_with_the_knob_takes_the_kernel(act, monkeypatch):
    """With `int8_x16_gemv` one row carrying its halves goes to the kernel (a gate_up
    layer's activation in its launch); the same row without them, and two rows, do not;
    all against float64."""
    from infer.models.linear import MergedColumnParallelLinear
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    gen = torch.Generator().manual_seed(7)
    layer = MergedColumnParallelLinear(512, [384, 384], bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(768, 512, generator=gen))
    layer = layer.to(DEVICE, torch.bfloat16)
    Int8WeightOnlyLinearMethod().quantize(layer)
    layer.int8_x16_gemv, layer.w8a16_gemv_rows = True, 2
    taken = []
    real = int8_x16_gemv.int8_x16_gemv
    monkeypatch.setattr(int8_x16_gemv, "int8_x16_gemv",
                        lambda *a, **k: taken.append(len(a[0])) or real(*a, **k))
    x = torch.randn(2, 512, generator=gen).to(DEVICE, torch.bfloat16)
    ref = x.double() @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T
    row = int8_x16.attach_halves(x[:1].clone(), int8_x16.split_rows(x[:1]))
    if act:
        ys = [layer.quant_method.apply_gate_up(layer, r, act, None).double()
              for r in (row, x[:1])]
        ref = gated_rows(ref.to(torch.bfloat16), act).double()
    else:
        ys = [layer(r).double() for r in (row, x[:1])]
        layer(x)  # two rows: another kernel
    assert taken == [1]
    for y in ys:
        assert (y - ref[:1]).abs().max().item() <= 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("residual", [False, True])
def test_the_norms_halves_are_split_rows_of_its_output(residual, rows):
    """An RMSNorm's output split into halves in its own launch (`x16_rows`) equals
    `split_rows` of the output as stored, bit for bit, and the output is the plain norm's."""
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, 1000, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    w = (torch.rand(1000, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    if residual:
        res = torch.randn(rows, 1000, generator=g).to(torch.bfloat16).to(DEVICE)
        out, res_out, (q, scale) = fused_add_rmsnorm(x, res.clone(), w, 1e-6, x16_rows=True)
        plain, plain_res = fused_add_rmsnorm(x, res.clone(), w, 1e-6)
        assert torch.equal(res_out, plain_res)
    else:
        out, (q, scale) = rmsnorm(x, w, 1e-6, x16_rows=True)
        plain = rmsnorm(x, w, 1e-6)
    assert torch.equal(out, plain)
    want_q, want_scale = int8_x16.split_rows(out)
    assert q.shape == want_q.shape == (2, rows, 1000)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the norms hand out halves on CUDA only")
def test_a_norms_halves_reach_the_kernel_without_a_split(monkeypatch):
    """With `x16_rows` the norm's one-row output carries its halves into the INT8 layer's
    kernel: no split of its own, the same product as with one."""
    from test_int8_x16 import int8_layer

    from infer.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(11)
    layer = int8_layer(gen, 256, 512)
    layer.int8_x16_gemv = True
    norm = RMSNorm(512, 1e-6).to(DEVICE, torch.bfloat16)
    norm.use_triton = True
    x = torch.randn(1, 512, generator=gen).to(DEVICE, torch.bfloat16)
    out = norm(x)
    want = int8_x16_gemv.int8_x16_gemv(out, layer.weight, layer.weight_scale)  # its own split
    norm.x16_rows = range(1, 2)
    monkeypatch.setattr(int8_x16_gemv, "split_rows", lambda *a: pytest.fail("split"))
    assert torch.equal(layer(norm(x)), want)


def rounded_as_split(x: torch.Tensor) -> torch.Tensor:
    """float32 rows `x` rounded as `split_rows` rounds them, in torch: `split_rows` in the
    interpreter on each of a model's layers took 70-115 s of CI (`test_int8_x16` pins its
    rounding; `test_the_torch_rounding_is_split_rows_own` pins this one to it)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1.0 / QMAX), torch.ones_like(amax))
    q = torch.floor(x * (1.0 / scale) + 0.5).clamp(-QMAX, QMAX)
    return q * scale


def test_the_torch_rounding_is_split_rows_own():
    x = _row(1000, 5).repeat(3, 1)
    x[1] = 0.0
    x[2] *= 1e-3
    q, scale = int8_x16.split_rows(x.to(DEVICE))
    rounded = (256 * q[0].float() + q[1].float()).cpu() * scale.cpu()[:, None]
    assert torch.equal(rounded_as_split(x), rounded)


def test_smollm2_with_x_in_halves_stays_within_one_percent_of_the_unquantized_model(monkeypatch):
    """x's rounding on real weights: SmolLM2 in INT8 with every row of x into its INT8
    layers (the LM head too) rounded as `split_rows` rounds it (what this kernel and
    `int8_x16` multiply, to float32 rounding). Its perplexity on the fixed text stays within
    1 % of the unquantized model's, and wherever its next-token choice differs from INT8's
    with x exact, the two tokens' logits under exact x were closer than the rounding moved
    that position's logits."""
    from paged_runner import run_paged
    from real_models import smollm2_gguf
    from test_quantization import TEXT, perplexity_of, smollm2_perplexities

    import infer.quantization.int8 as int8
    from infer.loader.tokenizer import Tokenizer

    before, exact_x, quantized = smollm2_perplexities("int8")
    ids = Tokenizer.from_gguf(smollm2_gguf()).encode(TEXT)
    exact = run_paged(quantized, [ids], [len(ids)], block_size=16)[0].double()

    def x_in_halves(layer, x):
        return rounded_as_split(x.float()) @ (
            layer.weight.float() * layer.weight_scale.float()[:, None]).T

    monkeypatch.setattr(int8, "_cpu_matmul", x_in_halves)
    rounded = run_paged(quantized, [ids], [len(ids)], block_size=16)[0].double()
    halves = perplexity_of(rounded, ids)
    moved = (rounded - exact).abs().amax(dim=-1)
    first, second = exact.argmax(-1), rounded.argmax(-1)
    differ = torch.nonzero(first != second).flatten()
    gaps = exact[differ, first[differ]] - exact[differ, second[differ]]
    print(f"perplexity: {before:.4f} unquantized, {exact_x:.4f} INT8, {halves:.4f} INT8 with "
          f"x in halves; next token unlike x exact's at {len(differ)} of {len(ids)}, exact "
          f"gaps {gaps.tolist()}; logits moved by at most {moved.max():.3f}")
    assert abs(halves - before) / before < 0.01, (before, halves)
    assert (gaps <= moved[differ]).all(), (gaps, moved[differ])
