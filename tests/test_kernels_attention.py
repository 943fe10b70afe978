"""Decode attention kernel (ds4station/kernels/attention.py) against its torch reference, the reference
model's sink_attention (engine/model.py) and GpuStage._attend (engine/gpu.py), at small odd shapes: window
only, shared compressed rows and indexed rows (with masked, out-of-range ids and NaN garbage in masked rows),
all-masked parts, fp32 and fp16 keys, split-K over many ragged key blocks, poisoned outputs, two launches."""

from __future__ import annotations

import pytest
import torch

from ds4station.engine.gpu import GpuStage
from ds4station.kernels import attention as attn_k
from ds4station.kernels.attention import attention_decode, attention_decode_ref, attention_decode_triton
from ds4station.kernels.dispatch import AttentionTiles, attention_tiles
from ds4station.kernels.reference import sink_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"rtol": 1e-5, "atol": 1e-5}
# The CUDA tiles use TF32 tensor-core dots (10-bit mantissa operands, fp32 accumulation); the interpreter and the
# explicit FMA / "ieee" tiles are fp32-exact.
TOL_DEFAULT = {"rtol": 3e-3, "atol": 3e-3} if DEVICE == "cuda" else TOL
# The CUDA prefill tiles round the dots' operands to fp16 (the interpreter too): the TF32 bound, on any device.
TOL_FP16 = {"rtol": 3e-3, "atol": 3e-3}

# Several ragged key blocks (a block straddles window and compressed keys), head blocks smaller than H and a
# ragged last head-dim step (96 = 64 + 32), and combine steps smaller than the split count.
SPLIT = AttentionTiles(block_h=2, block_n=4, block_d=64, num_warps=1, block_s=4, block_dc=64, num_warps_c=1)


def _tol(precision: str) -> dict:
    return TOL_FP16 if precision == "fp16" else TOL_DEFAULT if precision == "tf32" else TOL


