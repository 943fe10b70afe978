"""What the control panel collects each refresh, and the GPU history it keeps for the whole session.

`collect_gpus` takes one sample per card (a blocking read: called from a thread worker). `GpuHistory` keeps,
per card, the SM/graphics clock (MHz and as a fraction of its maximum), the hottest temperature and the power,
each with the sample's time, plus whether and why it ever throttled, so a card that throttled an hour ago
still shows it. `Throughput` keeps the server's decode and prefill tok/s over time. `spark` draws a series
as block characters, `chart` draws timed points as a column chart over a time axis, `bar` draws a fill level;
all are plain strings so they render the same everywhere.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds4station.hardware import Device, Gpu, Sample

HISTORY = 600  # samples kept per card and per throughput series (ten minutes at one refresh a second)
SPAN_S = 120.0  # the time the charts show, up to now
_BLOCKS = "▁▂▃▄▅▆▇█"
_EIGHTHS = " ▁▂▃▄▅▆▇█"

Point = tuple[float, float | None]  # (unix time, value); None: not known at that time (a gap)


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


def _ago(seconds: float) -> str:
    if seconds <= 0:
        return "now"
    return f"-{seconds:.0f}s" if seconds < 60 or seconds % 60 else f"-{seconds / 60:.0f}m"


def time_axis(width: int, span_s: float = SPAN_S) -> str:
    """Labels under a chart `width` columns wide whose last column is now and first is `span_s` ago: the
    start, the middle and "now", each where its column is."""
    line = [" "] * width
    for frac in (0.0, 0.5, 1.0):
        label = _ago(span_s * (1 - frac))
        col = min(max(round(frac * (width - 1)) - (len(label) - 1 if frac == 1 else len(label) // 2 if frac else 0),
                      0), max(width - len(label), 0))
        line[col:col + len(label)] = label
    return "".join(line)[:width]


def chart(points: Iterable[Point], now: float, width: int, height: int = 3, span_s: float = SPAN_S, lo: float = 0.0,
          hi: float | None = None) -> list[str]:
    """The points of the last `span_s` seconds as `height` rows of `width` columns, oldest left, now right:
    each column covers span_s / width seconds and shows the largest value in it (a request that finished
    just before an idle refresh still shows), scaled to [lo, hi] (hi: the largest value shown) in eighths of
    a cell; a column with no point is blank."""
    cols: list[float | None] = [None] * width
    step = span_s / width
    for t, v in points:
        age = now - t
        if v is None or not 0 <= age < span_s + step:
            continue
        c = min(int((span_s - age) / step), width - 1)
        cols[c] = v if cols[c] is None else max(cols[c], v)  # type: ignore[type-var]
    known = [v for v in cols if v is not None]
    top = hi if hi is not None else max(known, default=0.0)
    span = top - lo
    levels = [None if v is None else round((1.0 if span <= 0 else min(max((v - lo) / span, 0.0), 1.0)) * height * 8)
              for v in cols]
    rows = []
    for r in range(height - 1, -1, -1):  # the top row first
        rows.append("".join(" " if lv is None else _EIGHTHS[min(max(lv - 8 * r, 0), 8)] for lv in levels))
    return rows


def bar(fraction: float, width: int) -> str:
    """A fill bar `width` cells wide, in eighths of a cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width)[:width]


def number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _series() -> collections.deque[Any]:
    return collections.deque(maxlen=HISTORY)


@dataclass
class CardHistory:
    clock_ratio: collections.deque[float | None] = field(default_factory=_series)
    temperature: collections.deque[float | None] = field(default_factory=_series)  # the hottest sensor, °C
    clock: collections.deque[Point] = field(default_factory=_series)  # SM / graphics clock, MHz
    heat: collections.deque[Point] = field(default_factory=_series)  # the hottest sensor, °C
    power: collections.deque[Point] = field(default_factory=_series)  # W
    throttled_samples: int = 0
    reasons_seen: dict[str, int] = field(default_factory=dict)  # reason -> samples it was active

    @property
    def ever_throttled(self) -> bool:
        return self.throttled_samples > 0

    def add(self, s: Sample) -> None:
        clock, top = number(s.clock_sm), number(s.clock_sm_max)
        self.clock_ratio.append(clock / top if clock is not None and top else None)
        temps = [t for t in (number(s.temp_junction), number(s.temp_edge), number(s.temp_memory)) if t is not None]
        self.temperature.append(max(temps) if temps else None)
        self.clock.append((s.timestamp, clock))
        self.heat.append((s.timestamp, self.temperature[-1]))
        self.power.append((s.timestamp, number(s.power)))
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


@dataclass(frozen=True)
class HostSample:
    """The CPU and RAM, sampled when the CPU is the device (no GPU found)."""

    cores: int
    cpu_percent: float  # busy, over all cores, since the last sample
    ram_used: int
    ram_total: int


def host_sample() -> HostSample:
    import psutil

    mem = psutil.virtual_memory()
    return HostSample(psutil.cpu_count() or 1, psutil.cpu_percent(interval=None),
                      int(mem.total - mem.available), int(mem.total))


class Throughput:
    """The server's decode and prefill tok/s over time, one point per refresh: the running requests' rates
    in their phases, summed (a batch of four streams decodes four times one stream's tokens), else the rates
    of requests that finished since the last refresh (at the time they finished; a request shorter than a
    refresh is seen only so), else 0 (idle)."""

    def __init__(self) -> None:
        self.decode: collections.deque[Point] = _series()
        self.prefill: collections.deque[Point] = _series()

    def add(self, now: float, status: dict[str, Any] | None, finished: Sequence[dict[str, Any]] = ()) -> None:
        if status is None:
            return
        running = [r for r in running_requests(status) if number(r.get("tokens_per_second")) is not None]
        if running:
            self.decode.append((now, sum(number(r["tokens_per_second"]) for r in running
                                         if r.get("phase") == "decode")))
            self.prefill.append((now, sum(number(r["tokens_per_second"]) for r in running
                                          if r.get("phase") != "decode")))
            return
        for r in sorted(finished, key=lambda r: number(r.get("finished_at")) or now):
            t = min(number(r.get("finished_at")) or now, now)
            self.prefill.append((t, number(r.get("prompt_per_second"))))
            self.decode.append((t, number(r.get("predicted_per_second"))))
        if not finished:
            self.decode.append((now, 0.0))
            self.prefill.append((now, 0.0))


def running_requests(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests /status says are running, in order of admission."""
    return [r for r in status.get("running") or [] if isinstance(r, dict)]


def collect_gpus(devices: Sequence[Device]) -> tuple[list[Gpu], list[Sample]]:
    """One telemetry sample per card (blocking sysfs/NVML reads)."""
    return [d.info() for d in devices], [d.sample() for d in devices]


def short_bus(bus: object) -> str:
    """`0000:0c:00.0` -> `0c:00.0` (bus:device.function); '' for anything that is not a PCI address."""
    return bus[-7:] if isinstance(bus, str) and bus.count(":") >= 1 else ""


def card_name(name: str, bus: str | None = None, desktop: bool = False, index: int | None = None) -> str:
    """One identity for a card wherever the panel names it: its number, name, short PCI bus id and the
    display mark, e.g. `2 AMD Radeon VII 0c:00.0 ◆`."""
    short = short_bus(bus) if bus != name else ""
    parts = [str(index)] if index is not None else []
    parts += [name] + ([short] if short else []) + (["◆"] if desktop else [])
    return " ".join(parts)
