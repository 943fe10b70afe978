"""The plan the control panel edits: propose one with the planner, then move layer boundaries, change the
context or the expert cache, with the fit recomputed on every change and any refusal explained.

No Textual here (the screens call it, tests drive it directly) and no torch: the demo model's shape comes
from the planner's named shape `demo-q2`, which is exactly what `ds4station serve` creates on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ds4station.model.footprint import DEMO_SHAPE
from ds4station.model.sizes import format_size, gib
from ds4station.planner import (
    DeviceBudget,
    ModelShape,
    Plan,
    PlanError,
    PlanSettings,
    PresetError,
    Route,
    RouteError,
    evaluate,
    load_preset,
    named_shape,
    propose,
)
from ds4station.planner.launch import DRAFTS

PRESETS = ("speed", "context")


@dataclass(frozen=True)
class ModelChoice:
    """What to serve: the built-in demo model (path None) or a GGUF file, with its planner shape; or a named
    shape alone (`shape_only`: planned without its file, not launchable)."""

    label: str
    shape: ModelShape
    path: str | None = None
    shape_only: bool = False


def demo_model() -> ModelChoice:
    return ModelChoice("demo model (random weights, q2)", named_shape(DEMO_SHAPE))


def model_from_shape(name: str) -> ModelChoice:
    """A named shape (`flash-q2`, ...) planned without its file: the plan is real, there is nothing to launch."""
    return ModelChoice(f"{name} (shape only, no file: plan, not launch)", named_shape(name), shape_only=True)


def model_from_file(path: str) -> ModelChoice:
    """Read a GGUF's header and tensor table (no torch; file I/O, so call it from a worker)."""
    from ds4station.model.gguf import GGUFFile
    from ds4station.planner import shape_from_specs

    f = GGUFFile.open(path)
    return ModelChoice(f.path.name, shape_from_specs(f.path.name, f.config, f.tensor_specs()), str(f.path))


