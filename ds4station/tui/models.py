"""What the model screen (m) shows, as data: the published files (hub.KNOWN) and whether each is on disk, the
GGUF files found in the models directory and beside the chosen model (each checked as `ds4station inspect`
checks it), the .part files of interrupted downloads, and the panel's downloads with their progress.

No Textual here and no torch (tests drive it directly). `scan` and `check_file` read files, so the screen
calls them from a worker; everything else is bookkeeping and formatting.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ds4station.hub import KNOWN, PullError, models_dir, resolve
from ds4station.model.sizes import GiB, gib

from .telemetry import bar

PART = ".part"  # hub.pull writes FILE.part and FILE.part.json until the file is complete and checked
UPDATES_PER_S = 4  # how often a download's progress reaches the screen, at most


@dataclass(frozen=True)
class DiskFile:
    """A .gguf file as its header says (`layers` when it is a DS4 GGUF this engine runs, else `error`), or
    the .part of an interrupted download (`partial`: bytes here, full size when the download recorded it)."""

    path: Path
    size: int
    layers: int | None = None
    error: str | None = None
    partial: tuple[int, int | None] | None = None

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(PART) if self.partial else self.path.name

    @property
    def usable(self) -> bool:
        return self.layers is not None


@dataclass(frozen=True)
class KnownFile:
    """One published file (hub.KNOWN) and what the models directory holds of it."""

    name: str
    filename: str
    description: str
    file: DiskFile | None = None  # the complete file, when present
    partial: DiskFile | None = None  # its .part, when a download was interrupted

    @property
    def on_disk(self) -> bool:
        return self.file is not None


@dataclass(frozen=True)
class Listing:
    known: list[KnownFile]
    files: list[DiskFile]  # complete files first, then partial downloads


def part_state(part: Path) -> tuple[int, int | None]:
    """(bytes downloaded, full size) of FILE.part; the size comes from hub.pull's FILE.part.json record
    (None when there is none or it cannot be read: the next download then starts again)."""
    have = part.stat().st_size
    try:
        size = json.loads(part.with_name(part.name + ".json").read_text()).get("size")
    except (OSError, ValueError):
        size = None
    return have, size if isinstance(size, int) and size > 0 else None


def check_file(path: Path) -> DiskFile:
    """Open a .gguf as `ds4station inspect` does (header and tensor table against the DS4 layout); a .part
    is only measured."""
    from ds4station.model.gguf import GGUFError, GGUFFile

    try:
        if path.name.endswith(PART):
            have, size = part_state(path)
            return DiskFile(path, have, partial=(have, size))
        size = path.stat().st_size
    except OSError as e:  # gone since the directory was listed, or unreadable
        return DiskFile(path, 0, error=str(e))
    if path.name == KNOWN["mtp"][0]:  # hub.pull checks it is a GGUF; it is a head for a model, not one
        return DiskFile(path, size, error="the MTP head: it goes with a model, it is not one to choose")
    try:
        return DiskFile(path, size, layers=GGUFFile.open(path).config.n_layers)
    except GGUFError as e:
        return DiskFile(path, size, error=str(e).removeprefix(f"{path}: "))  # the row names the file already


def scan_dirs(chosen: str | None = None, extra: Iterable[str | Path] = (), directory: Path | None = None) -> list[Path]:
    """Where to look: the models directory (where downloads go), the chosen model's directory, any extra
    ones; each once, in that order."""
    dirs = [directory or models_dir(), *([Path(chosen).parent] if chosen else []), *map(Path, extra)]
    return list(dict.fromkeys(d.expanduser().absolute() for d in dirs))


def scan(dirs: Iterable[Path], directory: Path | None = None) -> Listing:
    """Every .gguf and .gguf.part in `dirs`, checked, and the published files as the models directory
    (`directory`, default hub.models_dir()) holds them. File I/O: call it from a worker."""
    paths: dict[Path, None] = {}
    for d in dirs:
        try:
            found = sorted(p for p in d.iterdir() if p.name.endswith((".gguf", ".gguf" + PART)))
        except OSError:  # a directory that is not there (yet): nothing in it
            continue
        paths.update((p.absolute(), None) for p in found)
    files = [check_file(p) for p in paths]
    return Listing(known_files(files, directory), sorted(files, key=lambda f: f.partial is not None))


def known_files(files: Iterable[DiskFile] = (), directory: Path | None = None) -> list[KnownFile]:
    """The published files with what `files` hold of them in the models directory (`directory`, default
    hub.models_dir()); with no files, as they are before the directory is read."""
    here = (directory or models_dir()).expanduser().absolute()
    by_path = {f.path: f for f in files}
    return [KnownFile(name, filename, what, by_path.get(here / filename), by_path.get(here / (filename + PART)))
            for name, (filename, what) in KNOWN.items()]


def browsable(paths: Iterable[Path]) -> list[Path]:
    """What the file picker lists of a directory: its directories and .gguf files, hidden ones left out."""
    return [p for p in paths if not p.name.startswith(".") and (p.suffix == ".gguf" or p.is_dir())]


def known_for(part: DiskFile) -> str | None:
    """The hub name (`q2`, ...) whose download left this .part, so that downloading it again resumes it."""
    return next((name for name, (filename, _) in KNOWN.items() if part.name == filename), None)


# ---- downloads ---------------------------------------------------------------------------------------------
@dataclass
class Download:
    """One `hub.pull` run: its progress as the worker reports it, then its end (`path`, or `error`)."""

    name: str  # what hub.pull takes: q2, ..., or OWNER/REPO/FILE
    filename: str
    state: str = "starting"  # starting | downloading | done | failed
    done: int = 0
    total: int = 0
    rate: float = 0.0  # bytes/s over this run (a resumed download counts only what it fetched)
    error: str | None = None
    path: Path | None = None
    started: float = field(default_factory=time.monotonic)
    _first: int | None = None
    _told: float = 0.0

    @property
    def running(self) -> bool:
        return self.state in ("starting", "downloading")

    def progress(self, done: int, total: int, now: float | None = None) -> bool:
        """Record `done` of `total` bytes; True when the screen should be told (at most UPDATES_PER_S times a
        second, and always for the last byte)."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = done
        self.state, self.done, self.total = "downloading", done, total
        self.rate = (done - self._first) / max(now - self.started, 1e-6)
        if now - self._told < 1 / UPDATES_PER_S and not (total and done >= total):
            return False
        self._told = now
        return True

    def finish(self, path: Path) -> None:
        self.state, self.path = "done", path
        self.done = self.total = path.stat().st_size

    def fail(self, error: str) -> None:
        self.state, self.error = "failed", error


