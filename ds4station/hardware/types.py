"""Gpu (static facts) and Sample (one telemetry reading), plus the NA sentinel for unsupported values.

Every field a driver may not expose holds `NA` instead of raising: NA is falsy, prints as "N/A" and becomes
null in JSON (`as_dict`). Units: bytes, degrees Celsius, watts, MHz, percent, RPM.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any


class _NAType:
    """The value a device could not report. A singleton; compare with `is NA` or use `is_na`."""

    _instance: _NAType | None = None

    def __new__(cls) -> _NAType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NA"

    def __format__(self, spec: str) -> str:
        try:
            return format("N/A", spec)
        except ValueError:  # a numeric spec such as ".1f"
            return "N/A"


NA = _NAType()
NAType = _NAType

MaybeInt = int | _NAType
MaybeFloat = float | _NAType
MaybeStr = str | _NAType
MaybeBool = bool | _NAType


def is_na(value: object) -> bool:
    return value is NA


def _jsonable(v: Any) -> Any:
    if v is NA:
        return None
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


@dataclass
class Gpu:
    index: int  # position in detection order (not a CUDA/HIP index: pin processes by pci_bus_id)
    vendor: str  # "nvidia" | "amd"
    name: str
    arch: MaybeStr = NA  # sm_90, gfx906, gfx1100, gfx1151
    vram_total: MaybeInt = NA
    vram_used: MaybeInt = NA
    pci_bus_id: MaybeStr = NA  # 0000:03:00.0 (lower case, 4-digit domain)
    uuid: MaybeStr = NA
    wave_size: MaybeInt = NA  # 32 (NVIDIA, RDNA) or 64 (GCN/CDNA)
    drives_display: MaybeBool = NA
    is_apu: bool = False
    gtt_total: MaybeInt = NA  # APUs: system RAM the GPU can map; the VRAM figure is only the carve-out
    gtt_used: MaybeInt = NA
    source: str = ""  # where it was read: /sys/class/drm/card1, nvml:0

    def as_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass
class Sample:
    utilisation: MaybeFloat = NA  # percent
    vram_used: MaybeInt = NA
    gtt_used: MaybeInt = NA
    temp_edge: MaybeFloat = NA  # NVIDIA's single "GPU" temperature is reported as edge
    temp_junction: MaybeFloat = NA
    temp_memory: MaybeFloat = NA
    temp_edge_crit: MaybeFloat = NA
    temp_junction_crit: MaybeFloat = NA
    temp_memory_crit: MaybeFloat = NA
    power: MaybeFloat = NA  # watts
    power_cap: MaybeFloat = NA
    clock_sm: MaybeFloat = NA  # MHz (gfx clock on AMD)
    clock_sm_max: MaybeFloat = NA
    clock_mem: MaybeFloat = NA
    clock_mem_max: MaybeFloat = NA
    fan_rpm: MaybeFloat = NA
    fan_percent: MaybeFloat = NA
    throttled: MaybeBool = NA
    throttle_reasons: list[str] = field(default_factory=list)
    timestamp: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


# Throttle reason names shared by both vendors, grouped for display.
def reason_category(reason: str) -> str:
    """thermal | power | current | other, for one throttle reason name."""
    if reason.startswith(("temp", "vrhot", "prochot", "hw_thermal", "sw_thermal")) or reason.endswith("_critical"):
        return "thermal"
    if reason.startswith(("ppt", "spl", "fppt", "sppt", "sw_power", "hw_power", "power")):
        return "power"
    if reason.startswith(("tdc", "edc")):
        return "current"
    return "other"


__all__ = ["Gpu", "MaybeBool", "MaybeFloat", "MaybeInt", "MaybeStr", "NA", "NAType", "Sample", "is_na",
           "reason_category"]
