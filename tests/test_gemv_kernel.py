"""The GEMV Triton kernel, one row or up to its MAX_ROWS (in the interpreter on the CPU; on
the GPU with INFER_TEST_DEVICE=cuda) against float64, and the linear layers that use it and,
for a few rows, kernels/rows_mma.py (tested on its own in test_rows_mma.py)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
EIGHT_BIT = [torch.int8] + ([torch.float8_e4m3fn] if DEVICE == "cuda" else [])


def launches():
    from infer.kernels.gemv import Launch

    # (n, k, launch): rows past N in the last block, K not a multiple of the step, K in one
    # step, one row block, the default launch.
    return [(40, 300, Launch(8, 64, 4)), (37, 256, Launch(8, 64, 2)),
            (70, 1000, Launch(16, 128, 4)), (64, 512, Launch(4, 512, 4)),
            (9, 96, Launch(16, 32, 1)), (38, 2048, None)]


@pytest.fixture
def gemv_form(monkeypatch):
    """Sets the GEMV's form (`gemv.set_form`) for the test, and records the form each
    launch took; "floats" again after it."""
    import infer.kernels.gemv as gemv_kernel

    taken = []
    real = gemv_kernel.form_of
    monkeypatch.setattr(gemv_kernel, "form_of",
                        lambda x, w: taken.append(real(x, w)) or taken[-1])

    def set_form(form: str) -> list[str]:
        gemv_kernel.set_form(form)
        return taken

    yield set_form
    gemv_kernel.set_form("floats")


def _form_taken(wdtype: torch.dtype, form: str) -> str:
    """The form a launch of `wdtype` weights takes when `form` is set (bfloat16 x, even
    K): units are int8's only, others take words."""
    return "words" if form == "units" and wdtype != torch.int8 else form


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(6))
def test_gemv_matches_float64(dtype, case):
    from infer.kernels.gemv import gemv

    n, k, launch = launches()[case]
    gen = torch.Generator().manual_seed(case)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    y = gemv(x.to(DEVICE), w.to(DEVICE), launch).cpu()
    ref = x.double() @ w.double().T
    assert y.dtype == dtype and y.shape == (1, n)
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("wdtype", [torch.bfloat16, *EIGHT_BIT])
@pytest.mark.parametrize("case", [0, 1, 4, 5])
def test_two_rows_are_each_the_one_row_product(case, wdtype):
    """Each row of a two-row launch: bit for bit the row's own one-row launch of the same
    tiles (the same float32 sums in the same order), and float64's product."""
    from infer.kernels.gemv import default_launch, gemv

    n, k, launch = launches()[case]
    rows = 2
    gen = torch.Generator().manual_seed(20 + case)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w, scale, dense = _weight_on_device(n, k, wdtype, gen)
    y = gemv(x, w, launch, scale=scale)
    launch = launch or default_launch(n, k, w.element_size(), rows)
    assert y.shape == (rows, n) and y.dtype == x.dtype
    for r in range(rows):
        assert torch.equal(y[r:r + 1], gemv(x[r:r + 1], w, launch, scale=scale))
    ref = x.double() @ dense.T
    error = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert error < 4 * TOLERANCE[torch.bfloat16], error


