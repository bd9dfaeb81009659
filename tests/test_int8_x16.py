"""INT8 weights times rows of x split into two int8 halves (`kernels/int8_x16.py`), against
float64: the split reconstructs each row's 16-bit fixed point exactly, the product equals
float64's on that rounded x to float32 rounding, and moves from the exact product by no
more than the rounding allows (every value within half a step of its row's scale). Shapes
off the launch's blocks, one to 64 rows, K in slices added by the last program (run twice:
the counters it leaves must let the next launch add its own). Triton's interpreter on the
CPU; `INFER_TEST_DEVICE=cuda` runs the compiled kernels."""

import os

import pytest
import torch

pytest.importorskip("triton")

from infer.kernels import int8_halves, int8_x16

DEVICE = torch.device(os.environ.get("INFER_TEST_DEVICE", "cpu"))
QMAX = int8_halves.QMAX.value


def _rows(m: int, k: int) -> torch.Tensor:
    magnitudes = torch.logspace(-3, 2, m, dtype=torch.float64)[:, None]
    x = torch.randn(m, k, dtype=torch.float64) * magnitudes
    x[m // 2] = 0.0  # a row of zeros: scale 1, every half 0
    x[0, 0] = 7.5 * x[0].abs().max()  # one outlier
    return x


def int8_layer(gen: torch.Generator, n: int, k: int) -> torch.nn.Module:
    """A bfloat16 `[n, k]` linear layer of random weights on DEVICE, made INT8 per channel."""
    from infer.models.linear import ColumnParallelLinear
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    layer = ColumnParallelLinear(k, n, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen))
    layer = layer.to(DEVICE, torch.bfloat16)
    Int8WeightOnlyLinearMethod().quantize(layer)
    return layer


@pytest.mark.parametrize("m,k", [(9, 1000), (3, 17000)])  # one pass; K in slices
def test_split_rows_are_each_rows_16_bit_fixed_point(m, k):
    x = _rows(m, k).float()
    q, scale = int8_x16.split_rows(x.to(DEVICE))
    q, scale = q.cpu(), scale.cpu()
    assert q.shape == (2, m, k) and q.dtype == torch.int8
    hi, lo = q[0].long(), q[1].long()
    assert hi.abs().max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    amax = x.abs().amax(dim=1)
    want = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    torch.testing.assert_close(scale, want, rtol=2e-7, atol=0)
    fixed = 256 * hi + lo
    assert fixed.abs().max() <= QMAX
    exact = x.double() / scale.double()[:, None]
    assert (fixed - exact).abs().max() <= 0.5 + 1e-3  # rounded to the nearest step
    assert torch.equal(fixed[m // 2], torch.zeros(k, dtype=torch.long))


@pytest.mark.parametrize("m,n,k,splits", [(1, 70, 256, 1), (5, 130, 300, 1),
                                          (17, 64, 1000, 3), (33, 200, 512, 2),
                                          (64, 96, 257, 1)])
def test_matches_float64_on_the_rounded_rows(m, n, k, splits):
    x = _rows(m, k).float()
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    w_scale = torch.rand(n) * 0.01 + 1e-4
    launch = dict(block_n=64, block_k=128, splits=splits, num_warps=4, num_stages=2)
    for _ in range(2):  # the second launch finds the split counters as the first left them
        y = int8_x16.int8_x16_matmul(x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE),
                                     **launch).cpu()
        assert y.shape == (m, n) and y.dtype == torch.float32
        q, scale = int8_x16.split_rows(x.to(DEVICE))
        rounded = (256 * q[0].double() + q[1].double()).cpu() * scale.cpu().double()[:, None]
        weights = w.double() * w_scale.double()[:, None]
        want = rounded @ weights.T
        magnitude = rounded.abs() @ weights.abs().T
        assert ((y.double() - want).abs() <= 1e-5 * magnitude + 1e-30).all()
        # against x itself: each value of x moved by at most half its row's step
        exact = x.double() @ weights.T
        bound = (scale.cpu().double()[:, None] / 2) * weights.abs().sum(dim=1)[None, :]
        assert ((y.double() - exact).abs() <= bound * (1 + 1e-4) + 1e-5 * magnitude).all()


def test_16_bit_rows_come_back_in_their_dtype():
    x = torch.randn(8, 384).to(torch.bfloat16)
    w = torch.randint(-127, 128, (48, 384), dtype=torch.int8)
    w_scale = torch.rand(48) * 0.01
    y = int8_x16.int8_x16_matmul(x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE)).cpu()
    assert y.dtype == torch.bfloat16
    want = x.double() @ (w.double() * w_scale.double()[:, None]).T
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_bad_shapes_are_refused():
    w = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(AssertionError):
        int8_x16.int8_x16_matmul(torch.zeros(65, 32), w, torch.ones(8))  # past MAX_ROWS
    with pytest.raises(AssertionError):
        int8_x16.int8_x16_matmul(torch.zeros(2, 32), w.float(), torch.ones(8))


