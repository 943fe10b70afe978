"""F16 decode matvec (ds4station/kernels/f16.py) against its torch reference: odd shapes (K / N tails), 1-8
rows, fp32 and fp16 activations, strided inputs and outputs, the tiles a GPU launch would pick, and the
errors for bad shapes. On a machine without a GPU the kernel runs in the Triton interpreter (tests/conftest.py
sets TRITON_INTERPRET)."""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err

from ds4station.kernels import dispatch
from ds4station.kernels.dispatch import F16Tiles, f16_matvec_tiles
from ds4station.kernels.f16 import f16_matmul_triton, f16_matvec, f16_matvec_ref, f16_matvec_triton
from ds4station.kernels.splitk import split_counters

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, torch.float16)
    return x, w


# (M, N, K): every K tail (16, 100, 257 against 16..1024-wide steps), N tails (1, 5, 67, 300), 1-8 rows
SHAPES = [(1, 1, 16), (3, 5, 100), (8, 67, 257), (1, 300, 1024), (3, 67, 1024), (8, 5, 16), (1, 67, 100)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(poisoned_empty: None, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    for seed in (0, 1):
        x, w = _case(m, n, k, dtype, seed=seed * 1000 + m * 100 + n + k)
        got = f16_matvec_triton(x, w)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert rel_err(got, f16_matvec_ref(x, w)) < 1e-5


@pytest.mark.parametrize(("m", "tiles"), [
    (1, F16Tiles(block_n=4, block_k=64, num_warps=4)),  # several K steps with a tail (257 = 4 * 64 + 1)
    (5, F16Tiles(block_n=8, block_k=32, num_warps=2)),
    (2, F16Tiles(block_n=1, block_k=256, num_warps=1)),
])
def test_explicit_tiles(poisoned_empty: None, m: int, tiles: F16Tiles) -> None:
    x, w = _case(m, 37, 257, torch.float32, seed=m)
    assert rel_err(f16_matvec_triton(x, w, tiles=tiles), f16_matvec_ref(x, w)) < 1e-5


@pytest.mark.parametrize(("backend", "m", "n", "k"), [("cuda", 1, 300, 257), ("cuda", 3, 2100, 100),
                                                      ("hip64", 8, 67, 1024), ("hip32", 1, 520, 16)])
def test_gpu_tiles_in_interpreter(poisoned_empty: None, backend: str, m: int, n: int, k: int) -> None:
    """The tiles a GPU launch would pick, run here."""
    x, w = _case(m, n, k, torch.float32, seed=n)
    tiles = f16_matvec_tiles(n, k, m, backend)  # type: ignore[arg-type]
    assert rel_err(f16_matvec_triton(x, w, tiles=tiles), f16_matvec_ref(x, w)) < 1e-5


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 67, 100, torch.float32), (3, 5, 257, torch.float16),
                                                    (8, 300, 16, torch.float32)])