@pytest.mark.parametrize("form", ["floats", "units"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, *EIGHT_BIT])
@pytest.mark.parametrize("act", ["", "silu"])
@pytest.mark.parametrize("case", [0, 1, 5])
def test_a_set_skip_flag_leaves_the_first_of_two_rows_out(case, act, wdtype, form,
                                                          gemv_form):
    """Inside `row_skip.first_row_skipped_where(flag)`: flag 1 -> a two-row launch's second
    row is bit for bit its one-row launch of the same tiles, whatever the first row holds
    (NaN here); flag 0 -> both rows as outside; one-row launches never read the flag. In
    the GEMV's first form and its last (words for weights other than int8)."""
    from infer.kernels.gemv import default_launch, gemv, gemv_gate_up
    from infer.kernels.row_skip import first_row_skipped_where

    taken = gemv_form(form)
    n, k, launch = launches()[case]
    gen = torch.Generator().manual_seed(80 + case)
    x = torch.randn(2, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w, scale, _ = _weight_on_device(2 * n, k, wdtype, gen)
    launch = launch or default_launch(2 * n, k, w.element_size(), 2)

    def product(rows: torch.Tensor) -> torch.Tensor:
        if act:
            return gemv_gate_up(rows, w, act, scale, launch)
        return gemv(rows, w, launch, scale=scale)

    both = product(x)
    flag = torch.ones(1, dtype=torch.int32, device=DEVICE)
    poisoned = x.clone()
    poisoned[0] = float("nan")
    with first_row_skipped_where(flag):
        second = product(poisoned)[1:]
        one_row = product(x[1:])
        flag.zero_()
        unskipped = product(x)
    assert torch.equal(second, product(x[1:]))
    assert torch.equal(second, both[1:])
    assert torch.equal(one_row, product(x[1:]))
    assert torch.equal(unskipped, both)
    assert set(taken) == {_form_taken(wdtype, form)}


@pytest.mark.parametrize("wdtype", [torch.bfloat16, *EIGHT_BIT])
@pytest.mark.parametrize("case", [0, 1, 5])
def test_gate_up_rows_apart_launches_the_first_row_only_where_the_flag_is_clear(case, wdtype):
    """`gemv_gate_up_rows_apart`: two one-row launches, each row bit for bit its own
    `gemv_gate_up`; the first row's launch writes nothing where the flag is set (its
    output row keeps what it held)."""
    from infer.kernels.gemv import _launch, gemv_gate_up, gemv_gate_up_rows_apart
    from infer.kernels.row_skip import first_row_skipped_where

    inter, k, _ = launches()[case]
    gen = torch.Generator().manual_seed(90 + case)
    x = torch.randn(2, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w, scale, _ = _weight_on_device(2 * inter, k, wdtype, gen)
    rows = [gemv_gate_up(x[r:r + 1], w, "silu", scale) for r in range(2)]
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with first_row_skipped_where(flag):
        both = gemv_gate_up_rows_apart(x, w, "silu", scale)
        flag.fill_(1)
        second = gemv_gate_up_rows_apart(x, w, "silu", scale)[1:]
    assert torch.equal(both, torch.cat(rows)) and torch.equal(second, rows[1])
    for set_flag in (1, 0):
        flag.fill_(set_flag)
        out = torch.full((1, inter), 7.0, dtype=x.dtype, device=DEVICE)
        _launch(x[:1], w, None, scale, "silu", out=out, skip_whole=flag)
        assert torch.equal(out, torch.full_like(out, 7.0) if set_flag else rows[0])


@pytest.mark.parametrize(("rows", "max_rows", "dtype"), [
    (1, 1, torch.float32), (3, 1, torch.float16), (3, 4, torch.float16), (5, 4, torch.float16),
    (3, 4, torch.float32)])
def test_linear_layers_take_infers_kernels_up_to_max_rows(rows, max_rows, dtype, monkeypatch):
    """One row: the GEMV, in any float dtype; 2 to max_rows rows of 16-bit weights: the
    tensor-core kernel; anything else: torch."""
    import infer.kernels.gemv as gemv_kernel
    import infer.kernels.rows_mma as rows_kernel
    from infer.models.linear import ColumnParallelLinear, set_triton_gemv

    calls = []
    for module, name in ((gemv_kernel, "gemv"), (rows_kernel, "rows_mma")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real, **kw:
                            calls.append(_n) or _r(*a, **kw))
    gen = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(96, 40, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=gen))
    layer = layer.to(DEVICE, dtype)
    set_triton_gemv(layer, True, max_rows)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE, dtype)
    y = layer(x).cpu().double()
    ref = x.cpu().double() @ layer.weight.cpu().double().T
    assert y.shape == (rows, 40)
    assert (y - ref).abs().max().item() < 2 * TOLERANCE[dtype] * ref.abs().max().item()
    wanted = [] if rows > max_rows else ["gemv"] if rows == 1 else (
        ["rows_mma"] if dtype != torch.float32 else [])
    assert calls == wanted


def _eight_bit_weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator):
    """A weight of `dtype` (int8 across its range, or FP8 values) and a scale per channel."""
    if dtype == torch.int8:
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    else:
        w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(dtype)
    return w, torch.rand(n, generator=gen) * 0.02 + 1e-3


def _weight_on_device(n: int, k: int, dtype: torch.dtype, gen: torch.Generator):
    """(weight, scale or None, the float64 weight it stands for), the first two on DEVICE:
    bfloat16, or 8-bit scaled per channel (`_eight_bit_weight`)."""
    if dtype == torch.bfloat16:
        w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
        return w, None, w.double()
    w, scale = _eight_bit_weight(n, k, dtype, gen)
    w, scale = w.to(DEVICE), scale.to(DEVICE)
    return w, scale, w.double() * scale.double()[:, None]


