"""The control panel never imports torch: not at start-up, not while detecting, and not when a GGUF is chosen
in the plan screen (the header and tensor table are read with numpy + gguf only). Checked in a fresh
interpreter, since pytest's own process has torch loaded already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from import_watch import WATCH

from ds4station.engine.demo import make_model
from ds4station.hardware import detect_devices

REPO = Path(__file__).resolve().parent.parent
HOST1 = REPO / "tests" / "fixtures" / "sysfs" / "gfx906-workstation"

# argv: GGUF path, sysfs root. Prints one JSON line. A meta-path finder records the stack of the first
# torch/triton import, so a failure names the chain.
_CHILD = WATCH + r"""
import asyncio, json, time

gguf, sysfs = sys.argv[1], sys.argv[2]

from ds4station.tui.app import Ds4StationApp
from ds4station.tui.screens import PlanScreen

result = {}

async def until(pilot, cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("the panel did not get there")
        await pilot.pause(0.05)

async def flow():
    app = Ds4StationApp(sysfs_root=sysfs, use_nvml=False, host_ram=64 << 30, poll_interval=0.05)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.editor is not None and app.polls >= 2)
        ed = app.editor
        result["before"] = ed.model.path
        await pilot.press("p")
        result["plan_screen"] = isinstance(app.screen, PlanScreen)
        field = app.screen.query_one("#model-path")
        field.focus()
        field.value = gguf
        await pilot.press("enter")
        await until(pilot, lambda: ed.model.path == gguf)
        await pilot.pause()
        result.update(path=ed.model.path, fits=ed.fits, route=str(ed.plan.route) if ed.plan else None,
                      devices=len(app.devices))
        await pilot.press("escape")
        await pilot.press("q")

asyncio.run(flow())
result["torch"] = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))[:5]
result["chain"] = Watch.chain
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_choosing_a_gguf_in_the_plan_screen_imports_no_torch(tiny: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tiny), str(HOST1)], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # the flow really happened: the fixture's cards detected and polled, the file chosen and planned
    cards = len(detect_devices(HOST1, use_nvml=False))
    assert cards >= 2 and result["devices"] == cards
    assert result["before"] is None and result["plan_screen"]
    assert result["path"] == str(tiny) and result["fits"] and result["route"], result
    chain = "\n".join(result["chain"] or [])
    assert result["torch"] == [], f"the control panel imported {result['torch']} through:\n{chain}"
