"""The route and cache planner: what fits where, and how much context.

Routes (model/route.py) and footprints (model/footprint.py: the one byte formula, which the engine
sizes its caches with) live in the torch-free model package and are re-exported here.
- devices.py: what each device offers (detected GPUs, a --gpus SPEC, APU GTT, CPU host RAM).
- presets.py: speed.toml / context.toml and host profiles in ds4station/presets/.
- propose.py: `propose(...)` -> Plan (route, context, expert caches, per-stage prediction vs available) and
  `evaluate(...)` for a hand-written route; PlanError says by how much a plan misses and what would help.

Nothing here imports torch: the TUI and `ds4station plan` stay light.
"""

from __future__ import annotations

from ds4station.model.footprint import (
    FootprintSettings,
    ModelShape,
    StageFootprint,
    named_shape,
    shape_from_specs,
    stage_footprint,
)
from ds4station.model.route import Route, RouteError, Stage, parse_route, route_from_dict, route_from_toml

from .devices import DeviceBudget, budgets_from_gpus, parse_gpu_spec
from .presets import HostProfile, PlanSettings, PresetError, load_host_profile, load_preset
from .propose import Plan, PlanError, StagePlan, evaluate, propose

__all__ = [
    "DeviceBudget", "FootprintSettings", "HostProfile", "ModelShape", "Plan", "PlanError", "PlanSettings",
    "PresetError", "Route", "RouteError", "Stage", "StageFootprint", "StagePlan", "budgets_from_gpus", "evaluate",
    "load_host_profile", "load_preset", "named_shape", "parse_gpu_spec", "parse_route", "propose", "route_from_dict",
    "route_from_toml", "shape_from_specs", "stage_footprint",
]
