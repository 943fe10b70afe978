"""What the control panel collects each refresh, and the GPU history it keeps for the whole session.

`collect_gpus` takes one sample per card (a blocking read: called from a thread worker). `GpuHistory` keeps,
per card, the SM/graphics clock as a fraction of its maximum and the hottest temperature, plus whether and
why it ever throttled, so a card that throttled an hour ago still shows it. `spark` draws such a series as
block characters; `bar` draws a fill level; both are plain strings so they render the same everywhere.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ds4station.hardware import Device, Gpu, Sample

HISTORY = 120  # samples kept per card (two minutes at one refresh a second)
_BLOCKS = "▁▂▃▄▅▆▇█"


def spark(values: Iterable[float | None], lo: float = 0.0, hi: float | None = None, width: int = 0) -> str:
    """A sparkline of `values` scaled to [lo, hi] (hi: the largest value); None draws a gap; the last
    `width` values when width > 0."""
    vals = list(values)
    if width > 0:
        vals = vals[-width:]
    known = [v for v in vals if v is not None]
    if not known:
        return " " * len(vals)
    top = hi if hi is not None else max(known)
    span = top - lo
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
            continue
        frac = 1.0 if span <= 0 else min(max((v - lo) / span, 0.0), 1.0)
        out.append(_BLOCKS[round(frac * (len(_BLOCKS) - 1))])
    return "".join(out)


def bar(fraction: float, width: int) -> str:
    """A fill bar `width` cells wide, in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width)[:width]


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass
class CardHistory:
    clock_ratio: collections.deque[float | None] = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    temperature: collections.deque[float | None] = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    throttled_samples: int = 0
    reasons_seen: dict[str, int] = field(default_factory=dict)  # reason -> samples it was active

    @property
    def ever_throttled(self) -> bool:
        return self.throttled_samples > 0

    def add(self, s: Sample) -> None:
        clock, top = _num(s.clock_sm), _num(s.clock_sm_max)
        self.clock_ratio.append(clock / top if clock is not None and top else None)
        temps = [t for t in (_num(s.temp_junction), _num(s.temp_edge), _num(s.temp_memory)) if t is not None]
        self.temperature.append(max(temps) if temps else None)
        if s.throttled is True:
            self.throttled_samples += 1
            for r in s.throttle_reasons:
                self.reasons_seen[r] = self.reasons_seen.get(r, 0) + 1


@dataclass
class GpuReading:
    gpu: Gpu
    sample: Sample
    history: CardHistory


class GpuHistory:
    """Per-card history over the session, keyed by detection index."""

    def __init__(self) -> None:
        self.cards: dict[int, CardHistory] = {}

    def add(self, gpus: Sequence[Gpu], samples: Sequence[Sample]) -> list[GpuReading]:
        out = []
        for g, s in zip(gpus, samples, strict=True):
            h = self.cards.setdefault(g.index, CardHistory())
            h.add(s)
            out.append(GpuReading(g, s, h))
        return out


def collect_gpus(devices: Sequence[Device]) -> tuple[list[Gpu], list[Sample]]:
    """One telemetry sample per card (blocking sysfs/NVML reads)."""
    return [d.info() for d in devices], [d.sample() for d in devices]


def card_name(name: str, bus: str | None = None, desktop: bool = False, index: int | None = None) -> str:
    """One identity for a card wherever the panel names it: its number, name, short PCI bus id and the
    display mark, e.g. `2 AMD Radeon VII 0c:00.0 ◆`."""
    short = bus[-7:] if isinstance(bus, str) and bus.count(":") >= 1 and bus != name else ""
    parts = [str(index)] if index is not None else []
    parts += [name] + ([short] if short else []) + (["◆"] if desktop else [])
    return " ".join(parts)
