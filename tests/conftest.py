"""Shared fixtures. A run that executes no test fails (pytest already fails on zero collected; this also
fails a run where everything was skipped or deselected)."""

from __future__ import annotations

import os

import pytest


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton kernels run in the CPU interpreter on machines without a GPU (CI); it must be set before import.
if "TRITON_INTERPRET" not in os.environ and not _has_gpu():
    os.environ["TRITON_INTERPRET"] = "1"


# The engine's tests check exact relations between decode, verification and prefill (chunkings, reuse, drafts,
# disk restores): on the CPU they run the experts' fp32 matvecs, as the GPU tests pass int_dot=False. The integer
# dot that a CPU stage decodes with by default has its own tests (test_kernels_cpu, test_kernels_moe, the engine's
# default in test_engine), which ask for it explicitly. Worker processes inherit this.
os.environ.setdefault("DS4STATION_CPU_INT8", "0")


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker() -> None:
    """pytest-xdist runs one worker per core; more torch threads per worker only fight over the cores
    (the tiny model ran ~15x slower with 2 threads per worker on a loaded 2-core machine)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch.empty a kernel launcher makes starts poisoned: NaN floats, and int64 at its maximum (which
    would win every top-k and decode to a negative id), so an element a kernel fails to write shows up."""
    import torch

    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.int64:
            t.fill_(torch.iinfo(torch.int64).max)
        return t

    monkeypatch.setattr(torch, "empty", empty)


class LaunchCounter:
    """Stands in for a @triton.jit kernel and counts its launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: object) -> object:
        self.launches += 1
        return self.kernel[grid]  # type: ignore[index]


@pytest.fixture
def count_launches(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """count_launches(module, "_kernel_name") -> a LaunchCounter patched in for that kernel."""
    def install(module: object, name: str) -> LaunchCounter:
        counter = LaunchCounter(getattr(module, name))
        monkeypatch.setattr(module, name, counter)
        return counter

    return install


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    if not reporter.stats.get("passed") and not hasattr(session.config, "workerinput"):
        session.exitstatus = 1