@pytest.mark.parametrize("wdtype", EIGHT_BIT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(6))
def test_gemv_of_8bit_weights_matches_float64(wdtype, dtype, case):
    """`w * scale[:, None]` (the weight as stored, scaled per channel at the end) against
    float64 on the same integers / FP8 values; poisoned output, launches off the blocks."""
    from infer.kernels.gemv import gemv

    n, k, launch = launches()[case]
    gen = torch.Generator().manual_seed(100 + case)
    x = torch.randn(1, k, generator=gen).to(dtype)
    w, scale = _eight_bit_weight(n, k, wdtype, gen)
    y = gemv(x.to(DEVICE), w.to(DEVICE), launch, scale=scale.to(DEVICE)).cpu()
    ref = x.double() @ (w.double() * scale.double()[:, None]).T
    assert y.dtype == dtype and y.shape == (1, n)
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 weights need a GPU")
@pytest.mark.parametrize("bits", [False, True])
@pytest.mark.parametrize("form", ["floats", "words"])
@pytest.mark.parametrize("rows", [1, 2])
def test_every_fp8_value_reaches_the_sums_exactly(rows, form, bits, gemv_form, monkeypatch):
    """Each of e4m3's 254 values (both zeros, the subnormals, +-448; not NaN) along a row
    of weights, x 1/64 (and -1/64 in a second row): each channel's sum is its value
    exactly, whether the GEMV makes FP8 weights floats by the hardware's convert or by
    their bits (`fp8_weight_bits`, `weight_cast.to_float_times`: subnormals as float32
    denormals, the sum taken back by 2^120), in either form."""
    import infer.kernels.gemv as gemv_kernel

    monkeypatch.setattr(gemv_kernel, "_fp8_bits", bits)
    taken = gemv_form(form)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = codes.float()
    keep = ~values.isnan()
    assert ((values[keep] != 0) & (values[keep].abs() < 2 ** -6)).sum() == 14  # subnormals
    k = 64
    w = codes[keep][:, None].expand(-1, k).contiguous()
    x = (torch.tensor([1.0, -1.0][:rows])[:, None].expand(rows, k) / k).to(torch.bfloat16)
    scale = torch.ones(len(w), device=DEVICE)
    y = gemv_kernel.gemv(x.to(DEVICE), w.to(DEVICE), scale=scale).float().cpu()
    expected = torch.stack([values[keep], -values[keep]][:rows])  # bfloat16 holds each
    assert set(taken) == {form}
    assert torch.equal(y, expected), (y - expected).abs().max()


def test_one_int8_row_on_a_4096_wide_layer_takes_its_own_launch(monkeypatch):
    """One INT8 row times a layer 4096 wide (the 8B's o) takes the launch swept for it (8
    channels, K in steps of 1024, a ragged last one here) and matches float64 on the same
    integers scaled; so does the down projection's (4 channels; K past 4096) on a narrow
    layer."""
    import infer.kernels.gemv as gemv_kernel
    from infer.kernels.gemv import Launch, default_launch, gemv

    asked = []
    monkeypatch.setattr(gemv_kernel, "default_launch",
                        lambda *a: asked.append(default_launch(*a)) or asked[-1])
    for n, k, launch in ((4096, 1100, None), (37, 4200, Launch(4, 1024, 4))):
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        w, scale = _eight_bit_weight(n, k, torch.int8, gen)
        y = gemv(x.to(DEVICE), w.to(DEVICE), launch, scale=scale.to(DEVICE)).cpu()
        ref = x.double() @ (w.double() * scale.double()[:, None]).T
        error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
        assert error < TOLERANCE[torch.bfloat16], (n, k, error)
    assert asked == [Launch(8, 1024, 4)] != [default_launch(4096, 1100, 1)], asked


