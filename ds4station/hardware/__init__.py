"""Hardware discovery and live telemetry: NVIDIA through NVML, AMD through amdgpu sysfs (+ pyamdgpuinfo).

    devices = detect_devices()             # NvidiaDevice / AmdDevice objects, NVIDIA first, then AMD cards
    gpus = [d.info() for d in devices]     # Gpu: static facts, memory in use
    sample = devices[0].sample()           # Sample: utilisation, temperatures, power, clocks, fan, throttling

`sysfs_root` points the AMD reader at a fake tree (tests) and `nvml` replaces the pynvml module (stubs).
Nothing here imports torch, so the TUI and `ds4station detect` stay light. Unsupported values are NA.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from .amd import AmdDevice, amd_devices
from .nvidia import NvidiaDevice, nvidia_devices
from .types import NA, Gpu, NAType, Sample, is_na, reason_category


class Device(Protocol):
    vendor: str

    def info(self) -> Gpu: ...

    def sample(self) -> Sample: ...


def detect_devices(sysfs_root: str | os.PathLike[str] = "/", nvml: Any = None, *,
                   use_nvml: bool = True) -> list[Device]:
    """All GPUs: NVIDIA (NVML) then AMD (sysfs under `sysfs_root`), indexed in that order."""
    found: list[Device] = list(nvidia_devices(nvml)) if use_nvml else []
    found += amd_devices(sysfs_root)
    for i, d in enumerate(found):
        d.info().index = i
    return found


def detect(sysfs_root: str | os.PathLike[str] = "/", nvml: Any = None, *, use_nvml: bool = True) -> list[Gpu]:
    """Static facts of every GPU found (see detect_devices)."""
    return [d.info() for d in detect_devices(sysfs_root, nvml, use_nvml=use_nvml)]


__all__ = ["AmdDevice", "Device", "Gpu", "NA", "NAType", "NvidiaDevice", "Sample", "detect", "detect_devices",
           "is_na", "reason_category"]
