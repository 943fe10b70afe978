"""Starting and stopping `ds4station serve` child processes for the control panel, with no orphans.

Each server runs in its own session (process group), so the workers it spawns share that group and one
`killpg` reaches them all: SIGTERM first (uvicorn shuts down gracefully), SIGKILL after a grace period.
Every live server is also stopped from an `atexit` hook, so leaving the TUI by any normal path (q, Ctrl+C,
an exception) never leaves a model loaded in memory. The child's stdout and stderr are merged and kept as
the last lines of the server log, which the panel shows, and which explain a crash.
"""

from __future__ import annotations

import atexit
import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

LOG_LINES = 400
STOP_GRACE_S = 12.0  # serve's own --shutdown-grace (5 s) to end its streams properly, and some room


# uvicorn's access-log line ('INFO:     127.0.0.1:53524 - "GET /health HTTP/1.1" 503 Service Unavailable'): the
# panel's own polling, never the reason a server failed.
_ACCESS = re.compile(r'^INFO:\s+\S+ - "[A-Z]+ \S+ HTTP/[0-9.]+" \d{3}')


def exit_reason(returncode: int) -> str:
    """How a server process ended, in words: 'exited with code 1', 'killed by SIGKILL'."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def error_lines(log: Sequence[str], n: int = 12) -> list[str]:
    """What explains a failed server, from the end of its log: its last traceback (from "Traceback" to the
    exception line, at most the last n lines of it) when there is one, else the last n lines that are not
    access-log lines."""
    lines = [line for line in log if not _ACCESS.match(line)]
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Traceback (most recent call")),
                 None)
    if start is not None:
        block = lines[start:]
        return block if len(block) <= n else [block[0], "  ...", *block[-(n - 2):]]
    return lines[-n:]


def serve_command(serve_args: Sequence[str]) -> list[str]:
    """argv for `ds4station serve ARGS` with this interpreter, so the child runs in the same environment."""
    return [sys.executable, "-m", "ds4station.cli", "serve", *serve_args]


@dataclass(eq=False)  # identity semantics: kept in a set of live servers
class ServerProcess:
    """One `ds4station serve` child: its argv, endpoint, API key, log tail and exit status."""

    argv: list[str]
    host: str
    port: int
    api_key: str | None = None
    started_at: float = field(default_factory=time.time)
    log: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=LOG_LINES))
    log_total: int = 0  # lines read so far (the deque keeps the last LOG_LINES of them)
    _proc: subprocess.Popen[bytes] | None = None
    _stopping: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # start_new_session: the child leads its own process group, so stop() reaches its workers too and a
        # Ctrl+C typed into the TUI is not delivered to the server behind our back.
        self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        _LIVE.add(self)
        threading.Thread(target=self._read_log, name=f"serve-log-{self.port}", daemon=True).start()

    def _read_log(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            with self._lock:
                self.log.append(line)
                self.log_total += 1

    def log_tail(self, n: int = 20) -> list[str]:
        with self._lock:
            return list(self.log)[-n:]

    def log_since(self, seen: int) -> tuple[list[str], int]:
        """Lines after the first `seen` ones (as many as are still kept) and the new total."""
        with self._lock:
            new = min(self.log_total - seen, len(self.log))
            return (list(self.log)[len(self.log) - new:] if new > 0 else []), self.log_total

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def crashed(self) -> bool:
        """Exited on its own (not through stop())."""
        return self._proc is not None and not self._stopping and self._proc.poll() is not None

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the whole process group, SIGKILL it after `grace_s`; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        self._stopping = True
        _LIVE.discard(self)
        try:
            pgid = os.getpgid(proc.pid)
        except ProcessLookupError:
            pgid = None
        if proc.poll() is None and pgid is not None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                proc.wait()
        if pgid is not None:
            # The server is gone; any worker that outlived it (same group) goes now.
            _signal_group(pgid, signal.SIGKILL)
        return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_LIVE: set[ServerProcess] = set()


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet."""
    for server in list(_LIVE):
        server.stop()


atexit.register(stop_all)

