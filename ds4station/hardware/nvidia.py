"""NVIDIA GPUs through NVML (the nvidia-ml-py package, imported as `pynvml`).

The NVML module is a parameter so tests pass a small stub per scenario (as gpustat's tests do). Each query
goes through `_q`, which turns an NVML error (not supported, no permission, GPU lost) into NA: a card that
cannot report its fan or memory temperature still reports everything else.

Clock-event reasons (`nvmlDeviceGetCurrentClocksEventReasons`, formerly "throttle reasons") are decoded
with the NVML bit values, which are part of NVML's stable API: idle, application clocks and display clocks
are normal operation; power cap, thermal and hardware slowdowns mean the card runs below its clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from .types import NA, Gpu, MaybeInt, Sample

# nvmlClocksEventReason* bit values (nvml.h)
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THROTTLING = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
              "hw_power_brake_slowdown"}

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_FI_DEV_MEMORY_TEMP = 82


def clock_event_reasons(mask: int) -> list[str]:
    """Decode a clock-event mask into reason names (unknown bits as other_0x...)."""
    out = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    if unknown:
        out.append(f"other_0x{unknown:x}")
    return out


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def normalise_bus_id(bus_id: str) -> str:
    """NVML's `00000000:01:00.0` -> `0000:01:00.0` (the form sysfs and the route use)."""
    b = bus_id.strip().lower()
    dom, sep, rest = b.partition(":")
    if sep and len(dom) > 4:
        b = dom[-4:] + ":" + rest
    return b


class NvidiaDevice:
    vendor = "nvidia"

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self.nvml, self.handle, self.index = nvml, handle, index
        self._info = self._read_info()

    def _q(self, fn: str, *args: Any) -> Any:
        f: Callable[..., Any] | None = getattr(self.nvml, fn, None)
        if f is None:
            return NA
        try:
            return f(self.handle, *args)
        except Exception:  # pynvml.NVMLError and its subclasses, or a stub's error
            return NA

    def _read_info(self) -> Gpu:
        mem = self._q("nvmlDeviceGetMemoryInfo")
        pci = self._q("nvmlDeviceGetPciInfo")
        cc = self._q("nvmlDeviceGetCudaComputeCapability")
        uuid = self._q("nvmlDeviceGetUUID")
        name = self._q("nvmlDeviceGetName")
        return Gpu(
            index=self.index, vendor="nvidia", name=_text(name) if name is not NA else "NVIDIA GPU",
            arch=f"sm_{cc[0]}{cc[1]}" if cc is not NA else NA,
            vram_total=int(mem.total) if mem is not NA else NA, vram_used=int(mem.used) if mem is not NA else NA,
            pci_bus_id=normalise_bus_id(_text(pci.busId)) if pci is not NA else NA,
            uuid=_text(uuid) if uuid is not NA else NA, wave_size=32, drives_display=self.drives_display(),
            source=f"nvml:{self.index}")

    def drives_display(self) -> bool | Any:
        """Display active (a display is initialised on the card) or, failing that, display mode (connected)."""
        active = self._q("nvmlDeviceGetDisplayActive")
        if active is not NA:
            return bool(active)
        mode = self._q("nvmlDeviceGetDisplayMode")
        return NA if mode is NA else bool(mode)

    def info(self) -> Gpu:
        mem = self._q("nvmlDeviceGetMemoryInfo")
        if mem is not NA:
            self._info.vram_used = int(mem.used)
        self._info.drives_display = self.drives_display()
        return self._info

    def sample(self) -> Sample:
        s = Sample()
        util = self._q("nvmlDeviceGetUtilizationRates")
        s.utilisation = float(util.gpu) if util is not NA else NA
        mem = self._q("nvmlDeviceGetMemoryInfo")
        s.vram_used = int(mem.used) if mem is not NA else NA
        s.temp_edge = _num(self._q("nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU))
        s.temp_edge_crit = _num(self._q("nvmlDeviceGetTemperatureThreshold", NVML_TEMPERATURE_THRESHOLD_SLOWDOWN))
        s.temp_memory = self._memory_temp()
        power = self._q("nvmlDeviceGetPowerUsage")
        s.power = power / 1000 if power is not NA else NA
        cap = self._q("nvmlDeviceGetEnforcedPowerLimit")
        s.power_cap = cap / 1000 if cap is not NA else NA
        s.clock_sm = _num(self._q("nvmlDeviceGetClockInfo", NVML_CLOCK_SM))
        s.clock_sm_max = _num(self._q("nvmlDeviceGetMaxClockInfo", NVML_CLOCK_SM))
        s.clock_mem = _num(self._q("nvmlDeviceGetClockInfo", NVML_CLOCK_MEM))
        s.clock_mem_max = _num(self._q("nvmlDeviceGetMaxClockInfo", NVML_CLOCK_MEM))
        s.fan_percent = _num(self._q("nvmlDeviceGetFanSpeed"))
        mask: MaybeInt = self._q("nvmlDeviceGetCurrentClocksEventReasons")
        if mask is NA:
            mask = self._q("nvmlDeviceGetCurrentClocksThrottleReasons")
        if mask is not NA:
            s.throttle_reasons = [r for r in clock_event_reasons(int(mask)) if r in THROTTLING]
            s.throttled = bool(s.throttle_reasons)
        return s

    def _memory_temp(self) -> Any:
        vals = self._q("nvmlDeviceGetFieldValues", [NVML_FI_DEV_MEMORY_TEMP])
        try:
            v = vals[0]
            if getattr(v, "nvmlReturn", 1) != 0:
                return NA
            t = float(v.value.uiVal)
        except (TypeError, IndexError, AttributeError):
            return NA
        return t if 0 < t < 200 else NA  # cards without a memory sensor report 0


def _num(v: Any) -> Any:
    return NA if v is NA else float(v)


def load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def nvidia_devices(nvml: Any = None) -> list[NvidiaDevice]:
    """Every NVIDIA GPU NVML sees; [] when the library or the driver is missing."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return []
    try:
        nvml.nvmlInit()
        count = int(nvml.nvmlDeviceGetCount())
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded on machines without an NVIDIA driver
        return []
    out = []
    for i in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception:  # a GPU that fell off the bus is skipped, the others still listed
            continue
        out.append(NvidiaDevice(nvml, handle, i))
    return out


__all__ = ["CLOCK_EVENT_REASONS", "NvidiaDevice", "THROTTLING", "clock_event_reasons", "normalise_bus_id",
           "nvidia_devices"]
