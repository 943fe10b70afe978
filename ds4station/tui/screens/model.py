"""The model screen (m): everything about getting and choosing the model. The published files (download one
with d or enter, resumably, as `ds4station pull` does), the GGUF files already on disk with their layout
checked (and interrupted downloads, which a new download resumes), a file picker, the named shapes to plan
without a file, and the built-in demo model. Choosing one plans it, as the plan screen's model field does.

Every file read (headers, directory listings, the downloads themselves) runs in a thread worker. Downloads
belong to the app, not to this screen: leaving the screen does not stop one, and coming back shows it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DirectoryTree, Footer, Header, Input, OptionList, Static
from textual.widgets.option_list import Option
from textual.worker import get_current_worker

from ds4station import hub
from ds4station.model.footprint import SHAPES
from ds4station.model.sizes import gib
from ds4station.planner import named_shape

from ..messages import ModelLoaded
from ..models import (
    DiskFile,
    Download,
    Downloads,
    KnownFile,
    Listing,
    browsable,
    download_row,
    file_row,
    known_files,
    known_for,
    known_row,
    scan,
    scan_dirs,
)
from ..planning import ModelChoice, PlanEditor, demo_model, model_from_file, model_from_shape

_DOWNLOADS: weakref.WeakKeyDictionary[App[None], Downloads] = weakref.WeakKeyDictionary()


def downloads_of(app: App[None]) -> Downloads:
    """The app's downloads (one registry per app, so they outlive every ModelScreen)."""
    return _DOWNLOADS.setdefault(app, Downloads())


class Scanned(Message):
    """The files were listed and their headers checked; `root`: where the file picker starts."""

    def __init__(self, listing: Listing, root: Path) -> None:
        super().__init__()
        self.listing, self.root = listing, root


class Browse(Message):
    """The path typed in the file field is a directory: show it in the picker."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path


class GGUFTree(DirectoryTree):
    """Directories and .gguf files only (DirectoryTree filters in its loader thread)."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return browsable(paths)


def _pull(app: App[None], dl: Download) -> None:
    """hub.pull in a thread worker owned by the app. Progress reaches the screen through call_from_thread at
    most UPDATES_PER_S times a second; the app's exit cancels the worker, which stops at the next block and
    leaves the .part for a later download to resume."""
    worker = get_current_worker()

    def progress(done: int, total: int) -> None:
        if worker.is_cancelled:
            raise hub.PullError(f"the download of {dl.filename} was stopped with the panel; download again to "
                                "resume it")
        if dl.progress(done, total):
            _tell(app)

    try:
        dl.finish(hub.pull(dl.name, downloads_of(app).directory, progress=progress))
    except Exception as e:  # PullError; GGUFError for a bad file already there; OSError: shown as the end
        dl.fail(str(e))
    _tell(app, rescan=True)


def _tell(app: App[None], rescan: bool = False) -> None:
    def show() -> None:
        if isinstance(app.screen, ModelScreen):
            app.screen.show_downloads()
            if rescan:
                app.screen.rescan()

    try:
        app.call_from_thread(show)
    except Exception:  # the app has gone (quit during the download): nothing to show it on
        pass


class ModelScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("d", "download", "download"),
        Binding("r", "rescan", "re-check files"),
    ]
    DEFAULT_CSS = """
    ModelScreen #models { height: 1fr; }
    ModelScreen OptionList.panel { height: auto; max-height: 14; background: $surface; }
    ModelScreen OptionList.panel:focus { border: round $accent; }
    ModelScreen #model-row { height: auto; }
    ModelScreen #model-row > .panel { width: 1fr; }
    ModelScreen.-narrow #model-row { layout: vertical; }
    ModelScreen #downloads { height: auto; }
    ModelScreen #browse { height: auto; }
    ModelScreen #model-file { margin-bottom: 1; }
    ModelScreen GGUFTree { height: 12; }
    ModelScreen #model-status { height: auto; padding: 0 1; }
    """

    def __init__(self, extra_dirs: Iterable[str | Path] = ()) -> None:
        super().__init__()
        self.extra_dirs = [Path(d) for d in extra_dirs]
        self.listing: Listing | None = None

    @property
    def editor(self) -> PlanEditor | None:
        return self.app.editor  # type: ignore[attr-defined, no-any-return]

    @property
    def downloads(self) -> Downloads:
        return downloads_of(self.app)

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="◆")
        with VerticalScroll(id="models"):
            yield OptionList(*(Option(_known_text(k, None), id=f"known:{k.name}") for k in known_files()),
                             id="known", classes="panel")
            yield Static(id="downloads", classes="panel")
            with Horizontal(id="model-row"):
                yield OptionList(Option(Text("checking…", style="dim"), id="checking", disabled=True),
                                 id="on-disk", classes="panel")
                yield OptionList(*_shape_options(), id="shapes", classes="panel")
            with Vertical(id="browse", classes="panel"):
                yield Input(placeholder="a .gguf file (enter chooses it) or a directory (enter shows it below)",
                            id="model-file", compact=True)
        yield Static(id="model-status")
        yield Footer()

    def on_mount(self) -> None:
        for widget_id, title in (("known", f"Published files ({hub.REPO}): d downloads, enter chooses one on disk"),
                                 ("downloads", "Downloads"), ("on-disk", "Files on disk: enter chooses"),
                                 ("shapes", "Without a file"), ("browse", "Open a file")):
            self.query_one(f"#{widget_id}").border_title = title
        ed = self.editor
        self.say(f"planning: {ed.model.label}" if ed else "detecting devices…", "dim")
        self.query_one("#known").focus()

    def on_screen_resume(self) -> None:
        """Shown (pushed, or uncovered: a download may have ended meanwhile): the downloads and the files anew."""
        self.show_downloads()
        self.rescan()

    # ---- listing -----------------------------------------------------------------------------------------
    def rescan(self) -> None:
        ed = self.editor
        self._scan(scan_dirs(ed.model.path if ed else None, self.extra_dirs, self.downloads.directory))

    @work(thread=True, exclusive=True, group="scan")
    def _scan(self, dirs: list[Path]) -> None:
        listing = scan(dirs, self.downloads.directory)
        root = next((d for d in dirs if d.is_dir()), Path.home())
        self.post_message(Scanned(listing, root))

    action_rescan = rescan

    def on_scanned(self, message: Scanned) -> None:
        self.listing = message.listing
        self.show_downloads()
        disk = self.query_one("#on-disk", OptionList)
        keep = disk.highlighted_option.id if disk.highlighted_option is not None else None
        planned = self.editor.model.path if self.editor else None
        disk.set_options([Option(_file_text(f, planned), id=str(f.path)) for f in message.listing.files]
                         or [Option(Text("no .gguf file here yet: d downloads a published one", style="dim"),
                                           disabled=True)])
        if keep is not None and any(o.id == keep for o in disk.options):
            disk.highlighted = disk.get_option_index(keep)
        if not self.query(GGUFTree):
            self.query_one("#browse").mount(GGUFTree(message.root, id="tree"))

    def show_downloads(self) -> None:
        """The downloads panel and the published files' states, from the app's download bookkeeping."""
        items = list(self.downloads.items.values())
        lines = [Text(download_row(d), style={"done": "green", "failed": "bold red"}.get(d.state, ""))
                 for d in items]
        self.query_one("#downloads", Static).update(
            Text("\n").join(lines) if lines else
            Text("none: d on a published file starts one (it goes on when you leave this screen)", style="dim"))
        known = self.query_one("#known", OptionList)
        for k in self.listing.known if self.listing else known_files():
            known.replace_option_prompt(f"known:{k.name}", _known_text(k, self.downloads.items.get(k.name)))

    # ---- downloads ---------------------------------------------------------------------------------------
    def action_download(self) -> None:
        """d: download the highlighted published file, or resume the highlighted partial download."""
        focused = self.focused
        if isinstance(focused, OptionList) and focused.id == "on-disk" and focused.highlighted_option is not None:
            f = self._disk_file(focused.highlighted_option.id)
            if f is not None and f.partial is not None:
                self._resume(f)
                return
        option = self.query_one("#known", OptionList).highlighted_option
        if option is not None and option.id:
            self.download(option.id.removeprefix("known:"))

    def download(self, name: str) -> None:
        k = next((k for k in self.listing.known if k.name == name), None) if self.listing else None
        if k is not None and k.on_disk:
            self.say(f"{name} is on disk already ({k.filename}): enter chooses it", "yellow")
            return
        try:
            dl = self.downloads.start(name)
        except hub.PullError as e:
            self.say(str(e), "yellow")
            return
        self.app.run_worker(partial(_pull, self.app, dl), name=f"pull {name}", group="pull", thread=True,
                            exit_on_error=False)
        self.say(f"downloading {dl.filename} into {self.downloads.directory or hub.models_dir()}", "dim")
        self.show_downloads()

    def _resume(self, f: DiskFile) -> None:
        name = known_for(f)
        if name is None:
            self.say(f"{f.name} is a partial download: `ds4station pull OWNER/REPO/{f.name}` resumes it", "yellow")
        else:
            self.download(name)

    # ---- choosing ----------------------------------------------------------------------------------------
    @on(OptionList.OptionSelected, "#known")
    def _known_selected(self, event: OptionList.OptionSelected) -> None:
        name = (event.option_id or "").removeprefix("known:")
        k = next((k for k in self.listing.known if k.name == name), None) if self.listing else None
        if k is not None and k.file is not None:
            self._load(k.file.path)
        else:
            self.download(name)

    @on(OptionList.OptionSelected, "#on-disk")
    def _disk_selected(self, event: OptionList.OptionSelected) -> None:
        f = self._disk_file(event.option_id)
        if f is not None and f.partial is not None:
            self._resume(f)
        elif f is not None:
            self._load(f.path)

    @on(OptionList.OptionSelected, "#shapes")
    def _shape_selected(self, event: OptionList.OptionSelected) -> None:
        shape = event.option_id or ""
        self.apply(demo_model() if shape == "demo" else model_from_shape(shape))

    @on(Input.Submitted, "#model-file")
    def _path_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self._load(Path(event.value.strip()).expanduser())

    @on(DirectoryTree.FileSelected)
    def _file_picked(self, event: DirectoryTree.FileSelected) -> None:
        self.query_one("#model-file", Input).value = str(event.path)
        self._load(event.path)

    def on_browse(self, message: Browse) -> None:
        self.query_one(GGUFTree).path = message.path
        self.say(f"showing {message.path}", "dim")

    def _disk_file(self, option_id: str | None) -> DiskFile | None:
        return next((f for f in self.listing.files if str(f.path) == option_id), None) if self.listing else None

    def _load(self, path: Path) -> None:
        self.say(f"reading {path}…", "dim")
        self._open(path)

    @work(thread=True, exclusive=True, group="model")
    def _open(self, path: Path) -> None:
        # Reading a GGUF header is file I/O (a slow disk, a network mount): never on the UI thread.
        if path.is_dir():
            self.post_message(Browse(path))
            return
        try:
            self.post_message(ModelLoaded(model_from_file(str(path))))
        except Exception as e:  # GGUFError, OSError: shown here, the previous model stays
            self.post_message(ModelLoaded(None, f"cannot use {path}: {e}"))

    def on_model_loaded(self, message: ModelLoaded) -> None:
        if message.model is None:
            self.say(f"✗ {message.error}; still planning {self.editor.model.label if self.editor else 'nothing'}",
                     "bold red")
        else:
            self.apply(message.model)

    def apply(self, choice: ModelChoice) -> None:
        """As the plan screen applies a model: the editor plans it, every view re-renders; then back to the
        screen this one was opened from (popped first, so that a plan screen under it re-renders too)."""
        ed = self.editor
        if ed is None:
            self.say("still detecting devices: choose again in a moment", "yellow")
            return
        ed.set_model(choice)
        self.app.pop_screen()
        self.app.plan_changed()  # type: ignore[attr-defined]

    def say(self, text: str, style: str = "") -> None:
        """The screen's status line: what was done, or why not (errors stay until the next message)."""
        self.query_one("#model-status", Static).update(Text(text, style=style))


def _known_text(k: KnownFile, download: Download | None) -> Text:
    first, _, second = known_row(k, download).partition("\n")
    style = "green" if k.on_disk else "yellow" if (download and download.running) or k.partial else ""
    return Text.assemble((first, style), "\n", (second, "dim"))


def _file_text(f: DiskFile, planned: str | None) -> Text:
    first, _, second = file_row(f).partition("\n")
    style = "yellow" if f.partial else "" if f.usable else "red"
    mark = ("  ● planned now", "bold green") if str(f.path) == planned else ("", "")
    return Text.assemble((first, "bold"), mark, "\n", (second, style or "dim"))


def _shape_options() -> list[Option]:
    rows = [Option(Text.assemble(("demo", "bold"), "  the built-in demo model (tiny, q2): launchable on the CPU"),
                   id="demo")]
    for name in SHAPES:
        shape = named_shape(name)
        rows.append(Option(Text.assemble((name, "bold"), f"  {shape.cfg.n_layers} layers, {gib(shape.total_bytes)}"
                                         ": plan it without the file (not launchable)"), id=name))
    return rows
