"""Lightning-indexer score + top-k kernel (ds4station/kernels/indexer.py) against its torch reference and the
model's selection rule (engine/model.py Indexer / engine/gpu.py GpuStage._index): odd shapes, no blocks yet,
k above n_blocks, queries that see none / some / all blocks, exact ties (lowest visible block wins), several
column blocks of the running selection, fp16 keys, strided inputs, every tile path (heads as dot rows,
per-head FMA, query blocks, fp32 ieee dots), poisoned scratch, no host synchronisation in decode.

The data are small integers (q, keys) and multiples of 1/4 (w), so every score is exact in fp32 whatever the
summation order and in fp16 dot operands: the kernel and the reference must agree exactly, ties included."""

from __future__ import annotations

import pytest
import torch

from ds4station.kernels import dispatch
from ds4station.kernels import indexer as indexer_k
from ds4station.kernels.dispatch import IndexerTiles, indexer_tiles
from ds4station.kernels.indexer import SCRATCH_BYTES, _column_step, index_topk, index_topk_ref, index_topk_triton
from ds4station.model import footprint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = 4


def _case(T: int, IH: int, D: int, n: int, seed: int, kdtype: torch.dtype = torch.float32,
          extra_rows: int = 3) -> dict:
    """Integer q / keys, w in quarters, positions from 'sees nothing' (pos < RATIO - 1) to 'sees all n'.
    The cache rows past n_blocks are NaN: the kernel must never read them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (T, IH, D), generator=gen).float()
    w = torch.randint(-4, 9, (T, IH), generator=gen).float() / 4
    keys = torch.randint(-3, 4, (n + extra_rows, D), generator=gen).float()
    keys[n:] = float("nan")
    pos = torch.randint(0, RATIO * n + RATIO, (T,), generator=gen)
    if T > 1:
        pos[0] = 1  # sees no block
        pos[-1] = RATIO * n + 1  # sees every block
    return {"q": q.to(DEVICE), "w": w.to(DEVICE), "keys": keys.to(kdtype).to(DEVICE), "n_blocks": n,
            "pos": pos.to(DEVICE), "ratio": RATIO}


def _model_mask(c: dict, k: int) -> torch.Tensor:
    """The selection as engine/model.py's Indexer states it: allowed [T, n] = chosen & visible."""
    n, pos = c["n_blocks"], c["pos"]
    visible = (torch.arange(n, device=pos.device)[None] + 1) * RATIO <= pos[:, None] + 1
    keys = c["keys"][:n].float()
    score = torch.einsum("th,thn->tn", c["w"], torch.einsum("thd,nd->thn", c["q"], keys).relu())
    top = torch.sort(score.masked_fill(~visible, float("-inf")), dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros_like(visible).scatter_(1, top[:, :min(k, n)], True)
    return chosen & visible


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The same selection entry for entry, in either order (the one-program select emits ascending block
    order, the torch.topk path and the reference score order): rows compared sorted by block id."""
    (ids, valid), (want_ids, want_valid) = got, want
    o, w = ids.argsort(dim=1), want_ids.argsort(dim=1)
    return (torch.equal(ids.gather(1, o), want_ids.gather(1, w))
            and torch.equal(valid.gather(1, o), want_valid.gather(1, w)))


def _check(c: dict, k: int, ids: torch.Tensor, valid: torch.Tensor) -> None:
    T, n = c["q"].shape[0], c["n_blocks"]
    kk = min(k, max(n, 1))
    assert ids.shape == valid.shape == (T, kk) and ids.dtype == torch.int64 and valid.dtype == torch.bool
    want_ids, want_valid = index_topk_ref(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k)
    # The caller's contract: the same set of valid blocks (and as many valid entries) as the reference ...
    assert torch.equal(valid.sum(1), want_valid.sum(1))
    for t in range(T):
        assert set(ids[t][valid[t]].tolist()) == set(want_ids[t][want_valid[t]].tolist())
    if n:
        assert ((ids >= 0) & (ids < n)).all()
        got_mask = torch.zeros(T, n, dtype=torch.bool, device=ids.device).scatter_(1, ids, valid)
        assert torch.equal(got_mask, _model_mask(c, k))
        assert len(set(ids[0].tolist())) == kk  # distinct blocks, the invalid fill included
    # ... and, stronger, entry for entry: the same invalid fill (lowest invisible blocks) as the reference.
    assert _same((ids, valid), (want_ids, want_valid))


@pytest.mark.parametrize(("T", "IH", "D", "n", "k", "kdtype"), [
    (1, 3, 32, 37, 16, torch.float32), (1, 4, 64, 37, 64, torch.float16), (1, 3, 32, 7, 4, torch.float32),
    (1, 4, 32, 1, 4, torch.float16), (5, 4, 64, 37, 4, torch.float32), (5, 3, 32, 37, 16, torch.float16),
    (5, 4, 32, 7, 64, torch.float32), (5, 3, 64, 1, 16, torch.float32), (5, 4, 32, 0, 16, torch.float32),
    (1, 3, 32, 0, 4, torch.float16), (20, 3, 32, 37, 16, torch.float16)])
def test_index_topk_matches_reference(poisoned_empty: None, T: int, IH: int, D: int, n: int, k: int,
                                      kdtype: torch.dtype) -> None:
    for seed in (0, 1):
        c = _case(T, IH, D, n, seed=seed * 100 + T + IH + D + n + k, kdtype=kdtype)
        ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k)
        _check(c, k, ids, valid)


# Every kernel path at small tiles: heads as dot rows in several head chunks, per-head FMA, query blocks
# (padded), and fp32 ieee dots instead of fp16 operands.
_TILES = {
    "heads-dot": IndexerTiles(block_t=1, block_h=16, block_n=16, block_d=32, dot=True, num_warps=1),
    "heads-fma": IndexerTiles(block_t=1, block_h=16, block_n=16, block_d=32, dot=False, num_warps=1),
    "query-block": IndexerTiles(block_t=16, block_h=1, block_n=16, block_d=32, dot=True, num_warps=1),
}


@pytest.mark.parametrize("path", sorted(_TILES))
@pytest.mark.parametrize("fp16_dot", [True, False])
def test_tile_paths(poisoned_empty: None, path: str, fp16_dot: bool) -> None:
    T = 1 if _TILES[path].block_t == 1 else 5
    c = _case(T, 20, 24, 37, seed=7 + fp16_dot, kdtype=torch.float16)  # 20 heads: two chunks of 16
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], 37, c["pos"], RATIO, 8, fp16_dot=fp16_dot,
                                   tiles=_TILES[path])
    _check(c, 8, ids, valid)


@pytest.mark.parametrize("path", sorted(_TILES))
def test_weight_scale_read_in_the_kernel_is_the_scaled_weights(poisoned_empty: None, path: str) -> None:
    """w_scale (GpuStage._index's 1 / sqrt(dim * heads)) multiplies each weight as the kernel reads it: the same
    selection as weights scaled by a launch of their own, in every tile path and in the reference."""
    T = 1 if _TILES[path].block_t == 1 else 5
    c = _case(T, 20, 24, 37, seed=31)
    scale = 24 ** -0.5 * 20 ** -0.5
    w_wide = torch.randn(T, 26, generator=torch.Generator().manual_seed(5)).to(DEVICE)  # w a column slice
    w = w_wide[:, 3:23]
    got = index_topk_triton(c["q"], w, c["keys"], 37, c["pos"], RATIO, 8, tiles=_TILES[path], w_scale=scale)
    want = index_topk_triton(c["q"], w * scale, c["keys"], 37, c["pos"], RATIO, 8, tiles=_TILES[path])
    assert all(torch.equal(g, h) for g, h in zip(got, want, strict=True))
    ref = index_topk_ref(c["q"], w, c["keys"], 37, c["pos"], RATIO, 8, w_scale=scale)
    assert all(torch.equal(g, h) for g, h in zip(ref, index_topk_ref(c["q"], w * scale, c["keys"], 37, c["pos"],
                                                                     RATIO, 8), strict=True))


@pytest.mark.parametrize("path", sorted(_TILES))
def test_fp16_dot_precision(path: str) -> None:
    """Block 1 outscores block 0 by 2^-12 relative, below fp16 resolution: fp32 (ieee) dots and the FMA path
    pick block 1; fp16 dot operands round both scores to 1, a tie, so block 0 (why fp16_dot=True needs q and
    keys that are fp16 values, as DS4's FP4 round trip makes them)."""
    T = 1 if _TILES[path].block_t == 1 else 2
    q = torch.zeros(T, 3, 16, device=DEVICE)
    q[:, 1, 0], q[:, 1, 1] = 1.0, 1.0 + 2.0**-12
    w = torch.zeros(T, 3, device=DEVICE)
    w[:, 1] = 1.0
    keys = torch.eye(16, device=DEVICE)[:2]
    pos = torch.full((T,), 100, device=DEVICE)
    for fp16_dot in (False, True):
        ids, valid = index_topk_triton(q, w, keys, 2, pos, RATIO, 1, fp16_dot=fp16_dot, tiles=_TILES[path])
        exact = not fp16_dot or not _TILES[path].dot
        assert ids.flatten().tolist() == [1 if exact else 0] * T and valid.all()


@pytest.mark.parametrize("T", [1, 5])
def test_exact_ties_pick_lowest_visible_blocks(poisoned_empty: None, T: int) -> None:
    """Every q . key < 0, so every head's ReLU is 0 and every score is 0 (w of either sign: +-0): the
    selection is the lowest visible blocks, then the lowest invisible ones as invalid fill."""
    IH, D, n, k = 4, 32, 37, 6
    gen = torch.Generator().manual_seed(11)
    q = torch.randint(1, 4, (T, IH, D), generator=gen).float().to(DEVICE)
    keys = -torch.randint(1, 4, (n, D), generator=gen).float().to(DEVICE)
    w = (torch.randint(-4, 5, (T, IH), generator=gen).float() / 4).to(DEVICE)
    pos = torch.tensor([2, 9, 23, 150, 80][:T], device=DEVICE)  # sees 0, 2, 6, 37, 20 blocks
    tiles = None if T == 1 else _TILES["query-block"]
    ids, valid = index_topk_triton(q, w, keys, n, pos, RATIO, k, step=10, tiles=tiles)
    for t in range(T):
        v = min(n, (int(pos[t]) + 1) // RATIO)
        assert ids[t].tolist() == list(range(k)) and valid[t].tolist() == [i < v for i in range(k)]
    assert _same((ids, valid), index_topk_ref(q, w, keys, n, pos, RATIO, k))


@pytest.mark.parametrize(("T", "k", "step", "launches"), [(1, 4, 5, 8), (5, 4, 3, 10), (5, 16, 9, 3),
                                                         (1, 16, None, 1)])
def test_column_blocks(poisoned_empty: None, count_launches, T: int, k: int, step: int | None,  # type: ignore[no-untyped-def]
                       launches: int) -> None:
    """A small `step` runs the running top-k over several column blocks (a step below k is raised to k)."""
    counter = count_launches(indexer_k, "_indexer_kernel")
    c = _case(T, 3, 32, 37, seed=step or 0, kdtype=torch.float16)
    tiles = None if T == 1 else _TILES["query-block"]
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], 37, c["pos"], RATIO, k, step=step, tiles=tiles)
    assert counter.launches == launches
    _check(c, k, ids, valid)


def test_strided_inputs() -> None:
    """q with a non-unit inner stride, w and keys with row strides above their widths (column slices of
    wider tensors), pos a strided column."""
    T, IH, D, n = 5, 3, 32, 37
    c = _case(T, IH, D, n, seed=21)
    q_t = c["q"].transpose(1, 2).contiguous().transpose(1, 2)  # [T, IH, D] with stride(2) == IH
    wide = torch.full((n + 2, D + 8), float("nan"), device=DEVICE)
    wide[:, :D] = c["keys"][: n + 2]
    w_wide = torch.zeros(T, IH + 2, device=DEVICE)
    w_wide[:, :IH] = c["w"]
    pos2 = torch.stack((c["pos"], -c["pos"]), dim=1)
    ids, valid = index_topk_triton(q_t, w_wide[:, :IH], wide[:, :D], n, pos2[:, 0], RATIO, 8,
                                   tiles=_TILES["query-block"])
    _check(c, 8, ids, valid)


def test_decode_has_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode (T = 1) reads nothing back to the host: no .item() / .tolist() / tensor truth value / int()."""
    c = _case(1, 4, 32, 37, seed=3, kdtype=torch.float16)
    want = index_topk_ref(c["q"], c["w"], c["keys"], 37, c["pos"], RATIO, 16)

    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("host synchronisation in the indexer launcher")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
            m.setattr(torch.Tensor, name, forbidden)
        ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], 37, c["pos"], RATIO, 16)
    assert _same((ids, valid), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_decode_captures_in_cuda_graph() -> None:
    c = _case(1, 64, 128, 1024, seed=4, kdtype=torch.float16)
    args = (c["q"], c["w"], c["keys"], 1024, c["pos"], RATIO, 512)
    index_topk_triton(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, valid = index_topk_triton(*args)
    c["q"].copy_(torch.randint(-3, 4, c["q"].shape, device=DEVICE).float())
    c["pos"].fill_(2000)
    graph.replay()
    torch.cuda.synchronize()
    assert _same((ids, valid), index_topk_ref(*args))


@pytest.mark.parametrize(("backend", "T"), [("cuda", 1), ("cuda", 20), ("hip64", 1), ("hip32", 20)])
def test_gpu_tiles_in_interpreter(backend: str, T: int) -> None:
    """The tiles a GPU launch would pick, run here on small shapes."""
    c = _case(T, 4, 32, 37, seed=T, kdtype=torch.float16)
    tiles = indexer_tiles(T, 37, 4, 32, backend)  # type: ignore[arg-type]
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], 37, c["pos"], RATIO, 16, tiles=tiles)
    _check(c, 16, ids, valid)


def test_public_index_topk_dispatch(count_launches) -> None:  # type: ignore[no-untyped-def]
    """CPU tensors go to the reference, except inside interpreted_kernels() where they take the kernel."""
    counter = count_launches(indexer_k, "_indexer_kernel")
    c = {key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in _case(5, 3, 32, 37, seed=9).items()}
    args = (c["q"], c["w"], c["keys"], 37, c["pos"], RATIO, 16)
    want = index_topk_ref(*args)
    got = index_topk(*args)
    assert counter.launches == 0 and _same(got, want)
    if dispatch.interpreting():
        with dispatch.interpreted_kernels():
            got = index_topk(*args)
        assert counter.launches == 1 and _same(got, want)


def test_no_blocks_and_no_queries() -> None:
    """n_blocks == 0: GpuStage._index's convention, zeros [T, 1] all invalid; T == 0: empty results."""
    c = _case(3, 3, 32, 0, seed=1)
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], 0, c["pos"], RATIO, 16)
    assert ids.shape == (3, 1) and not ids.any() and not valid.any()
    c = _case(3, 3, 32, 7, seed=1)
    ids, valid = index_topk_triton(c["q"][:0], c["w"][:0], c["keys"], 7, c["pos"][:0], RATIO, 16)
    assert ids.shape == valid.shape == (0, 7)