def test_out_is_strided_column_slice(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """out = columns [7, 7 + n) of a wider NaN buffer; x a strided view too: only the slice is written."""
    x_big, w = _case(m, n, k + 9, dtype, seed=k)
    x = x_big[:, 3:3 + k]  # row stride k + 9
    w = w[:, :k]  # row stride k + 9
    buf = torch.full((m, n + 20), float("nan"), device=DEVICE, dtype=torch.float32)
    out = buf[:, 7:7 + n]
    assert out.stride(0) != n
    got = f16_matvec_triton(x, w, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(buf[:, 7:7 + n], f16_matvec_ref(x, w)) < 1e-5
    assert buf[:, :7].isnan().all() and buf[:, 7 + n:].isnan().all()


def test_matvec_tiles_fill_the_gpu() -> None:
    """DS4's decode shapes: >= 256 programs where N allows, ~32 fp16 per lane per step, any warp size."""
    for n, k in [(2624, 4096), (8192, 1024), (256, 4096), (64, 4096), (1024, 4096)]:
        for backend, lanes in [("cuda", 32), ("hip32", 32), ("hip64", 64)]:
            for m in (1, 8):
                t = f16_matvec_tiles(n, k, m, backend)  # type: ignore[arg-type]
                programs = -(-n // t.block_n)
                assert programs >= min(256, n), (n, k, backend, t)
                assert 16 <= t.block_n * t.block_k // (t.num_warps * lanes) <= 32, (n, k, backend, t)
    cpu = f16_matvec_tiles(2624, 4096, 1, "cpu")
    assert cpu.num_warps == 1 and -(-2624 // cpu.block_n) <= 64


@pytest.mark.parametrize("m", [2, 5, 16])
def test_few_row_matmul_matches_reference(poisoned_empty: None, m: int) -> None:
    """The few-row tensor-core form at the tiles CUDA gives the stacked compressor / indexer projection (2624 x
    4096: 64 rows, 128-wide K steps in 3 stages, 7 slices), on a smaller matrix (70 rows: a masked second tile;
    K = 3,072: 24 steps, 4 a slice, so the seventh slice is empty and adds zeros), x and out strided. Within
    1e-5 of the fp32 product: x's fp16 low part is dotted too (fp16(x) alone is ~1e-4 off)."""
    tiles = dispatch.f16_matmul_tiles(2624, 4096, m)
    assert (tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages, tiles.split_k, tiles.w_as_a) == \
        (16, 64, 128, 3, 7, False)
    n, k = 70, 3072
    x_big, w = _case(m, n, k + 8, torch.float32, seed=m)
    x = x_big[:, 8:]
    w = w[:, :k].contiguous()
    buf = torch.full((m, n + 3), float("nan"), device=DEVICE, dtype=torch.float32)
    got = f16_matmul_triton(x, w, out=buf[:, 3:], tiles=tiles)
    want = f16_matvec_ref(x, w)
    assert rel_err(got, want) < 1e-5 and buf[:, :3].isnan().all()
    assert rel_err(x.half().float() @ w.float().T, want) > 3e-5  # what dotting fp16(x) alone would give
    assert int(split_counters(x.device).count_nonzero()) == 0  # every tile's counter left at zero
    assert torch.equal(f16_matmul_triton(x, w, tiles=tiles), got)  # the fixed-order sum: bit-stable


def test_f16_route_and_tiles() -> None:
    """CUDA: the matvec keeps 2 rows of the >= 8M-weight matrices, 3 of the >= 2M, 4 of the rest; the matmul
    up to 16 rows; other backends always the matvec. Matmul tiles: 64 weight rows from n = 2,048 (else 32)."""
    def routes(n: int, k: int) -> list[str]:
        return [dispatch.f16_route(n, k, m, "cuda") for m in (1, 2, 3, 4, 5, 8, 16, 17)]

    assert routes(2624, 4096) == routes(8192, 1024) == ["matvec"] * 2 + ["matmul"] * 5 + ["matvec"]
    assert routes(1024, 4096) == ["matvec"] * 3 + ["matmul"] * 4 + ["matvec"]
    assert routes(256, 4096) == routes(64, 4096) == ["matvec"] * 4 + ["matmul"] * 3 + ["matvec"]
    assert {dispatch.f16_route(2624, 4096, m, b) for m in (1, 4) for b in ("hip64", "hip32", "cpu")} == {"matvec"}
    assert [dispatch.f16_matmul_tiles(n, 4096, 4).block_n for n in (64, 256, 1024, 2048, 2624)] == [32] * 3 + [64] * 2
    assert dispatch.f16_matmul_tiles(64, 4096, 8).split_k == 16  # 2 programs: K in 16 slices of 2 steps


def test_public_op_dispatches() -> None:
    x, w = _case(2, 67, 100, torch.float32, seed=3)
    want = f16_matvec_ref(x, w)
    out = torch.full((2, 67), float("nan"), device=DEVICE)
    assert rel_err(f16_matvec(x, w, out=out), want) < 1e-5 and rel_err(out, want) < 1e-5
    if DEVICE == "cpu":
        assert torch.equal(f16_matvec(x, w), want)  # plain CPU tensors: the torch reference
        with dispatch.interpreted_kernels():  # the Triton path on CPU tensors
            assert rel_err(f16_matvec(x, w), want) < 1e-5


def test_bad_shapes_raise() -> None:
    x, w = _case(2, 5, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="K differs"):
        f16_matvec_triton(x, w[:, :8])
    with pytest.raises(ValueError, match="1-8 activation rows"):
        f16_matvec_triton(torch.zeros(9, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="1-8 activation rows"):
        f16_matvec_triton(torch.zeros(0, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="w must be fp16"):
        f16_matvec_triton(x, w.float())
    with pytest.raises(ValueError, match="x must be fp32 or fp16"):
        f16_matvec_triton(x.double(), w)
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        f16_matvec_triton(x[0], w)
    with pytest.raises(ValueError, match=r"w must be \[N, K\]"):
        f16_matvec_triton(x, w[0])
    with pytest.raises(ValueError, match="out must be fp32"):
        f16_matvec_triton(x, w, out=torch.zeros(2, 5, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be fp32"):
        f16_matvec_triton(x, w, out=torch.zeros(2, 6, device=DEVICE))
    with pytest.raises(ValueError, match="unit last stride"):
        f16_matvec_triton(x, w, out=torch.zeros(5, 2, device=DEVICE).T)
    with pytest.raises(ValueError, match="unit last stride"):
        f16_matvec_triton(x, torch.zeros(16, 5, device=DEVICE, dtype=torch.float16).T)
    with pytest.raises(ValueError, match="K differs"):
        f16_matvec(x, w[:, :8])  # the reference path checks too
