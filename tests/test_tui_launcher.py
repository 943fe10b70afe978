"""Child processes of the control panel (ds4station/tui/launcher.py): the whole process group stops,
SIGKILL follows a SIGTERM that is ignored, and the log keeps the last lines for a crash report."""

from __future__ import annotations

import sys
import time

import psutil

from ds4station.ports import free_port
from ds4station.tui.launcher import ServerProcess, serve_command

# A parent that starts a grandchild (like serve starting stage workers), prints, then waits.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("worker", child.pid, flush=True)
time.sleep(60)
"""

_STUBBORN = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM", flush=True)
time.sleep(60)
"""


def _wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_stop_takes_the_whole_process_group() -> None:
    server = ServerProcess([sys.executable, "-c", _PARENT], "127.0.0.1", free_port())
    server.start()
    _wait_for(lambda: any(line.startswith("worker") for line in server.log_tail()))
    worker = int(next(line for line in server.log_tail() if line.startswith("worker")).split()[1])
    assert server.pid is not None and psutil.pid_exists(worker) and server.running
    server.stop(grace_s=5)
    assert not server.running and not server.crashed
    _wait_for(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE)


def test_sigkill_follows_an_ignored_sigterm() -> None:
    server = ServerProcess([sys.executable, "-c", _STUBBORN], "127.0.0.1", free_port())
    server.start()
    _wait_for(lambda: server.log_tail() == ["ignoring SIGTERM"])
    t = time.monotonic()
    code = server.stop(grace_s=0.3)
    assert code == -9 and time.monotonic() - t < 5


def test_a_crash_keeps_its_last_log_lines() -> None:
    script = "import sys\nfor i in range(500): print('line', i)\nprint('error: bad weights', file=sys.stderr)\n" \
             "sys.exit(3)"
    server = ServerProcess([sys.executable, "-c", script], "127.0.0.1", free_port())
    server.start()
    _wait_for(lambda: server.returncode() is not None and server.log_total == 501)
    assert server.crashed and server.returncode() == 3
    assert server.log_tail(2) == ["line 499", "error: bad weights"]
    lines, total = server.log_since(498)
    assert total == 501 and lines == ["line 498", "line 499", "error: bad weights"]
    assert server.log_since(0)[0][0] == "line 101"  # only the last 400 lines are kept


def test_serve_command_runs_this_interpreter() -> None:
    argv = serve_command(["--port", "1"])
    assert argv[0] == sys.executable and argv[-3:] == ["serve", "--port", "1"]