def test_rejects_bad_arguments() -> None:
    c = _case(2, 3, 32, 7, seed=2)
    q, w, keys, pos = c["q"], c["w"], c["keys"], c["pos"]
    with pytest.raises(ValueError, match="q must be"):
        index_topk_triton(q[0], w, keys, 7, pos, RATIO, 4)
    with pytest.raises(ValueError, match="w must be"):
        index_topk_triton(q, w[:, :2], keys, 7, pos, RATIO, 4)
    with pytest.raises(ValueError, match="keys must be"):
        index_topk_triton(q, w, keys[:, :16], 7, pos, RATIO, 4)
    with pytest.raises(ValueError, match="fp32 or fp16"):
        index_topk_triton(q, w, keys.double(), 7, pos, RATIO, 4)
    with pytest.raises(ValueError, match="n_blocks must be"):
        index_topk_triton(q, w, keys, 11, pos, RATIO, 4)
    with pytest.raises(ValueError, match="pos must be"):
        index_topk_triton(q, w, keys, 7, pos[:1], RATIO, 4)
    with pytest.raises(ValueError, match="k and ratio"):
        index_topk_triton(q, w, keys, 7, pos, RATIO, 0)
    with pytest.raises(ValueError, match="step must be"):
        index_topk_triton(q, w, keys, 7, pos, RATIO, 4, step=0)
    with pytest.raises(ValueError, match="block_d"):
        index_topk_triton(q, w, keys, 7, pos, RATIO, 4, tiles=IndexerTiles(1, 16, 16, 16, True, 1))