@pytest.mark.parametrize("form", ["words", "units"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, *EIGHT_BIT])
@pytest.mark.parametrize("case", [0, 1, 2, 3, 4, 5, 6])
def test_the_word_forms_match_float64(case, wdtype, form, gemv_form):
    """The GEMV's "words" and "units" forms (`_word_rows`), one and two rows: each row bit
    for bit its own one-row launch, and float64's product on the same weights (bfloat16,
    or the integers / FP8 values scaled); case 6 has an outlier of x (400, on a column of
    zero weights), where the units' float32 sums lose the most."""
    from infer.kernels.gemv import Launch, default_launch, gemv

    if form == "units" and wdtype != torch.int8:
        pytest.skip("units are int8's: the others take words (the other parameter)")
    n, k, launch = [*launches(), (48, 4096, Launch(16, 512, 8))][case]
    gen = torch.Generator().manual_seed(110 + case)
    x = torch.randn(2, k, generator=gen)
    w, scale, dense = _weight_on_device(n, k, wdtype, gen)
    if case == 6:
        x[:, 17] = 400.0
        w[:, 17] = 0
        dense[:, 17] = 0
    x = x.to(torch.bfloat16).to(DEVICE)
    taken = gemv_form(form)
    launch = launch or default_launch(n, k, w.element_size(), 2)
    y = gemv(x, w, launch, scale=scale)
    rows = [gemv(x[r:r + 1], w, launch, scale=scale) for r in range(2)]
    assert taken == [form] * 3
    assert torch.equal(y, torch.cat(rows))
    ref = x.double() @ dense.T
    error = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert error < TOLERANCE[torch.bfloat16], error


@pytest.mark.parametrize("outlier", [0.0, 1000.0])
def test_the_units_float32_sums_round_at_a_ten_thousandth(outlier):
    """The GEMV's float32 sums before they are rounded to x's dtype (stored as float32 by a
    direct launch), int8 weights of an 8B layer's size: "floats" and "words" within 1e-6 of
    the largest |y| of float64's, "units" within 5e-4 (its sums of `x (1 + (q + 128) /
    2^15)` round at 2^15 times the weight's step; ~1.5e-4 here, with an outlier of x or
    not). What EngineConfig.gemv_form's help says."""
    import triton

    from infer.kernels.gemv import Launch, _gemv_kernel

    n, k, launch = 32, 4096, Launch(16, 512, 8)
    gen = torch.Generator().manual_seed(130)
    x = torch.randn(1, k, generator=gen)
    x[0, 17], x[0, 999] = outlier, -outlier
    x = x.to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * 36).round().clamp(-127, 127).to(torch.int8)
    w[:, 17] = 0
    ref = x.double().cpu() @ w.double().T
    errors = {}
    for form in ("floats", "words", "units"):
        y = torch.full((1, n), float("nan"), device=DEVICE)
        _gemv_kernel[(triton.cdiv(n, launch.block_n),)](
            x, w.to(DEVICE), torch.ones(n, device=DEVICE), x, y, n, k, x.stride(0), k, n,
            BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, ROWS=1, EVEN_K=True, GATE_UP="",
            SCALED=True, SKIPS=False, SKIPPED_WHOLE=False, PTX=DEVICE == "cuda", PDL=False,
            FORM=form, num_warps=launch.num_warps)
        errors[form] = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert errors["floats"] < 1e-6 and errors["words"] < 1e-6, errors
    assert 1e-6 < errors["units"] < 5e-4, errors


def test_the_word_forms_are_taken_only_where_rows_are_whole_words(gemv_form):
    """`form_of`: "floats" unless set otherwise, for x not bfloat16, and where x's rows or a
    16-bit weight's are not whole 32-bit words (odd K, odd row stride, a start off a 4-byte
    boundary); units for int8 weights only, words for the others."""
    from infer.kernels.gemv import form_of

    taken = gemv_form("floats")
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    int8, fp8 = torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 64, dtype=torch.uint8)
    bf16 = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert form_of(x, int8) == form_of(x, bf16) == "floats"
    for form in ("words", "units"):
        gemv_form(form)
        assert form_of(x, int8) == form
        assert form_of(x, fp8) == "words"  # any other one-byte weight: no units
        assert form_of(x, bf16) == "words"
        assert form_of(x, torch.zeros(8, 65, dtype=torch.bfloat16)[:, :64]) == "floats"
        assert form_of(x, torch.zeros(8, 65, dtype=torch.bfloat16)[:, 1:]) == "floats"
        assert form_of(x.half(), int8) == "floats"
        assert form_of(torch.zeros(1, 63, dtype=torch.bfloat16), int8[:, :63]) == "floats"
        assert form_of(torch.zeros(2, 65, dtype=torch.bfloat16)[:, :64], int8) == "floats"
        assert form_of(torch.zeros(1, 65, dtype=torch.bfloat16)[:, 1:], int8) == "floats"
        assert form_of(torch.zeros(1, 66, dtype=torch.bfloat16)[:, 2:], int8) == form
    assert len(taken) == 22


