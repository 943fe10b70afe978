"""The dashboard: GPUs on top, the plan and the server side by side, then the live view and the logs.
Below 120 columns the side-by-side rows stack and the screen scrolls."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, RichLog

from ..widgets import GpuPanel, LivePanel, PlanSummary, ServerPanel


class DashboardScreen(Screen[None]):
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with VerticalScroll(id="dashboard"):
            yield GpuPanel("detecting GPUs…", id="gpus", classes="panel")
            with Horizontal(id="middle", classes="row"):
                yield PlanSummary("detecting devices…", id="plan-summary", classes="panel")
                yield ServerPanel(id="server", classes="panel")
            with Horizontal(id="bottom", classes="row"):
                yield LivePanel(id="live", classes="panel")
                yield RichLog(id="request-log", classes="panel log", max_lines=200, wrap=True, min_width=20,
                          markup=False)
                yield RichLog(id="server-log", classes="panel log", max_lines=500, wrap=True, min_width=20,
                          markup=False)
        yield Footer()

    def on_mount(self) -> None:
        for widget_id, title in (("gpus", "GPUs"), ("plan-summary", "Plan (p to edit)"), ("server", "Server"),
                                 ("live", "Live"), ("request-log", "Requests"), ("server-log", "Server log")):
            self.query_one(f"#{widget_id}").border_title = title
        self.query_one(ServerPanel).show(None)
        self.query_one(LivePanel).show(None, [])
