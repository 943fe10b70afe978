"""AMD GPUs through the amdgpu sysfs interface, read from a configurable root so tests run on fake trees.

Per card (`/sys/class/drm/cardN/device/`): vendor/device/revision ids, `uevent` (PCI_SLOT_NAME),
`mem_info_{vram,gtt}_{total,used}`, `gpu_busy_percent`, `pp_dpm_sclk` / `pp_dpm_mclk` (the starred level is
current, the last the maximum), `unique_id`, the binary `gpu_metrics` table (gpu_metrics.py), and hwmon
(`hwmon/hwmonM/temp{1,2,3}_{input,label,crit}` = edge / junction / mem in millidegrees, `power1_average` or
`power1_input` and `power1_cap` in microwatts, `fan1_input` in RPM, `pwm1` 0-255). A card drives a display
when one of its connectors (`/sys/class/drm/cardN-*/status`) says "connected". The architecture (gfx906,
gfx1100, gfx1151) and wave size come from the KFD topology (`/sys/class/kfd/kfd/topology/nodes/*/properties`,
matched by PCI location), falling back to a table of PCI ids. pyamdgpuinfo, when installed and reading the
real root, supplies the marketing name. Anything missing reads as NA; nothing here raises for a odd card.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .gpu_metrics import GpuMetrics, GpuMetricsError, decode, residency_reasons
from .types import NA, Gpu, MaybeFloat, MaybeInt, MaybeStr, Sample

AMD_VENDOR = 0x1002
CRIT_MARGIN_C = 5.0  # a temperature within this of its hwmon critical limit counts as a thermal limit

# PCI device id -> (name, arch, apu); revision refines Navi 31's name. Used when KFD/pyamdgpuinfo are absent.
_PCI_IDS: dict[int, tuple[str, str, bool]] = {
    0x66A0: ("AMD Instinct MI50/MI60 (Vega 20)", "gfx906", False),
    0x66A1: ("AMD Radeon Pro VII / Instinct MI50 (Vega 20)", "gfx906", False),
    0x66A2: ("AMD Vega 20", "gfx906", False),
    0x66A3: ("AMD Radeon Pro Vega II (Vega 20)", "gfx906", False),
    0x66A7: ("AMD Vega 20", "gfx906", False),
    0x66AF: ("AMD Radeon VII", "gfx906", False),
    0x744C: ("AMD Radeon RX 7900 XT/XTX", "gfx1100", False),
    0x1586: ("AMD Radeon 8060S (Strix Halo)", "gfx1151", True),
}
_NAVI31_REV = {0xC8: "AMD Radeon RX 7900 XTX", 0xCC: "AMD Radeon RX 7900 XT", 0xCE: "AMD Radeon RX 7900 GRE"}
_TEMP_NAMES = {"edge": "edge", "junction": "junction", "mem": "memory"}
_DEFAULT_TEMP_LABEL = {1: "edge", 2: "junction", 3: "mem"}


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(path: Path, base: int = 0) -> MaybeInt:
    t = _text(path)
    if t is None:
        return NA
    try:
        return int(t, base)
    except ValueError:
        return NA


def _scaled(path: Path, scale: float) -> MaybeFloat:
    v = _int(path)
    return NA if v is NA else v / scale


def _first(*values: object) -> object:
    return next((v for v in values if v is not NA and v is not None), NA)


def parse_dpm(text: str | None) -> tuple[MaybeFloat, MaybeFloat]:
    """`0: 700Mhz\\n1: 1801Mhz *` -> (current, max) in MHz."""
    if not text:
        return NA, NA
    levels, current = [], NA
    for line in text.splitlines():
        m = re.match(r"\s*\d+:\s*([0-9.]+)\s*[Mm][Hh]z(\s*\*)?", line)
        if m:
            levels.append(float(m.group(1)))
            if m.group(2):
                current = float(m.group(1))
    return current, (max(levels) if levels else NA)


def gfx_arch(target_version: int) -> str:
    """KFD gfx_target_version (major*10000 + minor*100 + stepping) -> gfx name: 90006 -> gfx906."""
    major, minor, step = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor}{step:x}"


def _kfd_nodes(root: Path) -> list[dict[str, int]]:
    base = root / "sys/class/kfd/kfd/topology/nodes"
    out = []
    try:
        names = sorted(os.listdir(base), key=lambda n: int(n) if n.isdigit() else 0)
    except OSError:
        return out
    for n in names:
        props: dict[str, int] = {}
        for line in (_text(base / n / "properties") or "").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                props[parts[0]] = int(parts[1])
        if props.get("simd_count", 0) > 0:  # GPU nodes only
            out.append(props)
    return out


def _bdf_key(bus_id: str) -> tuple[int, int] | None:
    m = re.match(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$", bus_id)
    if not m:
        return None
    domain = int(m.group(1) or "0", 16)
    return domain, int(m.group(2), 16) << 8 | int(m.group(3), 16) << 3 | int(m.group(4))


class AmdDevice:
    """One amdgpu card: static facts (`info`) and live telemetry (`sample`)."""

    vendor = "amd"

    def __init__(self, card: str, root: Path, index: int, kfd: list[dict[str, int]]) -> None:
        self.card, self.root, self.index = card, root, index
        self.drm = root / "sys/class/drm"
        self.dev = self.drm / card / "device"
        self._kfd = self._match_kfd(kfd)
        self._last_residency: dict[str, int] | None = None
        self._info = self._read_info()

    # ---- static facts --------------------------------------------------------------------------
    def _pci_bus_id(self) -> MaybeStr:
        for line in (_text(self.dev / "uevent") or "").splitlines():
            if line.startswith("PCI_SLOT_NAME="):
                return line.split("=", 1)[1].strip().lower()
        try:
            name = os.path.basename(os.path.realpath(self.dev))
        except OSError:
            return NA
        return name.lower() if _bdf_key(name) else NA

    def _match_kfd(self, kfd: list[dict[str, int]]) -> dict[str, int]:
        bus = self._pci_bus_id()
        key = _bdf_key(bus) if isinstance(bus, str) else None
        for props in kfd:
            if key and (props.get("domain", 0), props.get("location_id")) == key:
                return props
        return {}

    def _read_info(self) -> Gpu:
        dev_id = _int(self.dev / "device", 16)
        rev = _int(self.dev / "revision", 16)
        known = _PCI_IDS.get(dev_id) if isinstance(dev_id, int) else None
        name = _text(self.dev / "product_name") or ""
        if not name and known:
            name = _NAVI31_REV.get(rev, known[0]) if dev_id == 0x744C and isinstance(rev, int) else known[0]
        if not name:
            name = f"AMD GPU {dev_id:#06x}" if isinstance(dev_id, int) else "AMD GPU"
        bus = self._pci_bus_id()
        if self.root == Path("/"):  # the library reads the live system, never a fake tree
            name = _pyamdgpuinfo_name(bus) or name
        target = self._kfd.get("gfx_target_version")
        arch: MaybeStr = gfx_arch(target) if target else (known[1] if known else NA)
        wave = self._kfd.get("wave_front_size") or (
            (64 if arch.startswith("gfx9") else 32) if isinstance(arch, str) else NA)
        vram_total = _int(self.dev / "mem_info_vram_total")
        gtt_total = _int(self.dev / "mem_info_gtt_total")
        metrics = self._metrics()
        is_apu = bool((known and known[2]) or (metrics and metrics.format_revision >= 2)
                      or (self._kfd.get("cpu_cores_count", 0) > 0))
        uuid = _text(self.dev / "unique_id") or NA
        return Gpu(index=self.index, vendor="amd", name=name, arch=arch, vram_total=vram_total,
                   vram_used=_int(self.dev / "mem_info_vram_used"), pci_bus_id=bus, uuid=uuid, wave_size=wave,
                   drives_display=self.drives_display(), is_apu=is_apu, gtt_total=gtt_total,
                   gtt_used=_int(self.dev / "mem_info_gtt_used"), source=str(self.drm / self.card))

    def drives_display(self) -> bool:
        try:
            names = os.listdir(self.drm)
        except OSError:
            return False
        return any(n.startswith(self.card + "-") and _text(self.drm / n / "status") == "connected" for n in names)

    def info(self) -> Gpu:
        """Static facts with the memory use refreshed."""
        self._info.vram_used = _int(self.dev / "mem_info_vram_used")
        self._info.gtt_used = _int(self.dev / "mem_info_gtt_used")
        self._info.drives_display = self.drives_display()
        return self._info

    # ---- telemetry -----------------------------------------------------------------------------
    def _metrics(self) -> GpuMetrics | None:
        try:
            data = (self.dev / "gpu_metrics").read_bytes()
        except OSError:
            return None
        try:
            return decode(data)
        except GpuMetricsError:
            return None

    def _hwmon(self) -> Path | None:
        base = self.dev / "hwmon"
        try:
            names = sorted(n for n in os.listdir(base) if n.startswith("hwmon"))
        except OSError:
            return None
        return base / names[0] if names else None

    def sample(self) -> Sample:
        s = Sample()
        m = self._metrics()
        hw = self._hwmon()
        temps: dict[str, tuple[MaybeFloat, MaybeFloat]] = {}
        if hw is not None:
            for n in range(1, 6):
                value = _scaled(hw / f"temp{n}_input", 1000)
                if value is NA:
                    continue
                label = (_text(hw / f"temp{n}_label") or _DEFAULT_TEMP_LABEL.get(n, "")).lower()
                if label in _TEMP_NAMES:
                    temps[_TEMP_NAMES[label]] = (value, _scaled(hw / f"temp{n}_crit", 1000))
        for kind, metric in (("edge", m.temp_edge if m else NA), ("junction", m.temp_hotspot if m else NA),
                             ("memory", m.temp_mem if m else NA)):
            if kind not in temps and metric is not NA:
                temps[kind] = (metric, NA)
        for kind, (value, crit) in temps.items():
            setattr(s, f"temp_{kind}", value)
            setattr(s, f"temp_{kind}_crit", crit)
        s.utilisation = _first(_scaled(self.dev / "gpu_busy_percent", 1), m.gfx_activity if m else NA)  # type: ignore[assignment]
        s.vram_used = _int(self.dev / "mem_info_vram_used")
        s.gtt_used = _int(self.dev / "mem_info_gtt_used")
        if hw is not None:
            s.power = _first(_scaled(hw / "power1_average", 1e6), _scaled(hw / "power1_input", 1e6))  # type: ignore[assignment]
            s.power_cap = _scaled(hw / "power1_cap", 1e6)
            s.fan_rpm = _scaled(hw / "fan1_input", 1)
            pwm = _int(hw / "pwm1")
            s.fan_percent = NA if pwm is NA else round(int(pwm) * 100 / 255, 1)
        if s.power is NA and m:
            s.power = m.socket_power
        if s.fan_rpm is NA and m:
            s.fan_rpm = m.fan_rpm
        s.clock_sm, s.clock_sm_max = parse_dpm(_text(self.dev / "pp_dpm_sclk"))
        s.clock_mem, s.clock_mem_max = parse_dpm(_text(self.dev / "pp_dpm_mclk"))
        if s.clock_sm is NA and m:
            s.clock_sm = m.gfxclk
        if s.clock_mem is NA and m:
            s.clock_mem = m.uclk

        reasons: list[str] = []
        known = False
        if m is not None:
            if m.residency:
                if self._last_residency is not None:
                    reasons += residency_reasons(self._last_residency, m.residency)
                    known = True
                self._last_residency = dict(m.residency)
            else:
                reasons += m.throttle_reasons
                known = known or m.throttle_status is not NA or m.indep_throttle_status is not NA
        for kind, (value, crit) in temps.items():
            if value is not NA and crit is not NA:
                known = True
                if float(value) >= float(crit) - CRIT_MARGIN_C:
                    reasons.append(f"temp_{kind}_critical")
        s.throttle_reasons = list(dict.fromkeys(reasons))
        s.throttled = bool(s.throttle_reasons) if known else NA
        return s


def _pyamdgpuinfo_name(bus: MaybeStr) -> str | None:
    try:
        import pyamdgpuinfo  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        for i in range(pyamdgpuinfo.detect_gpus()):
            g = pyamdgpuinfo.get_gpu(i)
            if isinstance(bus, str) and str(getattr(g, "pci_slot", "")).lower().endswith(bus[-7:]):
                return str(g.name) if g.name else None
    except Exception:  # a library probing hardware may fail in many ways; the sysfs name still stands
        return None
    return None


def amd_devices(root: str | os.PathLike[str] = "/") -> list[AmdDevice]:
    """Every amdgpu card under `root` (default: the real /sys), in card order."""
    root = Path(root)
    drm = root / "sys/class/drm"
    try:
        cards = sorted((n for n in os.listdir(drm) if re.fullmatch(r"card\d+", n)), key=lambda n: int(n[4:]))
    except OSError:
        return []
    kfd = _kfd_nodes(root)
    out = []
    for card in cards:
        if _int(drm / card / "device" / "vendor", 16) != AMD_VENDOR:
            continue
        out.append(AmdDevice(card, root, len(out), kfd))
    return out


__all__ = ["AmdDevice", "amd_devices", "gfx_arch", "parse_dpm"]
