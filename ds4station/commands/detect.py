"""`ds4station detect`: list the GPUs (NVIDIA through NVML, AMD through sysfs) with one telemetry sample."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object: {\"gpus\": [...]}")
    p.add_argument("--sysfs-root", default="/", metavar="PATH",
                   help="read AMD sysfs under PATH instead of / (e.g. tests/fixtures/sysfs/gfx906-workstation)")
    p.add_argument("--no-nvml", action="store_true", help="do not query NVIDIA GPUs")


def _gib(v: object) -> str:
    return f"{v / 2**30:.2f}" if isinstance(v, (int, float)) else "N/A"


def _num(v: object, fmt: str = ".0f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "N/A"


def _temp(value: object, crit: object) -> str:
    t = _num(value)
    return t + (f"/{_num(crit)}" if isinstance(crit, (int, float)) else "")


def run(args: argparse.Namespace) -> int:
    from ds4station.hardware import detect_devices

    devices = detect_devices(args.sysfs_root, use_nvml=not args.no_nvml)
    rows = [(d.info(), d.sample()) for d in devices]
    if args.json:
        print(json.dumps({"gpus": [g.as_dict() | {"sample": s.as_dict()} for g, s in rows]}, indent=1))
        return 0
    if not rows:
        where = "NVML" if not args.no_nvml else ""
        where = " and ".join(x for x in (where, f"amdgpu sysfs under {args.sysfs_root}") if x)
        print(f"No GPU found (looked through {where}). `ds4station plan --gpus SPEC` plans for cards you "
              f"do not have yet.")
        return 0
    print(f"{len(rows)} GPU{'s' if len(rows) != 1 else ''}")
    print(f"{'#':>2} {'name':32} {'arch':8} {'VRAM used/total GiB':>20} {'bus id':13} {'wave':>4} display")
    for g, _ in rows:
        mem = f"{_gib(g.vram_used)}/{_gib(g.vram_total)}"
        extra = f"  APU, GTT {_gib(g.gtt_used)}/{_gib(g.gtt_total)} GiB" if g.is_apu else ""
        display = {True: "yes", False: "no"}.get(g.drives_display, "N/A")  # type: ignore[call-overload]
        print(f"{g.index:>2} {g.name[:32]:32} {g.arch!s:8} {mem:>20} {g.pci_bus_id!s:13} {g.wave_size!s:>4} "
              f"{display}{extra}")
    print(f"\n{'#':>2} {'util%':>5} {'edge/crit':>9} {'junc/crit':>9} {'mem/crit':>9} {'power/cap W':>12} "
          f"{'sclk/max MHz':>13} {'mclk/max':>10} {'fan':>8}  throttling")
    for g, s in rows:
        power = f"{_num(s.power)}/{_num(s.power_cap)}"
        fan = f"{_num(s.fan_rpm)}rpm" if isinstance(s.fan_rpm, float) else (
            f"{_num(s.fan_percent)}%" if isinstance(s.fan_percent, float) else "N/A")
        throttle = ("no" if s.throttled is False else ", ".join(s.throttle_reasons) if s.throttled else "N/A")
        print(f"{g.index:>2} {_num(s.utilisation):>5} {_temp(s.temp_edge, s.temp_edge_crit):>9} "
              f"{_temp(s.temp_junction, s.temp_junction_crit):>9} {_temp(s.temp_memory, s.temp_memory_crit):>9} "
              f"{power:>12} {_num(s.clock_sm) + '/' + _num(s.clock_sm_max):>13} "
              f"{_num(s.clock_mem) + '/' + _num(s.clock_mem_max):>10} {fan:>8}  {throttle}")
    return 0