def test_column_step_bounds_the_scratch() -> None:
    """DS4 prefill (T = 2048, k = 512) at 1M context (262,144 blocks): the [T, k + step] int64 scratch stays
    within SCRATCH_BYTES; decode is one column block; a step is never below k nor above n_blocks."""
    step = _column_step(2048, 512, 262_144, 128)
    assert 2048 * (512 + step) * 8 <= SCRATCH_BYTES and step % 128 == 0 and step >= 8192
    assert _column_step(1, 512, 262_144, 64) == 262_144
    assert _column_step(5, 16, 37, 16, step=3) == 16 and _column_step(5, 16, 37, 16, step=100) == 37


@pytest.mark.parametrize("backend", ["cuda", "hip64", "hip32", "cpu"])
@pytest.mark.parametrize(("T", "n", "IH", "D"), [(1, 1024, 64, 128), (1, 8192, 64, 128), (2048, 8192, 64, 128),
                                                 (5, 37, 3, 32), (20, 7, 4, 64)])
def test_indexer_tiles(backend: str, T: int, n: int, IH: int, D: int) -> None:
    t = indexer_tiles(T, n, IH, D, backend)  # type: ignore[arg-type]
    for v in (t.block_t, t.block_h, t.block_n, t.block_d):
        assert v >= 1 and v & (v - 1) == 0
    assert t.block_d >= max(D, 16) and t.block_n >= 16 and 1 <= t.num_warps <= 8 and t.num_stages >= 1
    if t.block_t == 1:
        assert T < 16 and t.block_h >= 16
    else:
        assert t.block_t >= 16 and t.dot
    if backend == "cuda" and T == 1 and n >= 1024:
        assert -(-n // t.block_n) >= 64  # enough programs for 132 SMs at decode


@pytest.mark.parametrize(("T", "n", "k", "step", "selects"), [
    (1, 2000, 512, None, 1),  # DS4 decode at ~8K tokens: one program holds the 2,000 keys
    (3, 300, 300, None, 1),  # k == n: every block, the invisible ones as invalid fill
    (2, 37, 16, 10, 0),  # several column blocks: torch.topk's running selection instead
])
def test_one_program_select(poisoned_empty: None, count_launches, T: int, n: int, k: int,  # type: ignore[no-untyped-def]
                            step: int | None, selects: int) -> None:
    """A single column block of at most select_max keys is selected by `_select_kernel` (63 counting rounds
    over the keys in registers), with the ids and valid flags written by the kernel itself."""
    counter = count_launches(indexer_k, "_select_kernel")
    c = _case(T, 3, 32, n, seed=n + k)
    tiles = None if T == 1 else _TILES["query-block"]
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k, step=step, tiles=tiles)
    assert counter.launches == selects
    _check(c, k, ids, valid)