class PlanEditor:
    """A proposed plan and the user's edits to it. After every change `plan` holds the per-stage accounting
    of the current route (None only if nothing could be proposed) and `refusal` says why it cannot run
    (None when every stage fits). An edit that cannot be made (a boundary that would empty a stage, a context
    outside the model's, a file that is not a model, ...) changes nothing: `notice` says why, and the route
    as it was stays launchable."""

    def __init__(self, model: ModelChoice, budgets: Sequence[DeviceBudget], host_ram: int | None = None,
                 preset: str = "speed") -> None:
        self.model = model
        self.budgets = list(budgets)
        self.host_ram = host_ram
        self.settings: PlanSettings = load_preset(preset)
        self.ctx: int | None = None  # None: the preset decides
        self.expert_cache: int | None = None  # None: the preset decides
        self.plan: Plan | None = None
        self.refusal: str | None = None
        self.notice: str | None = None  # the last edit that was refused (and not made)
        self.edited = False  # the route was changed by hand since the last proposal
        self.dropped: set[str] = set()  # devices the user took out of the proposals (set_dropped)
        self.draft = "off"  # serve --draft (set_draft)
        self.propose()

    @property
    def preset(self) -> str:
        return self.settings.name

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.refusal is None

    # ---- whole proposals ---------------------------------------------------------------------------------
    def propose(self) -> None:
        """A fresh proposal for the current model, preset, context and cache (drops hand edits)."""
        self.edited, self.notice = False, None
        kept = [b for b in self.budgets if b.device not in self.dropped]
        try:
            plan = propose(self.model.shape, kept, self.settings, ctx=self.ctx, expert_cache=self.expert_cache,
                           host_ram=self.host_ram)
            dropped = tuple((b, "dropped here (the plan's Cards list adds it back)") for b in self.budgets
                            if b.device in self.dropped)
            self.plan = dataclasses.replace(plan, excluded=plan.excluded + dropped)
            self.refusal = None
        except PlanError as e:
            self.plan = None
            self.refusal = str(e)

    def set_dropped(self, devices: set[str]) -> None:
        """Leave these devices out of the route and re-propose (an empty set: every device may be used). At
        least one device stays: dropping them all is refused, and nothing changes."""
        unknown = devices - {b.device for b in self.budgets}
        if unknown:
            self.notice = f"no such device: {', '.join(sorted(unknown))}"
            return
        if len(devices) >= len(self.budgets):
            self.notice = "at least one device must stay in the route"
            return
        self.dropped = set(devices)
        self.propose()

    def set_model(self, model: ModelChoice) -> None:
        self.model, self.ctx, self.expert_cache = model, None, None
        dropped = self.draft == "mtp" and not model.shape.mtp_specs
        if dropped:  # the new model has no MTP layer to draft with
            self.draft = "off"
            self._count_mtp()
        self.propose()
        if dropped:
            self.notice = f"drafts off: {model.label} has no MTP layer (mtp.0.* tensors)"

    def set_preset(self, name: str) -> None:
        try:
            self.settings = load_preset(name)
        except PresetError as e:
            self.notice = str(e)
            return
        self._count_mtp()
        self.ctx = self.expert_cache = None
        self.propose()

    def set_draft(self, name: str) -> None:
        """Speculative decoding for the server (serve --draft): "lookup" needs nothing more; "mtp" drafts with
        the model file's MTP layer, which the plan then counts on the stage holding the output head (a model
        without one is refused, and nothing changes)."""
        if name not in DRAFTS:
            self.notice = f"drafts {name!r}: use one of {', '.join(DRAFTS)}"
            return
        if name == "mtp" and not self.model.shape.mtp_specs:
            self.notice = (f"{self.model.label} has no MTP layer (mtp.0.* tensors) to draft with: use lookup, or "
                           "a model file that holds the layer (`ds4station serve --mtp FILE` takes a separate one)")
            return
        self.draft = name
        self._count_mtp()
        self._recheck()

    def _count_mtp(self) -> None:
        """The plan counts the MTP layer exactly when the drafts are the MTP layer's."""
        self.settings = dataclasses.replace(self.settings, footprint=dataclasses.replace(
            self.settings.footprint, mtp=self.draft == "mtp"))

    # ---- edits -------------------------------------------------------------------------------------------
    def set_ctx(self, ctx: int) -> None:
        """A new context length: the hand-edited route is kept and re-checked; otherwise a new proposal."""
        limit = self.model.shape.cfg.context_length
        low = min(self.settings.min_ctx, limit)
        if not low <= ctx <= limit:
            self.notice = f"context {ctx} is outside {low}-{limit} tokens (the model's limit is {limit})"
            return
        self.ctx = ctx
        self._recheck()

    def set_expert_cache(self, size: int) -> None:
        """Stream routed experts through a cache of `size` bytes per GPU stage (0: keep them resident)."""
        if size:
            need = self.model.shape.min_expert_cache(range(self.model.shape.cfg.n_layers))
            if size < need:
                self.notice = (f"an expert cache of {format_size(size)} cannot hold one layer's routed experts: "
                               f"the minimum is {format_size(need)}")
                return
        self.expert_cache = size
        self._recheck()

    def move_boundary(self, boundary: int, delta: int) -> None:
        """Move the boundary after stage `boundary` by `delta` layers (+1: that stage takes the next stage's
        first layer; -1: it gives its last layer away)."""
        if self.plan is None:
            self.notice = "there is no route to edit: change the context or the preset first"
            return
        stages = list(self.plan.route.stages)
        if len(stages) < 2:
            self.notice = f"the route has a single stage on {stages[0].device}: there is no layer boundary to move"
            return
        if not 0 <= boundary < len(stages) - 1:
            self.notice = f"there is no boundary {boundary}: the route has {len(stages) - 1}"
            return
        left, right = stages[boundary], stages[boundary + 1]
        cut = left.last_layer + delta
        if cut < left.first_layer or cut >= right.last_layer:
            empty = boundary if cut < left.first_layer else boundary + 1
            self.notice = (f"stage {empty} ({stages[empty].device}) would hold no layers; every stage keeps at "
                           f"least one (to use fewer cards, drop one in the plan screen's Cards list)")
            return
        stages[boundary] = dataclasses.replace(left, last_layer=cut)
        stages[boundary + 1] = dataclasses.replace(right, first_layer=cut + 1)
        try:
            route = Route(tuple(stages), self.plan.route.n_layers)
        except RouteError as e:
            self.notice = str(e)
            return
        self.edited, self.notice = True, None
        self._evaluate(route, self.plan.ctx)

    # ---- accounting --------------------------------------------------------------------------------------
    def _recheck(self) -> None:
        if self.plan is None or not self.edited:
            self.propose()
            return
        cache = self.expert_cache or 0
        stages = tuple(dataclasses.replace(s, expert_cache_bytes=0 if s.device == "cpu" else cache)
                       for s in self.plan.route.stages)
        ctx = self.ctx if self.ctx is not None else self.plan.ctx
        self._evaluate(Route(stages, self.plan.route.n_layers), ctx)

    def _evaluate(self, route: Route, ctx: int) -> None:
        by_device = {b.device: b for b in self.budgets}
        # the proposal's own sizes (its prefill chunk may be smaller than the preset's, to fit)
        settings = self.settings if self.plan is None else dataclasses.replace(
            self.settings, footprint=dataclasses.replace(self.plan.footprint, mtp=self.settings.footprint.mtp))
        try:
            plan = evaluate(self.model.shape, route, [by_device[s.device] for s in route.stages], settings, ctx,
                            host_ram=self.host_ram)
        except PlanError as e:
            self.refusal = str(e)
            return
        self.plan = dataclasses.replace(plan, preset=self.settings.name, notes=("route edited by hand",))
        self.notice = None
        short = [(i, s) for i, s in enumerate(plan.stages) if not s.fits]
        if not short:
            self.refusal = None
            return
        i, s = short[0]
        self.refusal = (f"stage {i} on {s.budget.label} needs {gib(s.footprint.predicted_bytes)} but "
                        f"{gib(s.available_bytes)} is available: short by {gib(-s.spare_bytes)}. Move a boundary "
                        f"to give it fewer layers, shorten the context, or press r to re-propose.")


def serve_args(plan: Plan, model: ModelChoice, port: int, host: str = "127.0.0.1",
               launch_dir: str | None = None, draft: str = "off") -> list[str]:
    """`ds4station serve` arguments for this plan: its launch file (written to `launch_dir`, default the cache
    directory) run with --plan, so the server allocates exactly what the plan counted; `draft` its serve
    --draft (the plan must count the MTP layer for "mtp": PlanEditor.set_draft)."""
    from pathlib import Path

    from ds4station.cache import cache_dir
    from ds4station.planner.launch import launch_from_plan, write_launch

    if model.shape_only:
        raise PlanError(f"this plan is for the shape {model.shape.name} without its file: get the file "
                        "(`ds4station pull q2`) and open it (`ds4station --model FILE`) to launch")
    path = Path(launch_dir) if launch_dir else cache_dir()
    out = write_launch(path / f"launch-{port}.toml", launch_from_plan(plan, model.path or "", draft=draft), plan)
    return ["--host", host, "--port", str(port), "--plan", str(out)]