@pytest.mark.parametrize("method", ["none", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_gated_mlp_without_the_gate_up_activation_launches_it_apart(method, rows,
                                                                      monkeypatch):
    """Without `set_gate_up_activation` a gated MLP's rows, one too, take the activation's
    own launch between infer's matmuls (16-bit: the GEMV or rows_mma; INT8 / FP8: their
    decode kernels), and every step matches torch on the same (dequantized) weights."""
    if method == "fp8" and DEVICE != "cuda":
        pytest.skip("FP8 weights are read by the Triton kernels on CUDA only")
    from infer.models.layers import set_kernel_backend
    from infer.models.linear import set_triton_gemv

    gen = torch.Generator().manual_seed(rows)
    mlp, dtype = _gated_mlp(method, 96, gen, 0.2)
    x = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    ref = mlp(x).double()  # torch's activation, then the same layers
    set_kernel_backend(mlp, "triton")
    set_triton_gemv(mlp, True, 4)
    calls = _count_activation_launches(monkeypatch)
    got = mlp(x).double()
    assert len(calls) == 1
    assert (got - ref).abs().max().item() < 4 * TOLERANCE[torch.bfloat16] * ref.abs().max().item()


@pytest.mark.parametrize("form", ["floats", "units"])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, *EIGHT_BIT])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("case", [0, 1, 3, 5])
def test_the_gate_up_gemv_stores_what_the_activation_kernel_would(case, rows, act, wdtype,
                                                                  form, gemv_form):
    """`gemv_gate_up`: bit for bit the GEMV's `[gate | up]` then the activation kernel (each
    program multiplies the gate and up rows of its channels; channels past I in the last
    program are not stored), and float64's `act(x W_gate^T) * (x W_up^T)`; in the GEMV's
    first form and its last (`gemv.form_of`: words for weights other than int8)."""
    from infer.kernels.activation import gated_rows
    from infer.kernels.gemv import gemv, gemv_gate_up

    taken = gemv_form(form)
    inter, k, launch = launches()[case]
    gen = torch.Generator().manual_seed(60 + case)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w, scale, dense = _weight_on_device(2 * inter, k, wdtype, gen)
    y = gemv_gate_up(x, w, act, scale, launch)
    assert y.shape == (rows, inter) and y.dtype == x.dtype
    assert torch.equal(y, gated_rows(gemv(x, w, launch, scale=scale), act))
    assert set(taken) <= {_form_taken(wdtype, form)}
    gate, up = (x.double() @ dense.T).chunk(2, dim=-1)
    activation = {"silu": torch.nn.functional.silu,
                  "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}[act]
    ref = activation(gate) * up
    error = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert error < 4 * TOLERANCE[torch.bfloat16], error


@pytest.mark.parametrize(("method", "rows", "launches_activation"), [
    ("none", 1, False), ("none", 2, True), ("int8", 1, False), ("int8", 2, True),
    ("fp8", 1, False)])
def test_a_gated_mlps_gate_up_gemv_stores_the_activation(method, rows, launches_activation,
                                                         monkeypatch):
    """With `set_gate_up_activation`, rows that go to the GEMV take no activation launch
    (16-bit: one row; 8-bit: up to gemv_8bit_max_rows, two only on layers at most 3,072
    wide: not the 8-bit one's 2 x 4,096), and the MLP's output is bit for bit the one with
    the activation's own launch; other steps launch it as before."""
    if method != "none" and DEVICE != "cuda":
        pytest.skip("8-bit layers read their weights through the GEMV on CUDA only")
    from infer.models.layers import set_gate_up_activation, set_kernel_backend
    from infer.models.linear import set_8bit_kernels, set_triton_gemv

    gen = torch.Generator().manual_seed(70 + rows)
    mlp, dtype = _gated_mlp(method, 96 if method == "none" else 4096, gen, 0.1)
    set_kernel_backend(mlp, "triton")
    set_triton_gemv(mlp, True, 4)
    set_8bit_kernels(mlp, 0, False, gemv_rows=2)
    x = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    apart = mlp(x)
    set_gate_up_activation(mlp, True)
    calls = _count_activation_launches(monkeypatch)
    got = mlp(x)
    assert len(calls) == int(launches_activation)
    assert torch.equal(got, apart)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_draft_rounds_two_rows_through_a_wide_gate_up_go_to_one_row_launches(method,
                                                                               monkeypatch):
    """With `gate_up_rows_apart`, two rows of a gated MLP too wide for the two-row GEMV,
    inside `first_row_skipped_where(flag)`: no activation launch; flag clear, the MLP's
    output as without it (the 8-bit matmul kernel, then the activation's launch), to
    rounding; flag set, its second row as with the flag clear, bit for bit."""
    if DEVICE != "cuda":
        pytest.skip("8-bit layers read their weights through the GEMV on CUDA only")
    from infer.kernels.row_skip import first_row_skipped_where
    from infer.models.layers import set_gate_up_activation, set_kernel_backend
    from infer.models.linear import set_8bit_kernels, set_triton_gemv

    gen = torch.Generator().manual_seed(75)
    mlp, dtype = _gated_mlp(method, 4096, gen, 0.1)
    set_kernel_backend(mlp, "triton")
    set_triton_gemv(mlp, True, 4)
    set_gate_up_activation(mlp, True)
    set_8bit_kernels(mlp, 0, False, gemv_rows=2)
    x = torch.randn(2, 64, generator=gen).to(DEVICE, dtype)
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with first_row_skipped_where(flag):
        before = mlp(x)
    set_8bit_kernels(mlp, 0, False, gemv_rows=2, gate_up_rows_apart=True)
    calls = _count_activation_launches(monkeypatch)
    with first_row_skipped_where(flag):
        both = mlp(x)
        flag.fill_(1)
        second = mlp(x)[1:]
    assert not calls
    error = (both.double() - before.double()).abs().max().item()
    assert error < 2e-2 * before.double().abs().max().item(), error
    assert torch.equal(second, both[1:])


def _gated_mlp(method: str, inter: int, gen: torch.Generator, spread: float):
    """(A 64 -> `inter` -> 64 SiLU-gated MLP on DEVICE with random weights times `spread`,
    its dtype): 16-bit ("none": float16, as the interpreter's tensor-core products take no
    bfloat16), or bfloat16 made INT8 / FP8 ("int8", "fp8")."""
    from infer.models.layers import GatedMLP
    from infer.quantization.fp8 import Fp8LinearMethod
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    mlp = GatedMLP(64, inter, "silu")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * spread)
    dtype = torch.float16 if method == "none" else torch.bfloat16
    mlp = mlp.to(DEVICE, dtype)
    if method != "none":
        quantize = {"int8": Int8WeightOnlyLinearMethod, "fp8": Fp8LinearMethod}[method]
        for layer in (mlp.gate_up_proj, mlp.down_proj):
            quantize().quantize(layer)
    return mlp, dtype