@pytest.mark.parametrize("backend", ["cuda", "hip64", "hip32", "cpu"])
def test_select_tiles(backend: str) -> None:
    lanes = 64 if backend == "hip64" else 32
    for n in (1, 37, 512, 2048, 4096, dispatch.select_max(backend)):  # type: ignore[arg-type]
        t = dispatch.select_tiles(n, backend)  # type: ignore[arg-type]
        assert t is not None and t.block >= n and t.block & (t.block - 1) == 0 and 1 <= t.num_warps <= 8
        assert t.block <= 32 * lanes * t.num_warps or backend == "cpu"  # at most 32 keys per lane
    assert dispatch.select_tiles(dispatch.select_max(backend) + 1, backend) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("T", "n", "k"), [(1, 300, 16), (2, 260, 16), (1, 300, 40), (3, 200, 6)])
def test_two_stage_select(poisoned_empty: None, count_launches, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                          T: int, n: int, k: int) -> None:
    """More keys than one program holds: per chunk the k largest (a short last chunk keeps all it has, padded
    with keys below every real one), then one program per query over the candidates. The program size is
    lowered to 128 keys so that small cases take the two-stage path; positions include queries that see
    fewer than k blocks (the cut falls in the tied invisible keys, next to the padding)."""
    backend = dispatch.launch_backend(torch.empty(0, device=DEVICE))
    monkeypatch.setitem(dispatch._SELECT_MAX, backend, 128)
    plan = dispatch.select_plan(n, k, backend)
    assert plan is not None and plan.chunk in (64, 128) and plan.chunks == -(-n // plan.chunk)
    counter = count_launches(indexer_k, "_select_kernel")
    c = _case(T, 3, 32, n, seed=n * k + T)
    c["pos"][0] = 4 * min(k, n) // 2  # sees about k / 2 blocks
    tiles = None if T == 1 else _TILES["query-block"]
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k, tiles=tiles)
    assert counter.launches == 2
    _check(c, k, ids, valid)


