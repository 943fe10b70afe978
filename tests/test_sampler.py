"""Sampler behaviours (greedy, seeds, each filter) and stop-string scanning of a text stream."""

from __future__ import annotations

import pytest
import torch

from ds4station.engine.sampler import (
    HostRead,
    Sampler,
    SamplingParams,
    StopScanner,
    _top_p_prefix,
    filtered_probs,
    host_ints,
)

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def draws(params: SamplingParams, n: int = 400, logits: torch.Tensor = LOGITS) -> list[int]:
    s = Sampler(params)
    return [s(logits) for _ in range(n)]


def test_greedy_is_argmax_and_ignores_seed():
    assert draws(SamplingParams(temperature=0, seed=1), 5) == [0] * 5
    assert Sampler(SamplingParams())(torch.tensor([[0.0, 3.0, 1.0]])) == 1


def test_seed_reproduces_and_differs_between_seeds():
    a = draws(SamplingParams(temperature=1.0, seed=42))
    assert a == draws(SamplingParams(temperature=1.0, seed=42))
    assert a != draws(SamplingParams(temperature=1.0, seed=43))
    assert set(a) == {0, 1, 2, 3, 4}  # temperature 1 over 400 draws reaches every token


def test_temperature_one_follows_the_distribution():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=0), 4000)), minlength=5)
    torch.testing.assert_close(counts / 4000, LOGITS.exp(), atol=0.03, rtol=0)


def test_low_temperature_sharpens():
    p = filtered_probs(LOGITS, SamplingParams(temperature=0.1))
    assert p[0] > 0.99


def test_top_k_keeps_k_most_likely():
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=3))) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p():
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8 <= + 0.15
    assert (p > 0).tolist() == [True, True, True, False, False]
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01))
    assert (p > 0).tolist() == [True, False, False, False, False]


def test_min_p_drops_tokens_below_fraction_of_best():
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))  # keep >= 0.15
    assert (p > 0).tolist() == [True, True, True, False, False]


def test_invalid_params_are_refused():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"min_p": 2}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def scan(stop: list[str], pieces: list[str]) -> tuple[str, bool]:
    sc = StopScanner(stop)
    out = "".join(sc.feed(p) for p in pieces) + sc.flush()
    return out, sc.stopped


def test_stop_string_split_across_pieces_is_never_emitted():
    assert scan(["STOP"], ["hello S", "TO", "P and more"]) == ("hello ", True)


def test_held_back_prefix_is_released_when_it_does_not_match():
    sc = StopScanner(["</end>"])
    assert sc.feed("a </e") == "a "
    assert sc.feed("xyz") == "</exyz"
    assert scan(["</end>"], ["tail </en"]) == ("tail </en", False)


def test_earliest_of_several_stop_strings_wins():
    assert scan(["world", "lo"], ["hello world"]) == ("hel", True)
    assert scan([], ["plain"]) == ("plain", False)


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p rule over the whole vocabulary sorted (what filtered_probs must equal)."""
    sorted_p, order = torch.sort(probs / probs.sum(), descending=True)
    drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= top_p
    out = torch.zeros_like(probs).scatter_(0, order, sorted_p.masked_fill(drop, 0.0))
    return out / out.sum()


@pytest.mark.parametrize("scale", [0.1, 3.0, 12.0])  # flat (the prefix needs the whole vocabulary) to peaked
@pytest.mark.parametrize("top_p", [0.5, 0.95, 0.999])
def test_top_p_over_a_large_vocabulary_keeps_what_a_full_sort_keeps(scale: float, top_p: float) -> None:
    """filtered_probs looks for the top-p prefix among the most likely 256, 4,096, ... tokens: the tokens kept
    and their probabilities are the full sort's, wherever the prefix ends."""
    logits = torch.randn(20000, generator=torch.Generator().manual_seed(7)) * scale
    params = SamplingParams(temperature=1.0, top_p=top_p)
    got = filtered_probs(logits, params)
    want = _top_p_by_full_sort(torch.softmax(logits, -1), top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert int((got > 0).sum()) > (256 if scale == 0.1 else 0)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_draw_never_picks_a_token_of_probability_zero(device: str) -> None:
    """Draws where the probabilities are (on a GPU from a device generator seeded by the sampler's): zeros
    anywhere (first, last, between) are never drawn, the probabilities need not sum to 1, the draws follow
    them, and a seed reproduces them."""
    probs = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0], device=device)
    s = Sampler(SamplingParams(temperature=1.0, seed=5))
    got = torch.tensor([s.draw(probs) for _ in range(4000)])
    assert set(got.tolist()) == {1, 3, 4}
    torch.testing.assert_close(torch.bincount(got, minlength=6) / 4000, probs.cpu() / 4, atol=0.03, rtol=0)
    assert s.draw(torch.tensor([0.0, 0.0, 1.0], device=device)) == 2
    again = Sampler(SamplingParams(temperature=1.0, seed=5))
    assert [again.draw(probs) for _ in range(4000)] == got.tolist()
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(device)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=9)
    assert [Sampler(params)(logits) for _ in range(3)] == [Sampler(params)(logits)] * 3



