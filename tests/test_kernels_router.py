"""MoE router kernel (ds4station/kernels/router.py) against its torch reference and the reference model's own
MoE.route (engine/model.py): odd expert counts, hash and biased layers, normalised or not, ties in the
biased scores (lower expert index wins), extreme logits (softplus tails), poisoned outputs, one launch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4station.engine.model import MoE
from ds4station.kernels import router as router_k
from ds4station.kernels.dispatch import RouterTiles, router_tiles
from ds4station.kernels.router import router, router_ref, router_triton
from ds4station.model.config import TINY

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _poisoned(T: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs every element of which the kernel must overwrite (an id of -1 / a NaN weight otherwise)."""
    return (torch.full((T, k), -1, dtype=torch.int64, device=DEVICE),
            torch.full((T, k), float("nan"), dtype=torch.float32, device=DEVICE))


def _inputs(T: int, E: int, k: int, seed: int, vocab: int = 40) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=gen) * 4
    bias = torch.randn(E, generator=gen) * 0.5
    tid2eid = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(vocab)]).int()
    tokens = torch.randint(0, vocab, (T,), generator=gen)
    return tuple(t.to(DEVICE) for t in (logits, bias, tid2eid, tokens))


@pytest.mark.parametrize(("T", "E", "k", "hashed", "norm"), [
    (3, 8, 3, False, True), (5, 17, 3, False, False), (4, 17, 3, True, True), (1, 8, 3, True, False),
    (2, 256, 6, False, True), (1, 256, 6, True, True)])
def test_router_matches_reference(T: int, E: int, k: int, hashed: bool, norm: bool) -> None:
    logits, bias, tid2eid, tokens = _inputs(T, E, k, seed=E * 10 + k + hashed)
    args = (logits, None if hashed else bias, tid2eid if hashed else None, tokens if hashed else None, k, norm, 1.5)
    out = _poisoned(T, k)
    ids, wts = router_triton(*args, out=out)
    assert ids.data_ptr() == out[0].data_ptr() and wts.data_ptr() == out[1].data_ptr()
    want_ids, want_wts = router_ref(*args)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_wts, **TOL)
    if norm:
        torch.testing.assert_close(wts.sum(-1), torch.full((T,), 1.5, device=DEVICE), **TOL)
    if not hashed:  # biased top-k: descending biased score, the bias itself not in the weights
        s = torch.sqrt(torch.nn.functional.softplus(logits)) + bias
        chosen = s.gather(1, ids)
        assert (chosen[:, :-1] >= chosen[:, 1:]).all()
        assert (chosen[:, -1:] >= s.scatter(1, ids, float("-inf")).amax(-1, keepdim=True)).all()


@pytest.mark.parametrize(("hashed", "norm"), [(False, True), (True, True), (False, False)])
def test_router_matches_model_route(hashed: bool, norm: bool) -> None:
    """The kernel on the gate logits equals MoE.route (which does the gate matvec itself)."""
    T, E, k, dim = 4, 17, 3, 24
    logits, bias, tid2eid, tokens = _inputs(T, E, k, seed=7 + hashed)
    gen = torch.Generator().manual_seed(8)
    xn = torch.randn(T, dim, generator=gen).to(DEVICE)
    gate_inp = (torch.randn(E, dim, generator=gen) * 0.5).to(DEVICE)
    moe = object.__new__(MoE)  # only route()'s fields; the experts are not needed
    moe.cfg = dataclasses.replace(TINY, n_experts=E, n_experts_used=k, expert_weights_norm=norm,
                                  expert_weights_scale=2.5)
    moe.gate_inp, moe.tid2eid, moe.bias = gate_inp, tid2eid.long() if hashed else None, None if hashed else bias
    want_ids, want_wts = moe.route(xn, tokens)
    ids, wts = router_triton(xn @ gate_inp.T, moe.bias, moe.tid2eid, tokens, k, norm, 2.5, out=_poisoned(T, k))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_wts, **TOL)


def test_router_ties_go_to_lower_expert() -> None:
    """Equal biased scores select the lower expert index first, at the cut-off too."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, -1.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                           [0.0, 5.0, 0.5, 0.5, 5.0, 0.5, 0.5, 0.5]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], device=DEVICE)
    ids, wts = router_triton(logits, bias, None, None, 3, True, 1.0, out=_poisoned(3, 3))
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 4, 2]]
    want_ids, want_wts = router_ref(logits, bias, None, None, 3, True, 1.0)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_wts, **TOL)


def test_router_softplus_tails() -> None:
    """Very negative logits (softplus ~ exp(x), where log(1 + v) would lose it) and very positive ones
    (softplus ~ x): the weights keep their relative precision."""
    logits = torch.tensor([[-30.0, -17.0, -9.0, -0.5, 0.0, 1e-4, 21.0, 90.0, -80.0]], device=DEVICE)
    ids, wts = router_triton(logits, None, None, None, 9, False, 1.0, out=_poisoned(1, 9))
    want_ids, want_wts = router_ref(logits, None, None, None, 9, False, 1.0)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_wts, rtol=1e-5, atol=0.0)


def test_one_launch_and_empty(count_launches) -> None:  # type: ignore[no-untyped-def]
    counter = count_launches(router_k, "_router_kernel")
    logits, bias, _, _ = _inputs(6, 8, 3, seed=3)
    router_triton(logits, bias, None, None, 3, True, 1.0)
    assert counter.launches == 1
    ids, wts = router_triton(logits[:0], bias, None, None, 3, True, 1.0)
    assert ids.shape == wts.shape == (0, 3) and counter.launches == 1


def test_public_router_uses_reference_on_cpu() -> None:
    logits, bias, tid2eid, tokens = (t.cpu() for t in _inputs(3, 17, 3, seed=4))
    for args in ((logits, bias, None, None), (logits, None, tid2eid, tokens)):
        got, want = router(*args, 3, True, 1.5), router_ref(*args, 3, True, 1.5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_router_rejects_bad_arguments() -> None:
    logits, bias, tid2eid, tokens = _inputs(2, 8, 3, seed=5)
    with pytest.raises(ValueError, match="k must be"):
        router_triton(logits, bias, None, None, 9, True, 1.0)
    with pytest.raises(ValueError, match="needs tokens"):
        router_triton(logits, None, tid2eid, None, 3, True, 1.0)
    with pytest.raises(ValueError, match="tid2eid must be"):
        router_triton(logits, None, tid2eid[:, :2], tokens, 3, True, 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        router_triton(logits, bias[:7], None, None, 3, True, 1.0)
    with pytest.raises(ValueError, match="out must be"):
        router_triton(logits, bias, None, None, 3, True, 1.0, out=_poisoned(2, 2))


@pytest.mark.parametrize("backend", ["cuda", "hip64", "hip32", "cpu"])
@pytest.mark.parametrize("E", [8, 17, 256])
def test_router_tiles(backend: str, E: int) -> None:
    tiles = router_tiles(E, backend)  # type: ignore[arg-type]
    assert tiles.block_e >= E and tiles.block_e & (tiles.block_e - 1) == 0
    assert 1 <= tiles.num_warps <= 4
    if backend == "hip64":  # wave64: never more warps than wave32 for the same row
        assert tiles.num_warps <= router_tiles(E, "hip32").num_warps
    assert isinstance(tiles, RouterTiles)
