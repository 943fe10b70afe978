"""SVG snapshots of the control panel's main screens at 80x24 and 160x48 (pytest-textual-snapshot).

Deterministic: fake sysfs hardware (fixed readings, one refresh), fixed host RAM, no NVML, and for the live
view a recorded /status document of the demo model served on the CPU with a fixed pid and uptime.
Regenerate after an intended change with `pytest tests/test_tui_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from ds4station.planner import named_shape
from ds4station.tui.app import Ds4StationApp
from ds4station.tui.messages import Collected, ServerView
from ds4station.tui.planning import ModelChoice
from ds4station.tui.telemetry import HostSample

HOST1 = Path(__file__).parent / "fixtures" / "sysfs" / "gfx906-workstation"  # six cards, one driving the display
STRIX = Path(__file__).parent / "fixtures" / "sysfs" / "rdna3-strix-halo"  # an RX 7900 XT beside a Strix Halo APU
HOSTS = {"demo-cpu": Path("/nonexistent-sysfs"), "gfx906-6-cards": HOST1, "strix-halo": STRIX}
NOW = 1795950031.0  # the panel's clock in these snapshots: just after STATUS's two requests finished
GiB = 1 << 30
SIZES = [(80, 24), (160, 48)]

# GET /status of `ds4station serve` (demo model, CPU) after two chat requests, as the server returns it.
STATUS: dict[str, Any] = {
    "model": {"name": "demo-q2-v2", "path": "/home/user/.cache/ds4station/demo-q2-v2.gguf", "ctx": 32768,
              "config": {"n_layers": 6, "dim": 256, "vocab_size": 8192, "n_experts": 8, "n_experts_used": 3,
                         "context_length": 131072}},
    "state": "ready", "error": None, "uptime_s": 42.0, "route": "cpu: embed, 0-5, output",
    "stages": [{"device": "cpu", "layers": [0, 6], "kv_bytes": 21532672}],
    "kv": {"bytes": 21532672, "tokens": 27, "ctx": 32768},
    "sessions": {"capacity": 2, "live": [{"tokens": 27, "kv_bytes": 21532672, "requests": 2, "idle_s": 3.5}],
                 "kv_bytes": 21532672, "prefix_hits": 1, "prefix_misses": 1, "resets": 0},
    "queue": {"length": 0, "capacity": 16}, "running": [],
    "throughput": {"recent": [
        {"id": 1, "kind": "chat", "reason": "length", "prompt_tokens": 5, "cached_tokens": 0,
         "completion_tokens": 16, "prompt_per_second": 41.5, "predicted_per_second": 12.2, "ttft_ms": 130.4,
         "finished_at": 1795950022.4},
        {"id": 2, "kind": "responses", "reason": "stop", "prompt_tokens": 11, "cached_tokens": 5,
         "completion_tokens": 6, "prompt_per_second": 55.0, "predicted_per_second": 13.1, "ttft_ms": 98.0,
         "finished_at": 1795950030.1}],
        "prompt_tokens_per_second": 48.25, "decode_tokens_per_second": 12.65},
    "totals": {"requests": 2, "prompt_tokens": 16, "cached_tokens": 5, "completion_tokens": 22, "cancelled": 0,
               "errors": 0},
    "replay_store": {"entries": 0, "hits": 0}, "expert_cache": None,
}
LOG = ["ds4station serve: http://127.0.0.1:8000/v1 (OpenAI, Responses), http://127.0.0.1:8000 (Anthropic)",
       "INFO:     Started server process [4242]", "INFO:     Application startup complete.",
       'INFO:     127.0.0.1:50312 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
       'INFO:     127.0.0.1:50320 - "POST /v1/responses HTTP/1.1" 200 OK']


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Request lines carry local times: the snapshots are taken in UTC wherever they run."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _app(sysfs_root: str | Path) -> Ds4StationApp:
    # one refresh only (the interval is an hour): the history and every reading are fixed; a fixed clock
    return Ds4StationApp(sysfs_root=str(sysfs_root), use_nvml=False, host_ram=64 * GiB, poll_interval=3600,
                         clock=lambda: NOW, host_probe=lambda: HostSample(16, 23.0, 21 * GiB, 64 * GiB))


async def _ready(pilot: Pilot[Any]) -> None:
    app: Ds4StationApp = pilot.app  # type: ignore[assignment]
    end = time.monotonic() + 20
    while app.polls < 1:
        assert time.monotonic() < end
        await pilot.pause(0.05)
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard_with_fake_gpus(snap_compare, size) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app(HOST1), terminal_size=size, run_before=_ready)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_plan_screen_with_a_refused_edit(snap_compare, size) -> None:  # type: ignore[no-untyped-def]
    async def run_before(pilot: Pilot[Any]) -> None:
        await _ready(pilot)
        app: Ds4StationApp = pilot.app  # type: ignore[assignment]
        assert app.editor is not None
        app.editor.set_model(ModelChoice("DeepSeek-V4-Flash q2", named_shape("flash-q2")))
        app.plan_changed()
        await pilot.press("p", "down", "left_square_bracket")
        await pilot.pause()

    assert snap_compare(_app(HOST1), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_live_view(snap_compare, size, host) -> None:  # type: ignore[no-untyped-def]
    """The demo model's server as /status reported it, on each host: a CPU-only machine (no GPU), the six
    gfx906 cards (the display card's charts) and the Strix Halo box."""
    async def run_before(pilot: Pilot[Any]) -> None:
        await _ready(pilot)
        view = ServerView("ready", "http://127.0.0.1:8000", None, 4242, status=STATUS, new_log=LOG, log_tail=LOG,
                          log_total=len(LOG), uptime_s=42.0)
        pilot.app.post_message(Collected([], view))
        await pilot.pause()

    assert snap_compare(_app(HOSTS[host]), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard_of_the_strix_halo_box(snap_compare, size) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(_app(STRIX), terminal_size=size, run_before=_ready)


def test_help_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def run_before(pilot: Pilot[Any]) -> None:
        await _ready(pilot)
        await pilot.press("question_mark")

    assert snap_compare(_app(HOST1), terminal_size=(80, 24), run_before=run_before)