def _case(H: int, D: int, nw: int, nc: int, indexed: bool, dtype: torch.dtype, seed: int,
          p_mask: float = 0.3) -> dict:
    """q, window keys + mask, compressed keys (a 50-row table + ids when indexed) + mask, sinks. Masked
    compressed entries hold garbage the kernel must never touch: out-of-range ids, NaN rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(H, D, generator=gen)
    kw = torch.randn(nw, D, generator=gen)
    mask_w = torch.rand(nw, generator=gen) > p_mask
    mask_w[-1] = True  # the query's own position
    sinks = torch.randn(H, generator=gen) * 2
    kc = mask_c = ids = None
    if nc:
        mask_c = torch.rand(nc, generator=gen) > p_mask
        if indexed:
            kc = torch.randn(50, D, generator=gen)
            ids = torch.randint(0, 50, (nc,), generator=gen)
            ids[~mask_c] = torch.tensor([-3, 10**6])[torch.arange(int((~mask_c).sum())) % 2]
        else:
            kc = torch.randn(nc, D, generator=gen)
            kc[~mask_c] = float("nan")
    kw, kc = kw.to(dtype), None if kc is None else kc.to(dtype)
    out = {"q": q, "kw": kw, "mask_w": mask_w, "kc": kc, "mask_c": mask_c, "sinks": sinks, "ids": ids}
    return {k: None if v is None else v.to(DEVICE) for k, v in out.items()}


def _run(c: dict, tiles: AttentionTiles | None = None) -> torch.Tensor:
    H, D = c["q"].shape
    out = torch.full((H, D), float("nan"), device=DEVICE)
    got = attention_decode_triton(c["q"], c["kw"], c["mask_w"], c["kc"], c["mask_c"], c["sinks"], D**-0.5,
                                  ids=c["ids"], out=out, tiles=tiles)
    assert got.data_ptr() == out.data_ptr()
    return got


def _ref(c: dict) -> torch.Tensor:
    D = c["q"].shape[1]
    return attention_decode_ref(c["q"], c["kw"], c["mask_w"], c["kc"], c["mask_c"], c["sinks"], D**-0.5,
                                ids=c["ids"])


@pytest.mark.parametrize(("D", "nc", "indexed", "dtype", "tiles"), [
    (64, 0, False, torch.float32, None), (96, 5, False, torch.float32, SPLIT), (96, 37, False, torch.float16, None),
    (64, 37, True, torch.float32, SPLIT), (96, 5, True, torch.float16, None), (96, 37, True, torch.float16, SPLIT)])
def test_attention_matches_reference(poisoned_empty: None, D: int, nc: int, indexed: bool, dtype: torch.dtype,
                                     tiles: AttentionTiles | None) -> None:
    c = _case(4, D, 9, nc, indexed, dtype, seed=D + nc + indexed)
    got = _run(c, tiles)
    torch.testing.assert_close(got, _ref(c), **(TOL if tiles else TOL_DEFAULT))


@pytest.mark.parametrize(("backend", "nc", "indexed"), [("cuda", 300, True), ("hip64", 1100, False)])
def test_gpu_tiles_in_interpreter(poisoned_empty: None, backend: str, nc: int, indexed: bool) -> None:
    """The tiles a GPU launch would pick (the tl.dot form on CUDA; wider key blocks past 1024 keys), run here."""
    c = _case(4, 96, 9, nc, indexed, torch.float16, seed=nc)
    tiles = attention_tiles(4, 96, 9 + nc, backend)  # type: ignore[arg-type]
    assert -(-(9 + nc) // tiles.block_n) > 8  # many splits
    torch.testing.assert_close(_run(c, tiles), _ref(c), **(TOL_DEFAULT if tiles.precision == "tf32" else TOL))


def test_reference_is_model_sink_attention() -> None:
    """With valid rows only, the reference is sink_attention over [kw ; rows] exactly (and the kernel too)."""
    c = _case(4, 64, 9, 6, True, torch.float32, seed=1, p_mask=-1.0)  # nothing masked
    keys = torch.cat((c["kw"], c["kc"][c["ids"]]))
    allowed = torch.cat((c["mask_w"], c["mask_c"]))[None]
    want = sink_attention(c["q"][None], keys, allowed, c["sinks"], 64**-0.5)[0]
    torch.testing.assert_close(_ref(c), want, rtol=0, atol=0)
    torch.testing.assert_close(_run(c), want, **TOL_DEFAULT)


@pytest.mark.parametrize("indexed", [False, True])
def test_matches_gpu_stage_attend(indexed: bool) -> None:
    """GpuStage._attend (the prefill path) on one query gives the same output; masked ids in range
    (the GPU stage dereferences them) and finite rows (it multiplies p = 0 by them)."""
    c = _case(4, 96, 9, 37, indexed, torch.float32, seed=11)
    if indexed:
        c["ids"] = c["ids"].clamp(0, 49)
    else:
        c["kc"] = torch.nan_to_num(c["kc"])
    kc = c["ids"][None] if indexed else c["kc"]
    want = GpuStage._attend(c["q"][None], c["kw"], c["mask_w"][None], c["kc"], kc, c["mask_c"][None], c["sinks"],
                            indexed)[0]
    torch.testing.assert_close(_run(c, SPLIT), want, **TOL)


def test_all_masked_parts(poisoned_empty: None) -> None:
    """An all-masked compressed part equals window-only attention; with every key masked only the sink is
    left in the softmax and the output is 0 (as in sink_attention)."""
    c = _case(4, 96, 9, 37, True, torch.float16, seed=5)
    c["mask_c"] = torch.zeros_like(c["mask_c"])
    window_only = dict(c, kc=None, mask_c=None, ids=None)
    got = _run(c, SPLIT)
    torch.testing.assert_close(got, _run(window_only, SPLIT), **TOL)
    torch.testing.assert_close(got, _ref(window_only), **TOL)
    c["mask_w"] = torch.zeros_like(c["mask_w"])
    torch.testing.assert_close(_run(c, SPLIT), torch.zeros(4, 96, device=DEVICE), rtol=0, atol=0)


def test_int_masks_and_large_logits() -> None:
    """Masks given as int8 (nonzero = attend), and logits far above the sinks (softmax stable)."""
    c = _case(4, 64, 9, 5, False, torch.float32, seed=6)
    c["q"] = c["q"] * 400  # logits of hundreds: exp overflows fp32 unless shifted by the running max
    want = _ref(c)
    c["mask_w"], c["mask_c"] = c["mask_w"].to(torch.int8) * 3, c["mask_c"].to(torch.int8)
    got = _run(c, SPLIT)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL)


def test_two_launches(count_launches) -> None:  # type: ignore[no-untyped-def]
    """One split launch (the FMA or, with CUDA's tiles, the tl.dot form) and one combine."""
    names = ("_attn_split_kernel", "_attn_split_dot_kernel", "_attn_combine_kernel")
    counters = {n: count_launches(attn_k, n) for n in names}
    _run(_case(2, 64, 3, 5, True, torch.float32, seed=7))
    split, split_dot, combine = (c.launches for c in counters.values())
    assert split + split_dot == 1 and combine == 1


def test_public_op_uses_reference_on_cpu() -> None:
    c = {k: None if v is None else v.cpu() for k, v in _case(4, 64, 9, 5, True, torch.float32, seed=8).items()}
    got = attention_decode(c["q"], c["kw"], c["mask_w"], c["kc"], c["mask_c"], c["sinks"], 0.125, ids=c["ids"])
    want = attention_decode_ref(c["q"], c["kw"], c["mask_w"], c["kc"], c["mask_c"], c["sinks"], 0.125, ids=c["ids"])
    assert torch.equal(got, want)


def test_rejects_bad_arguments() -> None:
    c = _case(4, 64, 9, 5, False, torch.float32, seed=9)
    with pytest.raises(ValueError, match="q must be"):
        attention_decode_triton(c["q"][None, None], c["kw"], c["mask_w"], None, None, c["sinks"], 0.1)
    with pytest.raises(ValueError, match="kw must be"):
        attention_decode_triton(c["q"], c["kw"][:, :-1], c["mask_w"], None, None, c["sinks"], 0.1)
    with pytest.raises(ValueError, match="mask_c must be"):
        attention_decode_triton(c["q"], c["kw"], c["mask_w"], c["kc"], c["mask_c"][:-1], c["sinks"], 0.1)
    with pytest.raises(ValueError, match="sinks must be"):
        attention_decode_triton(c["q"], c["kw"], c["mask_w"], None, None, c["sinks"][:3], 0.1)
    with pytest.raises(ValueError, match="fp32 or fp16"):
        attention_decode_triton(c["q"], c["kw"].double(), c["mask_w"], None, None, c["sinks"], 0.1)


@pytest.mark.parametrize("backend", ["cuda", "hip64", "hip32", "cpu"])
@pytest.mark.parametrize(("H", "D", "n"), [(64, 512, 128), (64, 512, 640), (64, 512, 128 + 8192), (4, 96, 46)])
def test_attention_tiles(backend: str, H: int, D: int, n: int) -> None:
    t = attention_tiles(H, D, n, backend)  # type: ignore[arg-type]
    for v in (t.block_h, t.block_n, t.block_d, t.block_s, t.block_dc):
        assert v >= 1 and v & (v - 1) == 0
    assert 1 <= t.num_warps <= 8 and 1 <= t.num_warps_c <= 8
    if backend != "cpu":
        lanes = 64 if backend == "hip64" else 32
        if t.block_dv:  # tl.dot form: all heads per program; the logit tile stays <= 64 fp32 per lane
            assert t.block_h >= H and t.block_h * t.block_n <= t.num_warps * lanes * 64
        else:
            assert t.block_h * t.block_n * t.block_d <= t.num_warps * lanes * 64  # <= 64 fp32 per lane
        assert -(-n // t.block_n) <= 130  # partials stay bounded on long compressed lists
        if backend == "hip64":
            assert t.num_warps <= attention_tiles(H, D, n, "hip32").num_warps


@pytest.mark.parametrize("form", ["fma", "tl.dot", "tl.dot fp16", "tl.dot fp16 whole"])
@pytest.mark.parametrize("layer", ["indexed", "ratio", "window"])
def test_positional_masks_from_the_ring_and_position(poisoned_empty: None, form: str, layer: str) -> None:
    """Decode's masks derived in the kernel from the position: the window read from the raw ring (slots wrap,
    positions below 0 masked) and shared compressed rows visible by ratio; both split kernels, odd heads; the
    tl.dot one in fp32, with fp16 operands in 32-wide head-dim steps, and with fp16 operands over the whole
    head dim in one load and one dot (block_d >= D)."""
    H, D = 5, 96
    gen = torch.Generator().manual_seed(11)
    q, sinks = torch.randn(H, D, generator=gen), torch.randn(H, generator=gen)
    ring, comp = torch.randn(40, D, generator=gen), torch.randn(30, D, generator=gen)
    ids = torch.randint(0, 30, (13,), generator=gen)
    valid = torch.rand(13, generator=gen) > 0.3
    kw = {"indexed": dict(kc=comp, mask_c=valid, ids=ids), "ratio": dict(kc=comp[:20], mask_c=None, ratio=4),
          "window": dict(kc=None, mask_c=None)}[layer]
    kc, mc = kw.pop("kc"), kw.pop("mask_c")
    tiles = SPLIT if form == "fma" else AttentionTiles(
        block_h=16, block_n=16, block_d=128 if "whole" in form else 32, num_warps=1, block_s=4, block_dc=64,
        num_warps_c=1, block_dv=64, precision="fp16" if "fp16" in form else "ieee")
    for p in (9, 57):  # early (window reaches below position 0) and wrapped around the 40-slot ring
        t = [x if x is None or x.dim() == 0 else x.to(DEVICE) for x in (q, ring, kc, mc, sinks)]
        pos = torch.tensor([p], device=DEVICE)
        extra = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        got = attention_decode_triton(t[0], t[1], None, t[2], t[3], t[4], D ** -0.5, pos=pos, window=16, tiles=tiles,
                                      **extra)
        want = attention_decode_ref(t[0], t[1], None, t[2], t[3], t[4], D ** -0.5, pos=pos, window=16, **extra)
        assert not got.isnan().any()
        assert torch.allclose(got.cpu(), want.cpu(), **_tol(tiles.precision)), (got.cpu() - want.cpu()).abs().max()


def test_positional_masks_need_the_position() -> None:
    q, ring = torch.zeros(2, 32, device=DEVICE), torch.zeros(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="position"):
        attention_decode_triton(q, ring, None, None, None, torch.zeros(2, device=DEVICE), 1.0, window=4)


@pytest.mark.parametrize(("backend", "shared"), [("cpu", None), ("cuda", None), ("cuda", 101376), ("hip64", None)])
@pytest.mark.parametrize("layer", ["indexed", "ratio", "window"])
def test_prefill_attention_matches_per_query_reference(poisoned_empty: None, backend: str, shared: int | None,
                                                       layer: str) -> None:
    """The prefill kernel (each query its own window from the ring, its own indexed rows or the causal share of
    the compressed rows) against the decode reference run query by query, with each backend's tiles (CUDA's for
    a GPU with 99 KB of shared memory per program too)."""
    from ds4station.kernels.attention import attention_prefill_ref, attention_prefill_triton
    from ds4station.kernels.dispatch import attention_prefill_tiles

    H, D, T, W = 5, 96, 7, 16
    gen = torch.Generator().manual_seed(13)
    q, sinks = torch.randn(T, H, D, generator=gen), torch.randn(H, generator=gen)
    ring, comp = torch.randn(40, D, generator=gen), torch.randn(30, D, generator=gen)
    pos = torch.arange(3, 3 + T)  # the first queries' windows reach below position 0
    ids, valid = torch.randint(0, 30, (T, 13), generator=gen), torch.rand(T, 13, generator=gen) > 0.3
    valid[0] = False  # a query with no compressed row at all
    kw = {"indexed": dict(kc=comp, mask_c=valid, ids=ids), "ratio": dict(kc=comp[:6], mask_c=None, ids=None, ratio=2),
          "window": dict(kc=None, mask_c=None, ids=None)}[layer]
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    args = (q.to(DEVICE), ring.to(DEVICE))
    common = dict(sinks=sinks.to(DEVICE), scale=D ** -0.5, pos=pos.to(DEVICE), window=W)
    tiles = attention_prefill_tiles(H, D, backend, shared)
    got = attention_prefill_triton(*args, **common, **kw, tiles=tiles)
    want = attention_prefill_ref(*args, **common, **kw)
    assert not got.isnan().any()
    assert torch.allclose(got.cpu(), want.cpu(), **_tol(tiles.precision)), (got.cpu() - want.cpu()).abs().max()


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("precision", ["ieee", "fp16"])
@pytest.mark.parametrize("layer", ["indexed", "ratio"])
def test_prefill_attention_skips_key_blocks_no_query_sees(poisoned_empty: None, resident: bool, precision: str,
                                                           layer: str) -> None:
    """Small key blocks, so that whole blocks are masked for some queries (a query with no indexed row, the
    compressed rows of a ratio layer past a query's position, window slots below position 0): those blocks are
    skipped or never visited, and every query still equals the reference, with the query held for the whole
    key loop (block_d >= D) or re-read per head-dim step, in fp32 and with fp16 operands."""
    from ds4station.kernels.attention import attention_prefill_ref, attention_prefill_triton

    H, D, T, W = 3, 40, 6, 8
    gen = torch.Generator().manual_seed(29)
    q, sinks = torch.randn(T, H, D, generator=gen), torch.randn(H, generator=gen)
    ring, comp = torch.randn(24, D, generator=gen), torch.randn(20, D, generator=gen)
    pos = torch.tensor([0, 1, 5, 9, 12, 13])
    ids, valid = torch.randint(0, 20, (T, 12), generator=gen), torch.zeros(T, 12, dtype=torch.bool)
    valid[2, :3] = True
    valid[3:] = torch.rand(3, 12, generator=gen) > 0.5
    valid[4, 4:] = False  # its second key block (rows 8-11) is masked: skipped
    kw = {"indexed": dict(kc=comp, mask_c=valid, ids=ids), "ratio": dict(kc=comp[:7], mask_c=None, ids=None, ratio=2)}
    kw = kw[layer]
    # 16 x 16 tiles (a GPU's tl.dot needs >= 16 per dim): keys 0-15 = the window's 8 + the first 8 rows, 16-31 the
    # last 4 rows and padding
    tiles = AttentionTiles(block_h=16, block_n=16, block_d=64 if resident else 16, num_warps=1, block_s=1,
                           block_dc=1, num_warps_c=1, block_dv=16, precision=precision)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = attention_prefill_triton(q.to(DEVICE), ring.to(DEVICE), sinks=sinks.to(DEVICE), scale=D ** -0.5,
                                   pos=pos.to(DEVICE), window=W, **dev, tiles=tiles)
    want = attention_prefill_ref(q, ring, sinks=sinks, scale=D ** -0.5, pos=pos, window=W, **kw)
    torch.testing.assert_close(got.cpu(), want, **_tol(precision))


@pytest.mark.parametrize("shared", [None, 101376])
def test_prefill_attention_at_the_flash_shape_with_the_cuda_tiles(poisoned_empty: None, shared: int | None) -> None:
    """The CUDA prefill tiles at DS4's attention shape (64 heads x 512, fp16 operands, 64-key blocks, the value
    dims in two programs; the query's [64, 512] tile held, or re-read in 128-wide steps where a program gets 99 KB
    of shared memory): window and 96 indexed rows of which some are masked, against the reference."""
    from ds4station.kernels.attention import attention_prefill_ref, attention_prefill_triton
    from ds4station.kernels.dispatch import attention_prefill_tiles

    H, D, T, W = 64, 512, 2, 128
    gen = torch.Generator().manual_seed(31)
    q, sinks = torch.randn(T, H, D, generator=gen), torch.randn(H, generator=gen)
    ring, comp = torch.randn(W + 8, D, generator=gen), torch.randn(200, D, generator=gen)
    pos = torch.tensor([130, 300])
    ids, valid = torch.randint(0, 200, (T, 96), generator=gen), torch.rand(T, 96, generator=gen) > 0.2
    tiles = attention_prefill_tiles(H, D, "cuda", shared)
    assert tiles.precision == "fp16" and (tiles.block_d >= D) == (shared is None)
    args = dict(sinks=sinks, scale=D ** -0.5, window=W, kc=comp, mask_c=valid, ids=ids)
    got = attention_prefill_triton(q.to(DEVICE), ring.to(DEVICE), pos=pos.to(DEVICE), tiles=tiles,
                                   **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    torch.testing.assert_close(got.cpu(), attention_prefill_ref(q, ring, pos=pos, **args), **TOL_FP16)


@pytest.mark.parametrize("backend", ["cuda", "hip64"])
@pytest.mark.parametrize("layer", ["indexed", "ratio", "window"])
def test_several_queries_in_one_split_launch(poisoned_empty: None, backend: str, layer: str) -> None:
    """The decode kernels over T queries at once (a static step of a short prompt: grid axis 2 is the query,
    each with its own position, indexed rows and partials) equal the per-query reference, with the tl.dot
    (cuda) and the CUDA-core (hip64) split forms; padded queries past the real ones change nothing."""
    from ds4station.kernels.attention import attention_prefill_ref

    H, D, T, W = 5, 96, 7, 16
    gen = torch.Generator().manual_seed(17)
    q, sinks = torch.randn(T, H, D, generator=gen), torch.randn(H, generator=gen)
    ring, comp = torch.randn(40, D, generator=gen), torch.randn(30, D, generator=gen)
    pos = torch.arange(3, 3 + T)
    ids, valid = torch.randint(0, 30, (T, 13), generator=gen), torch.rand(T, 13, generator=gen) > 0.3
    valid[0] = False
    kw = {"indexed": dict(kc=comp, mask_c=valid, ids=ids), "ratio": dict(kc=comp[:6], mask_c=None, ids=None, ratio=2),
          "window": dict(kc=None, mask_c=None, ids=None)}[layer]
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    common = dict(scale=D ** -0.5, pos=pos.to(DEVICE), window=W)
    tiles = attention_tiles(H, D, W + (13 if layer == "indexed" else 6 if layer == "ratio" else 0), backend)
    got = attention_decode_triton(q.to(DEVICE), ring.to(DEVICE), None, dev["kc"], dev["mask_c"], sinks.to(DEVICE),
                                  ids=dev["ids"], **common, ratio=kw.get("ratio", 0), tiles=tiles)
    want = attention_prefill_ref(q, ring, kw["kc"], kw["mask_c"], sinks, D ** -0.5, kw["ids"], pos, W,
                                 kw.get("ratio", 0))
    tol = TOL_DEFAULT if tiles.precision == "tf32" else TOL
    assert got.shape == (T, H, D) and torch.allclose(got.cpu(), want, **tol), (got.cpu() - want).abs().max()
    one = attention_decode_triton(q[2].to(DEVICE), ring.to(DEVICE), None, dev["kc"],
                                  None if dev["mask_c"] is None else dev["mask_c"][2], sinks.to(DEVICE),
                                  ids=None if dev["ids"] is None else dev["ids"][2], scale=D ** -0.5,
                                  pos=pos[2:3].to(DEVICE), window=W, ratio=kw.get("ratio", 0), tiles=tiles)
    assert torch.equal(one, got[2])  # a query's result does not depend on the others in the launch
    with pytest.raises(ValueError, match="ring"):
        attention_decode_triton(q.to(DEVICE), ring.to(DEVICE), None, None, None, sinks.to(DEVICE), 1.0,
                                pos=pos.to(DEVICE), window=0)


@pytest.mark.parametrize(("backend", "block_dc"), [("cuda", None), ("hip64", None), ("cuda", 32), ("cuda", 1)])
def test_output_rope_undone_in_the_combine(poisoned_empty: None, backend: str, block_dc: int | None) -> None:
    """`unrope`: the decode kernels rotate the output's last 2 * HALF dims back by the inverse RoPE at each query's
    position in their combine launch: bit for bit what the separate RoPE launch (norm.rope_) gives on the
    output, for T queries, with the rotated tail inside one combine block or spread over several (on a GPU to
    fp32 rounding: the two kernels' multiply-adds may contract differently); an odd combine block (no pairs in
    it) takes the separate launch. The reference does the same."""
    from ds4station.kernels.norm import rope_triton_

    H, D, T, W, half = 5, 96, 3, 16, 16
    gen = torch.Generator().manual_seed(23)
    q, sinks = torch.randn(T, H, D, generator=gen).to(DEVICE), torch.randn(H, generator=gen).to(DEVICE)
    ring = torch.randn(40, D, generator=gen).to(DEVICE)
    pos = torch.tensor([5, 17, 39], device=DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))).to(DEVICE)
    tiles = attention_tiles(H, D, W, backend)
    if block_dc is not None:
        tiles = AttentionTiles(**{**tiles.__dict__, "block_dc": block_dc})
    common = dict(scale=D ** -0.5, pos=pos, window=W, tiles=tiles)
    plain = attention_decode_triton(q, ring, None, None, None, sinks, **common)
    got = attention_decode_triton(q, ring, None, None, None, sinks, **common, unrope=inv_freq)
    want = rope_triton_(plain.clone().view(T * H, D), pos, inv_freq, H, inverse=True).view(T, H, D)
    assert torch.equal(got[..., :D - 2 * half], plain[..., :D - 2 * half])
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # compiled, the two kernels may contract the rotation's products into FMAs differently
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    ref = attention_decode_ref(q.cpu(), ring.cpu(), None, None, None, sinks.cpu(), D ** -0.5, pos=pos.cpu(), window=W,
                               unrope=inv_freq.cpu())
    torch.testing.assert_close(ref, want.cpu(), **(TOL_DEFAULT if tiles.precision == "tf32" else TOL))
    with pytest.raises(ValueError, match="unrope needs"):
        attention_decode_triton(q, ring, None, None, None, sinks, **common, unrope=torch.ones(D // 2 + 1,
                                                                                              device=DEVICE))


@pytest.mark.parametrize(("D", "block_dc", "unrope"), [(128, 32, True), (128, 64, False), (192, 128, True),
                                                     (128, 16, True)])
def test_output_quantised_in_the_combine(poisoned_empty: None, D: int, block_dc: int, unrope: bool) -> None:
    """`act16`: the combine launch also stores the output rows [T, H * D] quantised for the output projection's
    integer-dot matvec: the same words and scales, bit for bit, as quantize_act16 of the output it stores (after
    the inverse RoPE), which is itself unchanged, also where a head's last block is ragged (192 = 128 + 64); a
    combine block that is not whole 32-groups (16) quantises in a launch of its own, to the same result. The
    reference path refuses it (no integer-dot kernels there)."""
    from ds4station.kernels.act_quant import quantize_act16

    H, T, W, half = 3, 2, 16, 16
    gen = torch.Generator().manual_seed(29)
    q, sinks = torch.randn(T, H, D, generator=gen).to(DEVICE), torch.randn(H, generator=gen).to(DEVICE)
    ring = torch.randn(40, D, generator=gen).to(DEVICE)
    pos = torch.tensor([7, 33], device=DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))).to(DEVICE)
    tiles = AttentionTiles(**{**attention_tiles(H, D, W, "cuda").__dict__, "block_dc": block_dc})
    common = dict(scale=D ** -0.5, pos=pos, window=W, tiles=tiles, unrope=inv_freq if unrope else None)
    plain = attention_decode_triton(q, ring, None, None, None, sinks, **common)
    got, act = attention_decode_triton(q, ring, None, None, None, sinks, **common, act16=True)
    assert torch.equal(got, plain)
    for a, b in zip(act, quantize_act16(plain.view(T, H * D)), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="act16"):
        attention_decode(q.cpu(), ring.cpu(), None, None, None, sinks.cpu(), D ** -0.5, pos=pos.cpu(), window=W,
                         act16=True)


def test_prefill_attention_rejects_bad_input() -> None:
    from ds4station.kernels.attention import attention_prefill_triton

    q, ring, pos = torch.zeros(3, 2, 32), torch.zeros(8, 32), torch.arange(3)
    with pytest.raises(ValueError, match="window"):
        attention_prefill_triton(q, ring, None, None, torch.zeros(2), 1.0, None, pos, window=9)
    with pytest.raises(ValueError, match="ratio"):
        attention_prefill_triton(q, ring, torch.zeros(4, 32), None, torch.zeros(2), 1.0, None, pos, window=4)
    with pytest.raises(ValueError, match="pos"):
        attention_prefill_triton(q, ring, None, None, torch.zeros(2), 1.0, None, pos[:2], window=4)
