"""The kernel dispatcher (ds4station/kernels/dispatch.py) and the public ops (ops.py): tile rules that the
kernels rely on for every backend (quant-block multiples, group divisibility, wave64 halving the warps),
the device -> backend mapping, and the ops' CPU path against gguf-py's dequantisation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ds4station.kernels import dispatch, ops
from ds4station.kernels.quants import random_blocks, row_bytes

DS4_MATVECS = [("q8_0", 1024, 4096), ("q8_0", 32768, 1024), ("q8_0", 512, 4096), ("q8_0", 8192, 4096),
               ("q8_0", 4096, 8192), ("q8_0", 2048, 4096), ("q8_0", 4096, 2048), ("q8_0", 129280, 4096),
               ("iq2_xxs", 2048, 4096), ("q2_k", 4096, 2048)]


@pytest.mark.parametrize(("qtype", "n", "k"), DS4_MATVECS)
def test_matvec_tiles_rules(qtype: str, n: int, k: int) -> None:
    block = {"q8_0": 32, "iq2_xxs": 256, "q2_k": 256}[qtype]
    per_backend = {b: dispatch.matvec_tiles(qtype, n, k, 1, b) for b in ("cuda", "hip64", "hip32")}
    for t in per_backend.values():
        assert t.block_k % block == 0 and t.block_n >= 1 and t.num_warps >= 1
        assert t.block_n & (t.block_n - 1) == 0  # power of two (tl.arange)
    # same tile, half the warps on wave64: the same bytes per lane
    assert per_backend["hip64"].block_n == per_backend["cuda"].block_n
    assert per_backend["hip64"].num_warps * 2 == per_backend["cuda"].num_warps or per_backend["hip64"].num_warps == 1


def test_grouped_tiles_divide_the_group() -> None:
    for rows in (1024, 12, 6, 3):
        for m in (1, 2, 3, 4, 8):
            t = dispatch.matvec_tiles("q8_0", rows * 8, 4096, m, "cuda", rows_per_group=rows)
            assert rows % t.block_n == 0


def test_q8_0_few_row_tiles() -> None:
    """2-4 rows on CUDA take the measured few-row tiles: one warp per program on the matrices of >= 16M weights
    (8 rows of a grouped projection), the one-row tiles elsewhere and at 1 or more than 4 rows."""
    one_row = dispatch.matvec_tiles("q8_0", 4096, 8192, 1, "cuda")
    for m in (2, 3, 4):
        big = dispatch.matvec_tiles("q8_0", 4096, 8192, m, "cuda")
        assert (big.block_n, big.block_k, big.num_warps) == (4, 1024, 1)
        grouped = dispatch.matvec_tiles("q8_0", 8192, 4096, m, "cuda", rows_per_group=1024)
        assert (grouped.block_n, grouped.block_k, grouped.num_warps) == (8, 512, 1)
        gate_up = dispatch.matvec_tiles("q8_0", 2048, 4096, m, "cuda")
        assert (gate_up.block_n, gate_up.block_k, gate_up.num_warps) == (4, 1024, 4)
        assert dispatch.matvec_tiles("q8_0", 4096, 8192, m, "hip32") == dispatch.matvec_tiles("q8_0", 4096, 8192, 1,
                                                                                                "hip32")
    assert one_row.num_warps > 1 and dispatch.matvec_tiles("q8_0", 4096, 8192, 8, "cuda").num_warps > 1


def test_matmul_tiles_per_backend() -> None:
    cuda = dispatch.matmul_tiles("q8_0", 2048, 4096, 4096, "cuda")
    vega = dispatch.matmul_tiles("q8_0", 2048, 4096, 4096, "hip64")
    assert cuda.block_k % 32 == 0 and vega.block_k % 32 == 0
    assert vega.block_m * vega.block_n < cuda.block_m * cuda.block_n  # no matrix cores on gfx906
    assert dispatch.matmul_tiles("q8_0", 5, 4096, 4096, "cuda").block_m == 16


# DS4's Q8_0 prefill matmuls (N, K): q_a + kv stacked, q_b, one group of output a, output b, shared expert
# gate + up stacked and down, the indexer's q_b.
DS4_MATMULS = [(1536, 4096), (32768, 1024), (1024, 4096), (4096, 8192), (4096, 4096), (4096, 2048), (8192, 1024)]


def _programs(t: dispatch.MatmulTiles, m: int, n: int) -> int:
    return -(-m // t.block_m) * -(-n // t.block_n) * t.split_k


@pytest.mark.parametrize(("n", "k"), DS4_MATMULS)
@pytest.mark.parametrize("m", [17, 22, 33, 64])
def test_small_m_matmul_tiles_split_k(m: int, n: int, k: int) -> None:
    t = dispatch.matmul_tiles("q8_0", m, n, k, "cuda")
    assert (t.block_n, t.block_k, t.num_warps, t.w_as_a) == (64, 128, 4, True)  # wgmma: A's M = 64 per warpgroup
    assert t.block_m == min(64, max(16, 1 << (m - 1).bit_length())) and t.block_m >= m
    steps = -(-k // t.block_k)
    per = -(-steps // t.split_k)  # the kernel's block_k steps per slice
    assert per >= 2 and -(-steps // per) == t.split_k  # slices of >= 256 weights, none empty
    tiles = _programs(t, m, n) // t.split_k
    if tiles >= 2 * 132:
        assert t.split_k == 1
    else:  # ~two programs per SM (equal slices round the count down, by < 1/4), or the shortest slices
        assert t.split_k > 1 or steps < 4
        assert _programs(t, m, n) >= 0.75 * 2 * 132 or per == 2


@pytest.mark.parametrize(("n", "k"), DS4_MATMULS + [(129280, 4096)])
@pytest.mark.parametrize("m", [2, 4, 9, 16])
def test_few_row_matmul_tiles(m: int, n: int, k: int) -> None:
    """Decode steps (<= 16 rows) on CUDA: one 16-row activation tile as the dot's A operand, the weights as B in
    64-row tiles (128 on the head), 256-wide K steps in 2 stages where K >= 4,096 (the head 3), else 128-wide
    in 3; K split as the small-M tiles split it (whole steps, ~2 programs per SM)."""
    t = dispatch.matmul_tiles("q8_0", m, n, k, "cuda")
    head = n == 129280
    assert (t.block_m, t.w_as_a, t.num_warps, t.group_m) == (16, False, 4, 1)
    assert t.block_n == (128 if head else 64) and t.block_k == (256 if k >= 4096 else 128)
    assert t.num_stages == (3 if head or k < 4096 else 2)
    steps = -(-k // t.block_k)
    per = -(-steps // t.split_k)
    assert per >= 2 and -(-steps // per) == t.split_k
    assert t.split_k == 1 if n // t.block_n >= 2 * 132 else t.split_k > 1 or steps < 4
    assert dispatch.matmul_tiles("q8_0", m, n, k, "hip64").split_k == 1  # other backends: their own table


def test_small_m_matmul_tiles_fill_the_h200() -> None:
    t = dispatch.matmul_tiles("q8_0", 22, 1536, 4096, "cuda")
    assert t.block_m == 32 and t.split_k > 1 and _programs(t, 22, 1536) >= 264
    assert dispatch.matmul_tiles("q8_0", 22, 32768, 1024, "cuda").split_k == 1  # 512 programs already
    # large M keeps the big tensor-core tiles; the other backends and Q4_K never split K
    assert dispatch.matmul_tiles("q8_0", 2048, 4096, 4096, "cuda") == dispatch.MatmulTiles(
        block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    assert dispatch.matmul_tiles("q8_0", 65, 1536, 4096, "cuda").block_n == 128
    for backend in ("hip64", "hip32", "cpu"):
        assert dispatch.matmul_tiles("q8_0", 22, 1536, 4096, backend).split_k == 1
    assert dispatch.matmul_tiles("q4_k", 22, 4096, 4096, "cuda").split_k == 1


def test_backend_of_cpu_and_errors() -> None:
    assert dispatch.device_backend("cpu") == "cpu"
    assert not dispatch.use_triton(torch.zeros(1))
    assert not dispatch.use_int_dot("hip64") and not dispatch.use_int_dot("cpu")
    with pytest.raises(ValueError, match="no matvec kernel"):
        dispatch.matvec_tiles("q6_k", 16, 256, 1, "cuda")
    with pytest.raises(ValueError, match="no repack"):
        ops.repack(torch.zeros(10, dtype=torch.uint8), "q5_k", 256)


@pytest.mark.parametrize(("qtype", "k"), [(Q.Q8_0, 64), (Q.IQ2_XXS, 256), (Q.Q2_K, 256)])
def test_ops_linear_cpu_matches_gguf(qtype: Q, k: int) -> None:
    n, m = 6, 3
    gen = torch.Generator().manual_seed(k)
    raw = random_blocks(qtype, n * k, gen, 0.1).view(n, row_bytes(qtype, k))
    w = ops.repack(raw, qtype.name, k)
    x = torch.randn(m, k, generator=gen)
    want = x.double() @ torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), qtype))).double().T
    got = ops.linear(x, w)
    assert got.shape == (m, n) and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.dequantize(w), ops.dequantize(ops.repack(raw.reshape(-1), qtype.name, k)))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K, Q.Q4_K])
def test_a_large_tensor_is_repacked_in_blocks_of_rows_exactly(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above REPACK_BLOCK_BYTES a tensor goes through the repack a block of rows at a time (bounding the
    repack's temporaries): every field equals the one-shot repack, for experts [E, N, row bytes] and for a
    flat matrix, with a last block shorter than the others."""
    k, e, n = 512, 3, 20
    gen = torch.Generator().manual_seed(7)
    raw = random_blocks(qtype, e * n * k, gen, 0.1).view(e, n, row_bytes(qtype, k))
    whole = ops.repack(raw, qtype.name, k)
    monkeypatch.setattr(ops, "REPACK_BLOCK_BYTES", 7 * row_bytes(qtype, k))  # 60 rows: blocks of 7, 7, ..., 4
    calls: list[int] = []
    one = ops._REPACK[qtype.name.lower()]
    monkeypatch.setitem(ops._REPACK, qtype.name.lower(), lambda r, kk: calls.append(r.shape[0]) or one(r, kk))
    for src in (raw, raw.reshape(-1)):
        calls.clear()
        blocked = ops.repack(src, qtype.name, k, device="cpu")
        assert calls == [7] * 8 + [4]
        lead = (e, n) if src.dim() == 3 else (e * n,)
        for f in dataclasses.fields(whole):
            want = getattr(whole, f.name)
            got = getattr(blocked, f.name)
            assert got.shape == (*lead, want.shape[-1]) and torch.equal(got.reshape(want.shape), want), f.name
    calls.clear()
    small = ops.repack(raw[:1, :7], qtype.name, k)  # within one block: the repack as it is, in one call
    assert calls == [1] and torch.equal(ops.dequantize(small), ops.dequantize(whole)[:1, :7])


