"""The control panel App: detection, the refresh loop, launch/stop, and the keys.

Refresh loop (collect -> render -> re-arm): a timer starts one thread worker that reads every GPU and asks the
server for /health and /status; the worker posts `Collected`; its handler renders and only then arms the
next timer, so polls never overlap and a slow read delays the next refresh instead of piling up. Input is
handled on the UI thread, which never does I/O except starting a child process.
"""

from __future__ import annotations

import collections
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.timer import Timer

from ds4station.cache import cache_dir
from ds4station.hardware import Device, detect_devices
from ds4station.planner import DeviceBudget, Plan, PlanError, budgets_from_gpus, load_preset, parse_gpu_spec
from ds4station.planner.launch import LaunchError
from ds4station.ports import free_port

from .launcher import ServerProcess, exit_reason, serve_command, stop_all
from .messages import Collected, Detected, ServerStopped, ServerView, StageLoad
from .planning import ModelChoice, PlanEditor, demo_model, model_from_file, model_from_shape, serve_args
from .screens import DashboardScreen, HelpScreen, ModelScreen, PlanScreen
from .telemetry import GpuHistory, GpuReading, HostSample, Throughput, collect_gpus, host_sample
from .widgets import GpuPanel, PlanSummary
from .widgets.server_panel import CLIENTS, client_snippets

THEMES = ("textual-dark", "nord", "gruvbox", "tokyo-night", "textual-light")


def plan_budgets(gpus: list[Any], host_ram: int, preset: str) -> list[DeviceBudget]:
    """Detected cards in stage order (discrete, roomiest first, as `ds4station plan` orders them), or the
    CPU when there is none."""
    if not gpus:
        return parse_gpu_spec("cpu", host_ram)
    settings = load_preset(preset)
    budgets = budgets_from_gpus(gpus, host_ram)
    budgets.sort(key=lambda b: (b.kind != "gpu", -b.available(settings.desktop_headroom, settings.reserve)))
    return budgets


# what a pipeline worker prints once its stage is in memory (ds4station.engine.stage)
_STAGE_LOADED = re.compile(r"\bstage (\d+) \(.*\) loaded on ")


def request_line(r: dict[str, Any]) -> str:
    """One finished request for the request log, labelled: when it finished, what it was, tokens in and out,
    prefill and decode rates, time to first token."""
    at = time.strftime("%H:%M:%S", time.localtime(r["finished_at"])) if r.get("finished_at") else "--:--:--"
    return (f"{at} #{r['id']} {r['kind']} ({r['reason']}): {r['prompt_tokens']} in, {r['cached_tokens']} cached, "
            f"{r['completion_tokens']} out; prefill {r['prompt_per_second']:.1f} tok/s, decode "
            f"{r['predicted_per_second']:.1f} tok/s, TTFT {r['ttft_ms']:.0f} ms")


def _is_own_poll(line: str) -> bool:
    """uvicorn's access-log line for the panel's own /health and /status polls (one pair a second: noise)."""
    return '"GET /health HTTP' in line or '"GET /status HTTP' in line


