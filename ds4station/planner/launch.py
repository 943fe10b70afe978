"""Launch files: the plan is the launch.

`ds4station plan ... --out plan.toml` writes one; `ds4station serve --plan plan.toml` runs exactly it; the
control panel launches through one. A launch file holds every setting the footprint counts (route with its
expert caches, context, sessions, prefill chunk, rollback, KV dtype), so what `serve` allocates is what the
plan predicted. Unknown keys are refused with the key named (a typo must not silently run a default):

    kind = "launch"
    model = "/models/DeepSeek-V4-Flash-q2.gguf"   # "" = the built-in demo model; absent = give serve --model
    preset = "speed"                              # informational: the preset that proposed it
    route = "cuda:0=embed,0-20,output; cuda:1=21-42,cache=8GiB"
    ctx = 32768
    sessions = 2
    prefill_chunk = 2048
    rollback = 1024
    kv_dtype = "f32"
    draft = "mtp"                                 # serve --draft (absent: off); plan counted the MTP layer
    mtp = "/models/DeepSeek-V4-Flash-MTP.gguf"   # serve --mtp (absent: the model file's own layer)

No torch here (the planner's side); `serve` turns it into Engine.load arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from ds4station.model.footprint import KV_DTYPE_BYTES
from ds4station.model.sizes import gib

from .presets import PresetError, _check_keys
from .propose import Plan

LAUNCH_KEYS = frozenset({"kind", "model", "preset", "route", "ctx", "sessions", "prefill_chunk", "rollback",
                         "kv_dtype", "draft", "mtp"})
DRAFTS = ("off", "lookup", "mtp")  # serve --draft
# the planner's KV dtype names -> the engine's
ENGINE_KV_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


class LaunchError(ValueError):
    """A launch file that cannot be run as written; the message names the file and the key."""


@dataclass(frozen=True)
class Launch:
    route: str
    ctx: int
    sessions: int
    prefill_chunk: int
    rollback: int
    kv_dtype: str = "f32"
    model: str | None = None  # "": the built-in demo model; None: not set (a plan for a named shape)
    preset: str = ""
    draft: str = "off"  # serve --draft
    mtp: str | None = None  # serve --mtp FILE (None: the model file's own MTP layer, with draft "mtp")

    @property
    def engine_kv_dtype(self) -> str:
        return ENGINE_KV_DTYPES[self.kv_dtype]


def launch_from_plan(plan: Plan, model: str | None, *, draft: str = "off", mtp: str | None = None) -> Launch:
    fs = plan.footprint
    if (draft == "mtp") != fs.mtp:
        raise LaunchError(f"draft {draft!r}: the plan was made {'with' if fs.mtp else 'without'} the MTP layer")
    return Launch(str(plan.route), plan.ctx, fs.sessions, fs.prefill_chunk, fs.rollback, fs.kv_dtype, model,
                  plan.preset, draft, mtp)


def launch_text(launch: Launch, plan: Plan | None = None) -> str:
    """The TOML of a launch file, with the plan's per-stage prediction as comments."""
    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["# ds4station launch file: `ds4station serve --plan THIS_FILE` runs exactly these settings.",
             'kind = "launch"']
    if launch.model is None:
        lines.append("# planned for a named shape: give `serve --plan THIS_FILE --model FILE`")
    else:
        lines.append(f"model = {q(launch.model)}")
    if launch.preset:
        lines.append(f"preset = {q(launch.preset)}")
    lines += [f"route = {q(launch.route)}", f"ctx = {launch.ctx}", f"sessions = {launch.sessions}",
              f"prefill_chunk = {launch.prefill_chunk}", f"rollback = {launch.rollback}",
              f"kv_dtype = {q(launch.kv_dtype)}"]
    if launch.draft != "off":
        lines.append(f"draft = {q(launch.draft)}")
    if launch.mtp is not None:
        lines.append(f"mtp = {q(launch.mtp)}")
    if plan is not None:
        mtp = plan.footprint.mtp
        lines.append("# predicted per stage (GiB): weights + KV + scratch + runtime + cache" + (" + MTP" if mtp else "")
                     + " = total / available")
        for i, s in enumerate(plan.stages):
            f = s.footprint
            lines.append(f"#   stage {i} {s.stage.device}: {gib(f.weights_bytes)} + {gib(f.kv_bytes)} + "
                         f"{gib(f.scratch_bytes)} + {gib(f.overhead_bytes)} + {gib(f.expert_cache_bytes)} "
                         + (f"+ {gib(f.mtp_bytes)} " if mtp else "")
                         + f"= {gib(f.predicted_bytes)} / {gib(s.available_bytes)}")
    return "\n".join(lines) + "\n"


def write_launch(path: str | Path, launch: Launch, plan: Plan | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(launch_text(launch, plan))
    tmp.replace(path)
    return path


def read_launch(path: str | Path) -> Launch:
    """Read and check a launch file (keys, types, ranges; the route itself is checked against the model by
    `serve`, which has the model's layer count)."""
    path = Path(path)
    where = f"launch file {path}"
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise LaunchError(f"{where}: no such file (write one with `ds4station plan ... --out {path}`)") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise LaunchError(f"{where}: {e}") from e
    try:
        _check_keys(data, LAUNCH_KEYS, where)
    except PresetError as e:
        raise LaunchError(str(e)) from None
    if data.get("kind", "launch") != "launch":
        raise LaunchError(f"{where}: kind = {data['kind']!r}; a launch file has kind = \"launch\" (presets and host "
                          "profiles go to `plan --preset` / `plan --gpus`)")
    for key in ("route", "ctx"):
        if key not in data:
            raise LaunchError(f"{where}: {key} is missing")

    def integer(key: str, default: int, least: int) -> int:
        v = data.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise LaunchError(f"{where}: {key} = {v!r}; write a whole number >= {least}")
        return v

    def text(key: str, default: str) -> str:
        v = data.get(key, default)
        if not isinstance(v, str):
            raise LaunchError(f"{where}: {key} = {v!r}; write a quoted string")
        return v

    kv = text("kv_dtype", "f32")
    if kv not in KV_DTYPE_BYTES:
        raise LaunchError(f"{where}: kv_dtype = {kv!r}; choose one of {', '.join(KV_DTYPE_BYTES)}")
    route = text("route", "")
    if not route.strip():
        raise LaunchError(f"{where}: route is empty")
    model = text("model", "") if "model" in data else None
    draft = text("draft", "off")
    if draft not in DRAFTS:
        raise LaunchError(f"{where}: draft = {draft!r}; choose one of {', '.join(DRAFTS)}")
    mtp = text("mtp", "") if "mtp" in data else None
    if mtp is not None and draft != "mtp":
        raise LaunchError(f"{where}: mtp = {mtp!r} is the MTP layer for draft = \"mtp\"; set it or drop mtp")
    return Launch(route=route, ctx=integer("ctx", 0, 16), sessions=integer("sessions", 2, 1),
                  prefill_chunk=integer("prefill_chunk", 2048, 1), rollback=integer("rollback", 1024, 0),
                  kv_dtype=kv, model=model, preset=text("preset", ""), draft=draft, mtp=mtp)


__all__ = ["ENGINE_KV_DTYPES", "LAUNCH_KEYS", "Launch", "LaunchError", "launch_from_plan", "launch_text",
           "read_launch", "write_launch"]
