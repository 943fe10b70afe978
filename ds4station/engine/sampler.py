"""Next-token sampling and the stop rules of a generated text stream.

`Sampler` turns last-position logits into a token: greedy (argmax) at temperature 0, otherwise
temperature -> top-k -> softmax -> min-p -> top-p -> draw with the sampler's own seeded torch.Generator, all
where the logits are; a seed reproduces a generation exactly and concurrent samplers do not share random state.
A temperature below GREEDY_BELOW is sampled greedily too: that is its limit, and dividing logits by it
would overflow float32 (1e-45 rounds to a denormal, 1e-300 to zero) into a distribution of inf/nan.

`StopScanner` applies stop strings to streamed text: it holds back the tail that could still become a stop
string, so text that ends up matching one is never emitted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Temperatures below this are greedy (as vLLM does): 1e-5 already puts all the mass on the argmax unless two
# logits are within ~1e-4 of each other.
GREEDY_BELOW = 1e-5
TOP_P_FIRST_K = 256  # top-p looks for its prefix among this many tokens first (x16 while their mass falls short)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None: a random seed per Sampler
    max_tokens: int = 256
    stop: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p {self.min_p} must be in [0, 1]")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens {self.max_tokens} must be >= 0")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed {self.seed} does not fit in 64 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> the distribution actually sampled from (not greedy), float32, sums to 1."""
    z = logits.float() / p.temperature
    if 0 < p.top_k < z.numel():
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1:
        # keep the smallest prefix (by falling probability) whose mass reaches top_p; the most likely token
        # always survives
        probs = probs / probs.sum()
        top, order, mass = _top_p_prefix(probs, p.top_p, sort=probs.device.type != "cpu")
        drop = (mass - top) >= p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, top.masked_fill(drop, 0.0))
    return probs / probs.sum()


def _top_p_prefix(probs: torch.Tensor, top_p: float, sort: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, their indices, running mass) of the most likely tokens, most likely first, up to at least the
    first whose running mass reaches top_p. `sort`: the whole vocabulary sorted (on a GPU: queued behind the
    step like the rest, nothing waited for). Else among the k most likely, k growing x16 from TOP_P_FIRST_K
    until their mass reaches top_p, which reads the mass on the host each time (on a CPU sorting 129,280 logits
    takes 16.7 ms on 2 cores, a top-256 ~1 ms). Both give the same tokens and the same sums."""
    if sort:
        top, order = torch.sort(probs, descending=True)
        return top, order, torch.cumsum(top, 0)
    n, k = probs.numel(), min(probs.numel(), TOP_P_FIRST_K)
    while True:
        top, order = torch.topk(probs, k)  # sorted, most likely first
        mass = torch.cumsum(top, 0)
        if k == n or host_float(mass[-1]) >= top_p:
            return top, order, mass
        k = min(n, k * 16)


def _wait(t: torch.Tensor) -> None:
    """On a GPU, wait for t by an event, which lets other Python threads run meanwhile (the server's event loop
    sending the previous token); reading the value alone would hold the interpreter lock for the whole wait."""
    if t.is_cuda:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        done.synchronize()


def host_int(t: torch.Tensor) -> int:
    """The value of a one-element tensor (see _wait)."""
    _wait(t)
    return int(t)


class HostRead:
    """The values of one-element tensors of one device (token ids picked by `Sampler.pick`), copied to the host
    behind the work queued so far: `values` waits for that work only, not for what is queued after this read
    began (the next decode step, queued ahead with `device` as its tokens). The copy lands in pinned memory
    (on a GPU), and the wait is an event's (see _wait)."""

    def __init__(self, ts: Sequence[torch.Tensor]) -> None:
        self.device = torch.stack([t.reshape(()) for t in ts])  # [n] where the picks are
        self._done: torch.cuda.Event | None = None
        if self.device.is_cuda:
            self._host = torch.empty(self.device.shape, dtype=self.device.dtype, pin_memory=True)
            self._host.copy_(self.device, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(self.device.device))
        else:
            self._host = self.device

    def values(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return [int(v) for v in self._host.tolist()]


def host_ints(ts: Sequence[torch.Tensor]) -> list[int]:
    """The values of several one-element tensors (token ids picked by `Sampler.pick`) with one wait per device:
    the picks of every request of a batched step were queued behind it, and come back together."""
    out = [0] * len(ts)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(ts):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, HostRead([ts[i] for i in idx]).values(), strict=True):
            out[i] = v
    return out