def _count_activation_launches(monkeypatch) -> list:
    """A list that gets an item for each launch of the activation kernel from now on."""
    import infer.kernels.activation as activation

    calls = []
    real = activation.gated_rows
    monkeypatch.setattr(activation, "gated_rows", lambda *a: calls.append(1) or real(*a))
    return calls


def test_the_gate_up_activation_knob_keeps_a_models_tokens_and_logprobs(monkeypatch):
    """`gemv_gate_up_activation`: every gated MLP asks its gate_up projection; the one-row
    steps launch no activation; greedy tokens and logprobs are those with it off."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams
    from infer.models.layers import GatedMLP

    calls = _count_activation_launches(monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2)
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
                  kernel_backend="triton", gemv_gate_up_activation=on, cuda_graphs=False,
                  async_scheduling=False)
        mlps = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, GatedMLP)]
        assert mlps and all(m.act_in_gate_up == on for m in mlps)
        calls.clear()
        out = llm.generate(["The tiny model says"], params)[0].outputs[0]
        # The prompt's step launches it in each layer; the two one-row steps only when off.
        assert len(calls) == len(mlps) * (1 if on else 3), (on, len(calls))
        outs[on] = (out.token_ids, [sorted((t, p.logprob) for t, p in lp.items())
                                    for lp in out.logprobs])
        del llm
    assert outs[True] == outs[False]


@pytest.mark.parametrize("rows", [2, 5])
def test_a_gated_mlps_few_rows_take_the_activation_in_the_tensor_core_launch(rows,
                                                                             monkeypatch):
    """With `gate_up_rows` (`mma_gate_up_activation`), 16-bit rows past one that go to
    rows_mma take no activation launch, and the MLP's output is bit for bit the one with
    the activation's own launch."""
    from infer.models.layers import set_gate_up_activation, set_kernel_backend
    from infer.models.linear import set_triton_gemv

    gen = torch.Generator().manual_seed(80 + rows)
    mlp, dtype = _gated_mlp("none", 96, gen, 0.1)
    set_kernel_backend(mlp, "triton")
    set_gate_up_activation(mlp, True)
    set_triton_gemv(mlp, True, 16)
    x = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    apart = mlp(x)
    set_triton_gemv(mlp, True, 16, gate_up_rows=16)
    calls = _count_activation_launches(monkeypatch)
    assert torch.equal(mlp(x), apart)
    assert not calls