@pytest.mark.parametrize(("step", "selects", "scores"), [(128, 4, 3), (100, 6, 5), (40, 0, 8)])
def test_two_stage_select_over_column_blocks(poisoned_empty: None, count_launches,  # type: ignore[no-untyped-def]
                                             monkeypatch: pytest.MonkeyPatch, step: int, selects: int,
                                             scores: int) -> None:
    """More blocks than the key scratch holds at once (a long prefill chunk at long context): each column
    block of whole first-stage chunks (the step rounded down to them) runs its first stage into one candidate
    buffer, then one second stage; a column block smaller than a chunk falls back to torch.topk."""
    backend = dispatch.launch_backend(torch.empty(0, device=DEVICE))
    monkeypatch.setitem(dispatch._SELECT_MAX, backend, 128)
    n, k = 300, 16
    plan = dispatch.select_plan(n, k, backend)
    assert plan is not None and plan.chunk == 64 and plan.chunks == 5
    select = count_launches(indexer_k, "_select_kernel")
    score = count_launches(indexer_k, "_indexer_kernel")
    c = _case(6, 3, 32, n, seed=step, kdtype=torch.float16)
    c["pos"][1:3] = torch.tensor([4 * k // 2, 4 * 64 + 4 * k], device=DEVICE)  # few blocks; chunk 1 sees k + 1
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k, step=step,
                                   tiles=_TILES["query-block"])
    assert (select.launches, score.launches) == (selects, scores)
    _check(c, k, ids, valid)


@pytest.mark.parametrize(("T", "mid_rows", "selects"), [(4, None, 3), (3, 2, 0)])
def test_three_stage_select(poisoned_empty: None, count_launches, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                            T: int, mid_rows: int | None, selects: int) -> None:
    """Candidates of more chunks than one program holds (decode past 512K tokens of context): a middle stage
    of the same programs over the first stage's candidates, then the last; past SELECT_MID_ROWS rows (a
    prefill piece) torch.topk over column blocks instead. select_max is lowered to 128 keys: 47 first-stage
    chunks of 64 keep 16 each (752 candidates), 6 middle chunks of 128 keep 16 each, one program takes 16 of
    those 96. Positions include queries that see nothing, fewer than k blocks, and every block."""
    backend = dispatch.launch_backend(torch.empty(0, device=DEVICE))
    monkeypatch.setitem(dispatch._SELECT_MAX, backend, 128)
    if mid_rows is not None:
        monkeypatch.setattr(dispatch, "SELECT_MID_ROWS", mid_rows)
    n, k = 3000, 16
    plan = dispatch.select_plan(n, k, backend)
    assert plan is not None and (plan.chunk, plan.chunks, plan.mid_chunk, plan.mid_chunks) == (64, 47, 128, 6)
    assert plan.mid is not None and plan.last.block == 128
    select = count_launches(indexer_k, "_select_kernel")
    c = _case(T, 3, 32, n, seed=T, kdtype=torch.float16)
    c["pos"][1] = 4 * k // 2  # sees about k / 2 blocks
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k, tiles=_TILES["query-block"])
    assert select.launches == selects
    _check(c, k, ids, valid)