def test_which_steps_take_the_int8_tensor_cores():
    """The CUDA routing rule (`quantization/int8.py`): 2 to `int8_mma_rows` rows the GEMV
    does not take (two rows of a layer this narrow it does), never one row."""
    from infer.models.linear import ColumnParallelLinear
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod, _to_int8_mma

    layer = ColumnParallelLinear(64, 768, bias=False)
    Int8WeightOnlyLinearMethod().quantize(layer)
    assert not _to_int8_mma(layer, 3)  # the knob unset
    layer.int8_mma_rows, layer.w8a16_gemv_rows = 64, 2
    for rows in (1, 2, 3, 64, 65):
        assert _to_int8_mma(layer, rows) == (3 <= rows <= 64), rows


@pytest.mark.skipif(DEVICE.type != "cuda", reason="INT8 layers take the kernel on CUDA only")
@pytest.mark.parametrize("rows", [2, 17, 64])
def test_int8_layers_with_the_knob_take_the_kernel_and_match_float64(rows, monkeypatch):
    from infer.kernels import w8a16_matmul

    gen = torch.Generator().manual_seed(rows)
    layer = int8_layer(gen, 384, 512)
    layer.int8_mma_rows = 64
    monkeypatch.setattr(w8a16_matmul, "w8a16_matmul", lambda *a, **k: pytest.fail("W8A16"))
    x = torch.randn(rows, 512, generator=gen).to(DEVICE, torch.bfloat16)
    y = layer(x).double()
    ref = x.double() @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T
    assert (y - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_the_knobs_reach_every_linear_layer_and_the_lm_head():
    """`int8_mma_rows` as set, and `int8_x16_gemv` by default, on every INT8 layer; the
    norms then hand out x's halves."""
    from tiny_model import tiny_model_dir

    from infer import LLM
    from infer.models.layers import RMSNorm
    from infer.models.linear import LinearBase, ParallelLMHead

    llm = LLM(str(tiny_model_dir()), device=str(DEVICE), num_blocks=64, max_model_len=128,
              quantization="int8", kernel_backend="triton", int8_mma_rows=32,
              cuda_graphs=False)
    layers = [m for m in llm.engine.core.runner.model.modules()
              if isinstance(m, (LinearBase, ParallelLMHead))]
    assert layers and all(m.int8_mma_rows == 32 for m in layers)
    assert all(m.int8_x16_gemv for m in layers)  # int8_x16_gemv.py's knob
    norms = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, RMSNorm)]
    # one row for the dp4a GEMV, up to 32 for the int8 tensor cores
    assert norms and all(m.x16_rows == range(1, 33) for m in norms)


def test_the_norms_split_only_the_steps_an_int8_kernel_takes_so():
    """`set_x16_norms`: the steps whose norms split their rows, by the knobs; none in a
    model without INT8 layers."""
    from infer.models.layers import RMSNorm
    from infer.models.linear import ColumnParallelLinear, set_x16_norms
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    attention = torch.nn.Module()  # per-head norms, as self_attention.py's with qk_norm
    attention.q_norm = RMSNorm(16, 1e-6, feeds_projection=False)
    attention.k_norm = RMSNorm(16, 1e-6, feeds_projection=False)
    model = torch.nn.ModuleList([RMSNorm(64, 1e-6), ColumnParallelLinear(64, 64, bias=False),
                                 attention])
    set_x16_norms(model, True, 64)
    assert model[0].x16_rows == range(0)  # no INT8 layer
    Int8WeightOnlyLinearMethod().quantize(model[1])
    for one_row, mma_rows, rows in [(True, 64, [1, 64]), (True, 0, [1, 1]),
                                    (False, 16, [2, 16]), (False, 0, None)]:
        set_x16_norms(model, one_row, mma_rows)
        assert list(model[0].x16_rows) == (list(range(rows[0], rows[1] + 1)) if rows else [])
        assert attention.q_norm.x16_rows == attention.k_norm.x16_rows == range(0)


