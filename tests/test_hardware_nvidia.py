"""NVIDIA detection through NVML stubs: one small fake pynvml module per scenario (as gpustat's tests do)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ds4station.hardware import NA, detect, detect_devices
from ds4station.hardware.nvidia import CLOCK_EVENT_REASONS, clock_event_reasons, normalise_bus_id

GiB = 1 << 30


class NVMLError(Exception):
    pass


class NotSupported(NVMLError):
    pass


def fake_nvml(gpus: list[dict[str, Any]], *, init_error: bool = False) -> SimpleNamespace:
    """A pynvml stand-in exposing exactly the calls ds4station makes; a missing key raises NotSupported."""

    def get(key: str) -> Any:
        def call(handle: int, *args: Any) -> Any:
            value = gpus[handle].get(key)
            if value is None:
                raise NotSupported(key)
            return value(*args) if callable(value) else value
        return call

    def init() -> None:
        if init_error:
            raise NVMLError("Driver Not Loaded")

    names = ["Name", "UUID", "PciInfo", "MemoryInfo", "CudaComputeCapability", "DisplayActive", "DisplayMode",
             "UtilizationRates", "Temperature", "TemperatureThreshold", "PowerUsage", "EnforcedPowerLimit",
             "ClockInfo", "MaxClockInfo", "FanSpeed", "CurrentClocksEventReasons", "FieldValues"]
    ns = SimpleNamespace(NVMLError=NVMLError, nvmlInit=init, nvmlDeviceGetCount=lambda: len(gpus),
                         nvmlDeviceGetHandleByIndex=lambda i: i)
    for n in names:
        setattr(ns, f"nvmlDeviceGet{n}", get(n))
    return ns


def h200(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "Name": b"NVIDIA H200", "UUID": "GPU-2b3c4d5e-6f70-8192-a3b4-c5d6e7f80912",
        "PciInfo": SimpleNamespace(busId=b"00000000:1B:00.0"),
        "MemoryInfo": SimpleNamespace(total=141 * 10**9, used=2 * GiB, free=139 * 10**9 - 2 * GiB),
        "CudaComputeCapability": (9, 0), "DisplayActive": 0, "DisplayMode": 0,
        "UtilizationRates": SimpleNamespace(gpu=87, memory=60),
        "Temperature": lambda sensor: 61 if sensor == 0 else 0,
        "TemperatureThreshold": lambda kind: {0: 95, 1: 87}[kind],
        "PowerUsage": 612_500, "EnforcedPowerLimit": 700_000,
        "ClockInfo": lambda clk: {1: 1980, 2: 3201}[clk], "MaxClockInfo": lambda clk: {1: 1980, 2: 3201}[clk],
        "FanSpeed": None,  # passively cooled: NOT_SUPPORTED
        "CurrentClocksEventReasons": 0,
        "FieldValues": lambda fields: [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=72))],
    }
    base.update(over)
    return base


def test_static_facts_and_bus_id() -> None:
    (g,) = detect("/nonexistent", fake_nvml([h200()]))
    assert (g.vendor, g.name, g.arch, g.wave_size) == ("nvidia", "NVIDIA H200", "sm_90", 32)
    assert g.pci_bus_id == "0000:1b:00.0" and g.uuid.startswith("GPU-")
    assert g.vram_total == 141 * 10**9 and g.vram_used == 2 * GiB
    assert g.drives_display is False


@pytest.mark.parametrize("mask, reasons", [
    (0x0, []),
    (0x1, []),  # idle is not throttling
    (0x4, ["sw_power_cap"]),
    (0x20 | 0x40, ["sw_thermal_slowdown", "hw_thermal_slowdown"]),
    (0x8, ["hw_slowdown"]),
    (0x8 | 0x80 | 0x100, ["hw_slowdown", "hw_power_brake_slowdown"]),
])
def test_clock_event_reasons(mask: int, reasons: list[str]) -> None:
    (dev,) = detect_devices("/nonexistent", fake_nvml([h200(CurrentClocksEventReasons=mask)]))
    s = dev.sample()
    assert s.throttle_reasons == reasons
    assert s.throttled is bool(reasons)


def test_sample_values_and_unsupported_queries() -> None:
    (dev,) = detect_devices("/nonexistent", fake_nvml([h200()]))
    s = dev.sample()
    assert s.utilisation == 87 and s.temp_edge == 61 and s.temp_edge_crit == 87 and s.temp_memory == 72
    assert s.power == pytest.approx(612.5) and s.power_cap == 700
    assert (s.clock_sm, s.clock_sm_max, s.clock_mem, s.clock_mem_max) == (1980, 1980, 3201, 3201)
    assert s.fan_percent is NA and s.fan_rpm is NA and s.temp_junction is NA
    # a card that supports almost nothing still yields a Gpu and a Sample
    bare = {"Name": "Tesla"}
    (dev,) = detect_devices("/nonexistent", fake_nvml([bare]))
    g, s = dev.info(), dev.sample()
    assert g.arch is NA and g.vram_total is NA and g.pci_bus_id is NA and g.drives_display is NA
    assert s.throttled is NA and s.temp_edge is NA and s.temp_memory is NA


def test_display_detection() -> None:
    active, mode_only, headless = detect("/nonexistent", fake_nvml([
        h200(DisplayActive=1), h200(DisplayActive=None, DisplayMode=1), h200()]))
    assert (active.drives_display, mode_only.drives_display, headless.drives_display) == (True, True, False)


def test_no_driver_means_no_gpu() -> None:
    assert detect("/nonexistent", fake_nvml([h200()], init_error=True)) == []


def test_reason_decoding_helpers() -> None:
    assert clock_event_reasons(0x4 | 0x1000) == ["sw_power_cap", "other_0x1000"]
    assert sorted(CLOCK_EVENT_REASONS) == [1 << i for i in range(9)]
    assert normalise_bus_id("00000000:01:00.0") == "0000:01:00.0"
    assert normalise_bus_id("0000:C4:00.0") == "0000:c4:00.0"


def test_real_pynvml_constants_agree() -> None:
    pynvml = pytest.importorskip("pynvml")
    assert pynvml.nvmlClocksEventReasonSwPowerCap == 0x4
    assert pynvml.nvmlClocksEventReasonHwThermalSlowdown == 0x40
    assert pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown == 0x80
    assert pynvml.NVML_FI_DEV_MEMORY_TEMP == 82 and pynvml.NVML_CLOCK_SM == 1


def test_detected_h200_becomes_a_planner_budget() -> None:
    from ds4station.planner.devices import budgets_from_gpus

    (b,) = budgets_from_gpus(detect("/nonexistent", fake_nvml([h200(DisplayActive=1)])))
    assert (b.device, b.kind, b.desktop, b.bandwidth_gbs) == ("0000:1b:00.0", "gpu", True, 4800)
    assert b.total_bytes == 141 * 10**9 and b.used_bytes == 2 * GiB
    assert b.available(desktop_headroom=3 * GiB // 2) == 141 * 10**9 - 2 * GiB  # in use already exceeds headroom
