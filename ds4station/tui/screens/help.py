"""The key help (?): every key of the panel and what it does."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("p", "plan: edit the route, context, expert cache, model and preset (esc back)"),
    ("m", "model: download a published file, choose one on disk or by path, a shape or the demo (esc back)"),
    ("l", "launch `ds4station serve` with the current plan"),
    ("s", "stop the server and every process it started"),
    ("t", "next colour theme"),
    ("1 2 3", "copy the opencode / Claude Code / Codex settings of the running server (clipboard and a file)"),
    ("q", "quit (stops the server first: nothing is left running)"),
    ("?", "this help"),
    ("[ ]", "plan screen: move the selected layer boundary up / down one layer"),
    ("↑ ↓", "plan screen: select the boundary"),
    ("r", "plan screen: re-propose from scratch"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, what in KEYS:
            table.add_row(key, what)
        with Vertical(id="help"):
            yield Static(table)
            yield Static("esc or ? closes", classes="dim")

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "Keys"
