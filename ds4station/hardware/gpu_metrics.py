"""Decode amdgpu's binary `gpu_metrics` sysfs file (struct gpu_metrics_vX_Y in the kernel's
drivers/gpu/drm/amd/include/kgd_pp_interface.h), the one read that gives temperatures, power, clocks,
activity and throttle status together.

Every table starts with `struct metrics_table_header {u16 structure_size; u8 format_revision; u8
content_revision}`. Format 1 is the dGPU layout, format 2 and 3 the APU layouts. The structs are plain C
(natural alignment, little endian), so they are declared here as ctypes structures in kernel field order;
only the fields we use are read. Versions handled:

- v1.0 (Vega 20: Radeon VII, Radeon Pro VII, MI50/60): not naturally aligned, 80 bytes; throttle_status in
  Vega 20's own bit layout (THROTTLER_STATUS_*_BIT in smu11_driver_if.h).
- v1.1 - v1.3 (Navi, RDNA2/3 such as the RX 7900 XT): v1.3 adds `indep_throttle_status`, the ASIC-independent
  SMU_THROTTLER_*_BIT mask (amdgpu_smu.h). v1.4/v1.5 are MI300's different layout and are not decoded.
- v2.0 - v2.4 (Renoir ... Phoenix APUs): temperatures in centi-degrees, power in mW; v2.2+ has indep status.
- v3.0 (Strix Point / Strix Halo): centi-degrees and mW; no status mask, but per-limit throttle residency
  counters: a counter that grew since the previous read means that limit is throttling now.

A value of 0xFFFF (0xFFFFFFFF for u32) means "not supported by this ASIC" and decodes to NA.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from .types import NA, MaybeFloat, MaybeInt

u8, u16, u32, u64 = ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64


class _Header(ctypes.LittleEndianStructure):
    _fields_ = [("structure_size", u16), ("format_revision", u8), ("content_revision", u8)]


class _V1_0(ctypes.LittleEndianStructure):
    _fields_ = [
        ("hdr", _Header), ("system_clock_counter", u64),
        ("temperature_edge", u16), ("temperature_hotspot", u16), ("temperature_mem", u16),
        ("temperature_vrgfx", u16), ("temperature_vrsoc", u16), ("temperature_vrmem", u16),
        ("average_gfx_activity", u16), ("average_umc_activity", u16), ("average_mm_activity", u16),
        ("average_socket_power", u16), ("energy_accumulator", u32),
        ("average_gfxclk_frequency", u16), ("average_socclk_frequency", u16), ("average_uclk_frequency", u16),
        ("average_vclk0_frequency", u16), ("average_dclk0_frequency", u16), ("average_vclk1_frequency", u16),
        ("average_dclk1_frequency", u16),
        ("current_gfxclk", u16), ("current_socclk", u16), ("current_uclk", u16), ("current_vclk0", u16),
        ("current_dclk0", u16), ("current_vclk1", u16), ("current_dclk1", u16),
        ("throttle_status", u32), ("current_fan_speed", u16), ("pcie_link_width", u8), ("pcie_link_speed", u8),
    ]


# v1.1 - v1.3 share this prefix; v1.3 appends firmware_timestamp, voltages and indep_throttle_status.
_V1_COMMON = [
    ("hdr", _Header),
    ("temperature_edge", u16), ("temperature_hotspot", u16), ("temperature_mem", u16),
    ("temperature_vrgfx", u16), ("temperature_vrsoc", u16), ("temperature_vrmem", u16),
    ("average_gfx_activity", u16), ("average_umc_activity", u16), ("average_mm_activity", u16),
    ("average_socket_power", u16), ("energy_accumulator", u64), ("system_clock_counter", u64),
    ("average_gfxclk_frequency", u16), ("average_socclk_frequency", u16), ("average_uclk_frequency", u16),
    ("average_vclk0_frequency", u16), ("average_dclk0_frequency", u16), ("average_vclk1_frequency", u16),
    ("average_dclk1_frequency", u16),
    ("current_gfxclk", u16), ("current_socclk", u16), ("current_uclk", u16), ("current_vclk0", u16),
    ("current_dclk0", u16), ("current_vclk1", u16), ("current_dclk1", u16),
    ("throttle_status", u32), ("current_fan_speed", u16), ("pcie_link_width", u16), ("pcie_link_speed", u16),
    ("padding", u16), ("gfx_activity_acc", u32), ("mem_activity_acc", u32), ("temperature_hbm", u16 * 4),
]


class _V1_1(ctypes.LittleEndianStructure):
    _fields_ = _V1_COMMON


class _V1_3(ctypes.LittleEndianStructure):
    _fields_ = _V1_COMMON + [
        ("firmware_timestamp", u64), ("voltage_soc", u16), ("voltage_gfx", u16), ("voltage_mem", u16),
        ("padding1", u16), ("indep_throttle_status", u64),
    ]


class _V2_0(ctypes.LittleEndianStructure):
    _fields_ = [
        ("hdr", _Header), ("system_clock_counter", u64),
        ("temperature_gfx", u16), ("temperature_soc", u16), ("temperature_core", u16 * 8), ("temperature_l3", u16 * 2),
        ("average_gfx_activity", u16), ("average_mm_activity", u16),
        ("average_socket_power", u16), ("average_cpu_power", u16), ("average_soc_power", u16),
        ("average_gfx_power", u16), ("average_core_power", u16 * 8),
        ("average_gfxclk_frequency", u16), ("average_socclk_frequency", u16), ("average_uclk_frequency", u16),
        ("average_fclk_frequency", u16), ("average_vclk_frequency", u16), ("average_dclk_frequency", u16),
        ("current_gfxclk", u16), ("current_socclk", u16), ("current_uclk", u16), ("current_fclk", u16),
        ("current_vclk", u16), ("current_dclk", u16), ("current_coreclk", u16 * 8), ("current_l3clk", u16 * 2),
        ("throttle_status", u32), ("fan_pwm", u16), ("padding", u16),
    ]


_V2_COMMON = [
    ("hdr", _Header),
    ("temperature_gfx", u16), ("temperature_soc", u16), ("temperature_core", u16 * 8), ("temperature_l3", u16 * 2),
    ("average_gfx_activity", u16), ("average_mm_activity", u16), ("system_clock_counter", u64),
    ("average_socket_power", u16), ("average_cpu_power", u16), ("average_soc_power", u16),
    ("average_gfx_power", u16), ("average_core_power", u16 * 8),
    ("average_gfxclk_frequency", u16), ("average_socclk_frequency", u16), ("average_uclk_frequency", u16),
    ("average_fclk_frequency", u16), ("average_vclk_frequency", u16), ("average_dclk_frequency", u16),
    ("current_gfxclk", u16), ("current_socclk", u16), ("current_uclk", u16), ("current_fclk", u16),
    ("current_vclk", u16), ("current_dclk", u16), ("current_coreclk", u16 * 8), ("current_l3clk", u16 * 2),
    ("throttle_status", u32), ("fan_pwm", u16), ("padding", u16 * 3),
]


class _V2_1(ctypes.LittleEndianStructure):
    _fields_ = _V2_COMMON


class _V2_2(ctypes.LittleEndianStructure):  # also the prefix of v2.3 and v2.4
    _fields_ = _V2_COMMON + [("indep_throttle_status", u64)]


class _V3_0(ctypes.LittleEndianStructure):
    _fields_ = [
        ("hdr", _Header),
        ("temperature_gfx", u16), ("temperature_soc", u16), ("temperature_core", u16 * 16), ("temperature_skin", u16),
        ("average_gfx_activity", u16), ("average_vcn_activity", u16), ("average_ipu_activity", u16 * 8),
        ("average_core_c0_activity", u16 * 16), ("average_dram_reads", u16), ("average_dram_writes", u16),
        ("average_ipu_reads", u16), ("average_ipu_writes", u16), ("system_clock_counter", u64),
        ("average_socket_power", u32), ("average_ipu_power", u16), ("average_apu_power", u32),
        ("average_gfx_power", u32), ("average_dgpu_power", u32), ("average_all_core_power", u32),
        ("average_core_power", u16 * 16), ("average_sys_power", u16), ("stapm_power_limit", u16),
        ("current_stapm_power_limit", u16),
        ("average_gfxclk_frequency", u16), ("average_socclk_frequency", u16), ("average_vpeclk_frequency", u16),
        ("average_ipuclk_frequency", u16), ("average_fclk_frequency", u16), ("average_vclk_frequency", u16),
        ("average_uclk_frequency", u16), ("average_mpipu_frequency", u16),
        ("current_coreclk", u16 * 16), ("current_core_maxfreq", u16), ("current_gfx_maxfreq", u16),
        ("throttle_residency_prochot", u32), ("throttle_residency_spl", u32), ("throttle_residency_fppt", u32),
        ("throttle_residency_sppt", u32), ("throttle_residency_thm_core", u32), ("throttle_residency_thm_gfx", u32),
        ("throttle_residency_thm_soc", u32), ("time_filter_alphavalue", u32),
    ]


STRUCTS: dict[tuple[int, int], type[ctypes.LittleEndianStructure]] = {
    (1, 0): _V1_0, (1, 1): _V1_1, (1, 2): _V1_1, (1, 3): _V1_3,
    (2, 0): _V2_0, (2, 1): _V2_1, (2, 2): _V2_2, (2, 3): _V2_2, (2, 4): _V2_2,
    (3, 0): _V3_0,
}

# Vega 20's ASIC-specific throttle_status bits (smu11_driver_if.h, THROTTLER_STATUS_*_BIT).
VEGA20_THROTTLE_BITS = {
    1: "temp_edge", 2: "temp_hotspot", 3: "temp_mem", 4: "temp_vr_gfx", 5: "temp_vr_soc", 6: "temp_vr_mem0",
    7: "temp_vr_mem1", 8: "temp_liquid", 9: "temp_plx", 10: "temp_skin", 11: "tdc_gfx", 12: "tdc_soc",
    13: "ppt", 14: "fit", 15: "ppm",
}
# ASIC-independent indep_throttle_status bits (amdgpu_smu.h, SMU_THROTTLER_*_BIT).
INDEP_THROTTLE_BITS = {
    0: "ppt0", 1: "ppt1", 2: "ppt2", 3: "ppt3", 4: "spl", 5: "fppt", 6: "sppt", 7: "sppt_apu",
    16: "tdc_gfx", 17: "tdc_soc", 18: "tdc_mem", 19: "tdc_vdd", 20: "tdc_cvip", 21: "edc_cpu", 22: "edc_gfx",
    23: "apcc", 32: "temp_gpu", 33: "temp_core", 34: "temp_mem", 35: "temp_edge", 36: "temp_hotspot",
    37: "temp_soc", 38: "temp_vr_gfx", 39: "temp_vr_soc", 40: "temp_vr_mem0", 41: "temp_vr_mem1",
    42: "temp_liquid0", 43: "temp_liquid1", 44: "vrhot0", 45: "vrhot1", 46: "prochot_cpu", 47: "prochot_gfx",
    56: "ppm", 57: "fit",
}
V3_RESIDENCY = {
    "throttle_residency_prochot": "prochot", "throttle_residency_spl": "spl", "throttle_residency_fppt": "fppt",
    "throttle_residency_sppt": "sppt", "throttle_residency_thm_core": "temp_core",
    "throttle_residency_thm_gfx": "temp_gfx", "throttle_residency_thm_soc": "temp_soc",
}


class GpuMetricsError(ValueError):
    """The bytes are not a gpu_metrics table this decoder knows."""


@dataclass
class GpuMetrics:
    format_revision: int
    content_revision: int
    temp_edge: MaybeFloat = NA  # APUs: the gfx temperature
    temp_hotspot: MaybeFloat = NA
    temp_mem: MaybeFloat = NA
    gfx_activity: MaybeFloat = NA  # percent
    socket_power: MaybeFloat = NA  # watts
    gfxclk: MaybeFloat = NA  # MHz
    uclk: MaybeFloat = NA
    fan_rpm: MaybeFloat = NA
    throttle_status: MaybeInt = NA  # raw ASIC-dependent mask
    indep_throttle_status: MaybeInt = NA  # raw ASIC-independent mask
    residency: dict[str, int] = field(default_factory=dict)  # v3: reason -> cumulative counter
    throttle_reasons: list[str] = field(default_factory=list)  # decoded from the masks (v3: see residency)

    @property
    def version(self) -> str:
        return f"{self.format_revision}.{self.content_revision}"


def _v(x: int, bits: int = 16) -> MaybeInt:
    return NA if x == (1 << bits) - 1 else int(x)


def _scaled(x: int, scale: float, bits: int = 16) -> MaybeFloat:
    v = _v(x, bits)
    return NA if v is NA else v / scale


def _mask_reasons(mask: int, names: dict[int, str]) -> list[str]:
    out = [name for bit, name in sorted(names.items()) if mask >> bit & 1]
    unknown = mask & ~sum(1 << b for b in names)
    if unknown:
        out.append(f"other_0x{unknown:x}")
    return out


def decode(data: bytes) -> GpuMetrics:
    """Decode one gpu_metrics read. Raises GpuMetricsError for a short or unknown table."""
    if len(data) < 4:
        raise GpuMetricsError(f"gpu_metrics is {len(data)} bytes, shorter than its header")
    hdr = _Header.from_buffer_copy(data[:4])
    key = (hdr.format_revision, hdr.content_revision)
    struct = STRUCTS.get(key)
    if struct is None and key[0] == 2 and key[1] > 4:
        # APU tables have only ever appended fields within format 2: read the known prefix.
        struct = STRUCTS[(2, 4)]
    if struct is None:
        # v1.4+ (MI300 class) reorder the table; v3.1+ are unknown: leave them to hwmon rather than guess.
        raise GpuMetricsError(f"gpu_metrics v{key[0]}.{key[1]} is not a layout this version decodes")
    if len(data) < ctypes.sizeof(struct):
        raise GpuMetricsError(f"gpu_metrics v{key[0]}.{key[1]} is {len(data)} bytes; expected at least "
                              f"{ctypes.sizeof(struct)}")
    s = struct.from_buffer_copy(data[: ctypes.sizeof(struct)])
    m = GpuMetrics(*key)
    if key[0] == 1:
        m.temp_edge, m.temp_hotspot, m.temp_mem = (_scaled(s.temperature_edge, 1), _scaled(s.temperature_hotspot, 1),
                                                   _scaled(s.temperature_mem, 1))
        m.socket_power = _scaled(s.average_socket_power, 1)
        m.fan_rpm = _scaled(s.current_fan_speed, 1)
        m.uclk = _scaled(s.current_uclk, 1)
    else:
        # APU tables: temperatures in centi-degrees, power in milliwatts, no discrete fan.
        m.temp_edge = _scaled(s.temperature_gfx, 100)
        m.socket_power = _scaled(s.average_socket_power, 1000, 32 if key[0] == 3 else 16)
        m.uclk = _scaled(s.average_uclk_frequency, 1)
    m.gfx_activity = _scaled(s.average_gfx_activity, 1)
    if key[0] == 2 and key[1] >= 4:
        m.gfx_activity = _scaled(s.average_gfx_activity, 100)  # v2.4 reports centi-percent
    m.gfxclk = _scaled(s.current_gfxclk if key[0] != 3 else s.average_gfxclk_frequency, 1)
    if key[0] != 3:
        m.throttle_status = _v(s.throttle_status, 32)
    if hasattr(s, "indep_throttle_status"):
        m.indep_throttle_status = _v(s.indep_throttle_status, 64)
    if m.indep_throttle_status is not NA:
        m.throttle_reasons = _mask_reasons(int(m.indep_throttle_status), INDEP_THROTTLE_BITS)
    elif key == (1, 0) and m.throttle_status is not NA:
        m.throttle_reasons = _mask_reasons(int(m.throttle_status), VEGA20_THROTTLE_BITS)
    elif m.throttle_status:
        m.throttle_reasons = [f"asic_0x{int(m.throttle_status):x}"]  # bit meaning differs per ASIC
    if key[0] == 3:
        m.residency = {name: int(getattr(s, f)) for f, name in V3_RESIDENCY.items()}
    return m


def residency_reasons(previous: dict[str, int], current: dict[str, int]) -> list[str]:
    """v3 tables: the limits whose residency counters grew between two reads are throttling now."""
    return [name for name, v in current.items() if name in previous and v > previous[name]]


def struct_size(format_revision: int, content_revision: int) -> int:
    """sizeof(struct gpu_metrics_vX_Y), e.g. 80 for v1.0 and 120 for v1.3."""
    return ctypes.sizeof(STRUCTS[(format_revision, content_revision)])


__all__ = ["GpuMetrics", "GpuMetricsError", "INDEP_THROTTLE_BITS", "VEGA20_THROTTLE_BITS", "decode",
           "residency_reasons", "struct_size"]
