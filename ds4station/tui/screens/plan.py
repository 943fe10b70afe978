"""The plan editor (p): model file or the demo model, preset, context and expert cache, and the route with
its layer boundaries movable by key; every change re-computes the fit and explains a refusal."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, Select, SelectionList, Static

from ds4station.model.sizes import format_size, parse_size, parse_tokens
from ds4station.planner.launch import DRAFTS

from ..messages import ModelLoaded
from ..planning import PRESETS, PlanEditor, demo_model, model_from_file
from ..telemetry import card_name
from ..widgets.plan_view import plan_body


def card_choices(ed: PlanEditor | None) -> list[tuple[str, str, bool]]:
    """The Cards list: every device the planner may use, checked unless dropped, named as the GPU panel does."""
    if ed is None:
        return []
    return [(b.label if b.device in ("cpu", b.label) else card_name(b.label, b.device, b.desktop, b.index), b.device,
             b.device not in ed.dropped) for b in ed.budgets]


class RouteEditor(Static, can_focus=True):
    """The route table; holds the selected boundary and moves it with [ and ]."""

    BINDINGS = [
        Binding("left_square_bracket", "move(-1)", "boundary up", key_display="["),
        Binding("right_square_bracket", "move(1)", "boundary down", key_display="]"),
        Binding("up", "select(-1)", "prev boundary", show=False),
        Binding("down", "select(1)", "next boundary", show=False),
        Binding("r", "repropose", "re-propose"),
    ]

    boundary = 0

    @property
    def editor(self) -> PlanEditor | None:
        return self.app.editor  # type: ignore[attr-defined, no-any-return]

    def refresh_plan(self) -> None:
        ed = self.editor
        if ed is None:
            self.update("detecting devices…")
            return
        n = len(ed.plan.stages) if ed.plan is not None else 0
        self.boundary = min(self.boundary, max(n - 2, 0))
        self.update(plan_body(ed, self.boundary if n > 1 else None, wide=self.app.size.width >= 100, detail=True))

    def action_select(self, step: int) -> None:
        self.boundary = max(self.boundary + step, 0)
        self.refresh_plan()

    def action_move(self, delta: int) -> None:
        if self.editor is not None:
            self.editor.move_boundary(self.boundary, delta)
            self.app.plan_changed()  # type: ignore[attr-defined]

    def action_repropose(self) -> None:
        if self.editor is not None:
            self.editor.propose()
            self.app.plan_changed()  # type: ignore[attr-defined]


class PlanScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "back")]

    def compose(self) -> ComposeResult:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        yield Header(show_clock=False, icon="◆")
        with Vertical(id="plan-form"):
            with Horizontal(classes="form-row"):
                yield Label("model", classes="form-label")
                yield Input(value=(ed.model.path or "") if ed else "", placeholder="demo (built-in) or a .gguf path",
                            id="model-path", compact=True)
                yield Label("preset", classes="form-label")
                yield Select([(p, p) for p in PRESETS], value=ed.preset if ed else "speed", allow_blank=False,
                             id="preset", compact=True)
            with Horizontal(classes="form-row"):
                yield Label("context", classes="form-label")
                yield Input(value=str(ed.plan.ctx) if ed and ed.plan else "", placeholder="tokens, e.g. 32K",
                            id="ctx", compact=True)
                yield Label("expert cache", classes="form-label")
                yield Input(placeholder="0 = resident; e.g. 2GiB", id="cache", compact=True)
                yield Label("drafts", classes="form-label")
                yield Select([(d, d) for d in DRAFTS], value=ed.draft if ed else "off", allow_blank=False,
                             id="draft", compact=True)
        with Horizontal(id="plan-main"):
            yield RouteEditor(id="route", classes="panel")
            yield SelectionList[str](*card_choices(ed), id="cards", classes="panel")
        yield Static("[ ] move boundary ┐┘ · ↑↓ pick it · r re-propose · tab: fields and Cards (space drops or "
                     "adds a card, then re-proposes) · enter applies", id="plan-hint")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#route").border_title = "Route"
        self.query_one("#cards").border_title = "Cards (space: use / drop)"
        self.refresh_plan()
        self.query_one(RouteEditor).focus()

    def refresh_plan(self) -> None:
        self.query_one(RouteEditor).refresh_plan()

    @on(SelectionList.SelectedChanged, "#cards")
    def _cards(self, event: SelectionList.SelectedChanged[str]) -> None:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is None:
            return
        dropped = {b.device for b in ed.budgets} - set(event.selection_list.selected)
        if dropped != ed.dropped:
            ed.set_dropped(dropped)
            if ed.dropped != dropped:  # refused (the last card): the list shows what the plan uses
                event.selection_list.select(next(iter(dropped - ed.dropped)))
            self.app.plan_changed()  # type: ignore[attr-defined]

    @on(Select.Changed, "#preset")
    def _preset(self, event: Select.Changed) -> None:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is not None and event.value != ed.preset:
            ed.set_preset(str(event.value))
            self.app.plan_changed()  # type: ignore[attr-defined]

    @on(Select.Changed, "#draft")
    def _draft(self, event: Select.Changed) -> None:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is not None and event.value != ed.draft:
            ed.set_draft(str(event.value))
            if ed.draft != event.value:  # refused (no MTP layer): the field shows what the plan runs
                event.select.value = ed.draft
            self.app.plan_changed()  # type: ignore[attr-defined]

    @on(Input.Submitted, "#ctx")
    def _ctx(self, event: Input.Submitted) -> None:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is None:
            return
        try:
            ed.set_ctx(parse_tokens(event.value))
        except ValueError as e:
            ed.notice = f"context: {e}"
        self.app.plan_changed()  # type: ignore[attr-defined]

    @on(Input.Submitted, "#cache")
    def _cache(self, event: Input.Submitted) -> None:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is None:
            return
        try:
            ed.set_expert_cache(parse_size(event.value or "0"))
        except ValueError as e:
            ed.notice = str(e)
        self.app.plan_changed()  # type: ignore[attr-defined]

    @on(Input.Submitted, "#model-path")
    def _model(self, event: Input.Submitted) -> None:
        path = event.value.strip()
        if path in ("", "demo"):
            self.post_message(ModelLoaded(demo_model()))
        else:
            self._load_model(path)

    @work(thread=True, exclusive=True, group="model")
    def _load_model(self, path: str) -> None:
        # Reading a GGUF header is file I/O (a slow disk, a network mount): never on the UI thread.
        try:
            self.post_message(ModelLoaded(model_from_file(path)))
        except Exception as e:  # GGUFError, OSError: shown as the refusal, the previous model stays
            self.post_message(ModelLoaded(None, f"cannot use {path}: {e}"))

    def on_model_loaded(self, message: ModelLoaded) -> None:
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is None:
            return
        if message.model is None:
            ed.notice = message.error
        else:
            ed.set_model(message.model)
        self.app.plan_changed()  # type: ignore[attr-defined]

    def sync_fields(self) -> None:
        """After a change made elsewhere (re-proposal, the model screen), show the plan's model, context and
        cache in the fields."""
        ed: PlanEditor | None = self.app.editor  # type: ignore[attr-defined]
        if ed is None:
            return
        path = self.query_one("#model-path", Input)
        if not path.has_focus:  # a model chosen in the model screen
            path.value = ed.model.path or ""
        draft = self.query_one("#draft", Select)
        if draft.value != ed.draft:  # drafts turned off by a model without an MTP layer
            draft.value = ed.draft
        if ed.plan is None:
            return
        ctx = self.query_one("#ctx", Input)
        if not ctx.has_focus:
            ctx.value = str(ed.plan.ctx)
        cache = max((s.expert_cache_bytes for s in ed.plan.route.stages), default=0)
        field = self.query_one("#cache", Input)
        if not field.has_focus:
            field.value = format_size(cache) if cache else ""
