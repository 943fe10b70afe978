"""Every message the control panel's workers post back to the UI thread.

Workers do the blocking work (sysfs/NVML reads, HTTP to the server, stopping processes) and post one of
these; the handlers on the App only render, so input never waits on I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from ds4station.hardware import Device

from .planning import ModelChoice, PlanEditor
from .telemetry import GpuReading, HostSample


@dataclass
class StageLoad:
    """Loading progress of one stage of the launched route."""

    label: str  # "0 cpu layers 0-5"
    weights_bytes: int  # the planner's prediction of its resident weights
    loaded_bytes: int | None = None  # when /status reports it
    done: bool = False  # its worker said it loaded, or the server is ready


@dataclass
class ServerView:
    """The launched server as one refresh saw it."""

    state: str  # starting | loading | ready | error | crashed | stopped
    base_url: str
    api_key: str | None
    pid: int | None
    status: dict[str, Any] | None = None  # GET /status, when it answered
    reason: str | None = None  # why not ready (health's reason, connection error, exit code)
    new_log: list[str] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)
    log_total: int = 0
    uptime_s: float = 0.0
    stages: list[StageLoad] = field(default_factory=list)


class Detected(Message):
    """Hardware detection finished; the first plan is proposed for what was found."""

    def __init__(self, devices: list[Device], editor: PlanEditor, warning: str | None = None) -> None:
        super().__init__()
        self.devices, self.editor, self.warning = devices, editor, warning


class Collected(Message):
    """One refresh: GPU readings and the server's state."""

    def __init__(self, readings: list[GpuReading], server: ServerView | None, error: str | None = None,
                 host: HostSample | None = None) -> None:
        super().__init__()
        self.readings, self.server, self.error, self.host = readings, server, error, host


class ModelLoaded(Message):
    """A GGUF chosen in the plan screen was read (or could not be: `error`)."""

    def __init__(self, model: ModelChoice | None, error: str | None = None) -> None:
        super().__init__()
        self.model, self.error = model, error


class ServerStopped(Message):
    """stop() returned: every process of the server is gone."""

    def __init__(self, returncode: int | None) -> None:
        super().__init__()
        self.returncode = returncode