def test_only_the_norms_before_a_projection_split_their_rows():
    """In a Gemma 3 model with INT8 layers: the norms before the q/k/v and gate/up
    projections and the final one (before the LM head, once that is INT8) split their rows;
    the per-head q / k norms (into RoPE) and the sandwich norms after attention and after
    the MLP (into the residual adds) do not; for GGUF's int8-x kernels the same norms round
    their rows."""
    from infer.models import config_from_hf, model_class
    from infer.models.layers import RMSNorm
    from infer.models.linear import set_x16_norms
    from infer.quantization.gguf_gpu import GGUFBlocksLinearMethod, set_gguf_int8_activations
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod, quantize_table

    cfg = config_from_hf(dict(model_type="gemma3_text", vocab_size=32, hidden_size=64,
                              intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    model = model_class(cfg)(cfg)
    layer = model.model.layers[0]
    Int8WeightOnlyLinearMethod().quantize(layer.self_attn.qkv_proj)
    set_x16_norms(model, True, 8)
    assert model.model.norm.x16_rows == range(0)  # its LM head is not INT8
    quantize_table(model.lm_head, model)
    set_x16_norms(model, True, 8)
    splitting = {name for name, m in model.named_modules()
                 if isinstance(m, RMSNorm) and m.x16_rows == range(1, 9)}
    assert splitting == {f"model.layers.{i}.{norm}" for i in range(2)
                         for norm in ("input_layernorm", "pre_feedforward_layernorm")
                         } | {"model.norm"}, sorted(splitting)
    layer.mlp.down_proj.quant_method = GGUFBlocksLinearMethod()  # as a GGUF model's
    set_gguf_int8_activations(model, True, fused=True)
    assert {name for name, m in model.named_modules()
            if isinstance(m, RMSNorm) and m.int8_rows} == splitting


def test_halves_made_beforehand_give_the_same_product_without_a_split(monkeypatch):
    """`int8_x16_matmul(..., halves)`: the product of the same x split in its own call,
    bit for bit, with no split launch."""
    x = _rows(17, 300).float().to(DEVICE)
    w = torch.randint(-127, 128, (96, 300), dtype=torch.int8).to(DEVICE)
    w_scale = (torch.rand(96) * 0.01 + 1e-4).to(DEVICE)
    want = int8_x16.int8_x16_matmul(x, w, w_scale)
    halves = int8_x16.split_rows(x)
    monkeypatch.setattr(int8_x16, "split_rows", lambda *a: pytest.fail("split"))
    assert torch.equal(int8_x16.int8_x16_matmul(x, w, w_scale, halves), want)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the norms hand out halves on CUDA only")
def test_a_norms_halves_reach_the_int8_tensor_cores_without_a_split(monkeypatch):
    """At 32 rows a norm's output carries its rows' halves into an INT8 layer on the int8
    tensor cores (`RMSNorm.x16_rows`): no split launch, the same output as with one."""
    from infer.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(23)
    layer = int8_layer(gen, 384, 512)
    layer.int8_mma_rows = 64
    norm = RMSNorm(512, 1e-6).to(DEVICE, torch.bfloat16)
    norm.use_triton = True
    x = torch.randn(32, 512, generator=gen).to(DEVICE, torch.bfloat16)
    want = layer(norm(x))
    norm.x16_rows = range(1, 65)
    monkeypatch.setattr(int8_x16, "split_rows", lambda *a: pytest.fail("split"))
    assert torch.equal(layer(norm(x)), want)