@pytest.mark.parametrize("scale", [0.1, 3.0, 12.0])
@pytest.mark.parametrize("top_p", [0.5, 0.95, 0.999])
def test_top_p_prefix_by_a_full_sort_is_the_growing_top_k_s(scale: float, top_p: float) -> None:
    """On a GPU the prefix comes from the whole vocabulary sorted (nothing read on the host), on the CPU from the
    growing top-k: the same probabilities in the same order and the same running mass up to the first that
    reaches top_p, over the same tokens (equal probabilities may come in another order), so filtered_probs keeps
    the same tokens with the same probabilities on either path."""
    probs = torch.softmax(torch.randn(20000, generator=torch.Generator().manual_seed(11)) * scale, -1)
    top_k, order_k, mass_k = _top_p_prefix(probs, top_p, sort=False)
    top_s, order_s, mass_s = _top_p_prefix(probs, top_p, sort=True)
    n = int((mass_k - top_k < top_p).sum())  # the kept prefix
    assert 0 < n <= top_k.numel() <= top_s.numel() == probs.numel()
    assert torch.equal(top_k[:n], top_s[:n]) and torch.equal(mass_k[:n], mass_s[:n])
    assert set(order_k[:n].tolist()) == set(order_s[:n].tolist())
    assert bool(mass_s[n - 1] >= top_p) or n == probs.numel()


def test_a_draw_is_multinomial_s_draw_for_the_same_seed() -> None:
    """The sampler draws by the exponential race torch.multinomial runs for one sample, with the same noise from
    the same generator: draw after draw the token multinomial gives from a generator in the same state (also
    where two tokens are equally likely and where most of the row is zero)."""
    gen = torch.Generator().manual_seed(4)
    rows = [torch.softmax(torch.randn(5000, generator=gen) * 3, -1), torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0]),
            filtered_probs(torch.randn(3000, generator=gen), SamplingParams(temperature=0.7, top_k=20, top_p=0.8))]
    for probs in rows:
        for seed in range(40):
            s = Sampler(SamplingParams(temperature=1.0, seed=seed))
            twin = torch.Generator().manual_seed(seed)
            for _ in range(3):
                assert s.draw(probs) == int(torch.multinomial(probs, 1, generator=twin))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_picks_read_together_are_each_sampler_s_own_tokens(device: str) -> None:
    """A batched step's requests pick their tokens where the logits are (`pick`: a one-element tensor on that
    device) and the scheduler reads them together (`host_ints`): each is the token that request's sampler gives
    on its own with the same seed, greedy and sampled with every filter, request after request."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 4000, generator=gen) * 4
    logits[5] = logits[1]
    logits = logits.to(device)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.6, top_p=0.9,
              seed=2), SamplingParams(temperature=1.3, top_k=30, seed=3), SamplingParams(temperature=0.9, min_p=0.05,
              top_p=0.95, top_k=100, seed=4), SamplingParams(temperature=1.0, seed=1)]
    together, alone = [Sampler(p) for p in params], [Sampler(p) for p in params]
    for _ in range(5):
        picks = [s.pick(logits[b]) for b, s in enumerate(together)]
        assert all(t.device.type == device and t.numel() == 1 for t in picks)
        got = host_ints(picks)
        assert got == [s(logits[b]) for b, s in enumerate(alone)]
        assert got[0] == int(logits[0].argmax()) and got[1] == got[5]  # the same seed and row, the same token
    assert host_ints([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="queued work is a GPU's")
def test_a_host_read_waits_for_the_picks_not_for_work_queued_after_it() -> None:
    """HostRead (what the decode loop reads a step's tokens with, after queueing the next step): its values are
    the picks', and reading them returns while work queued after the read began still runs."""
    logits = torch.randn(3, 1000, device="cuda")
    want = logits.argmax(-1).tolist()
    read = HostRead([torch.argmax(row) for row in logits])
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time, queued behind the copy
    assert read.values() == want
    assert not torch.cuda.current_stream().query()  # the work queued after it still runs
    torch.cuda.synchronize()
