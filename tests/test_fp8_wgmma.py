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
    x = (torch.randn(m, k + 8, generator=gen) * 3).to(torch.bfloat16)[:, :k].cuda()
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
