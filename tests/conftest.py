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


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker() -> None:
    """pytest-xdist runs one worker per core; more torch threads per worker only fight over the cores
    (the tiny model ran ~15x slower with 2 threads per worker on a loaded 2-core machine)."""
    import torch

    torch.set_num_threads(1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    if not reporter.stats.get("passed") and not hasattr(session.config, "workerinput"):
        session.exitstatus = 1
