"""The live view: decode and prefill tok/s over the last minutes (charts over a time axis, moving while a
request runs), the display card's temperature, clock and power the same way, TTFT, KV use per stage and
live sessions, the queue, and the expert-cache hit rate when experts are streamed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widgets import Static

from ds4station.model.sizes import gib

from ..telemetry import (
    SPAN_S,
    GpuReading,
    Point,
    Throughput,
    bar,
    card_name,
    chart,
    number,
    running_requests,
    time_axis,
)


def _hit_rate(cache: dict[str, Any]) -> float | None:
    if isinstance(cache.get("hit_rate"), (int, float)):
        return float(cache["hit_rate"])
    hits, misses = cache.get("hits"), cache.get("misses")
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses:
        return hits / (hits + misses)
    return None


def _plot(label: str, unit: str, points: Sequence[Point], now: float, width: int, height: int, style: str,
          lo: float = 0.0, hi: float | None = None, value: str = "") -> list[Text]:
    """A titled chart over the time axis: the title line (label, the latest value), `height` rows with the
    scale's top and bottom at the left, and no axis (the caller adds one under a group of charts)."""
    latest = next((v for _, v in reversed(points) if v is not None), None)
    shown = [v for t, v in points if v is not None and now - t <= SPAN_S]
    top = hi if hi is not None else max(shown, default=0.0)
    rows = chart(points, now, width, height, lo=lo, hi=top if top > lo else None)
    head = Text.assemble((f"{label:8}", "bold"), f"{latest:8.1f} {unit}" if latest is not None else f"{'–':>8} {unit}",
                         (f"  {value}" if value else "", "dim"))
    out = [head]
    for i, row in enumerate(rows):
        scale = f"{top:.0f}" if i == 0 else f"{lo:.0f}" if i == len(rows) - 1 else ""
        out.append(Text.assemble((f"{scale:>6} ▕", "dim"), (row, style)))
    return out


def _axis(width: int) -> Text:
    return Text(" " * 8 + time_axis(width), style="dim")


