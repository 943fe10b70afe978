"""AMD detection and telemetry on fake sysfs trees built from the real layouts (tests/fixtures/sysfs)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import struct
from pathlib import Path

import pytest

from ds4station.commands import detect as detect_cmd
from ds4station.hardware import NA, detect, detect_devices, reason_category
from ds4station.hardware.amd import gfx_arch, parse_dpm
from ds4station.hardware.gpu_metrics import GpuMetricsError, decode, residency_reasons, struct_size

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"
HOST1 = FIXTURES / "gfx906-workstation"
HOST2 = FIXTURES / "rdna3-strix-halo"
GiB, MiB = 1 << 30, 1 << 20


def _make_trees():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_trees", FIXTURES / "make_trees.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mk = _make_trees()


# ---- gpu_metrics -----------------------------------------------------------------------------------------
def test_struct_sizes_match_the_kernel_layouts() -> None:
    # sizeof() of the kernel structs, as reported in their own structure_size header field
    assert struct_size(1, 0) == 80 == len(mk.pack_v1_0(edge=1, hotspot=1, mem=1, gfx_activity=0, socket_power=0,
                                                       gfxclk=0, uclk=0, throttle_status=0, fan_rpm=0))
    assert struct_size(1, 3) == 120
    assert struct_size(2, 2) == 128
    assert struct_size(3, 0) == 264


def test_decode_v1_0_vega20_throttle_bits() -> None:
    data = mk.pack_v1_0(edge=88, hotspot=107, mem=86, gfx_activity=100, socket_power=250, gfxclk=1610, uclk=1000,
                        throttle_status=(1 << 13) | (1 << 2) | (1 << 11), fan_rpm=3200)
    m = decode(data)
    assert m.version == "1.0"
    assert (m.temp_edge, m.temp_hotspot, m.temp_mem) == (88, 107, 86)
    assert (m.gfx_activity, m.socket_power, m.gfxclk, m.uclk, m.fan_rpm) == (100, 250, 1610, 1000, 3200)
    assert m.throttle_reasons == ["temp_hotspot", "tdc_gfx", "ppt"]
    assert m.indep_throttle_status is NA


def test_decode_v1_3_uses_the_asic_independent_mask() -> None:
    mask = (1 << 0) | (1 << 36) | (1 << 18) | (1 << 60)
    m = decode(mk.pack_v1_3(edge=70, hotspot=0xFFFF, mem=80, gfx_activity=50, socket_power=280, gfxclk=2300,
                            uclk=1250, throttle_status=0x5, indep_throttle_status=mask, fan_rpm=1500))
    assert m.temp_hotspot is NA  # 0xFFFF = not supported
    assert m.temp_mem == 80 and m.socket_power == 280 and m.gfxclk == 2300
    assert m.throttle_reasons == ["ppt0", "tdc_mem", "temp_hotspot", f"other_0x{1 << 60:x}"]
    assert [reason_category(r) for r in m.throttle_reasons[:3]] == ["power", "current", "thermal"]


def test_decode_v2_2_apu_units_and_indep_status() -> None:
    data = mk.pack_v2_2(gfx_centi=4550, gfx_activity=30, socket_mw=15000, gfxclk=1900, uclk=1600,
                        throttle_status=0x20, indep_throttle_status=(1 << 4) | (1 << 33))
    assert len(data) == struct_size(2, 2)
    m = decode(data)
    assert (m.temp_edge, m.socket_power, m.gfx_activity, m.gfxclk, m.uclk) == (45.5, 15.0, 30, 1900, 1600)
    assert m.throttle_reasons == ["spl", "temp_core"] and m.fan_rpm is NA
    # v2.4 appended fields and reports activity in centi-percent; a later v2 revision reads the known prefix
    v24 = bytearray(mk.pack_v2_2(gfx_centi=4550, gfx_activity=3000, socket_mw=15000, gfxclk=1900, uclk=1600,
                                 throttle_status=0, indep_throttle_status=0)) + bytes(40)
    v24[3] = 4
    assert decode(bytes(v24)).gfx_activity == 30
    v24[3] = 9
    assert decode(bytes(v24)).temp_edge == 45.5


def test_decode_v3_0_apu_units_and_residency() -> None:
    m = decode(mk.pack_v3_0(gfx_centi=6150, gfx_activity=40, socket_mw=45500, gfxclk=2800, uclk=4000,
                            residency=(1, 2, 3, 4, 5, 6, 7)))
    assert m.version == "3.0"
    assert m.temp_edge == pytest.approx(61.5)  # centi-degrees
    assert m.socket_power == pytest.approx(45.5)  # milliwatts
    assert m.gfxclk == 2800 and m.gfx_activity == 40
    assert m.residency == {"prochot": 1, "spl": 2, "fppt": 3, "sppt": 4, "temp_core": 5, "temp_gfx": 6,
                           "temp_soc": 7}
    later = dict(m.residency, spl=9, temp_gfx=8)
    assert residency_reasons(m.residency, later) == ["spl", "temp_gfx"]


def test_decode_rejects_short_or_unknown_tables() -> None:
    with pytest.raises(GpuMetricsError, match="shorter than its header"):
        decode(b"\x01\x02")
    with pytest.raises(GpuMetricsError, match="expected at least 120"):
        decode(struct.pack("<HBB", 120, 1, 3) + bytes(20))
    with pytest.raises(GpuMetricsError, match="v1.5"):  # MI300 layout: not guessed
        decode(struct.pack("<HBB", 400, 1, 5) + bytes(400))


# ---- sysfs helpers -------------------------------------------------------------------------------------------
def test_parse_dpm_and_gfx_arch() -> None:
    assert parse_dpm("0: 808Mhz\n1: 1301Mhz *\n2: 1801Mhz\n") == (1301.0, 1801.0)
    assert parse_dpm(None) == (NA, NA)
    assert [gfx_arch(v) for v in (90006, 90010, 110000, 110501)] == ["gfx906", "gfx90a", "gfx1100", "gfx1151"]


def test_committed_trees_match_the_generator(tmp_path: Path) -> None:
    for name in mk.TREES:
        fresh = mk.build(tmp_path, name)
        want = {p.relative_to(fresh): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
        have = {p.relative_to(FIXTURES / name): p.read_bytes() for p in (FIXTURES / name).rglob("*") if p.is_file()}
        assert have == want, f"tests/fixtures/sysfs/{name} is stale: run python tests/fixtures/sysfs/make_trees.py"


# ---- reference host 1: 32 GiB Vega 20 + 5 x Radeon VII -----------------------------------------------------------
def test_host1_static_facts() -> None:
    gpus = detect(HOST1, use_nvml=False)
    assert len(gpus) == 6
    assert [g.arch for g in gpus] == ["gfx906"] * 6
    assert all(g.wave_size == 64 and g.vendor == "amd" and not g.is_apu for g in gpus)
    assert gpus[0].vram_total == 32 * GiB - 16 * MiB and gpus[0].uuid == "3f1c2d4e5a6b7c80"
    assert [g.name for g in gpus[1:]] == ["AMD Radeon VII"] * 5
    assert [g.drives_display for g in gpus] == [False, True, False, False, False, False]
    assert [g.pci_bus_id for g in gpus][:2] == ["0000:03:00.0", "0000:06:00.0"]
    assert gpus[1].vram_used == 700 * MiB


def test_host1_telemetry_temperatures_and_throttling() -> None:
    devices = detect_devices(HOST1, use_nvml=False)
    idle, desktop, hot = (d.sample() for d in devices[:3])
    assert (desktop.temp_edge, desktop.temp_junction, desktop.temp_memory) == (45.0, 52.0, 50.0)
    assert (desktop.temp_edge_crit, desktop.temp_junction_crit, desktop.temp_memory_crit) == (100.0, 110.0, 95.0)
    assert desktop.throttled is False and desktop.throttle_reasons == []
    assert idle.power == 24.0 and idle.power_cap == 250.0
    assert (idle.clock_sm, idle.clock_sm_max, idle.clock_mem, idle.clock_mem_max) == (808, 1801, 351, 1000)
    assert hot.utilisation == 100 and hot.fan_rpm == 3200 and hot.fan_percent == 40.0
    assert hot.throttled is True
    # gpu_metrics v1.0 status (PPT, hotspot) plus hwmon junction 107 C within 5 C of its 110 C limit
    assert hot.throttle_reasons == ["temp_hotspot", "ppt", "temp_junction_critical"]
    assert {reason_category(r) for r in hot.throttle_reasons} == {"thermal", "power"}


# ---- reference host 2: RX 7900 XT + Strix Halo ------------------------------------------------------------------
def test_host2_static_facts_gtt_vs_carveout() -> None:
    xt, apu = detect(HOST2, use_nvml=False)
    assert (xt.name, xt.arch, xt.wave_size, xt.is_apu) == ("AMD Radeon RX 7900 XT", "gfx1100", 32, False)
    assert xt.vram_total == 20 * GiB - 16 * MiB and xt.drives_display is False
    assert (apu.arch, apu.is_apu, apu.drives_display) == ("gfx1151", True, True)
    assert apu.vram_total == 512 * MiB and apu.gtt_total == 96 * GiB


def test_host2_telemetry_and_v3_residency_between_reads(tmp_path: Path) -> None:
    root = shutil.copytree(HOST2, tmp_path / "host2")
    xt, apu = detect_devices(root, use_nvml=False)
    s = xt.sample()
    assert (s.temp_edge, s.temp_junction, s.temp_memory) == (71.0, 96.0, 84.0)
    assert s.power == 299.0 and s.throttled is True and s.throttle_reasons == ["ppt0"]
    first = apu.sample()
    assert first.temp_edge == 52.3 and first.temp_junction is NA and first.fan_rpm is NA
    assert first.power == 38.0  # power1_input (no power1_average on this APU)
    assert first.throttled is NA  # v3 counters need two reads; hwmon has no critical limit here
    metrics = root / "sys/class/drm/card1/device/gpu_metrics"
    metrics.write_bytes(mk.pack_v3_0(gfx_centi=9800, gfx_activity=100, socket_mw=120000, gfxclk=2500, uclk=4000,
                                     residency=(0, 10, 0, 0, 0, 9, 0)))
    second = apu.sample()
    assert second.throttled is True and second.throttle_reasons == ["temp_gfx"]
    third = apu.sample()
    assert third.throttled is False  # counters unchanged since the last read


def test_missing_and_broken_files_read_as_na(tmp_path: Path) -> None:
    dev = tmp_path / "sys/class/drm/card0/device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x1002\n")
    (dev / "gpu_metrics").write_bytes(b"\x00\x01")
    (tmp_path / "sys/class/drm/card0-DP-1").mkdir()  # a connector without a status file
    (gpu,) = detect(tmp_path, use_nvml=False)
    assert gpu.name == "AMD GPU" and gpu.arch is NA and gpu.vram_total is NA and gpu.wave_size is NA
    assert gpu.drives_display is False
    s = detect_devices(tmp_path, use_nvml=False)[0].sample()
    assert s.temp_edge is NA and s.power is NA and s.clock_sm is NA and s.throttled is NA
    assert json.loads(json.dumps(s.as_dict()))["temp_edge"] is None


def test_arch_falls_back_to_the_pci_id_table_without_kfd(tmp_path: Path) -> None:
    root = shutil.copytree(HOST1, tmp_path / "h")
    shutil.rmtree(root / "sys/class/kfd")
    gpus = detect(root, use_nvml=False)
    assert [g.arch for g in gpus] == ["gfx906"] * 6 and gpus[0].wave_size == 64


def test_non_amd_cards_are_skipped(tmp_path: Path) -> None:
    dev = tmp_path / "sys/class/drm/card0/device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x8086\n")
    assert detect(tmp_path, use_nvml=False) == []


# ---- the detect command ------------------------------------------------------------------------------------------
def _run_detect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    detect_cmd.add_arguments(p)
    rc = detect_cmd.run(p.parse_args(list(argv)))
    return rc, capsys.readouterr().out


def test_detect_command_no_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out = _run_detect(capsys, "--sysfs-root", str(tmp_path), "--no-nvml")
    assert rc == 0 and "No GPU found" in out
    rc, out = _run_detect(capsys, "--sysfs-root", str(tmp_path), "--no-nvml", "--json")
    assert rc == 0 and json.loads(out) == {"gpus": []}


def test_detect_command_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run_detect(capsys, "--sysfs-root", str(HOST1), "--no-nvml")
    assert rc == 0 and "6 GPUs" in out and "AMD Radeon VII" in out
    assert "temp_hotspot, ppt, temp_junction_critical" in out
    rc, out = _run_detect(capsys, "--sysfs-root", str(HOST2), "--no-nvml", "--json")
    data = json.loads(out)["gpus"]
    assert [g["arch"] for g in data] == ["gfx1100", "gfx1151"]
    assert data[1]["is_apu"] is True and data[1]["gtt_total"] == 96 * GiB
    assert data[0]["sample"]["throttle_reasons"] == ["ppt0"] and data[1]["sample"]["throttled"] is None
