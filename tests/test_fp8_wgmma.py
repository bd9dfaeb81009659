"""fp8_wgmma.py: FP8 weights times bfloat16 x at 1..64 rows on Hopper's async wgmma (Gluon),
each weight made a bfloat16 in registers by its bits.

On the CPU: the kernel's bit recipe redone in torch for every e4m3 byte against torch's own
FP8 -> float conversion, and its order of K (the words' bytes joined, reshaped and permuted
as the kernel does, against x's gather index) shown to pair each weight with its own x.
The kernel itself runs only on a Hopper GPU (`INFER_TEST_DEVICE=cuda` there); its compile
for sm_90 is in test_kernels_compile_for_sm90.py (the conversion into the wgmma operand
asserted free)."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gluon_hopper, triton_available


def _bf16_bits_times_2_120(byte: torch.Tensor) -> torch.Tensor:
    """`_fp8_to_bf16`'s recipe for one byte (int64 0..255): sign-extended to 16 bits by the
    byte permute, shifted left 4, masked with 0x87F0, read as a bfloat16, times 2^120."""
    sext = torch.where(byte >= 128, byte | 0xFF00, byte)
    lane = (sext << 4) & 0x87F0
    as_bf16 = lane.to(torch.int16).view(torch.bfloat16)  # bits 0..15, sign bit included
    return as_bf16.double() * 2.0 ** 120


def test_every_e4m3_byte_becomes_its_value():
    byte = torch.arange(256, dtype=torch.int64)
    finite = (byte & 0x7F) != 0x7F  # e4m3fn's NaNs
    want = byte.to(torch.uint8).view(torch.float8_e4m3fn).double()
    got = _bf16_bits_times_2_120(byte)
    assert torch.equal(got[finite], want[finite])
    assert got[0x80].item() == 0.0 and torch.signbit(got[0x80])  # -0 stays -0
    assert (got[finite & (byte & 0x78 == 0) & (byte & 7 != 0)].abs() < 2 ** -6).all()


def _kernel_order(words: torch.Tensor) -> torch.Tensor:
    """A 128-wide step of `words [N, 32]` (int64 word indices standing for each word's four
    bytes) put in the wgmma operand's order as the kernel does: byte j of word w is the
    weight at k = 4 w + j; join(join(b0, b1), join(b2, b3)) (new dimension last), reshape
    to [N, 4, 8, 2, 2], permute (0, 2, 4, 1, 3), reshape to [N, 128]."""
    b = [4 * words + j for j in range(4)]
    wb = torch.stack([torch.stack([b[0], b[1]], -1), torch.stack([b[2], b[3]], -1)], -1)
    return wb.reshape(words.shape[0], 4, 8, 2, 2).permute(0, 2, 4, 1, 3).reshape(-1, 128)


def test_each_weight_meets_its_own_x():
    words = torch.arange(32).repeat(3, 1)
    k_of_weight = _kernel_order(words)  # [3, 128]: the k each operand column holds
    kp = torch.arange(128)
    kx = 32 * (kp // 2 % 4) + 4 * (kp // 16) + 2 * (kp // 8 % 2) + kp % 2  # the x gather
    assert torch.equal(k_of_weight, kx.expand(3, -1))
    assert sorted(kx.tolist()) == list(range(128))
    # each thread's 32 loaded bytes (t = its lane % 4) land in its own operand columns:
    # k' with (k' // 2) % 4 == t
    t_of_column = kp // 2 % 4
    assert torch.equal(kx // 32, t_of_column)


def _hopper() -> bool:
    return (torch.cuda.is_available() and triton_available()
            and gluon_hopper(torch.device("cuda"), "fp8_wgmma"))


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Triton's Gluon")


@hopper
@pytest.mark.parametrize(("m", "n", "k", "splits"),
                         [(1, 200, 4096, 1), (1, 4096, 4096, 3), (5, 64, 272, 1),
                          (32, 130, 1024, 2), (64, 96, 640, 1), (17, 6144, 4096, 4)])
def test_the_kernel_matches_float64(m, n, k, splits):
    from infer.kernels.fp8_wgmma import fp8_wgmma

    gen = torch.Generator().manual_seed(m + n + k)
    # rows only 8-byte aligned (a view of wider rows)
    x = (torch.randn(m, k + 4, generator=gen) * 3).to(torch.bfloat16).cuda()[:, :k]
    w = (torch.randn(n, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    want = (x.double().cpu() @ (w.double() * scale.double()[:, None]).T)
    bound = x.double().abs().cpu() @ (w.double().abs() * scale.double()[:, None]).T
    got = fp8_wgmma(x, w.cuda(), scale.cuda(), splits=splits).double().cpu()
    # products exact, float32 sums, then one bfloat16 rounding
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * bound).all()


@hopper
def test_every_byte_exactly_through_one_hot_rows():
    from infer.kernels.fp8_wgmma import fp8_wgmma

    n, k = 64, 256
    w = torch.arange(n * k).remainder(256).to(torch.uint8)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w).view(torch.float8_e4m3fn)
    w = w.reshape(n, k)
    x = torch.zeros(64, k, dtype=torch.bfloat16)
    cols = torch.arange(0, k, 4)  # 64 rows, each one column
    x[torch.arange(64), cols] = 1.0
    got = fp8_wgmma(x.cuda(), w.cuda(), torch.ones(n, device="cuda")).float().cpu()
    want = w.float()[:, cols].T.to(torch.bfloat16).float()  # e4m3 values are exact in bf16
    assert torch.equal(got, want)


def _gated64(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """`act(gate) * up` in float64: silu, or gelu's tanh approximation."""
    if act == "silu":
        return gate * torch.sigmoid(gate) * up
    z = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)
    return 0.5 * gate * (1 + torch.tanh(z)) * up