def live_view(status: dict[str, Any] | None, throughput: Throughput, requests: Sequence[dict[str, Any]],
              card: GpuReading | None = None, width: int = 40, height: int = 24,
              now: float | None = None) -> RenderableType:
    """`requests`: finished-request records (/status throughput.recent) seen this session, oldest first;
    `card`: the card whose temperature, clock and power are charted (the display card when there is one)."""
    if status is None:
        return Text("no live server: launch (l) and send a request to see throughput", style="dim")
    now = time.time() if now is None else now
    plot_w = max(width - 10, 10)
    # rows for the charts: what the panel has after its text lines (4), the titles and axes of the
    # throughput charts (3) and of the card's (5); the card's charts are left out when there is no room
    spare = height - 7 - (1 if status.get("expert_cache") else 0)
    card_rows = max(min(3, (spare - 7) // 3), 0) if card is not None else 0
    if card_rows:
        spare -= 5 + 3 * card_rows
    rows = max(min(10, spare // 2), 1)
    tp = status.get("throughput") or {}
    parts: list[RenderableType] = []
    for label, series, mean, style in (("decode", throughput.decode, tp.get("decode_tokens_per_second"), "green"),
                                       ("prefill", throughput.prefill, tp.get("prompt_tokens_per_second"), "cyan")):
        note = f"{mean:.2f} tok/s mean of the recent requests" if isinstance(mean, (int, float)) else ""
        parts += _plot(label, "tok/s", series, now, plot_w, rows, style, value=note)
    parts.append(_axis(plot_w))
    if card is not None and card_rows:
        g, s, h = card.gpu, card.sample, card.history
        desktop = g.drives_display is True
        parts.append(Text.assemble(("card    ", "bold"), card_name(g.name, g.pci_bus_id, desktop, g.index),
                                   (" (drives the display)" if desktop else "", "dim")))
        parts += _plot("temp", "°C", h.heat, now, plot_w, card_rows, "magenta", lo=30.0, hi=110.0)
        parts += _plot("clock", "MHz", h.clock, now, plot_w, card_rows, "cyan", hi=number(s.clock_sm_max))
        parts += _plot("power", "W", h.power, now, plot_w, card_rows, "yellow", hi=number(s.power_cap))
        parts.append(_axis(plot_w))
    ttft = [r.get("ttft_ms") for r in requests[-5:] if isinstance(r.get("ttft_ms"), (int, float))]
    parts.append(Text.assemble(("TTFT    ", "bold"), ", ".join(f"{t:.0f}" for t in ttft) + " ms" if ttft else "–",
                               ("  (last requests)", "dim")))
    kv = status.get("kv") or {}
    sessions = status.get("sessions") or {}
    live = sessions.get("live") or []
    ctx = kv.get("ctx") or 0
    frac = (kv.get("tokens") or 0) / ctx if ctx else 0.0
    stages = status.get("stages") or []
    per_stage = "; ".join(f"{i} {st.get('device', '?')} {gib(st.get('kv_bytes') or 0)}" for i, st in enumerate(stages))
    reuse, detail = "", ""
    if "prefix_hits" in sessions:  # prompts that reused a prefix, of all; how, when not only from live sessions
        hits, disk = sessions["prefix_hits"], sessions.get("disk")
        reuse = f"; reused {hits}/{hits + sessions.get('prefix_misses', 0)}"
        if sessions.get("checkpoint_hits") or isinstance(disk, dict):
            detail = f"prompt checkpoints {sessions.get('checkpoint_hits', 0)}" + (
                f", disk {disk.get('hits', 0)} ({disk.get('entries', 0)} saved, {gib(disk.get('used_bytes') or 0)})"
                if isinstance(disk, dict) else "")
    parts.append(Text.assemble(("KV      ", "bold"), (bar(frac, 10), "magenta"),
                               f" {kv.get('tokens', 0)}/{ctx} tok, {gib(kv.get('bytes') or 0)}; "
                               f"sessions {len(live)}/{sessions.get('capacity', '?')}{reuse}",
                               (f"  (stages {per_stage})" if len(stages) > 1 else "", "dim")))
    if detail:
        parts.append(Text.assemble(("reuse   ", "bold"), detail))
    queue = status.get("queue") or {}
    running = running_requests(status)
    batch = status.get("batch") or {}
    now_text = ""
    if running:  # the requests under way, at the refresh rate
        now_text = f"  running {len(running)}/{batch.get('limit', '?')}:"
        for r in running[:4]:
            done = r.get("generated") if r.get("phase") == "decode" else r.get("prefilled")
            rate = r.get("tokens_per_second")
            now_text += f" #{r.get('id')} {r.get('phase')}"
            if isinstance(done, int) and isinstance(rate, (int, float)):
                now_text += f" {done} tok {rate:.1f}/s"
        if len(running) > 4:
            now_text += f" +{len(running) - 4}"
        mean = batch.get("mean_decode_batch")
        if isinstance(mean, (int, float)) and mean:
            now_text += f"; batch mean {mean:.1f}"
        ahead, steps = batch.get("ahead_steps"), batch.get("decode_steps")
        if isinstance(ahead, int) and isinstance(steps, int) and ahead and steps:  # the GPU did not wait for the host
            now_text += f", {min(1.0, ahead / steps):.0%} of steps ahead"
    draft = status.get("draft") or {}
    if draft.get("source", "off") != "off" and draft.get("drafted"):  # speculative decoding, when on
        now_text += f"; drafts {draft['accepted']}/{draft['drafted']} accepted, " \
                    f"{draft.get('tokens_per_verify') or 0:.2f} tok per verify"
    parts.append(Text.assemble(("queue   ", "bold"), f"{queue.get('length', 0)}/{queue.get('capacity', '?')}",
                               now_text or "  idle"))
    cache = status.get("expert_cache")
    if isinstance(cache, dict):
        rate = _hit_rate(cache)
        streamed = cache.get("bytes_read") or 0
        speed = cache.get("gb_per_s")
        parts.append(Text.assemble(("experts ", "bold"), f"cache hit rate {rate:.0%}" if rate is not None
                                   else "cache: no hits yet",
                                   f", {cache.get('misses', 0)} misses, {gib(streamed)} streamed"
                                   + (f" at {speed:.1f} GB/s" if isinstance(speed, (int, float)) and speed else "")))
    return Group(*parts)


class LivePanel(Static):
    """Drawn for its size: the charts take the rows the panel has (and are drawn again when it resizes)."""

    _last: tuple[Any, ...] | None = None

    def show(self, status: dict[str, Any] | None, throughput: Throughput, requests: Sequence[dict[str, Any]],
             card: GpuReading | None = None, now: float | None = None) -> None:
        self._last = (status, throughput, requests, card, now)
        self.update(live_view(status, throughput, requests, card, self.size.width or 40, self.size.height or 24, now))

    def on_resize(self) -> None:
        if self._last is not None:
            self.show(*self._last)
