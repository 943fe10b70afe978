"""The memory the planner may use on each device: from detected GPUs, a hypothetical SPEC, or a host profile.

SPEC describes cards for planning ahead of buying or wiring them, in the order the stages should use them:
comma-separated `SIZE[:FLAG...][xN]` entries, e.g. `32GiB,16GiB:desktop,16GiBx4`. Flags: `desktop` (the
card drives the display and keeps the desktop headroom), `apu` (SIZE is the GTT the integrated GPU may map,
i.e. system RAM shared with the CPU), `bw=GBPS` (memory bandwidth, so the speed preset gives a faster card more
layers). `cpu` (optionally `cpu:SIZE`, `cpu:bw=GBPS`) adds a CPU stage using host RAM; it counts with
CPU_BANDWIDTH unless given its own.

What a device offers a stage (`DeviceBudget.available`): its total (VRAM; GTT for an APU, not the small
VRAM carve-out; host RAM minus a reserve for the CPU), less what other processes already use (detected cards
only), less the desktop headroom on a display card, less a small reserve against allocator fragmentation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds4station.model.sizes import GiB, format_size, gib, parse_size

if TYPE_CHECKING:
    from ds4station.hardware import Gpu

DEFAULT_DESKTOP_HEADROOM = 3 * GiB // 2
DEFAULT_HOST_RESERVE = 8 * GiB  # the OS, the server process and some page cache for the GGUF
# What the speed preset assumes a CPU stage reads its weights at, in the cards' nominal GB/s: a dual-channel
# DDR5 desktop's memory is ~60-90 GB/s against a few hundred to thousands on a card (_BANDWIDTH_BY_NAME), and a
# CPU stage's kernels are compute-bound on few cores (docs/PERFORMANCE.md: ~13 GB/s on two). `cpu:bw=GBPS`.
CPU_BANDWIDTH = 60.0
# ... and a card whose bandwidth is unknown, beside such a CPU stage (when no card's is known to compare with)
CARD_BANDWIDTH = 600.0


@dataclass(frozen=True)
class DeviceBudget:
    device: str  # route device string: cpu, cuda:N or a PCI bus id
    label: str
    kind: str = "gpu"  # gpu | apu | cpu
    total_bytes: int = 0
    used_bytes: int = 0  # in use by others right now (detected devices); 0 for hypothetical ones
    desktop: bool = False
    bandwidth_gbs: float = 0.0  # memory bandwidth (nominal GB/s) for balancing decode time; 0 = unknown
    index: int | None = None  # the detected card's number (what the GPU panel shows), None for a SPEC card
    cap: str = ""  # how total_bytes was limited, when it was (an APU's GTT by the host's RAM)

    def available(self, desktop_headroom: int = DEFAULT_DESKTOP_HEADROOM, reserve: int = 0) -> int:
        taken = max(self.used_bytes, desktop_headroom if self.desktop else 0)
        return max(self.total_bytes - taken - reserve, 0)

    def explain_available(self, desktop_headroom: int = DEFAULT_DESKTOP_HEADROOM, reserve: int = 0) -> str:
        """Where `available` comes from, e.g. `16.00 GiB VRAM - 1.50 GiB desktop headroom = 14.50 GiB`."""
        what = {"apu": "GTT", "cpu": "RAM"}.get(self.kind, "VRAM")
        text = f"{gib(self.total_bytes)} {what}" + (f" ({self.cap})" if self.cap else "")
        if self.desktop and desktop_headroom >= self.used_bytes:
            text += f" - {gib(desktop_headroom)} desktop headroom"
        elif self.used_bytes:
            text += f" - {gib(self.used_bytes)} in use by other processes"
        if reserve:
            text += f" - {gib(reserve)} reserve"
        return f"{text} = {gib(self.available(desktop_headroom, reserve))}"

    def describe(self) -> str:
        extra = ", desktop" if self.desktop else ""
        what = {"apu": "GTT", "cpu": "RAM"}.get(self.kind, "VRAM")
        return f"{self.label} ({format_size(self.total_bytes)} {what}{extra})"


_ENTRY = re.compile(r"^(?P<body>.+?)(?:\s*[x*]\s*(?P<n>\d+))?$")


def parse_gpu_spec(spec: str, host_ram: int | None = None) -> list[DeviceBudget]:
    """`32GiB,16GiB:desktop,16GiBx4` -> budgets named cuda:0, cuda:1, ... in that order."""
    out: list[DeviceBudget] = []
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise ValueError("empty --gpus SPEC: write e.g. 32GiB,16GiB:desktop,16GiBx4")
    for entry in entries:
        m = _ENTRY.match(entry)
        assert m is not None
        count = int(m.group("n") or 1)
        if count < 1:
            raise ValueError(f"--gpus entry {entry!r}: the repeat count must be >= 1")
        head, *flags = [p.strip().lower() for p in m.group("body").split(":")]
        bw = 0.0
        for f in [f for f in flags if f.startswith("bw=")]:
            try:
                bw = float(f[3:])
            except ValueError:
                raise ValueError(f"--gpus entry {entry!r}: {f} is not a bandwidth in GB/s") from None
            if bw <= 0:
                raise ValueError(f"--gpus entry {entry!r}: {f}: a bandwidth is a positive number of GB/s")
            flags.remove(f)
        if head == "cpu":
            if len(flags) > 1:
                raise ValueError(f"--gpus entry {entry!r}: a cpu stage takes cpu[:SIZE][:bw=GBPS]")
            size = parse_size(flags[0]) if flags else host_ram
            if size is None:
                raise ValueError("--gpus has a cpu stage: give its memory as cpu:SIZE or with --host-ram SIZE")
            for _ in range(count):
                out.append(DeviceBudget("cpu", "CPU", "cpu", max(size - DEFAULT_HOST_RESERVE, 0),
                                        bandwidth_gbs=bw or CPU_BANDWIDTH))
            continue
        try:
            size = parse_size(head)
        except ValueError as e:
            raise ValueError(f"--gpus entry {entry!r}: {e}") from None
        unknown = set(flags) - {"desktop", "apu"}
        if unknown:
            raise ValueError(f"--gpus entry {entry!r}: unknown flag(s) {', '.join(sorted(unknown))} "
                             f"(use :desktop, :apu, :bw=GBPS)")
        kind = "apu" if "apu" in flags else "gpu"
        if kind == "apu" and host_ram is not None:
            size = min(size, max(host_ram - DEFAULT_HOST_RESERVE, 0))
        for _ in range(count):
            n = sum(1 for d in out if d.device.startswith("cuda:"))
            label = f"{'APU' if kind == 'apu' else 'GPU'} {format_size(size)}"
            out.append(DeviceBudget(f"cuda:{n}", label, kind, size, 0, "desktop" in flags, bw))
    return out


def budgets_from_gpus(gpus: Sequence[Gpu], host_ram: int | None = None) -> list[DeviceBudget]:
    """Detected GPUs -> budgets, addressed by PCI bus id (stable across CUDA/ROCm enumeration orders)."""
    out = []
    for g in gpus:
        total, used, kind, cap = _int(g.vram_total), _int(g.vram_used), "gpu", ""
        gtt = _int(getattr(g, "gtt_total", 0))
        if g.is_apu:
            # An APU maps its working memory through GTT (system RAM); the VRAM figure is a small carve-out.
            kind = "apu"
            total = max(total, gtt)
            if host_ram is not None and total > host_ram - DEFAULT_HOST_RESERVE:
                total = max(host_ram - DEFAULT_HOST_RESERVE, 0)
                cap = (f"of {gib(max(_int(g.vram_total), gtt))}, capped at the host's {gib(host_ram)} of RAM less "
                       f"{gib(DEFAULT_HOST_RESERVE)} for the system")
            used = _int(getattr(g, "gtt_used", 0))
        device = g.pci_bus_id if isinstance(g.pci_bus_id, str) and g.pci_bus_id else f"cuda:{len(out)}"
        index = g.index if isinstance(getattr(g, "index", None), int) else None
        out.append(DeviceBudget(device, str(g.name), kind, total, used, bool(g.drives_display),
                                nominal_bandwidth(str(g.name), g.arch if isinstance(g.arch, str) else ""), index, cap))
    return out


# Nominal memory bandwidth in GB/s, by marketing-name fragment first, then by architecture. Only ratios matter:
# the speed preset gives a card work in proportion to how fast it reads its weights.
_BANDWIDTH_BY_NAME = {"H200": 4800, "H100 SXM": 3350, "H100": 2000, "A100": 2039, "4090": 1008, "3090": 936,
                      "MI50": 1024, "MI60": 1024, "Radeon VII": 1024, "Pro VII": 1024, "7900 XTX": 960,
                      "7900 XT": 800, "7900 GRE": 576}
_BANDWIDTH_BY_ARCH = {"gfx906": 1024, "gfx90a": 1638, "gfx942": 5300, "gfx1100": 800, "gfx1151": 256,
                      "sm_80": 1935, "sm_86": 936, "sm_89": 1008, "sm_90": 3350}


def nominal_bandwidth(name: str, arch: str) -> float:
    """The card's nominal memory bandwidth (GB/s) or 0.0 when unknown."""
    for fragment, bw in _BANDWIDTH_BY_NAME.items():
        if fragment in name:
            return float(bw)
    return float(_BANDWIDTH_BY_ARCH.get(arch, 0))


def _int(v: object) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


__all__ = ["CARD_BANDWIDTH", "CPU_BANDWIDTH", "DEFAULT_DESKTOP_HEADROOM", "DEFAULT_HOST_RESERVE", "DeviceBudget",
           "budgets_from_gpus",
           "nominal_bandwidth", "parse_gpu_spec"]