@pytest.mark.parametrize("seen", [0, 1, 15, 16, 17, 40])
@pytest.mark.parametrize(("stages", "region"), [(1, 0), (2, 1), (3, 0), (3, 8)])
def test_select_of_queries_and_chunks_that_see_few_blocks(poisoned_empty: None, monkeypatch: pytest.MonkeyPatch,
                                                          stages: int, region: int, seen: int) -> None:
    """A query (one stage) or a chunk of a reducing stage that sees at most k blocks keeps its first k keys
    without counting; one that sees more counts. The blocks of first-stage chunk `region` on are the ones
    the query sees `seen` of, scored in ascending block order and above every other block, so a selection
    that kept the first k of k + 1 visible blocks would lose the best one. Three stages: the middle stage
    reads candidates, whose index is at most their block's (region 0: the shortcut fires in every stage;
    region 8, the second middle chunk: the middle stage counts)."""
    backend = dispatch.launch_backend(torch.empty(0, device=DEVICE))
    if stages > 1:
        monkeypatch.setitem(dispatch._SELECT_MAX, backend, 128)
    n, k = (3000 if stages == 3 else 300), 16
    plan = dispatch.select_plan(n, k, backend)
    assert plan is not None and (plan.chunks == 1 if stages == 1 else plan.chunks >= 3 and plan.chunk > 40)
    assert (plan.mid is not None) == (stages == 3)
    base = region * plan.chunk  # the first block of the region that sees `seen` blocks
    c = _case(2, 3, 32, n, seed=seen)
    c["q"], c["w"] = c["q"].abs() + 1, c["w"].abs() + 0.25  # every score rises with the key values
    c["keys"][base:base + 64] = 10 + torch.arange(64, device=DEVICE)[:, None].float()
    last = base + seen - 1  # the last visible block: (last + 1) ratio <= pos + 1
    c["pos"] = torch.tensor([(last + 1) * RATIO - 1, (last + 1) * RATIO + RATIO - 2], device=DEVICE)
    ids, valid = index_topk_triton(c["q"], c["w"], c["keys"], n, c["pos"], RATIO, k, tiles=_TILES["query-block"])
    _check(c, k, ids, valid)
    if seen:
        assert last in ids[0].tolist()


