"""ds4station.kernels.quants against gguf-py's numpy reference: dequantisation bit for bit on random and
extreme blocks, quantiser parity where gguf-py has one, round-trip error of the RTN quantisers, random
valid blocks, and the errors for malformed input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ds4station.kernels import quants

BLOCK_TYPES = [Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.MXFP4]
ALL_TYPES = [Q.F32, Q.F16, Q.BF16, *BLOCK_TYPES]

# Byte offsets of the fp16 scale fields (d, dmin) in one block, read off ggml-common.h; written out here
# rather than taken from the module so the test does not share its assumptions.
FP16_FIELDS = {
    Q.Q8_0: (0,), Q.Q2_K: (80, 82), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ2_XXS: (0,),
}
# fp16 bit patterns at the edges: 0, -0, smallest subnormal, largest subnormal, smallest normal, 1, max, -max
EXTREME_F16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF]
# e8m0 exponents at the edges (0 and 1 decode to subnormals, 255 to 2^127)
EXTREME_E8M0 = [0, 1, 2, 127, 128, 254, 255]


def reference(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    with np.errstate(all="ignore"):
        out = gguf_quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(-1))


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same float32 bit patterns wherever `want` is a number; NaN exactly where `want` is NaN."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    mismatch = (got.view(torch.int32) != want.view(torch.int32)) & ~nan
    assert not mismatch.any(), f"{int(mismatch.sum())} values differ, first at {int(mismatch.nonzero()[0])}"


def random_raw(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """Uniformly random bytes (every byte string is a valid block), with edge values planted in the scales."""
    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == Q.MXFP4:
        raw[: len(EXTREME_E8M0), 0] = EXTREME_E8M0[: n_blocks]
    for at in FP16_FIELDS.get(qtype, ()):
        edge = np.array(EXTREME_F16[:n_blocks], dtype=np.uint16).view(np.uint8).reshape(-1, 2)
        raw[: len(edge), at:at + 2] = edge
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed,n_blocks", [(0, 1), (1, 7), (2, 33), (3, 129)])
def test_dequantize_matches_gguf_bit_for_bit(qtype: Q, seed: int, n_blocks: int) -> None:
    block, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = n_blocks if block > 1 else n_blocks * 37
    raw = random_raw(qtype, n_blocks, seed)
    got = quants.dequantize(raw, qtype, (n_blocks * block,))
    assert_bits_equal(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_realistic_blocks_are_exact_and_finite(qtype: Q) -> None:
    """Blocks as a model holds them (finite scales): exact equality, no NaN anywhere, 2-D shape kept."""
    gen = torch.Generator().manual_seed(5)
    block = quants.block_size(qtype)
    raw = quants.random_blocks(qtype, 3 * 5 * block, gen, 0.05)
    got = quants.dequantize(raw, qtype, (3, 5 * block))
    assert got.shape == (3, 5 * block)
    want = reference(raw.numpy(), qtype).reshape(3, 5 * block)
    assert torch.equal(got, want)
    assert got.isfinite().all()


def test_dequantize_takes_numpy_memmap_and_torch(tmp_path) -> None:
    raw = random_raw(Q.Q8_0, 9, seed=4)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    from_map = quants.dequantize(mapped, Q.Q8_0, (9, 32))
    assert torch.equal(from_map, quants.dequantize(torch.from_numpy(raw), Q.Q8_0, (9, 32)))
    # the result owns its memory: writing to it must not try to write the read-only map
    from_map.zero_()
    assert torch.equal(quants.dequantize(mapped, Q.Q8_0, (288,)), reference(raw, Q.Q8_0))


def test_dequantize_f32_i32_and_misaligned_input() -> None:
    values = np.arange(-6, 6, dtype=np.int32)
    got = quants.dequantize(values.view(np.uint8), Q.I32, (3, 4))
    assert got.dtype == torch.int32 and torch.equal(got, torch.from_numpy(values).reshape(3, 4))
    floats = np.linspace(-1, 1, 8, dtype=np.float32)
    shifted = torch.from_numpy(np.concatenate([[0], floats.view(np.uint8)]).astype(np.uint8))[1:]
    assert torch.equal(quants.dequantize(shifted, Q.F32, (8,)), torch.from_numpy(floats))


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_gguf(qtype: Q, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows = 17
    # rows spanning 14 decades, plus an all-zero block, a block with one huge value and exact rounding ties
    x = torch.randn(rows, 96, generator=gen) * torch.logspace(-6, 7, rows).unsqueeze(1)
    x[0, :32] = 0
    x[1, 40] = 3e5
    x[2, :32] = torch.arange(32) - 15.5
    if qtype in (Q.F16, Q.BF16):
        x[3, :4] = torch.tensor([float("inf"), float("-inf"), 1e38, 1.00390625])  # 1 + 2^-8: a bf16 tie
    with np.errstate(over="ignore"):  # the huge rows overflow fp16 on purpose
        want = gguf_quants.quantize(x.numpy(), qtype)
    want = torch.from_numpy(np.ascontiguousarray(want).view(np.uint8).reshape(rows, -1))
    got = quants.quantize(x, qtype)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got, want)


def test_quantize_bf16_nan_is_quiet_like_gguf() -> None:
    bits = torch.tensor([0x7F800001, 0xFFC00000 - 2**32, 0x7FFFFFFF, 0x3F808000], dtype=torch.int32)
    x = bits.view(torch.float32)
    want = torch.from_numpy(gguf_quants.quantize(x.numpy(), Q.BF16).view(np.uint8).copy())
    assert torch.equal(quants.quantize(x, Q.BF16), want)


# relative RMS error bound for Gaussian data, a little above what the quantisers reach
ROUND_TRIP_BOUND = {
    Q.Q8_0: 0.01, Q.MXFP4: 0.14, Q.Q6_K: 0.025, Q.Q4_K: 0.10, Q.Q2_K: 0.38, Q.IQ2_XXS: 0.38,
    Q.F16: 1e-3, Q.BF16: 5e-3, Q.F32: 0.0,
}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUND), ids=lambda t: t.name)
def test_round_trip_error(qtype: Q) -> None:
    gen = torch.Generator().manual_seed(11)
    # rows of different magnitudes so the block scales must follow the data
    x = torch.randn(12, 512, generator=gen) * torch.logspace(-3, 2, 12).unsqueeze(1)
    raw = quants.quantize(x, qtype)
    assert raw.shape == (12, 512 // quants.block_size(qtype) * quants.type_size(qtype))
    y = quants.dequantize(raw, qtype, x.shape)
    rel = ((y - x).square().mean(dim=1) / x.square().mean(dim=1)).sqrt()
    assert rel.max() <= ROUND_TRIP_BOUND[qtype], rel
    # the bytes are valid for the reference decoder too, and it reads the same values
    assert torch.equal(reference(raw.numpy().reshape(-1), qtype).reshape(x.shape), y)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q4_K, Q.Q6_K, Q.IQ2_XXS], ids=lambda t: t.name)
def test_rtn_quantisers_keep_zeros_and_constants(qtype: Q) -> None:
    x = torch.zeros(3, 256)
    x[1] = 0.75
    x[2, 7] = -2.0
    y = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    assert torch.equal(y[0], x[0])
    assert y.isfinite().all()
    # IQ2_XXS has no zero (grid magnitudes are 8, 25, 43), so a lone spike costs its neighbours more
    assert (y[1] - 0.75).abs().max() <= 0.75 * 0.05
    assert (y[2] - x[2]).norm() <= (0.8 if qtype == Q.IQ2_XXS else 0.05) * x[2].norm()
    assert y[2, 7] < 0


def test_iq2_xxs_signs_follow_the_data() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=gen)
    y = quants.dequantize(quants.quantize(x, Q.IQ2_XXS), Q.IQ2_XXS, x.shape)
    wrong = ((y < 0) != (x < 0)).reshape(-1, 8)
    # at most one flip per group of 8 (the parity fix-up), and always on the group's smallest |x|
    assert wrong.sum(dim=1).max() <= 1
    flipped = wrong.any(dim=1)
    smallest = x.reshape(-1, 8).abs().argmin(dim=1)
    assert torch.equal(wrong[flipped].int().argmax(dim=1), smallest[flipped])


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [0.02, 3.0])
def test_random_blocks_magnitude_and_validity(qtype: Q, scale: float) -> None:
    n = 64 * 256
    raw = quants.random_blocks(qtype, n, torch.Generator().manual_seed(1), scale)
    assert raw.dtype == torch.uint8 and raw.shape == (n // quants.block_size(qtype) * quants.type_size(qtype),)
    values = quants.dequantize(raw, qtype, (n,))
    assert values.isfinite().all()
    rms = values.square().mean().sqrt().item()
    assert scale / 1.5 < rms < scale * 1.5
    assert abs(values.mean().item()) < 0.2 * scale  # centred, like weights
    blocks = raw.reshape(-1, quants.type_size(qtype)).numpy()
    for at in FP16_FIELDS.get(qtype, ()):
        assert np.isfinite(blocks[:, at:at + 2].copy().view(np.float16)).all()
    if qtype in BLOCK_TYPES:
        assert torch.equal(values, reference(raw.numpy(), qtype))


def test_random_blocks_deterministic_and_fast_path_sizes() -> None:
    a = quants.random_blocks(Q.IQ2_XXS, 4096, torch.Generator().manual_seed(7), 0.1)
    b = quants.random_blocks(Q.IQ2_XXS, 4096, torch.Generator().manual_seed(7), 0.1)
    c = quants.random_blocks(Q.IQ2_XXS, 4096, torch.Generator().manual_seed(8), 0.1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # more blocks than the calibration sample: all of them get scaled, not only the sampled ones
    big = quants.random_blocks(Q.Q8_0, 32 * 5000, torch.Generator().manual_seed(0), 0.5)
    rms = quants.dequantize(big, Q.Q8_0, (5000, 32)).square().mean(dim=1).sqrt()
    assert rms[-1000:].mean() == pytest.approx(0.5, rel=0.2)


def test_sizes_and_qtensor() -> None:
    assert (quants.block_size(Q.Q2_K), quants.type_size(Q.Q2_K)) == (256, 84)
    assert (quants.block_size(Q.IQ2_XXS), quants.type_size(Q.IQ2_XXS)) == (256, 66)
    assert (quants.block_size(Q.MXFP4), quants.type_size(Q.MXFP4)) == (32, 17)
    assert (quants.block_size(Q.F16), quants.type_size(Q.F16)) == (1, 2)
    raw = random_raw(Q.Q6_K, 6, seed=9)
    t = quants.QTensor(raw, Q.Q6_K, (2, 768))
    assert isinstance(t.data, torch.Tensor) and t.nbytes == 6 * 210 and t.n_elements == 1536
    assert_bits_equal(t.dequantize().reshape(-1), reference(raw, Q.Q6_K))


def test_malformed_input_raises_clear_errors() -> None:
    raw = torch.zeros(84 * 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q2_K tensor of shape \[2, 256\] takes 168 bytes, but 252"):
        quants.dequantize(raw, Q.Q2_K, (2, 256))
    with pytest.raises(ValueError, match="blocks of 256; a row of 100 values"):
        quants.dequantize(raw, Q.Q2_K, (3, 100))
    with pytest.raises(ValueError, match="must be uint8"):
        quants.dequantize(torch.zeros(8), Q.F32, (2,))
    with pytest.raises(ValueError, match="blocks of 32; a row of 48 values"):
        quants.quantize(torch.zeros(2, 48), Q.Q8_0)
    with pytest.raises(ValueError, match="blocks of 256"):
        quants.random_blocks(Q.IQ2_XXS, 300, torch.Generator(), 1.0)
    with pytest.raises(ValueError, match="positive finite"):
        quants.random_blocks(Q.Q8_0, 32, torch.Generator(), 0.0)
    with pytest.raises(ValueError, match="fp16 range"):
        quants.random_blocks(Q.Q8_0, 32, torch.Generator(), 1e9)
    with pytest.raises(ValueError, match="takes 420 bytes"):
        quants.QTensor(torch.zeros(10, dtype=torch.uint8), Q.Q6_K, (512,))
    with pytest.raises(NotImplementedError, match="Q3_K"):
        quants.dequantize(raw, Q.Q3_K, (256,))
    with pytest.raises(NotImplementedError, match="Q5_K"):
        quants.quantize(torch.zeros(256), Q.Q5_K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: Q) -> None:
    block = quants.block_size(qtype)
    raw = torch.from_numpy(random_raw(qtype, 65, seed=6))
    n = raw.numel() // quants.type_size(qtype) * block
    got = quants.dequantize(raw.cuda(), qtype, (n,)).cpu()
    assert_bits_equal(got, quants.dequantize(raw, qtype, (n,)))
    x = torch.randn(8, 512) * torch.logspace(-4, 4, 8).unsqueeze(1)
    if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.MXFP4):  # the gguf-py-exact quantisers stay exact on CUDA
        assert torch.equal(quants.quantize(x.cuda(), qtype).cpu(), quants.quantize(x, qtype))
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = quants.dequantize(quants.random_blocks(qtype, 256 * 64, gen, 0.1), qtype, (256 * 64,))
    assert values.is_cuda and values.isfinite().all()