class Downloads:
    """The panel's downloads by name, newest last. They outlive the screen that started them: leaving the
    screen does not stop a download, and coming back shows it."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory  # None: hub.models_dir() at the time of the download
        self.items: dict[str, Download] = {}

    def start(self, name: str) -> Download:
        """A new download of `name`; PullError for an unknown name or one already under way."""
        current = self.items.get(name)
        if current is not None and current.running:
            raise PullError(f"{name} is already downloading")
        dl = Download(name, Path(resolve(name).filename).name)
        self.items.pop(name, None)
        self.items[name] = dl
        return dl

    def running(self) -> list[Download]:
        return [d for d in self.items.values() if d.running]


# ---- rows as the screen shows them -------------------------------------------------------------------------
def _partial_text(have: int, size: int | None) -> str:
    of = f"{have / GiB:.2f} of {size / GiB:.2f} GiB" if size else f"{gib(have)} (size not recorded)"
    return f"partial, {of}: download again to resume"


def file_row(f: DiskFile) -> str:
    """The file's name, then its state and directory: `SIZE, N layers` / `✗ why` / `partial, N of M GiB:
    download again to resume`."""
    if f.partial is not None:
        state = _partial_text(*f.partial)
    else:
        state = f"{gib(f.size)}, {f.layers} layers" if f.usable else f"✗ {f.error}"
    return f"{f.name}\n       {state}  ·  {f.path.parent}"


def known_row(k: KnownFile, download: Download | None = None) -> str:
    """Name, state and description on one line, the file name on the next."""
    if download is not None and download.running:
        pct = f" {100 * download.done / download.total:.0f}%" if download.total else ""
        state = f"downloading{pct}"
    elif k.file is not None:
        state = "✓ on disk" if k.file.usable or k.name == "mtp" else f"on disk ✗ {k.file.error}"
    elif k.partial is not None and k.partial.partial is not None:
        state = _partial_text(*k.partial.partial)
    else:
        state = "not downloaded: d or enter downloads it"
    return f"{k.name:6} {state}  ·  {k.description}\n       {k.filename}"


def download_row(d: Download, width: int = 24) -> str:
    """`q2  ███▌     1.20 / 81.00 GiB  45 MB/s  downloading`, or how it ended."""
    if d.state == "done":
        return f"{d.name:6} done: {d.path} ({gib(d.done)}), on disk: choose it under Files on disk"
    if d.state == "failed":
        return f"{d.name:6} failed: {d.error}"
    frac = d.done / d.total if d.total else 0.0
    return (f"{d.name:6} {bar(frac, width)} {d.done / GiB:.2f} / {d.total / GiB:.2f} GiB {100 * frac:5.1f}%  "
            f"{d.rate / 1e6:.1f} MB/s  {d.state}")


__all__ = ["DiskFile", "Download", "Downloads", "KnownFile", "Listing", "browsable", "check_file", "download_row",
           "file_row", "known_files", "known_for", "known_row", "part_state", "scan", "scan_dirs"]