def test_select_plan() -> None:
    top = dispatch.select_max("cuda")
    one = dispatch.select_plan(2048, 512, "cuda")
    assert one is not None and one.chunks == 1 and one.last.block == 2048
    two = dispatch.select_plan(top + 28, 512, "cuda")  # decode just past 32K tokens: 3 half-size chunks
    assert two is not None and two.chunk == top // 2 and two.chunks == 3 and two.last.block == 2048
    full = dispatch.select_plan(8 * top, 512, "cuda")  # 16 half-size chunks -> 8,192 candidates
    assert full is not None and full.chunk == top // 2 and full.chunks == 16 and full.last.block == top
    wide = dispatch.select_plan(16 * top, 512, "cuda")  # 16 full-size chunks
    assert wide is not None and wide.chunk == top and wide.chunks == 16
    # decode after 1M tokens (262,144 blocks): 64 half-size chunks -> 32,768 candidates -> 8 middle chunks
    # -> 4,096; a prefill piece there keeps torch.topk
    far = dispatch.select_plan(32 * top, 512, "cuda")
    assert far is not None and (far.chunk, far.chunks, far.mid_chunk, far.mid_chunks) == (top // 2, 64, top // 2, 8)
    assert far.mid is not None and far.last.block == top // 2
    assert dispatch.select_plan(32 * top, 512, "cuda", rows=dispatch.SELECT_MID_ROWS) is not None
    assert dispatch.select_plan(32 * top, 512, "cuda", rows=dispatch.SELECT_MID_ROWS + 1) is None
    assert dispatch.select_plan(16 * top + 1, 512, "cuda", rows=2048) is None  # 17 chunks: torch.topk instead
    hip = dispatch.select_plan(32 * top, 512, "hip64")  # 4,096 keys a program: 64 full chunks, 8 middle ones
    assert hip is not None and (hip.chunk, hip.chunks, hip.mid_chunk, hip.mid_chunks) == (4096, 64, 4096, 8)


def test_planner_counts_the_selection_scratch() -> None:
    """The planner's byte formula (model/footprint.py) bounds what a prefill chunk's selection allocates: the
    same key block bound, and at least the candidates every backend's plan keeps (two stages; three for a
    chunk of few rows), at contexts from one stage to the torch.topk fallback (FLASH: k = 512)."""
    assert footprint.INDEXER_SCRATCH_BYTES == SCRATCH_BYTES
    assert footprint.INDEXER_SELECT_MAX == max(dispatch.select_max(b) for b in ("cuda", "hip64", "hip32"))
    assert footprint.INDEXER_MID_ROWS == dispatch.SELECT_MID_ROWS
    k = 512
    for chunk in (2048, 64, 1):
        for ctx in (4096, 32768, 32772, 65536, 131072, 262144, 524288, 524292, 1 << 20):
            n = -(-ctx // 4)
            step = _column_step(chunk, k, n, 128)
            for backend in ("cuda", "hip64", "hip32"):
                plan = dispatch.select_plan(n, k, backend, rows=chunk)  # type: ignore[arg-type]
                cands = plan.chunks * k if plan is not None and plan.chunks > 1 else 0
                cands += plan.mid_chunks * k if plan is not None else 0
                assert plan is None or plan.mid is None or step >= n  # a middle stage scores all blocks at once
                need = 8 * chunk * (k + step) + max(16 * chunk * k, 8 * chunk * cands + 9 * chunk * k)
                got = footprint.indexer_scratch_bytes(footprint.SHAPES["flash-q2"][0], ctx, chunk)
                assert got >= need, (chunk, ctx, backend)