def test_the_mma_gate_up_knob_keeps_a_models_tokens_and_logprobs(monkeypatch):
    """`mma_gate_up_activation`: a float16 model's decode steps of three rows launch no
    activation, and greedy tokens and logprobs are those with it off."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams
    from infer.models.layers import GatedMLP

    calls = _count_activation_launches(monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts = ["The tiny model says", "Once upon", "A list: one, two,"]
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_model_dir()), device=DEVICE, dtype="float16", num_blocks=64,
                  max_model_len=128, kernel_backend="triton", mma_gate_up_activation=on,
                  cuda_graphs=False, async_scheduling=False)
        mlps = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, GatedMLP)]
        assert mlps and all(m.gate_up_proj.quant_method.gate_up_rows == (16 if on else 1)
                            for m in mlps)
        calls.clear()
        outs[on] = [(out.token_ids, [sorted((t, p.logprob) for t, p in lp.items())
                                     for lp in out.logprobs])
                    for o in llm.generate(prompts, params, use_tqdm=False)
                    for out in o.outputs]
        # The prompts' step launches it in each layer; the two 3-row steps only when off.
        assert len(calls) == len(mlps) * (1 if on else 3), (on, len(calls))
        del llm
    assert outs[True] == outs[False]


def test_the_fp8_bits_knob_is_each_engines_and_keeps_greedy_tokens(monkeypatch):
    """`fp8_weight_bits`: each engine sets it for the GEMV (one after another does not
    inherit it); on a GPU an FP8 model's greedy tokens are the same either way, logprobs
    within their rounding (the weights' floats are the same values)."""
    from tiny_model import tiny_model_dir

    import infer.kernels.gemv as gemv_kernel
    from infer import LLM, SamplingParams

    monkeypatch.setattr(gemv_kernel, "_fp8_bits", None)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = ["The tiny model says", "Once upon", "A list: one, two,"]
    outs = {}
    for bits in (True, False):
        llm = LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
                  kernel_backend="triton", quantization="fp8", dtype="bfloat16",
                  cuda_graphs=False, async_scheduling=False,
                  fp8_weight_bits=bits)
        assert gemv_kernel._fp8_bits == bits
        if DEVICE == "cuda":
            outs[bits] = [(out.token_ids, [lp[t].logprob for t, lp in
                                           zip(out.token_ids, out.logprobs)])
                          for o in llm.generate(prompts, params, use_tqdm=False)
                          for out in o.outputs]
        del llm
    for (tokens, logprobs), (want, want_logprobs) in zip(outs.get(True, []),
                                                         outs.get(False, [])):
        assert tokens == want
        assert logprobs == pytest.approx(want_logprobs, abs=0.05)


def test_the_form_knob_sets_the_gemvs_form_and_keeps_greedy_tokens(gemv_form):
    """`gemv_form`: each engine sets the GEMV's form (an engine after another does not
    inherit it); on a GPU, where the one-row steps of bfloat16 and INT8 layers go through
    the GEMV (in the form asked: units are INT8's only), each form gives the greedy tokens
    of "floats", logprobs to within their rounding."""
    from tiny_model import tiny_model_dir

    import infer.kernels.gemv as gemv_kernel
    from infer import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = ["The tiny model says", "Once upon", "A list: one, two,"]
    outs = {}
    taken = gemv_form("floats")
    for quantization, form in itertools.product(("none", "int8"), ("units", "words", "floats")):
        llm = LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
                  kernel_backend="triton", quantization=quantization, gemv_form=form,
                  dtype="bfloat16", cuda_graphs=False, async_scheduling=False)
        assert gemv_kernel._form == form
        if DEVICE == "cuda":
            taken.clear()
            outs[quantization, form] = [(out.token_ids, [lp[t].logprob for t, lp in
                                                         zip(out.token_ids, out.logprobs)])
                                        for o in llm.generate(prompts, params, use_tqdm=False)
                                        for out in o.outputs]
            assert set(taken) == {form if quantization == "int8" or form == "floats"
                                  else "words"}, (quantization, form)
        del llm
    for (quantization, form), got in outs.items():
        for (tokens, logprobs), (want, want_logprobs) in zip(got, outs[quantization, "floats"]):
            assert tokens == want, (quantization, form)
            assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 0.05, form