@hopper
@pytest.mark.parametrize(("m", "inter", "k", "splits", "act"),
                         [(1, 200, 4096, 1, "silu"), (1, 4096, 2048, 3, "silu"),
                          (7, 96, 640, 1, "gelu_tanh"), (40, 1000, 1024, 2, "gelu_tanh"),
                          (64, 32, 272, 1, "silu")])
def test_the_gated_launch_matches_float64(m, inter, k, splits, act):
    """`[gate | up]` in one launch, its result `act(gate) * up`: the sums as the plain
    launch's (float32), the activation in float32, one bfloat16 rounding."""
    from infer.kernels.fp8_wgmma import fp8_wgmma

    gen = torch.Generator().manual_seed(m + inter + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16).cuda()
    w = (torch.randn(2 * inter, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(2 * inter, generator=gen) * 1e-3 + 1e-4
    w64 = w.double() * scale.double()[:, None]
    sums = x.double().cpu() @ w64.T
    bound = x.double().abs().cpu() @ w64.abs().T
    gate, up = sums[:, :inter], sums[:, inter:]
    want = _gated64(gate, up, act)
    got = fp8_wgmma(x, w.cuda(), scale.cuda(), act=act, splits=splits).double().cpu()
    assert got.shape == (m, inter)
    # each sum off by at most 1e-5 of its bound; act' is at most 1.13 for both
    slack = 1e-5 * (1.2 * up.abs() * bound[:, :inter] + gate.abs() * bound[:, inter:])
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + slack + 1e-30).all()


@hopper
@pytest.mark.parametrize("rows", [1, 3])
def test_an_fp8_gate_up_layer_takes_the_gated_launch(rows):
    """With `fp8_wgmma_rows` set the FP8 method's gate_up stores `act(gate) * up` from
    fp8_wgmma's own launch: the same numbers as the plain launch's sums through the
    activation, up to the plain launch's bfloat16 rounding of the sums."""
    from infer.kernels.activation import gated_rows
    from infer.kernels.fp8_wgmma import fp8_wgmma
    from infer.models.linear import MergedColumnParallelLinear
    from infer.quantization.fp8 import Fp8LinearMethod

    torch.manual_seed(rows)
    layer = MergedColumnParallelLinear(512, [384, 384])
    with torch.no_grad():
        layer.weight.copy_(torch.randn(768, 512))
    layer = layer.to("cuda", torch.bfloat16)
    Fp8LinearMethod().quantize(layer)
    layer.fp8_wgmma_rows = 64
    x = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    got = layer.forward_gate_up(x, "silu")
    assert got is not None and got.shape == (rows, 384)
    fused = fp8_wgmma(x, layer.weight, layer.weight_scale, act="silu")
    assert torch.equal(got, fused)
    apart = gated_rows(fp8_wgmma(x, layer.weight, layer.weight_scale), "silu")
    torch.testing.assert_close(got.float(), apart.float(), rtol=2 ** -6, atol=1e-2)
