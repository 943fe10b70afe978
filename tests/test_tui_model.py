"""The control panel's model screen (m; ds4station/tui/screens/model.py, ds4station/tui/models.py): published
files downloaded from a local hub (tests/test_pull.py's, as HF_ENDPOINT) with progress, a cut download shown
as failed and its .part as partial, then resumed; files on disk checked as `ds4station inspect` checks them
(a bad one shows why and cannot replace the model); the file field; the named shapes and the demo model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import test_pull
from test_pull import Hub
from test_tui import HOST1, GiB, until
from textual.widgets import Input

from ds4station import hub
from ds4station.hub import KNOWN, PullError
from ds4station.tui.app import Ds4StationApp
from ds4station.tui.models import (
    UPDATES_PER_S,
    Download,
    Downloads,
    browsable,
    check_file,
    download_row,
    file_row,
    known_files,
    known_for,
    known_row,
    scan,
    scan_dirs,
)
from ds4station.tui.screens import ModelScreen, PlanScreen
from ds4station.tui.screens.model import GGUFTree, downloads_of

local_hub, model_bytes = test_pull.local_hub, test_pull.model_bytes  # the local hub and a tiny real DS4 GGUF
Q2 = KNOWN["q2"][0]


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache: the models directory (hub.models_dir()) under it, not yet made."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return hub.models_dir()


def _app() -> Ds4StationApp:
    return Ds4StationApp(sysfs_root=str(HOST1), use_nvml=False, host_ram=64 * GiB, poll_interval=3600)


def _shown(screen: ModelScreen, widget_id: str) -> str:
    """What a list or panel of the screen shows, as plain text."""
    w = screen.query_one(f"#{widget_id}")
    if hasattr(w, "options"):
        return "\n".join(str(o.prompt) for o in w.options)
    return str(w.content)  # type: ignore[attr-defined]


async def _open(pilot, app: Ds4StationApp) -> ModelScreen:  # type: ignore[no-untyped-def]
    await until(pilot, lambda: app.editor is not None)
    await pilot.press("m")
    screen = app.screen
    assert isinstance(screen, ModelScreen)
    await until(pilot, lambda: screen.listing is not None)
    return screen


async def _choose(pilot, screen: ModelScreen, list_id: str, option_id: str) -> None:  # type: ignore[no-untyped-def]
    options = screen.query_one(f"#{list_id}")
    options.focus()
    options.highlighted = options.get_option_index(option_id)  # type: ignore[attr-defined]
    await pilot.press("enter")


def test_download_a_published_file_see_it_on_disk_and_choose_it(local_hub: Hub, model_bytes: bytes,
                                                                 models: Path) -> None:
    local_hub.files[f"{hub.REPO}/{Q2}"] = model_bytes

    async def flow() -> None:
        app = _app()
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await _open(pilot, app)
            known = _shown(screen, "known")
            for name, (filename, what) in KNOWN.items():
                assert name in known and filename in known and what in known
            assert "on disk" not in known and "not downloaded" in known
            await pilot.press("d")  # the highlighted (first) published file: q2
            dl = downloads_of(app).items["q2"]
            await until(pilot, lambda: dl.state == "done")
            path = models / Q2
            assert dl.path == path and path.read_bytes() == model_bytes and dl.done == len(model_bytes)
            await until(pilot, lambda: screen.listing is not None and screen.listing.known[0].on_disk)
            assert "q2     ✓ on disk" in _shown(screen, "known") and "q2     done: " in _shown(screen, "downloads")
            assert f"{Q2}\n       0.01 GiB, 6 layers  ·  {models}" in _shown(screen, "on-disk")
            await pilot.press("d")  # not again: it is here
            assert "on disk already" in _shown(screen, "model-status")
            # leaving the screen and coming back keeps the download's record
            await pilot.press("escape", "m")
            screen = app.screen
            assert isinstance(screen, ModelScreen) and "q2     done: " in _shown(screen, "downloads")
            await until(pilot, lambda: screen.listing is not None)
            await _choose(pilot, screen, "on-disk", str(path))
            await until(pilot, lambda: app.editor.model.path == str(path))  # type: ignore[union-attr]
            assert not isinstance(app.screen, ModelScreen) and app.editor.fits  # type: ignore[union-attr]
            assert app.editor.model.label == Q2  # type: ignore[union-attr]
            # from the plan screen: the model screen on top, the demo chosen, the plan screen's field follows
            await pilot.press("p", "m")
            screen = app.screen
            assert isinstance(screen, ModelScreen)
            await until(pilot, lambda: screen.listing is not None)
            await _choose(pilot, screen, "shapes", "demo")
            await until(pilot, lambda: isinstance(app.screen, PlanScreen))
            await until(pilot, lambda: app.screen.query_one("#model-path", Input).value == "")
            assert app.editor.model.path is None  # type: ignore[union-attr]

    asyncio.run(flow())


def test_a_cut_download_is_partial_and_a_second_one_resumes_it(local_hub: Hub, model_bytes: bytes, models: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    local_hub.files[f"{hub.REPO}/{Q2}"] = model_bytes
    cut = len(model_bytes) // 3
    local_hub.cut_after = cut
    drawn: list[str] = []  # every state of the downloads panel, as the worker's progress reached it
    draw = ModelScreen.show_downloads

    def recorded(self: ModelScreen) -> None:
        draw(self)
        drawn.append(_shown(self, "downloads"))

    monkeypatch.setattr(ModelScreen, "show_downloads", recorded)

    async def flow() -> None:
        app = _app()
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await _open(pilot, app)
            await _choose(pilot, screen, "known", "known:q2")  # enter on a file not on disk downloads it
            await until(pilot, lambda: downloads_of(app).items["q2"].state == "failed")
            total = f"{len(model_bytes) / GiB:.2f}"
            assert any(f"{cut / GiB:.2f} / {total} GiB" in d and "MB/s  downloading" in d for d in drawn), drawn
            shown = _shown(screen, "downloads")
            assert "q2     failed: the download of" in shown and "run the same command again to resume" in shown
            part = models / (Q2 + ".part")
            assert part.stat().st_size == cut
            await until(pilot, lambda: screen.listing is not None and screen.listing.known[0].partial is not None)
            assert f"partial, {cut / GiB:.2f} of {total} GiB: download again to resume" in _shown(screen, "on-disk")
            assert "q2     partial," in _shown(screen, "known")
            # d on the partial file resumes the download it belongs to
            await pilot.press("tab")
            assert screen.focused is screen.query_one("#on-disk")
            await pilot.press("d")
            await until(pilot, lambda: downloads_of(app).items["q2"].state == "done")
            assert ("GET", f"bytes={cut}-") in local_hub.requests  # resumed, not started again
            assert (models / Q2).read_bytes() == model_bytes and not part.exists()
            await until(pilot, lambda: screen.listing is not None and screen.listing.known[0].on_disk)
            assert "partial, " not in _shown(screen, "on-disk")

    asyncio.run(flow())


def test_a_bad_file_shows_why_and_choosing_it_keeps_the_model(local_hub: Hub, models: Path) -> None:
    models.mkdir(parents=True)
    (models / "x.gguf").write_text("these are notes, not a model\n")

    async def flow() -> None:
        app = _app()
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await _open(pilot, app)
            before = app.editor.model  # type: ignore[union-attr]
            shown = _shown(screen, "on-disk")
            assert "x.gguf" in shown and "✗ not a readable GGUF file" in shown
            await _choose(pilot, screen, "on-disk", str(models / "x.gguf"))
            await until(pilot, lambda: "cannot use" in _shown(screen, "model-status"))
            assert "not a readable GGUF file" in _shown(screen, "model-status")
            assert app.screen is screen and app.editor.model is before and app.editor.fits  # type: ignore[union-attr]
            # a download the hub refuses ends with the hub's reason
            screen.download("me/ds4-test/missing.gguf")
            await until(pilot, lambda: downloads_of(app).items["me/ds4-test/missing.gguf"].state == "failed")
            await until(pilot, lambda: "has no file 'missing.gguf'" in _shown(screen, "downloads"))

    asyncio.run(flow())


def test_shapes_the_demo_and_a_file_by_path(model_bytes: bytes, models: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tiny = elsewhere / "tiny.gguf"
    tiny.write_bytes(model_bytes)

    async def flow() -> None:
        app = _app()
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await _open(pilot, app)
            assert all(name in _shown(screen, "shapes") for name in ("demo", "flash-q2", "flash-f16", "tiny-q2"))
            await _choose(pilot, screen, "shapes", "flash-q2")
            ed = app.editor
            assert ed is not None and ed.model.shape_only and ed.model.shape.name == "flash-q2"
            assert not isinstance(app.screen, ModelScreen) and ed.fits
            screen = await _open(pilot, app)
            await _choose(pilot, screen, "shapes", "demo")
            assert ed.model.path is None and not ed.model.shape_only
            # the file field: a directory shows it in the picker, a file is chosen
            screen = await _open(pilot, app)
            await until(pilot, lambda: bool(screen.query(GGUFTree)))
            field = screen.query_one("#model-file")
            field.focus()
            field.value = str(elsewhere)  # type: ignore[attr-defined]
            await pilot.press("enter")
            await until(pilot, lambda: screen.query_one(GGUFTree).path == elsewhere)
            field.value = str(tiny)  # type: ignore[attr-defined]
            await pilot.press("enter")
            await until(pilot, lambda: ed.model.path == str(tiny))
            # the chosen model's directory is listed next time, and any extra directory given
            screen = await _open(pilot, app)
            assert f"tiny.gguf  ● planned now\n       0.01 GiB, 6 layers  ·  {elsewhere}" in _shown(screen, "on-disk")
            await pilot.press("escape")
            extra = tmp_path / "extra"
            extra.mkdir()
            (extra / "other.gguf").write_bytes(model_bytes)
            screen = ModelScreen([extra])
            app.push_screen(screen)
            await until(pilot, lambda: screen.listing is not None)
            assert "other.gguf" in _shown(screen, "on-disk")

    asyncio.run(flow())


def test_scan_checks_files_and_reads_partial_downloads(model_bytes: bytes, models: Path, tmp_path: Path) -> None:
    models.mkdir(parents=True)
    (models / Q2).write_bytes(model_bytes)
    (models / "bad.gguf").write_bytes(b"GGUF not really")
    (models / "notes.txt").write_text("not listed")
    q4 = KNOWN["q4"][0]
    (models / (q4 + ".part")).write_bytes(b"\0" * 1000)
    (models / (q4 + ".part.json")).write_text(json.dumps({"url": "u", "etag": "e", "size": 3 * GiB}))
    (models / "odd.gguf.part").write_bytes(b"\0" * 10)  # no record: its size is unknown
    listing = scan(scan_dirs(), models)
    names = [f.name for f in listing.files]
    assert sorted(names[:2]) == sorted([Q2, "bad.gguf"]) and sorted(names[2:]) == sorted([q4, "odd.gguf"])
    good, bad = (next(f for f in listing.files if f.name == n) for n in (Q2, "bad.gguf"))
    assert good.usable and good.layers == 6 and good.size == len(model_bytes)
    assert not bad.usable and "not a readable GGUF" in (bad.error or "") and str(models) not in (bad.error or "")
    part = next(f for f in listing.files if f.name == q4)
    assert part.partial == (1000, 3 * GiB) and known_for(part) == "q4"
    assert file_row(part) == f"{q4}\n       partial, 0.00 of 3.00 GiB: download again to resume  ·  {models}"
    odd = next(f for f in listing.files if f.name == "odd.gguf")
    assert odd.partial == (10, None) and known_for(odd) is None and "size not recorded" in file_row(odd)
    assert file_row(bad).startswith("bad.gguf\n       ✗ not a readable GGUF")
    by_name = {k.name: k for k in listing.known}
    assert by_name["q2"].on_disk and by_name["q2"].file == good and not by_name["q4"].on_disk
    assert by_name["q4"].partial == part and by_name["mtp"].file is None
    assert known_row(by_name["q2"]).startswith("q2     ✓ on disk  ·  2-bit routed experts")
    assert known_row(by_name["q2"]).endswith("\n       " + Q2)
    assert "partial, 0.00 of 3.00 GiB" in known_row(by_name["q4"]) and "not downloaded" in known_row(by_name["mtp"])
    # the MTP head is a GGUF, but not a model to choose
    (models / KNOWN["mtp"][0]).write_bytes(b"GGUF")
    mtp = check_file(models / KNOWN["mtp"][0])
    assert not mtp.usable and "MTP head" in (mtp.error or "")
    # where to look: the models directory first, each directory once; a missing one lists nothing
    dirs = scan_dirs(str(models / "a.gguf"), [models, tmp_path / "nowhere"], models)
    assert dirs == [models, tmp_path / "nowhere"] and scan(dirs[1:], models).files == []


def test_download_bookkeeping_rate_limits_and_rows() -> None:
    downloads = Downloads()
    dl = downloads.start("q2")
    assert dl.filename == Q2 and dl.running and downloads.running() == [dl]
    with pytest.raises(PullError, match="already downloading"):
        downloads.start("q2")
    with pytest.raises(PullError, match="give one of"):
        downloads.start("q3")
    t0 = dl.started
    told = [dl.progress(n * 100, 1000, t0 + n / 40) for n in range(1, 10)]  # 40 calls a second
    assert sum(told) <= 9 / 40 * UPDATES_PER_S + 1 and told[0]
    assert dl.progress(1000, 1000, t0 + 9.5 / 40)  # the last byte is always told
    assert dl.rate == pytest.approx(900 / (9.5 / 40))  # counted from the first report (a resume's start)
    row = download_row(dl)
    assert row.startswith("q2     ") and "100.0%" in row and "downloading" in row
    assert "q2     downloading 100%" in known_row(known_files()[0], dl)
    dl.fail("the disk is full")
    assert not dl.running and download_row(dl) == "q2     failed: the disk is full"
    again = downloads.start("q2")  # a failed one can start again
    assert downloads.items == {"q2": again} and again is not dl


def test_the_picker_shows_directories_and_gguf_files_only(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.txt", ".hidden.gguf"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    assert sorted(p.name for p in browsable(tmp_path.iterdir())) == ["a.gguf", "sub"]


def test_download_record_of_a_finished_file(tmp_path: Path) -> None:
    f = tmp_path / "x.gguf"
    f.write_bytes(b"\0" * 123)
    dl = Download("me/r/x.gguf", "x.gguf")
    dl.finish(f)
    assert dl.state == "done" and dl.done == dl.total == 123 and str(f) in download_row(dl)
