"""The GPU panel: one row per card (number, name, short PCI bus id: the identity the plan uses too; arch,
VRAM bar, utilisation, temperatures, power, fan, clocks, throttling), the desktop card marked, throttling
highlighted, and a clock/temperature history per card."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from ..telemetry import GpuReading, HostSample, bar, short_bus, spark

DESKTOP_MARK = "◆"
GiB = 1 << 30


def _n(v: object, fmt: str = ".0f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"


def _vram(r: GpuReading, width: int) -> Text:
    used = r.sample.vram_used if isinstance(r.sample.vram_used, int) else r.gpu.vram_used
    total = r.gpu.vram_total
    if r.gpu.is_apu and isinstance(r.gpu.gtt_total, int):  # an APU works out of GTT, not the carve-out
        used = r.sample.gtt_used if isinstance(r.sample.gtt_used, int) else r.gpu.gtt_used
        total = r.gpu.gtt_total
    if not isinstance(used, int) or not isinstance(total, int) or not total:
        return Text("–")
    frac = used / total
    style = "red" if frac > 0.9 else "yellow" if frac > 0.7 else "green"
    numbers = f"{used / GiB:.1f}/{total / GiB:.1f} GiB" + (" GTT" if r.gpu.is_apu else "")
    if not width:  # narrow: the numbers alone, coloured by how full the card is
        return Text(numbers, style=style)
    t = Text(bar(frac, width), style=style)
    t.append(" " + numbers)
    return t


def _throttle(r: GpuReading) -> Text:
    s, h = r.sample, r.history
    if s.throttled is True:  # one row: the first reasons, then how many more
        shown = s.throttle_reasons[:2] + ([f"+{len(s.throttle_reasons) - 2}"] if len(s.throttle_reasons) > 2 else [])
        t = Text("⚠ " + ", ".join(shown), style="bold white on red")
    elif h.ever_throttled:
        worst = max(h.reasons_seen, key=lambda k: h.reasons_seen[k]) if h.reasons_seen else "?"
        t = Text(f"was: {worst} ×{h.throttled_samples}", style="yellow")
    elif s.throttled is False:
        t = Text("no", style="green")
    else:
        t = Text("N/A", style="dim")
    return t


class GpuPanel(Static):
    """Rendered from the readings of the last refresh (`show`) or a no-GPU explanation (`show_none`)."""

    _readings: list[GpuReading] | None = None

    def on_resize(self) -> None:
        if self._readings is not None:
            self.show(self._readings)

    def show(self, readings: list[GpuReading]) -> None:
        self._readings = readings
        wide = self.size.width >= 120
        table = Table(box=None, padding=(0, 1), expand=True, header_style="bold")
        table.add_column("#", justify="right", width=2)
        table.add_column("GPU", no_wrap=True, max_width=28 if wide else 14, overflow="ellipsis")
        if wide:
            table.add_column("bus", no_wrap=True)
            table.add_column("arch", no_wrap=True)
        table.add_column("VRAM", no_wrap=True)
        table.add_column("util", justify="right", no_wrap=True)
        table.add_column("°C e/j/m" if wide else "°C j", justify="right", no_wrap=True)
        table.add_column("W", justify="right", no_wrap=True)
        if wide:
            table.add_column("fan", justify="right", no_wrap=True)
        table.add_column("clock MHz" if wide else "MHz", justify="right", no_wrap=True)
        if wide:
            table.add_column("history clk│temp", no_wrap=True)
        table.add_column("throttle", ratio=1, no_wrap=True, overflow="ellipsis")
        for r in readings:
            g, s, h = r.gpu, r.sample, r.history
            name = Text((DESKTOP_MARK + " " if g.drives_display is True else "") + g.name)
            if g.drives_display is True:
                name.stylize("bold", 0, 1)
            util = f"{_n(s.utilisation)}%"
            if wide:
                temps = f"{_n(s.temp_edge)}/{_n(s.temp_junction)}/{_n(s.temp_memory)}"
                power = f"{_n(s.power)}/{_n(s.power_cap)}"
            else:
                hottest = s.temp_junction if isinstance(s.temp_junction, float) else s.temp_edge
                temps, power = _n(hottest), _n(s.power)
            clock = f"{_n(s.clock_sm)}/{_n(s.clock_sm_max)}" if wide else _n(s.clock_sm)
            row: list[Text | str] = [str(g.index), name]
            if wide:
                row += [short_bus(g.pci_bus_id), str(g.arch)]
            row += [_vram(r, 10 if wide else 0), util, temps, power]
            if wide:
                row.append(f"{_n(s.fan_percent)}%" if isinstance(s.fan_percent, (int, float)) else
                           f"{_n(s.fan_rpm)}rpm" if isinstance(s.fan_rpm, (int, float)) else "–")
            row.append(clock)
            if wide:
                hist = Text(spark(h.clock_ratio, 0.0, 1.0, width=8).rjust(8), style="cyan")
                hist.append("│")
                hist.append(spark(h.temperature, 30.0, 110.0, width=8).rjust(8), style="magenta")
                row.append(hist)
            row.append(_throttle(r))
            style = "on dark_red" if s.throttled is True else ""
            table.add_row(*row, style=style)
        if any(r.gpu.drives_display is True for r in readings):
            table.caption = f"{DESKTOP_MARK} drives the display (keeps desktop headroom)"
            table.caption_justify = "left"
        self.update(table)

    def show_none(self, where: str, host: HostSample | None = None) -> None:
        text = Text.assemble(("No GPU found", "bold yellow"), f" (looked through {where}). ",
                             "The planner uses the CPU and launch serves the model there; "
                             "plug in a card or plan for hypothetical ones with `ds4station plan --gpus`.")
        if host is not None:  # the CPU is the device: its load and memory take the cards' place
            frac = host.ram_used / host.ram_total if host.ram_total else 0.0
            style = "red" if frac > 0.9 else "yellow" if frac > 0.7 else "green"
            text.append_text(Text.assemble(("\nCPU ", "bold"), f"{host.cores} cores, {host.cpu_percent:.0f}% busy  ",
                                           ("RAM ", "bold"), (bar(frac, 10), style),
                                           f" {host.ram_used / GiB:.1f}/{host.ram_total / GiB:.1f} GiB used"))
        self.update(text)
