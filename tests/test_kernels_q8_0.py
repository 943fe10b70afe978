"""Q8_0 kernels (ds4station/kernels/q8_0.py) against gguf-py's numpy dequantisation and plain torch: the
repack, the decode matvec (plain and grouped, 1-8 rows, fp16/fp32) and the fp16 tl.dot prefill matmul. On a
machine without a GPU the Triton kernels run in the interpreter (tests/conftest.py sets TRITON_INTERPRET)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from numerics import rel_err

from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import dequantize_act16, quantize_act16
from ds4station.kernels.q8_0 import (
    PackedQ8_0,
    dequantize_q8_0,
    q8_0_matmul,
    q8_0_matmul_ref,
    q8_0_matvec,
    q8_0_matvec_q16,
    q8_0_matvec_q16_ref,
    q8_0_matvec_ref,
    repack_q8_0,
)
from ds4station.kernels.quants import random_blocks, row_bytes
from ds4station.kernels.splitk import counter_lane, split_counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def raw_q8_0(lead: tuple[int, ...], k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(lead))
    return random_blocks(Q.Q8_0, n * k, g, 0.05).view(*lead, row_bytes(Q.Q8_0, k))


@pytest.mark.parametrize("lead", [(7,), (3, 5)])
def test_repack_matches_gguf(lead: tuple[int, ...]) -> None:
    k = 96
    raw = raw_q8_0(lead, k, seed=1)
    w = repack_q8_0(raw, k)
    assert w.qs.shape == (*lead, k) and w.qs.dtype == torch.int8
    assert w.d.shape == (*lead, k // 32) and w.d.dtype == torch.float16
    want = gguf_quants.dequantize(raw.numpy(), Q.Q8_0)
    assert torch.equal(dequantize_q8_0(w), torch.from_numpy(np.ascontiguousarray(want)))
    flat = repack_q8_0(raw.reshape(-1), k)
    assert torch.equal(flat.qs.reshape(w.qs.shape), w.qs)


def test_repack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        repack_q8_0(torch.zeros(34, dtype=torch.uint8), 48)
    with pytest.raises(TypeError):
        repack_q8_0(torch.zeros(34, dtype=torch.int8), 32)
    with pytest.raises(ValueError, match="does not hold rows"):
        repack_q8_0(torch.zeros(35, dtype=torch.uint8), 32)


# (n, k, rows, activation dtype, groups, explicit tiles or None for the dispatcher's)
MATVEC_CASES = [
    (37, 96, 1, torch.float32, 1, None),
    (40, 160, 3, torch.float16, 1, None),
    (37, 160, 2, torch.float32, 1, dispatch.MatvecTiles(block_n=4, block_k=64, num_warps=4)),  # K loop + tails
    (48, 64, 1, torch.float16, 4, None),  # grouped: 4 groups of 12 rows
    (24, 96, 5, torch.float32, 3, dispatch.MatvecTiles(block_n=8, block_k=32, num_warps=2)),
]


@pytest.mark.parametrize(("n", "k", "m", "dtype", "groups", "tiles"), MATVEC_CASES)
def test_matvec_matches_reference(n: int, k: int, m: int, dtype: torch.dtype, groups: int,
                                  tiles: dispatch.MatvecTiles | None) -> None:
    w = repack_q8_0(raw_q8_0((n,), k, seed=n + k + m).to(DEVICE), k)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    q8_0_matvec(x, w, groups=groups, out=out, tiles=tiles)
    want = q8_0_matvec_ref(x, w, groups=groups, out_dtype=torch.float32)
    assert rel_err(out, want) < 1e-5
    # independent oracle: gguf's dequantisation, float64 math
    wf = torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(w_raw_np(w), Q.Q8_0))).double()
    xg = x.double().cpu().reshape(m, groups, k)
    oracle = torch.einsum("mgk,gnk->mgn", xg, wf.reshape(groups, n // groups, k)).reshape(m, n)
    assert rel_err(out, oracle) < 1e-5


def w_raw_np(w) -> np.ndarray:
    """Rebuild GGUF bytes from the packed arrays (the inverse of repack) for the numpy oracle."""
    qs = w.qs.cpu().view(torch.uint8).reshape(w.n, -1, 32)
    d = w.d.cpu().view(torch.uint8).reshape(w.n, -1, 2)
    return torch.cat([d, qs], dim=-1).reshape(w.n, -1).numpy()


def test_matvec_default_dtype_and_errors() -> None:
    w = repack_q8_0(raw_q8_0((9,), 64, seed=3).to(DEVICE), 64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.float16)
    y = q8_0_matvec(x, w)
    assert y.dtype == torch.float16 and y.shape == (2, 9)
    assert rel_err(y.float(), q8_0_matvec_ref(x, w, out_dtype=torch.float32)) < 2e-3
    with pytest.raises(ValueError, match="1-8 activation rows"):
        q8_0_matvec(torch.zeros(9, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        q8_0_matvec(torch.zeros(1, 65, device=DEVICE), w)


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "tiles"),
    [
        (21, 37, 96, torch.float16, None),
        (9, 20, 160, torch.float32, dispatch.MatmulTiles(block_m=16, block_n=16, block_k=64, group_m=2,
                                                        num_warps=4, num_stages=1)),
    ],
)
def test_matmul_matches_reference(m: int, n: int, k: int, dtype: torch.dtype, tiles) -> None:
    w = repack_q8_0(raw_q8_0((n,), k, seed=m * n).to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    q8_0_matmul(x, w, out=out, tiles=tiles)
    # fp16 operands with fp32 sums: only the summation order differs from the reference
    assert rel_err(out, q8_0_matmul_ref(x, w, out_dtype=torch.float32)) < 1e-4
    assert rel_err(out, x.double().cpu() @ dequantize_q8_0(w).double().cpu().T) < 2e-3


def test_matmul_weights_as_register_operand() -> None:
    """The Y^T = W X^T form (dispatch's w_as_a) computes the same product."""
    m, n, k = 19, 24, 128
    w = repack_q8_0(raw_q8_0((n,), k, seed=5).to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    tiles = dispatch.MatmulTiles(block_m=16, block_n=16, block_k=64, group_m=2, num_warps=4, num_stages=1,
                                 w_as_a=True)
    q8_0_matmul(x, w, out=out, tiles=tiles)
    assert rel_err(out, q8_0_matmul_ref(x, w, out_dtype=torch.float32)) < 1e-4


# The small-M (short prefill) tiles at the interpreter's scale: 64 weight rows as the dot's A operand, K slices
# of whole block_k steps; K = 96 * 32 = 3072 is 24 steps of 128, so 4 slices of 6 steps (and 9 steps of 352
# are 3 slices of 3 and a tail of 1 step, partly masked: K = 1120 is not a multiple of block_k).
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize(("m", "n", "k"), [(9, 70, 96 * 32), (22, 64, 1120), (33, 40, 512), (64, 96, 96 * 32)])
def test_matmul_split_k_matches_reference(poisoned_empty: None, split: int, m: int, n: int, k: int) -> None:
    w = repack_q8_0(raw_q8_0((n,), k, seed=m + n + k).to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(DEVICE, torch.float16)
    tiles = dispatch.MatmulTiles(block_m=min(64, max(16, 1 << (m - 1).bit_length())), block_n=64, block_k=128,
                                 group_m=1, num_warps=4, num_stages=2, w_as_a=True, split_k=split)
    want = q8_0_matmul_ref(x, w, out_dtype=torch.float32)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    assert q8_0_matmul(x, w, out=out, tiles=tiles) is out
    # fp16 operands with fp32 sums: the slices only change the summation order
    assert rel_err(out, want) < 1e-5
    y = q8_0_matmul(x, w, tiles=tiles)  # no `out`: the partials' sum cast to x's dtype
    assert y.dtype == torch.float16 and y.shape == (m, n)
    assert rel_err(y.float(), want) < 2e-3
    # the fixed-order reduction is bit-stable from run to run
    assert torch.equal(q8_0_matmul(x, w, out_dtype=torch.float32, tiles=tiles), out)
    # the slice that finished last left its tile's counter at zero, ready for the next launch
    assert int(split_counters(x.device).count_nonzero()) == 0


def test_split_k_launches_count_on_their_lane(poisoned_empty: None) -> None:
    """A split-K launch inside `counter_lane(1)` (the GPU stage's second stream) counts on lane 1's counters
    only: with lane 0's counters left at 3 (a launch of 4 slices counting there would sum its partials after
    the first slice, a wrong result) it gives the reference's result, and leaves both arrays as they were."""
    m, n, k = 8, 70, 96 * 32
    tiles = dispatch.matmul_tiles("q8_0", m, 4096, 4096, "cuda")
    assert tiles.split_k == 4
    w = repack_q8_0(raw_q8_0((n,), k, seed=3).to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float32)
    lane0, lane1 = split_counters(DEVICE, lane=0), split_counters(DEVICE, lane=1)
    assert lane0.data_ptr() != lane1.data_ptr()
    with counter_lane(1):
        assert split_counters(DEVICE) is lane1
    assert split_counters(DEVICE) is lane0
    lane0[:8] = 3
    try:
        with counter_lane(1):
            out = q8_0_matmul(x, w, out_dtype=torch.float32, tiles=tiles)
        assert rel_err(out, q8_0_matmul_ref(x, w, out_dtype=torch.float32)) < 1e-5
        assert lane0[:8].tolist() == [3] * 8 and int(lane0[8:].count_nonzero()) == 0
        assert int(lane1.count_nonzero()) == 0
    finally:
        lane0.zero_()


@pytest.mark.parametrize("m", [3, 8, 16])
def test_matmul_few_row_tiles_match_reference(poisoned_empty: None, m: int) -> None:
    """The decode steps' tiles as dispatch gives them on CUDA for a 4096 x 4096 projection (the activation rows
    as the dot's A operand, 256-wide K steps, 4 slices), on a smaller matrix: K = 3,072 is 12 steps, 3 a
    slice; 70 weight rows leave the second 64-row tile partly masked."""
    tiles = dispatch.matmul_tiles("q8_0", m, 4096, 4096, "cuda")
    assert not tiles.w_as_a and tiles.block_m == 16 and tiles.split_k == 4
    n, k = 70, 96 * 32
    w = repack_q8_0(raw_q8_0((n,), k, seed=m).to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1)).to(DEVICE, torch.float32)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    q8_0_matmul(x, w, out=out, tiles=tiles)
    assert rel_err(out, q8_0_matmul_ref(x, w, out_dtype=torch.float32)) < 1e-5
    assert int(split_counters(x.device).count_nonzero()) == 0


def test_matmul_split_k_more_slices_than_steps() -> None:
    """A split_k above the number of K steps runs one step per slice (no slice without K)."""
    m, n, k = 12, 20, 256
    w = repack_q8_0(raw_q8_0((n,), k, seed=7).to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float32)
    tiles = dispatch.MatmulTiles(block_m=16, block_n=16, block_k=64, group_m=1, num_warps=1, num_stages=1,
                                 split_k=9)
    out = q8_0_matmul(x, w, tiles=tiles)
    assert out.dtype == torch.float32
    assert rel_err(out, q8_0_matmul_ref(x, w, out_dtype=torch.float32)) < 1e-5


@pytest.mark.parametrize("split", [1, 2])
def test_grouped_matmul_in_one_launch(split: int) -> None:
    """The grouped projection (the attention output's first half): G groups of rows, group g reading its own
    K columns of x, in one launch (and split-K); equals G separate products."""
    groups, rows, k, m = 4, 32, 96, 11
    w = repack_q8_0(raw_q8_0((groups * rows,), k, seed=31).to(DEVICE), k)
    x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    tiles = dispatch.MatmulTiles(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=1, num_stages=1,
                                 split_k=split)
    out = q8_0_matmul(x, w, tiles=tiles, groups=groups)
    parts = [q8_0_matmul_ref(x[:, g * k:(g + 1) * k], PackedQ8_0(w.qs[g * rows:(g + 1) * rows],
                                                                 w.d[g * rows:(g + 1) * rows]))
             for g in range(groups)]
    assert rel_err(out, torch.cat(parts, dim=1)) < 1e-5
    with pytest.raises(ValueError, match="divide"):
        q8_0_matmul(x, w, tiles=dataclasses.replace(tiles, block_n=64), groups=groups)
    # the dispatcher's tiles fit the group (block_n halved down to 16), or the groups go one launch each
    for backend in ("cuda", "cpu"):
        for m_, rows_ in ((41, 64), (9, 64), (2048, 64), (2048, 1024)):
            bn = dispatch.matmul_tiles("q8_0", m_, 8 * rows_, 4096, backend, rows_).block_n
            assert rows_ % bn == 0 and bn >= 16
    w3 = repack_q8_0(raw_q8_0((3 * 24,), k, seed=32).to(DEVICE), k)  # 24 rows: no power-of-two tile >= 16 fits
    x3 = x[:, :3 * k]
    want = torch.cat([q8_0_matmul_ref(x3[:, g * k:(g + 1) * k], PackedQ8_0(w3.qs[g * 24:(g + 1) * 24],
                                                                          w3.d[g * 24:(g + 1) * 24]))
                      for g in range(3)], dim=1)
    assert rel_err(q8_0_matmul(x3, w3, groups=3), want) < 1e-5
    with pytest.raises(ValueError, match="group"):
        q8_0_matmul(x[:, :k], w, groups=groups)


@pytest.mark.parametrize(("n", "k", "m", "groups"), [(37, 96, 1, 1), (24, 64, 3, 4)])
def test_int_dot_matvec_from_16bit_activations(n: int, k: int, m: int, groups: int) -> None:
    """Integer-dot Q8_0 (dp4a on CUDA, the same integer sums in the interpreter) on activations quantised to
    two int8 digits per value: matches its reference closely and the exact product to ~1e-4."""
    w = repack_q8_0(raw_q8_0((n,), k, seed=n * m).to(DEVICE), k)
    x = (torch.randn(m, groups * k, generator=torch.Generator().manual_seed(k)) * 5).to(DEVICE)
    act = quantize_act16(x)
    back = dequantize_act16(*act)
    assert ((back - x).abs() <= act[2].repeat_interleave(32, dim=1) * 0.5 + 1e-7).all()
    out = torch.full((m, n), float("nan"), device=DEVICE)
    q8_0_matvec_q16(act, w, groups=groups, out=out,
                    tiles=dispatch.MatvecTiles(block_n=4, block_k=64, num_warps=4) if groups == 1 else None)
    assert rel_err(out, q8_0_matvec_q16_ref(act, w, groups=groups)) < 1e-5
    assert rel_err(out, q8_0_matvec_ref(x, w, groups=groups, out_dtype=torch.float32)) < 2e-4


@pytest.mark.parametrize(("n", "k", "m", "groups"), [(6, 1024, 1, 1), (8, 1024, 2, 2), (5, 2048, 3, 1),
                                                       (3, 512, 4, 1)])
def test_int_dot_matvec_at_the_routed_tiles(n: int, k: int, m: int, groups: int) -> None:
    """The integer-dot matvec at the tiles dispatch.q8_0_int_dot_tiles gives where q8_0_route sends the large
    projections (one warp, one or two rows per program, K steps of 512-2,048; a row count that the program's
    rows do not divide; groups), each shape's tiles for the rows it runs at."""
    w = repack_q8_0(raw_q8_0((n,), k, seed=n + k).to(DEVICE), k)
    act = quantize_act16(torch.randn(m, groups * k, generator=torch.Generator().manual_seed(m)).to(DEVICE))
    for shape in ((32768, 1024), (8192, 4096), (129280, 4096)):
        tiles = dispatch.q8_0_int_dot_tiles(*shape, m)
        if groups > 1 and (n // groups) % tiles.block_n:
            continue
        out = q8_0_matvec_q16(act, w, groups=groups, tiles=tiles)
        assert rel_err(out, q8_0_matvec_q16_ref(act, w, groups=groups)) < 1e-5, tiles


@pytest.mark.parametrize(("n", "k", "m", "groups", "tiles"), [
    (96, 512, 1, 1, dispatch.MatvecTiles(32, 256, 4, 2, tma=True)),  # a last row block past N, 2 K steps
    (80, 768, 2, 1, dispatch.MatvecTiles(32, 256, 4, 3, tma=True, per_sm=1)),  # persistent: 2 programs, 3 blocks
    (128, 1024, 3, 4, dispatch.MatvecTiles(32, 512, 4, 2, tma=True, per_sm=1)),  # groups
    (70, 512, 1, 1, dispatch.q8_0_int_dot_tiles(32768, 1024, 1, tma=True)),  # the routed tiles, N < one block
])
def test_int_dot_matvec_through_tensor_descriptors(poisoned_empty: None, n: int, k: int, m: int, groups: int,
                                                   tiles: dispatch.MatvecTiles) -> None:
    """The integer-dot matvec with `tma` tiles (the weights and scales behind tensor descriptors, one flat
    pipelined loop over (row block, K step), optionally a persistent grid): the same result as its reference
    and as the plain integer-dot kernel, every output row written."""
    assert tiles.tma
    w = repack_q8_0(raw_q8_0((n,), k, seed=n + m).to(DEVICE), k)
    act = quantize_act16(torch.randn(m, groups * k, generator=torch.Generator().manual_seed(k)).to(DEVICE))
    got = q8_0_matvec_q16(act, w, groups=groups, tiles=tiles)
    assert rel_err(got, q8_0_matvec_q16_ref(act, w, groups=groups)) < 1e-5
    plain = q8_0_matvec_q16(act, w, groups=groups, tiles=dispatch.MatvecTiles(block_n=1, block_k=256, num_warps=1))
    assert rel_err(got, plain) < 1e-6


def test_int_dot_matvec_through_tensor_descriptors_refuses_what_they_cannot_read() -> None:
    w = repack_q8_0(raw_q8_0((64,), 768, seed=1).to(DEVICE), 768)
    act = quantize_act16(torch.randn(1, 768, generator=torch.Generator().manual_seed(2)).to(DEVICE))
    for tiles in (dispatch.MatvecTiles(32, 512, 4, 2, tma=True),  # K = 768 is not a multiple of 512
                  dispatch.MatvecTiles(32, 128, 4, 2, tma=True)):  # scale rows of 4 fp16: under TMA's 16 bytes
        with pytest.raises(ValueError, match="tensor descriptors"):
            q8_0_matvec_q16(act, w, tiles=tiles)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.IQ2_XXS])
def test_cpu_linear_dequantises_in_bounded_blocks_of_rows(monkeypatch: pytest.MonkeyPatch, qtype: Q) -> None:
    """On the CPU the activation rows past ops.CPU_MATVEC_ROWS (a prefill's) meet the matrix dequantised a block of
    rows at a time (ops.CPU_DEQUANT_BYTES of fp32), giving the rows of the whole matrix's product."""
    from ds4station.kernels import ops

    n, k, m = 300, 256, ops.CPU_MATVEC_ROWS + 3
    gen = torch.Generator().manual_seed(4)
    w = ops.repack(random_blocks(qtype, n * k, gen, 0.05).view(n, -1), qtype.name, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    whole = ops.linear(x, w, out_dtype=torch.float32)
    monkeypatch.setattr(ops, "CPU_DEQUANT_BYTES", 4 * k * 64)  # 64 rows per block: 5 blocks, the last short
    blocks = ops.linear(x, w, out_dtype=torch.float32)
    assert blocks.shape == (m, n)
    torch.testing.assert_close(blocks, whole, rtol=0, atol=1e-5)
    assert torch.equal(blocks[:, :64], (x @ ops.dequantize(w)[:64].T))
