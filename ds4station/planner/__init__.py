"""The route and cache planner: what fits where, and how much context.

- route.py: Route / Stage, the text form `cuda:0=embed,0-11,output; cuda:1=12-17` and its TOML form;
  `parse_route(text, n_layers)` validates and names any gap, overlap or missing embed/output.
- footprint.py: bytes per stage (weights from the tensor table, KV per token per layer type, prefill and
  indexer scratch, runtime overhead) for a GGUF's tensor list or a named shape such as `flash-q2`.
- devices.py: what each device offers (detected GPUs, a --gpus SPEC, APU GTT, CPU host RAM).
- presets.py: speed.toml / context.toml and host profiles in ds4station/presets/.
- propose.py: `propose(...)` -> Plan (route, context, expert caches, per-stage prediction vs available) and
  `evaluate(...)` for a hand-written route; PlanError says by how much a plan misses and what would help.

Nothing here imports torch: the TUI and `ds4station plan` stay light.
"""

from __future__ import annotations

from .devices import DeviceBudget, budgets_from_gpus, parse_gpu_spec
from .footprint import FootprintSettings, ModelShape, StageFootprint, named_shape, shape_from_specs, stage_footprint
from .presets import HostProfile, PlanSettings, PresetError, load_host_profile, load_preset
from .propose import Plan, PlanError, StagePlan, evaluate, propose
from .route import Route, RouteError, Stage, parse_route, route_from_dict, route_from_toml

__all__ = [
    "DeviceBudget", "FootprintSettings", "HostProfile", "ModelShape", "Plan", "PlanError", "PlanSettings",
    "PresetError", "Route", "RouteError", "Stage", "StageFootprint", "StagePlan", "budgets_from_gpus", "evaluate",
    "load_host_profile", "load_preset", "named_shape", "parse_gpu_spec", "parse_route", "propose", "route_from_dict",
    "route_from_toml", "shape_from_specs", "stage_footprint",
]
