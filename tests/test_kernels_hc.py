"""Fused hyper-connection kernels (ds4station/kernels/hc.py) against the reference model's own math
(engine/model.py: HyperConnection.pre / .post, hc_mix, sinkhorn, DS4Model.head) at small odd shapes, with
every buffer the launchers allocate poisoned with NaN, split-K over several (and ragged) chunks, Sinkhorn at
1 and 20 iterations, in-place hc_post, and the launch count per call."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_norm import _same_quant

from ds4station.engine.model import DS4Model
from ds4station.kernels import hc
from ds4station.kernels.act_quant import quantize_act, quantize_act16
from ds4station.kernels.dispatch import HcTiles, hc_tiles
from ds4station.kernels.hc import hc_head_pre_triton, hc_post_ref, hc_post_triton, hc_pre_triton
from ds4station.kernels.reference import HyperConnection, rms_norm, sinkhorn
from ds4station.model.config import TINY

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"rtol": 1e-5, "atol": 1e-5}

# Forces split-K (K = 4 * 96 = 384 -> 3 chunks of 128, padded to 4 in the finalize; 4 * 256 -> 8 chunks) and
# ragged dim blocks (96 = 64 + 32) so the masks are exercised; None = the launcher's own tiles.
SPLIT = HcTiles(block_k=64, chunk_k=128, block_d=64, num_warps=1, num_warps_d=1)
RAGGED_K = HcTiles(block_k=256, chunk_k=256, block_d=128, num_warps=1, num_warps_d=1)  # 384 = 256 + 128


def _weights(T: int, C: int, dim: int, m: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(T, C, dim, generator=gen) * 3
    fn = torch.randn(m, C * dim, generator=gen) * 0.2  # mix entries of a few units: non-trivial sigmoids
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(m, generator=gen)
    return tuple(t.to(DEVICE) for t in (X, fn, scale, base))


def _norm_weight(dim: int) -> torch.Tensor:
    """An RMSNorm weight for hc_pre's norm (attn_norm / ffn_norm): not all ones, so it is applied."""
    return (torch.rand(dim, generator=torch.Generator().manual_seed(dim)) + 0.5).to(DEVICE)


