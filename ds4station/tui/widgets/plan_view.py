"""The proposed route as a table (stage, device, layers, weights, KV, expert cache, predicted vs available,
a fit bar), with the refusal or notes under it. Used by the dashboard summary and the plan screen."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from ds4station.planner import DeviceBudget, Plan

from ..planning import PlanEditor
from ..telemetry import bar, card_name, short_bus

GiB = 1 << 30


def _g(n: int) -> str:
    return f"{n / GiB:.2f}"


def short_name(d: DeviceBudget) -> str:
    """A card as a short identity (its number, short bus id, display mark: the GPU panel names it in full)."""
    if d.device in ("cpu", d.label):
        return d.label
    parts = [str(d.index)] if d.index is not None else []
    return " ".join([*parts, short_bus(d.device), *(["◆"] if d.desktop else [])])


def route_table(plan: Plan, selected_boundary: int | None = None, wide: bool = True) -> Table:
    """One row per stage; the rows either side of `selected_boundary` are marked (the boundary the plan
    screen's [ and ] keys move)."""
    t = Table(box=None, padding=(0, 1), expand=True, header_style="bold")
    t.add_column("stage", justify="right", no_wrap=True)
    t.add_column("device", no_wrap=True, ratio=1)
    t.add_column("layers", justify="right", no_wrap=True)
    if wide:  # what "need" is made of
        for name in ("weights", "KV", "scratch", "runtime", "cache"):
            t.add_column(name, justify="right")
    t.add_column("need/have GiB", justify="right", no_wrap=True)
    t.add_column("fit", no_wrap=True, width=12 if wide else 8)
    for i, s in enumerate(plan.stages):
        st, f = s.stage, s.footprint
        span = ("E " if st.embed else "") + f"{st.first_layer}-{st.last_layer}" + (" O" if st.output else "")
        mark = ""
        if selected_boundary is not None and i in (selected_boundary, selected_boundary + 1):
            mark = "┐" if i == selected_boundary else "┘"
        frac = f.predicted_bytes / s.available_bytes if s.available_bytes else 1.0
        fit_style = "red" if not s.fits else "yellow" if frac > 0.95 else "green"
        fit = Text(bar(frac, 12 if wide else 8), style=fit_style)
        b = s.budget  # the card as the GPU panel names it: number, name, short bus id, display mark
        device = b.label if st.device in ("cpu", b.label) else card_name(b.label, st.device, b.desktop, b.index)
        stage = Text.assemble((mark, "bold cyan"), f" {i}")
        row: list[str | Text] = [stage, device, span]
        if wide:
            row += [_g(f.weights_bytes), _g(f.kv_bytes), _g(f.scratch_bytes), _g(f.overhead_bytes),
                    _g(f.expert_cache_bytes)]
        need = Text(f"{_g(f.predicted_bytes)}/{_g(s.available_bytes)}", style="" if s.fits else "bold red")
        row += [need, fit]
        t.add_row(*row)
    return t


def plan_header(editor: PlanEditor) -> Text:
    plan = editor.plan
    head = Text.assemble(("preset ", "dim"), (editor.preset, "bold"), ("  model ", "dim"), editor.model.label)
    if plan is not None:
        mode = "experts streamed" if plan.streaming else "resident"
        head.append_text(Text.assemble(("  ctx ", "dim"), (str(plan.ctx), "bold"), ("  ", ""), (mode, "dim")))
        if editor.draft != "off":
            head.append_text(Text.assemble(("  drafts ", "dim"), (editor.draft, "bold")))
        if editor.edited:
            head.append("  (edited)", style="italic yellow")
    return head


def plan_body(editor: PlanEditor, selected_boundary: int | None = None, wide: bool = True,
              detail: bool = False) -> RenderableType:
    """The plan; `detail` (the plan screen) adds where each stage's "have" comes from."""
    parts: list[RenderableType] = [plan_header(editor)]
    if editor.plan is not None:
        parts.append(route_table(editor.plan, selected_boundary, wide))
        if detail:
            st = editor.settings
            for i, s in enumerate(editor.plan.stages):
                have = s.budget.explain_available(st.desktop_headroom, st.reserve)
                parts.append(Text.assemble((f"  have {i}: ", "dim"), short_name(s.budget), (f": {have}", "dim")))
        reasons: dict[str, list[str]] = {}  # every card is in the plan: those left out, grouped by why
        for d, why in editor.plan.excluded:
            reasons.setdefault(why, []).append(short_name(d))
        for why, names in reasons.items():
            parts.append(Text.assemble(("  – ", "dim"), ", ".join(names), (f": {why}", "dim")))
    if editor.notice:  # an edit that was not made: the route shown is the one before it
        parts.append(Text("✗ not changed: " + editor.notice, style="bold yellow"))
    if editor.refusal:
        parts.append(Text("✗ " + editor.refusal, style="bold red"))
    elif editor.plan is not None:
        parts.append(Text("✓ fits", style="green"))
        parts += [Text("note: " + n, style="dim") for n in editor.plan.notes]
    return Group(*parts)


class PlanSummary(Static):
    """The dashboard's view of the current plan (the plan screen edits it)."""

    _editor: PlanEditor | None = None

    def on_resize(self) -> None:
        if self._editor is not None:
            self.show(self._editor)

    def show(self, editor: PlanEditor | None) -> None:
        self._editor = editor
        if editor is None:
            self.update(Text("detecting devices…", style="dim"))
            return
        self.update(plan_body(editor, wide=self.size.width >= 90))
