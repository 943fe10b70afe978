"""Planner presets and host profiles: TOML files in ds4station/presets/.

A preset (`speed.toml`, `context.toml`) sets the objective and the footprint knobs; a host profile
(`kind = "host"`) names a machine's cards as a --gpus SPEC plus its RAM, so `--gpus gfx906-workstation` plans
for that machine from anywhere. Both are looked up by name in the presets folder, or read from a path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4station.model.footprint import DEFAULT_RUNTIME_OVERHEAD, FootprintSettings
from ds4station.model.sizes import MiB, parse_size

from .devices import DEFAULT_DESKTOP_HEADROOM

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
OBJECTIVES = ("speed", "context")
STREAMING = ("never", "auto")


class PresetError(ValueError):
    """A preset or host profile that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class PlanSettings:
    name: str = "speed"
    objective: str = "speed"  # speed: balance decode time; context: longest context, conservative split
    ctx: int | None = 32768  # None = as long as fits (up to the model's limit)
    footprint: FootprintSettings = field(default_factory=FootprintSettings)
    expert_streaming: str = "never"  # auto: stream routed experts when resident weights leave too little room
    expert_cache: int = 2048 * MiB  # per streaming process
    stream_below_ctx: int = 131072  # auto streaming kicks in when resident weights allow less than this
    desktop_headroom: int = DEFAULT_DESKTOP_HEADROOM
    reserve: int = 256 * MiB  # per device, against allocator fragmentation
    spare_target: int = 0  # keep this much spare on every device when the context allows (context preset)
    min_ctx: int = 4096  # below this a plan is not useful
    ctx_step: int = 1024  # proposed contexts are multiples of this (or the model's limit)
    description: str = ""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise PresetError(f"preset {self.name}: objective {self.objective!r}; choose {' or '.join(OBJECTIVES)}")
        if self.expert_streaming not in STREAMING:
            raise PresetError(f"preset {self.name}: expert_streaming {self.expert_streaming!r}; choose "
                              f"{' or '.join(STREAMING)}")


@dataclass(frozen=True)
class HostProfile:
    name: str
    gpus: str  # a --gpus SPEC
    host_ram: int | None = None
    description: str = ""


def _find(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".toml" and p.is_file():
        return p
    cand = PRESET_DIR / f"{name}.toml"
    if cand.is_file():
        return cand
    known = ", ".join(sorted(x.stem for x in PRESET_DIR.glob("*.toml")))
    raise PresetError(f"no preset or host profile named {name!r} (known: {known}; or give a .toml path)")


def _read(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"{path}: {e}") from e


# The keys each kind of file takes; anything else is refused with its name (a typo must not silently plan
# with a default).
PRESET_KEYS = frozenset({
    "name", "description", "objective", "ctx", "prefill_chunk", "sessions", "rollback", "kv_dtype", "runtime_overhead",
    "activation_factor", "expert_streaming", "expert_cache", "stream_below_ctx", "desktop_headroom", "reserve",
    "spare_target", "min_ctx", "ctx_step"})
HOST_KEYS = frozenset({"kind", "name", "description", "gpus", "host_ram"})


def _check_keys(data: dict[str, Any], known: frozenset[str], where: str) -> None:
    import difflib

    for key in data:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; known keys: {', '.join(sorted(known))}"
            raise PresetError(f"{where}: unknown key {key!r}{hint}")


def settings_from_dict(data: dict[str, Any], name: str = "custom") -> PlanSettings:
    _check_keys(data, PRESET_KEYS, f"preset {name}")

    def size(key: str, default: int) -> int:
        try:
            return parse_size(data[key]) if key in data else default
        except ValueError as e:
            raise PresetError(f"preset {name}: {key}: {e}") from e

    ctx = data.get("ctx", 32768)
    if isinstance(ctx, str):
        if ctx != "max":
            raise PresetError(f"preset {name}: ctx = {ctx!r}; write a number of tokens or \"max\"")
        ctx = None
    try:
        base = FootprintSettings()
        fp = FootprintSettings(prefill_chunk=int(data.get("prefill_chunk", base.prefill_chunk)),
                               sessions=int(data.get("sessions", base.sessions)),
                               rollback=int(data.get("rollback", base.rollback)),
                               kv_dtype=str(data.get("kv_dtype", "f32")),
                               runtime_overhead=size("runtime_overhead", DEFAULT_RUNTIME_OVERHEAD),
                               activation_factor=float(data.get("activation_factor", 1.0)))
    except ValueError as e:
        raise PresetError(f"preset {name}: {e}") from e
    return PlanSettings(
        name=str(data.get("name", name)), objective=str(data.get("objective", "speed")), ctx=ctx, footprint=fp,
        expert_streaming=str(data.get("expert_streaming", "never")), expert_cache=size("expert_cache", 2048 * MiB),
        stream_below_ctx=int(data.get("stream_below_ctx", 131072)),
        desktop_headroom=size("desktop_headroom", DEFAULT_DESKTOP_HEADROOM), reserve=size("reserve", 256 * MiB),
        spare_target=size("spare_target", 0), min_ctx=int(data.get("min_ctx", 4096)),
        ctx_step=int(data.get("ctx_step", 1024)),
        description=str(data.get("description", "")))


def load_preset(name: str) -> PlanSettings:
    path = _find(name)
    data = _read(path)
    if data.get("kind") == "host":
        raise PresetError(f"{path.name} is a host profile; pass it to --gpus, and speed or context to --preset")
    return settings_from_dict(data, path.stem)


def load_host_profile(name: str) -> HostProfile:
    path = _find(name)
    data = _read(path)
    if data.get("kind") != "host" or "gpus" not in data:
        raise PresetError(f"{path.name} is not a host profile (needs kind = \"host\" and gpus = \"SPEC\")")
    _check_keys(data, HOST_KEYS, f"host profile {path.name}")
    ram = data.get("host_ram")
    try:
        host_ram = parse_size(ram) if ram is not None else None
    except ValueError as e:
        raise PresetError(f"{path.name}: host_ram: {e}") from e
    return HostProfile(str(data.get("name", path.stem)), str(data["gpus"]), host_ram, str(data.get("description", "")))


def is_host_profile(name: str) -> bool:
    try:
        return _read(_find(name)).get("kind") == "host"
    except PresetError:
        return False


__all__ = ["HOST_KEYS", "HostProfile", "PRESET_DIR", "PRESET_KEYS", "PlanSettings", "PresetError", "is_host_profile",
           "load_host_profile", "load_preset", "settings_from_dict"]
