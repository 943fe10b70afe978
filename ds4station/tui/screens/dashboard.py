"""The dashboard, in one of two layouts chosen by the terminal's width (recomposed when it crosses WIDE):

- wide (>= 120 columns): the GPUs across the top; the plan and the server side by side; then the live
  charts beside tabs for the request log, the server log and the client settings;
- narrow: tabs, the first ("Now") with the server's state and the live view together, then GPUs, Plan,
  Requests, Log and Clients, each with the whole screen.

The widgets are drawn from the App's state (`draw`), so a recomposed layout shows at once what the old one
showed, logs included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Header, RichLog, TabbedContent, TabPane

from ..widgets import ClientsPanel, GpuPanel, LivePanel, PlanSummary, ServerPanel

if TYPE_CHECKING:
    from ..app import Ds4StationApp

WIDE = 120  # columns from which the panels sit side by side
TITLES = {"gpus": "GPUs", "plan-summary": "Plan (p to edit)", "server": "Server", "live": "Live",
          "request-log": "Requests", "server-log": "Server log", "clients": "Clients (1 2 3 copy)"}


class DashboardScreen(Screen[None]):
    narrow: reactive[bool] = reactive(False, recompose=True)

    def compose(self) -> ComposeResult:
        self.set_reactive(DashboardScreen.narrow, self.app.size.width < WIDE)  # the first layout: no recompose
        yield Header(show_clock=False, icon="◆")
        gpus = GpuPanel("detecting GPUs…", id="gpus", classes="panel")
        plan = PlanSummary("detecting devices…", id="plan-summary", classes="panel")
        server, live, clients = ServerPanel(id="server", classes="panel"), LivePanel(id="live", classes="panel"), \
            ClientsPanel(id="clients", classes="panel")
        requests = RichLog(id="request-log", classes="panel log", max_lines=200, wrap=True, min_width=20, markup=False)
        log = RichLog(id="server-log", classes="panel log", max_lines=500, wrap=True, min_width=20, markup=False)
        if self.narrow:
            with TabbedContent(id="tabs"):
                with TabPane("Now", id="tab-now"), Vertical():
                    yield server
                    yield live
                for title, widget in (("GPUs", gpus), ("Plan", plan), ("Requests", requests), ("Log", log),
                                      ("Clients", clients)):
                    with TabPane(title, id=f"tab-{widget.id}"), VerticalScroll():
                        yield widget
        else:
            with Vertical(id="dashboard"):
                yield gpus
                with Horizontal(id="middle", classes="row"):
                    yield plan
                    yield server
                with Horizontal(id="bottom", classes="row"):
                    yield live
                    with TabbedContent(id="side"):
                        for title, widget in (("Requests", requests), ("Server log", log), ("Clients", clients)):
                            with TabPane(title, id=f"tab-{widget.id}"):
                                yield widget
        yield Footer()

    def on_mount(self) -> None:
        self._titles()

    def on_resize(self) -> None:
        self.narrow = self.app.size.width < WIDE

    def watch_narrow(self) -> None:
        self.call_after_refresh(self._redraw)

    def _redraw(self) -> None:
        self._titles()
        app: Ds4StationApp = self.app  # type: ignore[assignment]
        self.draw(app, full=True)

    def _titles(self) -> None:
        for widget_id, title in TITLES.items():
            for w in self.query(f"#{widget_id}"):
                w.border_title = title

    def draw(self, app: Ds4StationApp, new_log: list[str] | None = None, new_requests: list[str] | None = None,
             full: bool = False) -> None:
        """Every panel from the App's state; the logs get `new_*` lines appended, or (`full`) all of them."""
        if app.readings:
            self.query_one(GpuPanel).show(app.readings)
        elif app.detected and not app.devices:
            self.query_one(GpuPanel).show_none(app.no_gpu_where(), app.host_load)
        self.query_one(PlanSummary).show(app.editor)
        view = app.last_view
        self.query_one(ServerPanel).show(view)
        self.query_one(ClientsPanel).show(view)
        server_log, request_log = self.query_one("#server-log", RichLog), self.query_one("#request-log", RichLog)
        if full:
            server_log.clear()
            request_log.clear()
            new_log, new_requests = list(app.server_log), app.request_lines()
        for line in new_log or ():
            server_log.write(line)
        for line in new_requests or ():
            request_log.write(line)
        live = view is not None and view.state != "stopped"
        self.query_one(LivePanel).show(view.status if live and view else None, app.throughput,
                                       list(app.requests.values()), app.charted_card(), app.clock())