class Ds4StationApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "ds4station"
    SUB_TITLE = "DeepSeek-V4-Flash control panel"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        Binding("p", "plan", "plan"),
        Binding("m", "models", "model"),
        Binding("l", "launch", "launch"),
        Binding("s", "stop", "stop"),
        Binding("t", "theme", "theme"),
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help", key_display="?"),
        *(Binding(key, f"copy('{key}')", f"copy {name}", show=False) for key, (name, _, _) in CLIENTS.items()),
    ]

    def __init__(self, *, sysfs_root: str = "/", use_nvml: bool = True, nvml: Any = None, host_ram: int | None = None,
                 model_path: str | None = None, preset: str = "speed", poll_interval: float = 1.0,
                 model_shape: str | None = None,
                 host: str = "127.0.0.1", port: int | None = None, api_key: str | None = None,
                 clock: Callable[[], float] = time.time, host_probe: Callable[[], HostSample] = host_sample,
                 serve_extra: Sequence[str] = ()) -> None:
        """`serve_extra`: more `ds4station serve` flags for the servers it launches (--serve-args)."""
        super().__init__()
        self.serve_extra = list(serve_extra)
        self.sysfs_root, self.use_nvml, self.nvml = sysfs_root, use_nvml, nvml
        self.host_ram, self.model_path, self.preset = host_ram, model_path, preset
        self.model_shape = model_shape  # a named shape planned without its file (--shape)
        self.poll_interval, self.host, self.port, self.api_key, self.clock = poll_interval, host, port, api_key, clock
        self.devices: list[Device] = []
        self.editor: PlanEditor | None = None
        self.detected = False
        self.history = GpuHistory()
        self.readings: list[GpuReading] = []  # the last refresh's
        self.host_probe = host_probe
        self.host_load: HostSample | None = None  # the CPU and RAM, when there is no GPU
        self.throughput = Throughput()
        self.server: ServerProcess | None = None
        self.last_view: ServerView | None = None
        self._stopped_pids: set[int | None] = set()  # servers stopped here: late poll results about them are stale
        self.requests: dict[int, dict[str, Any]] = {}  # finished requests seen, by id, for the live plots
        self.server_log: collections.deque[str] = collections.deque(maxlen=500)  # the lines the log panel shows
        self.launched: Plan | None = None  # the plan the running server was started with
        self._stages_loaded: set[int] = set()
        self.polls = 0
        self._polling = False
        self._timer: Timer | None = None
        self._log_seen = 0
        self.dashboard = DashboardScreen()

    # ---- start-up ----------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self.push_screen(self.dashboard)
        self._detect()

    @work(thread=True, exclusive=True, group="detect")
    def _detect(self) -> None:
        devices = detect_devices(self.sysfs_root, self.nvml, use_nvml=self.use_nvml)
        host_ram = self.host_ram
        if host_ram is None:
            import psutil

            host_ram = int(psutil.virtual_memory().total)
        budgets = plan_budgets([d.info() for d in devices], host_ram, self.preset)
        warning = None
        model: ModelChoice = demo_model() if not self.model_shape else model_from_shape(self.model_shape)
        if self.model_path:
            try:
                model = model_from_file(self.model_path)
            except Exception as e:  # GGUFError, OSError: say so and plan the demo model meanwhile
                warning = f"cannot use {self.model_path}: {e}; planning the demo model (p to choose another file)"
        editor = PlanEditor(model, budgets, host_ram, self.preset)
        self.post_message(Detected(devices, editor, warning))

    def on_detected(self, message: Detected) -> None:
        self.devices, self.editor, self.detected = message.devices, message.editor, True
        if message.warning:
            self.notify(message.warning, severity="error", timeout=15)
        if not self.devices:
            self.dashboard.query_one(GpuPanel).show_none(self.no_gpu_where())
        self.plan_changed()
        self._start_poll()

    # ---- refresh loop ------------------------------------------------------------------------------------
    def _start_poll(self) -> None:
        if self._polling:
            return
        self._polling = True
        self._collect()

    def poll_now(self) -> None:
        """Refresh at once instead of at the next tick (after launch/stop), unless a poll is under way."""
        if self._timer is not None:
            self._timer.stop()
        self._start_poll()

    @work(thread=True, group="poll")
    def _collect(self) -> None:
        readings: list[GpuReading] = []
        view: ServerView | None = None
        error = host = None
        try:
            if self.devices:
                readings = self.history.add(*collect_gpus(self.devices))
            else:  # the CPU is the device: its load and RAM instead
                host = self.host_probe()
            view = self._server_view()
        except Exception as e:  # always answer, so the loop is re-armed; the next refresh tries again
            error = f"refresh failed: {type(e).__name__}: {e}"
        self.post_message(Collected(readings, view, error, host))

    def _server_view(self) -> ServerView | None:
        import httpx

        srv = self.server
        if srv is None:
            return None
        new, self._log_seen = srv.log_since(self._log_seen)
        view = ServerView("starting", srv.base_url, srv.api_key, srv.pid, new_log=new, log_tail=srv.log_tail(200),
                          log_total=self._log_seen, uptime_s=self.clock() - srv.started_at)
        for line in new:
            m = _STAGE_LOADED.search(line)
            if m:
                self._stages_loaded.add(int(m.group(1)))
        rc = srv.returncode()
        if rc is not None:
            view.state = "crashed" if srv.crashed else "stopped"
            view.reason = f"ds4station serve {exit_reason(rc)}"
            return view
        headers = {"Authorization": f"Bearer {srv.api_key}"} if srv.api_key else {}
        try:
            with httpx.Client(base_url=srv.base_url, timeout=2.0, headers=headers) as http:
                health = http.get("/health")
                body = health.json()
                if health.status_code == 200:
                    view.state = "ready"
                else:
                    view.state = "loading" if body.get("status") == "loading" else "error"
                    view.reason = body.get("reason")
                status = http.get("/status")
                if status.status_code == 200:
                    view.status = status.json()
        except httpx.TransportError:
            view.reason = f"waiting for {srv.base_url} (the engine is starting)"
        except ValueError as e:  # a body that is not JSON: not our server on that port
            view.state, view.reason = "error", f"unexpected answer from {srv.base_url}: {e}"
        view.stages = self._stage_loads(view)
        return view

    def _stage_loads(self, view: ServerView) -> list[StageLoad]:
        """Per-stage loading progress: bytes when /status reports them, else what the workers' logs say."""
        plan = self.launched
        if plan is None:
            return []
        reported = (view.status or {}).get("stages") or []
        out = []
        for i, sp in enumerate(plan.stages):
            st = sp.stage
            loaded = reported[i].get("loaded_bytes") if i < len(reported) else None
            out.append(StageLoad(f"{i} {st.device} layers {st.first_layer}-{st.last_layer}",
                                 sp.footprint.weights_bytes, loaded if isinstance(loaded, int) else None,
                                 view.state == "ready" or i in self._stages_loaded))
        return out

    def _shutting_down(self) -> bool:
        return not self.dashboard.is_attached or self._closing or self.dashboard._closing

    def on_collected(self, message: Collected) -> None:
        self._polling = False
        if self._shutting_down():
            return
        self.polls += 1
        if message.error:
            self.notify(message.error, severity="warning")
        try:
            self.render_collected(message)
        except NoMatches:  # a poll's result that arrived while the dashboard's widgets were being torn down
            if self._shutting_down():
                return
            raise
        self._timer = self.set_timer(self.poll_interval, self._start_poll)

    def render_collected(self, message: Collected) -> None:
        if message.readings:
            self.readings = message.readings
        self.host_load = message.host or self.host_load
        view = message.server
        if view is not None and self.server is None and view.pid in self._stopped_pids:
            # a stop finished while this poll ran: its view is stale, ServerStopped already rendered the end
            view = self.last_view
        self.last_view = view if view is not None else self.last_view
        new_log: list[str] = []
        finished: list[dict[str, Any]] = []
        if view is not None:
            new_log = [line for line in view.new_log if not _is_own_poll(line)]
            self.server_log.extend(new_log)
            for r in sorted((view.status or {}).get("throughput", {}).get("recent", []), key=lambda r: r["id"]):
                if r["id"] not in self.requests:
                    self.requests[r["id"]] = r
                    finished.append(r)
            self.throughput.add(self.clock(), view.status, finished)
        self.dashboard.draw(self, new_log, [request_line(r) for r in finished])

    def request_lines(self) -> list[str]:
        return [request_line(r) for r in self.requests.values()]

    def no_gpu_where(self) -> str:
        return ("NVML and " if self.use_nvml else "") + f"amdgpu sysfs under {self.sysfs_root}"

    def charted_card(self) -> GpuReading | None:
        """The card the live view charts: the one driving the display (the one a user feels), else the first."""
        readings = self.readings
        return next((r for r in readings if r.gpu.drives_display is True), readings[0] if readings else None)

    # ---- plan --------------------------------------------------------------------------------------------
    def plan_changed(self) -> None:
        """Re-render every view of the plan after an edit."""
        self.dashboard.query_one(PlanSummary).show(self.editor)
        if isinstance(self.screen, PlanScreen):
            self.screen.refresh_plan()
            self.screen.sync_fields()

    def action_plan(self) -> None:
        self._toggle(PlanScreen)

    def action_models(self) -> None:
        self._toggle(ModelScreen)

    def _toggle(self, screen: type[PlanScreen] | type[ModelScreen]) -> None:
        """Open a screen that works on the plan (its key again closes it); not before there is a plan."""
        if isinstance(self.screen, screen):
            self.pop_screen()
        elif self.editor is None:
            self.notify("still detecting devices", severity="warning")
        else:
            self.push_screen(screen())

    # ---- launch / stop -----------------------------------------------------------------------------------
    def action_launch(self) -> None:
        if self.server is not None and self.server.running:
            self.notify(f"a server is already running at {self.server.base_url}: s stops it", severity="warning")
            return
        ed = self.editor
        if ed is None or ed.plan is None or not ed.fits:
            why = "still detecting devices" if ed is None else ed.refusal or "there is no plan"
            self.notify(f"cannot launch: {why}", severity="error", timeout=8)
            return
        port = self.port or free_port(self.host)
        try:
            args = serve_args(ed.plan, ed.model, port, self.host, draft=ed.draft)
        except (PlanError, LaunchError) as e:  # a shape planned without its file; drafts the plan did not count
            self.notify(f"cannot launch: {e}", severity="error", timeout=10)
            return
        except OSError as e:  # the launch file could not be written
            self.notify(f"cannot write the launch file: {e}", severity="error", timeout=8)
            return
        if self.api_key:
            args += ["--api-key", self.api_key]
        args += self.serve_extra
        # --parent-pid: the server (and with it its workers) dies with this panel, even killed with -9
        server = ServerProcess(serve_command([*args, "--parent-pid", str(os.getpid())]), self.host, port,
                               self.api_key)
        server.start()
        self.server, self._log_seen, self.requests = server, 0, {}
        self.launched, self._stages_loaded = ed.plan, set()
        self.server_log.clear()
        self.throughput = Throughput()
        self.dashboard.draw(self, full=True)
        self.notify(f"launching ds4station serve on {server.base_url}")
        if isinstance(self.screen, PlanScreen):
            self.pop_screen()
        self.poll_now()

    def action_stop(self) -> None:
        if self.server is None:
            self.notify("no server to stop")
            return
        self._stop(self.server)

    @work(thread=True, exclusive=True, group="stop")
    def _stop(self, server: ServerProcess) -> None:
        self.post_message(ServerStopped(server.stop()))

    def on_server_stopped(self, message: ServerStopped) -> None:
        server = self.server
        self.server = None
        if server is not None:
            self._stopped_pids.add(server.pid)
            rc = message.returncode
            view = ServerView("stopped", server.base_url, server.api_key, None,
                              reason="stopped" if rc is None else f"the server {exit_reason(rc)}")
            self.last_view = view
            self.dashboard.draw(self)
        self.notify("server stopped")

    def action_copy(self, key: str) -> None:
        """Copy a client's settings for the running server: to the terminal's clipboard (OSC 52, which not
        every terminal honours) and, always, to a file whose path the notification shows."""
        view = self.last_view
        if self.server is None or view is None or view.state != "ready":
            self.notify("launch a server first (l): the settings name its address", severity="warning")
            return
        name, filename, _ = CLIENTS[key]
        model = ((view.status or {}).get("model") or {}).get("name") or "ds4"
        text = client_snippets(view.base_url, model, view.api_key)[name]
        self.copy_to_clipboard(text)
        path = cache_dir() / "clients" / filename
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
            where = f"; also in {path}"
        except OSError as e:
            where = f" (could not write {path}: {e})"
        self.notify(f"{name} settings copied to the clipboard{where}")

    # ---- the rest ----------------------------------------------------------------------------------------
    def action_theme(self) -> None:
        i = THEMES.index(self.theme) if self.theme in THEMES else -1
        self.theme = THEMES[(i + 1) % len(THEMES)]

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        self.stop_servers()
        self.exit()

    def stop_servers(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        stop_all()

    def on_unmount(self) -> None:
        self.stop_servers()