def _pre(X: torch.Tensor, *args, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN002, ANN003
    """hc_pre_triton with `_norm_weight` and no quantised forms -> (xn, post, comb)."""
    xn, _, post, comb = hc_pre_triton(X, *args, _norm_weight(X.shape[-1]), **kw)
    return xn, post, comb


def _normed(pre: tuple[torch.Tensor, ...], w: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """The model's HyperConnection.pre (x, post, comb) with x through the RMSNorm after it."""
    return (rms_norm(pre[0], w, eps), *pre[1:])


@pytest.mark.parametrize(("T", "dim", "seed", "iters", "tiles"), [
    (1, 96, 0, 20, None), (3, 96, 1, 20, SPLIT), (3, 96, 2, 1, RAGGED_K), (1, 256, 3, 1, SPLIT),
    (3, 256, 4, 20, None), (1, 256, 5, 20, SPLIT)])
def test_hc_pre_matches_model(poisoned_empty: None, T: int, dim: int, seed: int, iters: int,
                              tiles: HcTiles | None) -> None:
    C = 4
    X, fn, scale, base = _weights(T, C, dim, (2 + C) * C, seed)
    cfg = dataclasses.replace(TINY, dim=dim, hc_mult=C, hc_sinkhorn_iters=iters)
    want = _normed(HyperConnection(fn, scale, base, cfg).pre(X), _norm_weight(dim), cfg.rms_eps)
    got = _pre(X, fn, scale, base, cfg.rms_eps, cfg.hc_eps, iters, tiles=tiles)
    for g, w, name in zip(got, want, ("xn", "post", "comb"), strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, n=name: f"{n}: {m}")  # noqa: B023
    # Every Sinkhorn round ends with the column normalisation: columns sum to 1 (up to the eps terms).
    torch.testing.assert_close(got[2].sum(-2), torch.ones(T, C, device=DEVICE), rtol=0, atol=1e-5)


def test_sinkhorn_iteration_count_matters() -> None:
    """1 and 20 iterations give different combs, each matching model.sinkhorn at its own count (so the
    kernel's loop bound is the argument, not a constant)."""
    X, fn, scale, base = _weights(1, 4, 96, 24, 7)
    fn = fn * 5  # peaked logits: the row normalisation rounds move the matrix visibly
    combs = {}
    for iters in (1, 20):
        _, _, combs[iters] = _pre(X, fn, scale, base, 1e-6, 1e-6, iters)
        cfg = dataclasses.replace(TINY, dim=96, hc_sinkhorn_iters=iters)
        torch.testing.assert_close(combs[iters], HyperConnection(fn, scale, base, cfg).pre(X)[2], **TOL)
    assert (combs[1] - combs[20]).abs().max() > 1e-3
    logits = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sinkhorn(logits, 1, 1e-6).sum(-2), torch.ones(2, 4), rtol=0, atol=1e-5)


def test_hc_pre_padded_streams(poisoned_empty: None) -> None:
    """C = 3 is padded to 4 lanes in registers: the padding must not leak into softmax / Sinkhorn / sums."""
    C, dim = 3, 40
    X, fn, scale, base = _weights(2, C, dim, (2 + C) * C, 8)
    cfg = dataclasses.replace(TINY, dim=dim, hc_mult=C)
    want = _normed(HyperConnection(fn, scale, base, cfg).pre(X), _norm_weight(dim), cfg.rms_eps)
    got = _pre(X, fn, scale, base, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters,
               tiles=HcTiles(block_k=32, chunk_k=64, block_d=16, num_warps=1, num_warps_d=1))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize(("T", "dim", "seed", "tiles"), [(1, 96, 0, SPLIT), (3, 96, 1, None),
                                                         (3, 256, 2, SPLIT), (1, 256, 3, None)])
def test_hc_post_matches_model(poisoned_empty: None, T: int, dim: int, seed: int, tiles: HcTiles | None) -> None:
    C = 4
    gen = torch.Generator().manual_seed(100 + seed)
    out = (torch.randn(T, dim, generator=gen) * 2).to(DEVICE)
    X = torch.randn(T, C, dim, generator=gen).to(DEVICE)
    post = (2 * torch.rand(T, C, generator=gen)).to(DEVICE)
    comb = sinkhorn(torch.randn(T, C, C, generator=gen), 20, 1e-6).to(DEVICE)
    want = HyperConnection.post(out, X, post, comb)
    got = hc_post_triton(out, X, post, comb, tiles=tiles)
    torch.testing.assert_close(got, want, **TOL)
    # In place over X (what a CUDA-graph decode step does with its static residual buffer).
    Xi = X.clone()
    assert hc_post_triton(out, Xi, post, comb, out_X=Xi, tiles=tiles) is Xi
    torch.testing.assert_close(Xi, want, **TOL)
    # A sublayer of two parts (the FFN's routed and shared experts) summed inside: exactly the sum's post.
    part = torch.randn(T, dim, generator=gen).to(DEVICE)
    two = hc_post_triton(out - part, X, post, comb, part, tiles=tiles)
    assert torch.equal(two, hc_post_triton((out - part) + part, X, post, comb, tiles=tiles))
    torch.testing.assert_close(two, HyperConnection.post((out - part) + part, X, post, comb), **TOL)
    with pytest.raises(ValueError, match="must have out's shape"):
        hc_post_triton(out, X, post, comb, part[:, :-1])


@pytest.mark.parametrize(("T", "dim", "seed", "block_dm"), [(1, 96, 0, 32), (3, 96, 1, 64), (2, 256, 2, None),
                                                            (1, 256, 3, 128)])
def test_hc_post_computes_the_next_mix_partials(poisoned_empty: None, T: int, dim: int, seed: int,
                                                block_dm: int | None) -> None:
    """hc_post(mix=fn) also writes the mix partials of the state it makes (the next hc_pre's first launch, folded
    into this one): the state is the plain hc_post's bit for bit; the partials sum to fn @ flatten(X') and
    |X'|^2, and hc_pre from them equals the model's HyperConnection.pre of X' (K chunks of block_dm, 96 = 64 + 32
    ragged)."""
    C, m = 4, 24
    gen = torch.Generator().manual_seed(200 + seed)
    out = (torch.randn(T, dim, generator=gen) * 2).to(DEVICE)
    X, fn, scale, base = _weights(T, C, dim, m, seed)
    post = (2 * torch.rand(T, C, generator=gen)).to(DEVICE)
    comb = sinkhorn(torch.randn(T, C, C, generator=gen), 20, 1e-6).to(DEVICE)
    tiles = hc_tiles(C * dim, m, dim, T, "cpu" if DEVICE == "cpu" else "cuda")
    if block_dm is not None:
        tiles = dataclasses.replace(tiles, block_dm=block_dm)
    Y, part = hc_post_triton(out, X, post, comb, tiles=tiles, mix=fn)
    assert torch.equal(Y, hc_post_triton(out, X, post, comb, tiles=tiles))
    assert part.shape == (T, C * -(-dim // tiles.block_dm), m + 1)
    flat = Y.reshape(T, -1)
    torch.testing.assert_close(part[..., :m].sum(1), flat @ fn.T, **TOL)
    torch.testing.assert_close(part[..., m].sum(1), (flat * flat).sum(1), rtol=1e-5, atol=1e-3)
    cfg = dataclasses.replace(TINY, dim=dim, hc_mult=C)
    want = _normed(HyperConnection(fn, scale, base, cfg).pre(Y), _norm_weight(dim), cfg.rms_eps)
    got = _pre(Y, fn, scale, base, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, part=part)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    with pytest.raises(ValueError, match="mix must be"):
        hc_post_triton(out, X, post, comb, mix=fn[:, :-1])
    with pytest.raises(ValueError, match="mix partials"):
        _pre(Y, fn, scale, base, cfg.rms_eps, cfg.hc_eps, 1, part=part[..., :-1])


@pytest.mark.parametrize("mix", [False, True])
def test_hc_post_padding_rows_take_the_last_real_rows_output(poisoned_empty: None, mix: bool) -> None:
    """hc_post(last=...): in a padded static step the rows after the last real one are copies of it, but the MoE
    kernels skip them (their rows of out are zero); hc_post gives them row last's out and extra, so they stay
    copies (bit for bit, also their mix partials) and the KV rows they write are the last row's. The rows up to
    last are the plain hc_post's; the reference does the same."""
    T, C, dim, m, last = 6, 4, 96, 24, 3
    gen = torch.Generator().manual_seed(31)
    X1, fn, _, _ = _weights(1, C, dim, m, 5)
    X = X1.expand(T, C, dim).contiguous()
    out = (torch.randn(1, dim, generator=gen) * 2).to(DEVICE).expand(T, dim).contiguous()
    extra = torch.randn(1, dim, generator=gen).to(DEVICE).expand(T, dim).contiguous()
    out[last + 1:] = 0  # the skipped rows
    post = (2 * torch.rand(1, C, generator=gen)).to(DEVICE).expand(T, C).contiguous()
    comb = sinkhorn(torch.randn(1, C, C, generator=gen), 20, 1e-6).to(DEVICE).expand(T, C, C).contiguous()
    at = torch.tensor([last], device=DEVICE)
    got = hc_post_triton(out, X, post, comb, extra, mix=fn if mix else None, last=at)
    Y, part = got if mix else (got, None)
    for r in range(last + 1, T):
        assert torch.equal(Y[r], Y[last]) and (part is None or torch.equal(part[r], part[last]))
    plain = hc_post_triton(out, X, post, comb, extra)
    assert torch.equal(Y[:last + 1], plain[:last + 1]) and not torch.equal(Y[-1], plain[-1])
    torch.testing.assert_close(hc_post_ref(out, X, post, comb, extra, at), Y, **TOL)


@pytest.mark.parametrize(("T", "dim", "seed", "tiles"), [(1, 96, 0, None), (3, 96, 1, SPLIT),
                                                         (3, 256, 2, None), (1, 256, 3, RAGGED_K)])
def test_hc_head_pre_matches_model_head(poisoned_empty: None, T: int, dim: int, seed: int,
                                        tiles: HcTiles | None) -> None:
    """DS4Model.head with an identity output matrix returns rms_norm(h) * output_norm: our hc_head_pre."""
    C = 4
    X, fn, scale, base = _weights(T, C, dim, C, seed)
    scale = scale[:1]
    base = base[:C]
    norm = (torch.rand(dim, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEVICE)
    cfg = dataclasses.replace(TINY, dim=dim, vocab_size=dim)
    weights = {"output_hc_fn.weight": fn, "output_hc_scale.weight": scale, "output_hc_base.weight": base,
               "output_norm.weight": norm, "output.weight": torch.eye(dim, device=DEVICE)}
    model = DS4Model(cfg, weights, range(0), embed=False, output=True)
    h, acts = hc_head_pre_triton(X, fn, scale, base, cfg.rms_eps, cfg.hc_eps, norm, tiles=tiles)
    assert acts == []
    torch.testing.assert_close(h, model.head(X), **TOL)
    torch.testing.assert_close(h, rms_norm(hc.hc_head_pre_ref(X, fn, scale, base, cfg.rms_eps, cfg.hc_eps), norm,
                                           cfg.rms_eps), **TOL)


@pytest.mark.parametrize(("T", "dim", "seed", "quant", "part"), [
    (1, 96, 0, (), False), (3, 256, 1, ("act16",), True), (2, 128, 2, ("act16", "iq2_xxs"), True),
    (1, 256, 3, ("q2_k",), False), (3, 40, 4, (), False)])
def test_hc_pre_quantises_its_normalised_rows(poisoned_empty: None, T: int, dim: int, seed: int,
                                              quant: tuple[str, ...], part: bool) -> None:
    """hc_pre's finalize also stores its normalised rows quantised for their integer-dot consumers (at most two
    forms): the codes the quantiser's own launch gives on the stored rows (`_same_quant`), and the rows the same
    with and without them (bit for bit in the interpreter, to fp32 rounding compiled); with the mix partials of
    the hc_post that made X too. The head's form likewise. 40 is a row that is no power of two."""
    C, m = 4, 24
    X, fn, scale, base = _weights(T, C, dim, m, seed)
    w = _norm_weight(dim)
    cfg = dataclasses.replace(TINY, dim=dim, hc_mult=C)
    args = (X, fn, scale, base, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    kw = {}
    if part:
        gen = torch.Generator().manual_seed(300 + seed)
        post0 = (2 * torch.rand(T, C, generator=gen)).to(DEVICE)
        comb0 = sinkhorn(torch.randn(T, C, C, generator=gen), 20, 1e-6).to(DEVICE)
        X, kw["part"] = hc_post_triton(X[:, 0] * 0.5, X, post0, comb0, mix=fn)
        args = (X, *args[1:])
    xn, acts, post, comb = hc_pre_triton(*args, w, quant=quant, **kw)
    xn0, acts0, post0, comb0 = hc_pre_triton(*args, w, **kw)
    assert acts0 == []
    for a, b in ((xn0, xn), (post0, post), (comb0, comb)):
        if DEVICE == "cpu":
            assert torch.equal(a, b)
        else:  # two kernels compiled with and without the quantiser may contract multiply-adds differently
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    ref = _normed(HyperConnection(fn, scale, base, cfg).pre(X), w, cfg.rms_eps)
    for got, want in zip((xn, post, comb), ref, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    assert len(acts) == len(quant)
    for got, q in zip(acts, quant, strict=True):
        _same_quant(got, quantize_act16(xn) if q == "act16" else quantize_act(xn, q), q)
    hq = ("act16",) if dim % 32 == 0 else ()
    h, hacts = hc_head_pre_triton(X, fn[:C], scale[:1], base[:C], cfg.rms_eps, cfg.hc_eps, w, quant=hq)
    for got in hacts:
        _same_quant(got, quantize_act16(h), "act16")
    with pytest.raises(ValueError, match="norm must be"):
        hc_pre_triton(*args, w[:-1])
    with pytest.raises(ValueError, match="at most two"):
        hc_pre_triton(*args, w, quant=("act16",) * 3)


def test_launches_per_call(count_launches) -> None:  # type: ignore[no-untyped-def]
    counters = {}
    for name in ("_hc_mix_partial_kernel", "_hc_finalize_kernel", "_hc_post_kernel"):
        counters[name] = count_launches(hc, name)

    def total() -> int:
        return sum(c.launches for c in counters.values())

    X, fn, scale, base = _weights(1, 4, 32, 24, 9)
    w = _norm_weight(32)
    x, _, post, comb = hc_pre_triton(X, fn, scale, base, 1e-6, 1e-6, 20, w, quant=("act16", "q2_k"), tiles=SPLIT)
    assert total() == 2  # the norm and both quantised forms in the finalize
    hc_post_triton(x, X, post, comb)
    assert total() == 3
    hc_head_pre_triton(X, fn[:4], scale[:1], base[:4], 1e-6, 1e-6, w, quant=("act16",))
    assert total() == 5
    assert counters["_hc_post_kernel"].launches == 1
    Y, part = hc_post_triton(x, X, post, comb, mix=fn)  # with the next hc_pre's partials: 2 launches for both
    hc_pre_triton(Y, fn, scale, base, 1e-6, 1e-6, 20, w, part=part)
    assert total() == 7 and counters["_hc_mix_partial_kernel"].launches == 2


def test_public_ops_use_reference_on_cpu() -> None:
    X, fn, scale, base = (t.cpu() for t in _weights(2, 4, 32, 24, 10))
    cfg = dataclasses.replace(TINY, dim=32)
    want = HyperConnection(fn, scale, base, cfg).pre(X)
    w = torch.rand(32) + 0.5
    xn, acts, post, comb = hc.hc_pre(X, fn, scale, base, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, w,
                                     (None, None))
    torch.testing.assert_close(xn, rms_norm(want[0], w, cfg.rms_eps))
    assert acts == [None, None]
    torch.testing.assert_close(post, want[1])
    torch.testing.assert_close(comb, want[2])
    Y, part = hc.hc_post(want[0], X, post, comb, mix=fn)
    torch.testing.assert_close(Y, HyperConnection.post(want[0], X, *want[1:]))
    assert part is None  # the mix partials are a GPU launch's: the reference hc_pre computes its own
    h, act = hc.hc_head_pre(X, fn[:4], scale[:1], base[:4], 1e-6, 1e-6, w)
    torch.testing.assert_close(h, rms_norm(hc.hc_head_pre_ref(X, fn[:4], scale[:1], base[:4], 1e-6, 1e-6), w, 1e-6))
    assert act is None
    with pytest.raises(ValueError, match="integer-dot kernels"):
        hc.hc_pre(X, fn, scale, base, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, w, ("act16",))


def test_launchers_reject_bad_shapes() -> None:
    X, fn, scale, base = _weights(1, 4, 32, 24, 11)
    with pytest.raises(ValueError, match="fn must be"):
        _pre(X, fn[:, :-1], scale, base, 1e-6, 1e-6, 20)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        _pre(X, fn, scale, base, 1e-6, 1e-6, 0)
    with pytest.raises(ValueError, match="shapes do not match"):
        hc_post_triton(X[:, 0], X, torch.ones(1, 3, device=DEVICE), torch.ones(1, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="multiple of block_k"):
        _pre(X, fn, scale, base, 1e-6, 1e-6, 20, tiles=HcTiles(64, 96, 32, 1, 1))


@pytest.mark.parametrize("backend", ["cuda", "hip64", "hip32", "cpu"])
@pytest.mark.parametrize(("t", "dim"), [(1, 4096), (7, 4096), (2048, 4096), (3, 96)])
def test_tiles_are_consistent(backend: str, t: int, dim: int) -> None:
    k, m = 4 * dim, 24
    tiles = hc_tiles(k, m, dim, t, backend)  # type: ignore[arg-type]
    assert tiles.chunk_k % tiles.block_k == 0
    nblk = -(-k // tiles.chunk_k)
    assert 1 <= nblk <= 256
    assert (nblk - 1) * tiles.chunk_k < k  # no empty chunk
    if backend != "cpu" and t >= 256:
        assert nblk == 1  # prefill: one chunk per token, the token programs fill the GPU
    assert 1 <= tiles.num_warps <= 8 and 1 <= tiles.num_warps_d <= 8 and 1 <= tiles.num_warps_m <= 8
    # hc_post's K chunks for the next mix partials: at most 256 per token, whole blocks of 32 or more
    assert 32 <= tiles.block_dm <= tiles.block_d and 4 * -(-dim // tiles.block_dm) <= 256
    if backend == "hip64":  # wave64: half the warps of wave32 for the same tile
        w32 = hc_tiles(k, m, dim, t, "hip32")
        assert tiles.num_warps <= w32.num_warps