def host_float(t: torch.Tensor) -> float:
    """The value of a one-element tensor (see _wait)."""
    _wait(t)
    return float(t)


class Sampler:
    """Greedy picks the argmax where the logits are (a GPU sends back one id, not the [vocab] row); a draw
    filters the logits where they are too and draws there (`draw`), from the sampler's own seeded CPU
    generator (on a GPU: a device generator seeded from it for each draw), so a seed reproduces the draws on
    the same kind of device and concurrent samplers share no random state."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(params.seed))
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def draw(self, probs: torch.Tensor) -> int:
        """A token drawn from probs [vocab] (non-negative, any positive sum): `_draw`'s, on the host."""
        return host_int(self._draw(probs))

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """A token drawn from probs [vocab] where they are, as a one-element tensor, by the exponential race
        torch.multinomial runs for one sample (argmax of p / q, q ~ Exp(1)), with its draws: the noise from the
        sampler's generator on the CPU; elsewhere from a generator of that device seeded from it for this draw
        (the [vocab] row never crosses to the host). Three operations, without multinomial's checks of the row
        (those are launches of their own on a GPU; the row here is a softmax's). The race changes its pick only
        when two tokens' ratios are within the logits' change; an inverse CDF moves with the sum of all earlier
        probabilities: on 512 random logits with 1e-3 / 1e-2 relative noise it changed 5 / 139 of 1,000 seeded
        draws against 1 / 7 (a batched step's rounding differs from a lone step's: tests/test_scheduler.py's
        batched tests)."""
        if probs.device.type == "cpu":
            gen = self.generator
        else:
            gen = self._device_generators.get(probs.device)
            if gen is None:
                gen = self._device_generators[probs.device] = torch.Generator(device=probs.device)
            gen.manual_seed(int(torch.randint(0, 2**62, (), generator=self.generator)))
        q = torch.empty_like(probs).exponential_(1, generator=gen)
        return torch.argmax(probs / q)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] (or [1, vocab]) of the last position -> the token id as a one-element tensor where the
        logits are, nothing waited for (on a GPU the work is queued; `host_ints` reads several picks at once)."""
        logits = logits.reshape(-1)
        if self.params.greedy:
            return torch.argmax(logits)
        return self._draw(filtered_probs(logits, self.params))

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [vocab] (or [1, vocab]) of the last position -> token id."""
        return host_int(self.pick(logits))

    def verify(self, logits: torch.Tensor, draft: int) -> tuple[int, bool]:
        """A drafted token against the target's logits at its position -> (the token to emit, accepted).
        Greedy: accepted when it is the argmax, which is emitted either way. Sampled, by the standard
        speculative rule for a draft that is certain of its token (prompt lookup: q(draft) = 1): accepted with
        probability p(draft), else a token drawn from p with the draft removed, so the emitted token is
        distributed exactly as `self(logits)` would draw it."""
        logits = logits.reshape(-1)
        if self.params.greedy:
            token = host_int(torch.argmax(logits))
            return token, token == draft
        probs = filtered_probs(logits, self.params)
        if float(torch.rand((), generator=self.generator)) < host_float(probs[draft]):
            return draft, True
        rest = probs.clone()
        rest[draft] = 0.0
        return self.draw(rest), False


class StopScanner:
    """Feed text pieces; get back what may be shown. After a stop string is seen, `stopped` is True and
    nothing from the stop string on is ever returned."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.stopped = False
        self._held = ""

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """End of stream: release the held-back tail (it did not become a stop string)."""
        text, self._held = self._held, ""
        return "" if self.stopped else text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