def test_q8_0_projections_leave_the_matvec_where_the_matmul_was_measured_faster() -> None:
    """dispatch.q8_0_matvec_rows: on CUDA the small Q8_0 matrices (q_a, kv) keep the matvec up to 3 rows, the
    shared expert's and the large (q_b, the output projections, the head) up to 2; other backends up to 8 (the
    matvec's limit)."""
    small, large = (1536, 4096), (32768, 1024)
    shapes = (small, (512, 4096), (4096, 2048), (2048, 4096), large, (129280, 4096))
    assert [dispatch.q8_0_matvec_rows(*shape, "cuda") for shape in shapes] == [3, 3, 2, 2, 2, 2]
    assert {dispatch.q8_0_matvec_rows(*shape, b) for shape in (small, large) for b in ("hip64", "hip32", "cpu")} == {8}


def test_q8_0_route_sends_large_few_row_projections_to_the_integer_dot_matvec() -> None:
    """dispatch.q8_0_route on CUDA: q_b and the output projections take the integer-dot matvec up to 2 rows, the
    head up to 3; the matrices of at most 16M weights only when their producer emits the rows quantised (a
    quantiser launch of their own costs more than the integer dot saves), then up to 3 rows; past those the
    fp32 matvec / matmul split as before; other backends never use the integer dot."""
    shapes = {"q_a": (1024, 4096), "shexp_down": (4096, 2048), "q_b": (32768, 1024), "output_b": (4096, 8192),
              "head": (129280, 4096)}
    routes = {name: [dispatch.q8_0_route(*shape, m, "cuda") for m in (1, 2, 3, 4, 8)] for name, shape in shapes.items()}
    assert routes == {
        "q_a": ["matvec"] * 3 + ["matmul"] * 2,
        "shexp_down": ["matvec"] * 2 + ["matmul"] * 3,
        "q_b": ["int_dot"] * 2 + ["matmul"] * 3,
        "output_b": ["int_dot"] * 2 + ["matmul"] * 3,
        "head": ["int_dot"] * 3 + ["matmul"] * 2,
    }
    assert {dispatch.q8_0_route(*shape, m, b) for shape in shapes.values() for m in (1, 4, 8)
            for b in ("hip64", "hip32", "cpu")} == {"matvec"}
    # rows their producer emits quantised (no quantiser launch): the small matrices take the integer dot too
    quantised = {name: [dispatch.q8_0_route(*shape, m, "cuda", quantised=True) for m in (1, 2, 3, 4, 8)]
                 for name, shape in shapes.items()}
    assert quantised == {**routes, "q_a": ["int_dot"] * 3 + ["matmul"] * 2,
                         "shexp_down": ["int_dot"] * 3 + ["matmul"] * 2}
    # the shared expert's gate + up (16M weights, "large") at 3 quantised rows too, q_b (32M) not
    assert [dispatch.q8_0_route(4096, 4096, m, "cuda", quantised=q) for q in (False, True) for m in (2, 3)] == \
        ["int_dot", "matmul", "int_dot", "int_dot"]
    assert {dispatch.q8_0_route(*shape, m, b, quantised=True) for shape in shapes.values() for m in (1, 4, 8)
            for b in ("hip64", "hip32", "cpu")} == {"matvec"}
    one = dispatch.q8_0_int_dot_tiles(8192, 4096, 1)
    assert (one.block_n, one.block_k, one.num_warps) == (1, 2048, 1)
    assert dispatch.q8_0_int_dot_tiles(32768, 1024, 1).block_n == 2
    assert dispatch.q8_0_int_dot_tiles(4096, 8192, 3).block_k == 512
    assert dispatch.q8_0_int_dot_tiles(129280, 4096, 4).block_k == 2048
    # through tensor descriptors (sm_90+): q_b at one row only; not where the GPU has none, not at two rows,
    # not on the other shapes, not where a group's rows do not divide into its blocks
    tma = dispatch.q8_0_int_dot_tiles(32768, 1024, 1, tma=True)
    assert tma.tma and (tma.block_n, tma.block_k, tma.num_warps, tma.num_stages, tma.per_sm) == (64, 512, 4, 3, 1)
    assert not dispatch.q8_0_int_dot_tiles(32768, 1024, 1).tma
    assert not dispatch.q8_0_int_dot_tiles(32768, 1024, 2, tma=True).tma
    assert not any(dispatch.q8_0_int_dot_tiles(n, k, 1, tma=True).tma
                   for n, k in ((1536, 4096), (8192, 4096), (4096, 8192), (4096, 2048), (129280, 4096)))
    assert not dispatch.q8_0_int_dot_tiles(32768, 1024, 1, tma=True, rows_per_group=32768 // 3 + 1).tma


def test_tensor_descriptor_reads_by_default_on_an_nvidia_sm90_gpu_unless_turned_off(monkeypatch) -> None:
    monkeypatch.delenv("DS4STATION_Q8_TMA", raising=False)
    assert dispatch.tma_reads(torch.zeros(1)) is False  # the CPU (the interpreter takes the tiles as given)
    if torch.cuda.is_available():
        x = torch.zeros(1, device="cuda")
        hopper = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
        assert dispatch.tma_reads(x) is hopper  # the default
        monkeypatch.setenv("DS4STATION_Q8_TMA", "1")
        assert dispatch.tma_reads(x) is hopper
        monkeypatch.setenv("DS4STATION_Q8_TMA", "0")
        assert dispatch.tma_reads(x) is False  # turned off
