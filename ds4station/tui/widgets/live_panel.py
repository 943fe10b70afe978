"""The live view: prefill and decode tok/s of recent requests over time (sparklines), TTFT, KV use per stage
and live sessions, the queue, and the expert-cache hit rate when experts are streamed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widgets import Static

from ..telemetry import bar, spark

MiB = 1 << 20


def _hit_rate(cache: dict[str, Any]) -> float | None:
    if isinstance(cache.get("hit_rate"), (int, float)):
        return float(cache["hit_rate"])
    hits, misses = cache.get("hits"), cache.get("misses")
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses:
        return hits / (hits + misses)
    return None


def live_view(status: dict[str, Any] | None, requests: Sequence[dict[str, Any]], width: int = 40) -> RenderableType:
    """`requests`: finished-request records (/status throughput.recent) seen this session, oldest first."""
    if status is None:
        return Text("no live server: launch (l) and send a request to see throughput", style="dim")
    plot_w = max(min(width - 28, 60), 8)
    prefill = [r.get("prompt_per_second") or None for r in requests]
    decode = [r.get("predicted_per_second") or None for r in requests]
    tp = status.get("throughput") or {}
    parts: list[RenderableType] = []
    for label, series, mean, style in (("prefill", prefill, tp.get("prompt_tokens_per_second"), "cyan"),
                                       ("decode ", decode, tp.get("decode_tokens_per_second"), "green")):
        value = f"{mean:8.2f} tok/s" if isinstance(mean, (int, float)) else "       – tok/s"
        parts.append(Text.assemble((label, "bold"), " ", (spark(series, width=plot_w).ljust(plot_w), style),
                                   " ", value))
    ttft = [r.get("ttft_ms") for r in requests[-5:] if isinstance(r.get("ttft_ms"), (int, float))]
    parts.append(Text.assemble(("TTFT   ", "bold"), ", ".join(f"{t:.0f}" for t in ttft) + " ms" if ttft else "–",
                               ("  (last requests)", "dim")))
    kv = status.get("kv") or {}
    sessions = status.get("sessions") or {}
    live = sessions.get("live") or []
    ctx = kv.get("ctx") or 0
    frac = (kv.get("tokens") or 0) / ctx if ctx else 0.0
    parts.append(Text.assemble(("KV     ", "bold"), (bar(frac, 10), "magenta"),
                               f" {kv.get('tokens', 0)}/{ctx} tok, {(kv.get('bytes') or 0) / MiB:.1f} MiB; "
                               f"sessions {len(live)}/{sessions.get('capacity', '?')}"))
    for i, st in enumerate(status.get("stages") or []):
        parts.append(Text(f"  stage {i} {st.get('device', '?')}: KV {(st.get('kv_bytes') or 0) / MiB:.1f} MiB",
                          style="dim"))
    queue = status.get("queue") or {}
    running = status.get("running")
    now = ""
    if running:  # the request under way, at the refresh rate (the sparklines move only when one finishes)
        done = running.get("generated") if running.get("phase") == "decode" else running.get("prefilled")
        rate = running.get("tokens_per_second")
        now = f"  running: {running['phase']} #{running['id']}"
        if isinstance(done, int) and isinstance(rate, (int, float)):
            now += f", {done} tokens at {rate:.1f} tok/s"
    parts.append(Text.assemble(("queue  ", "bold"), f"{queue.get('length', 0)}/{queue.get('capacity', '?')}",
                               now or "  idle"))
    cache = status.get("expert_cache")
    if isinstance(cache, dict):
        rate = _hit_rate(cache)
        streamed = (cache.get("bytes_read") or 0) / 2**30
        speed = cache.get("gb_per_s")
        parts.append(Text.assemble(("experts", "bold"), f" cache hit rate {rate:.0%}" if rate is not None
                                   else " cache: no hits yet",
                                   f", {cache.get('misses', 0)} misses, {streamed:.1f} GiB streamed"
                                   + (f" at {speed:.1f} GB/s" if isinstance(speed, (int, float)) and speed else "")))
    return Group(*parts)


class LivePanel(Static):
    def show(self, status: dict[str, Any] | None, requests: Sequence[dict[str, Any]]) -> None:
        self.update(live_view(status, requests, self.size.width or 40))