@pytest.fixture
def halves(monkeypatch):
    """The GEMV with `fp8_gemv_halves` on, and the forms its launches took."""
    import infer.kernels.gemv as gemv_kernel

    monkeypatch.setattr(gemv_kernel, "_fp8_halves", True)
    taken = []
    real = gemv_kernel._gemv_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                taken.append(kwargs["FORM"])
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(gemv_kernel, "_gemv_kernel", Spy())
    return taken


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 weights and the form 'halves' are a GPU's")
@pytest.mark.parametrize("case", launches())
@pytest.mark.parametrize(("x_size", "act"), [(1.0, ""), (30.0, ""), (1.0, "silu")])
def test_the_halves_form_matches_float64_within_its_rounding(case, x_size, act, halves):
    """One row of FP8 weights with `fp8_gemv_halves`: float16 products and runs of float16
    sums, each channel within 2^-8 of its sum of |products| of the float64 result (and
    the output's rounding); the float32 form is within ~1e-6 of it."""
    from infer.kernels.gemv import gemv, gemv_gate_up

    n, k, launch = case
    gen = torch.Generator().manual_seed(n * k)
    n = n + n % 2 if act else n
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) / 100 + 1e-3
    x = (torch.randn(1, k, generator=gen) * x_size).to(torch.bfloat16)
    dense = w.double() * scale.double()[:, None]
    sums = x.double() @ dense.T
    bound = (x.double().abs() @ dense.abs().T) * 2 ** -8
    args = (x.to(DEVICE), w.to(DEVICE))
    if act:
        y = gemv_gate_up(*args, act, scale=scale.to(DEVICE), launch=launch).double().cpu()
        gate, up = sums[:, : n // 2], sums[:, n // 2:]
        want = torch.nn.functional.silu(gate) * up
        # the gate's error moves act(gate) by at most its slope (< 1.1) times it
        bound = (bound[:, n // 2:] * (gate.abs() * 1.1 + 1) + bound[:, : n // 2] * 1.1
                 * up.abs())
    else:
        y = gemv(*args, launch=launch, scale=scale.to(DEVICE)).double().cpu()
        want = sums
    assert halves and set(halves) == {"halves"}
    error = (y - want).abs() - want.abs() * 2 ** -8  # less bfloat16's rounding of y
    assert (error <= bound).all(), (error - bound).max()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 weights and the form 'halves' are a GPU's")
def test_a_halves_run_that_overflows_float16_is_redone_in_float32(halves):
    """x of 6,000 against weights of 448: one product is 10,500 in the form's float16
    (times 2^-8), a run of 8 passes 65,504, and the program redoes its sums in float32."""
    from infer.kernels.gemv import Launch, gemv

    n, k = 24, 1024
    w = torch.full((n, k), 448.0)
    w[::2] = -448.0
    w = w.to(torch.float8_e4m3fn)
    x = torch.full((1, k), 6000.0, dtype=torch.bfloat16)
    x[0, 1::3] = 1.5
    scale = torch.full((n,), 1e-4)
    y = gemv(x.to(DEVICE), w.to(DEVICE), launch=Launch(8, 64, 4),
             scale=scale.to(DEVICE)).double().cpu()
    want = x.double() @ (w.double() * scale.double()[:, None]).T
    assert halves == ["halves"]
    assert torch.isfinite(y).all()
    assert ((y - want).abs() <= want.abs() * 2 ** -8).all()


def test_the_halves_knob_is_each_engines(monkeypatch):
    """`fp8_gemv_halves`: each engine's set-up sets it for the GEMV (one built after another
    does not inherit it)."""
    import infer.kernels.gemv as gemv_kernel
    from infer.engine.config import EngineConfig
    from infer.engine.runner_setup import set_layer_kernels

    monkeypatch.setattr(gemv_kernel, "_fp8_halves", None)
    for on in (True, False):
        set_layer_kernels(torch.nn.Linear(2, 2), EngineConfig(model="m", fp8_gemv_halves=on),
                          "triton")
        assert gemv_kernel._fp8_halves is on
