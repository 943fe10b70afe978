"""`ds4station pull` (ds4station/hub.py) against a local HTTP server speaking the hub's file API (HEAD / GET
/{repo}/resolve/{revision}/{file}, ranges, ETag), as HF_ENDPOINT: a download cut off midway resumes from where
it stopped with a Range request, the file is checked as a DS4 GGUF before it takes its name, a short disk is
refused before any byte is written, and unknown names and files are reported."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ds4station import hub
from ds4station.commands import pull as pull_cmd
from ds4station.engine.demo import make_model
from ds4station.hub import PullError, pull, resolve
from ds4station.model.gguf import GGUFFile
from ds4station.server.app import BackgroundServer

REPO_FILE = "me/ds4-test/tiny.gguf"


class Hub:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.cut_after: int | None = None  # the next GET sends this many bytes, then drops the connection

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{owner}/{repo}/resolve/{rev}/{filename:path}", methods=["GET", "HEAD"])
        async def resolve_file(owner: str, repo: str, rev: str, filename: str, request: Request) -> Response:
            self.requests.append((request.method, request.headers.get("range")))
            data = self.files.get(f"{owner}/{repo}/{filename}")
            if data is None:
                return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound"})
            headers = {"X-Repo-Commit": "c" * 40, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            if request.method == "HEAD":
                return Response(headers={**headers, "Content-Length": str(len(data))})
            start, status = 0, 200
            rng = request.headers.get("range")
            if rng:
                start, status = int(rng.removeprefix("bytes=").split("-")[0]), 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            headers["Content-Length"] = str(len(body))
            cut, self.cut_after = self.cut_after, None
            if cut is None:
                return Response(body, status_code=status, headers=headers)

            async def cut_off() -> Iterator[bytes]:
                yield body[:cut]
                await asyncio.sleep(0.05)
                raise ConnectionResetError("the test hub drops the connection")

            return StreamingResponse(cut_off(), status_code=status, headers=headers)

        return app


@pytest.fixture
def local_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    h = Hub()
    srv = BackgroundServer(h.app()).start()
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        yield h
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_model(tmp_path_factory.mktemp("hub") / "tiny.gguf", preset="tiny", seed=0, quant="q2").read_bytes()


def test_a_cut_download_resumes_where_it_stopped_and_is_checked(local_hub: Hub, model_bytes: bytes,
                                                                 tmp_path: Path) -> None:
    local_hub.files[REPO_FILE] = model_bytes
    cut = len(model_bytes) // 3
    local_hub.cut_after = cut
    seen: list[tuple[int, int]] = []
    with pytest.raises(PullError, match="stopped at .* run the same command again to resume"):
        pull(REPO_FILE, tmp_path, progress=lambda done, total: seen.append((done, total)))
    part = tmp_path / "tiny.gguf.part"
    assert part.stat().st_size == cut and not (tmp_path / "tiny.gguf").exists()
    path = pull(REPO_FILE, tmp_path, progress=lambda done, total: seen.append((done, total)))
    assert ("GET", f"bytes={cut}-") in local_hub.requests  # resumed, not started again
    assert path == tmp_path / "tiny.gguf" and path.read_bytes() == model_bytes and not part.exists()
    assert GGUFFile.open(path).config.n_layers == 6
    assert seen[-1] == (len(model_bytes), len(model_bytes))
    before = len(local_hub.requests)
    assert pull(REPO_FILE, tmp_path) == path and len(local_hub.requests) == before  # already here: checked only


def test_a_changed_file_on_the_hub_starts_again(local_hub: Hub, model_bytes: bytes, tmp_path: Path) -> None:
    local_hub.files[REPO_FILE] = model_bytes
    local_hub.cut_after = 1000
    with pytest.raises(PullError):
        pull(REPO_FILE, tmp_path)
    newer = model_bytes[:-16] + b"\0" * 16  # a new version of the file (another ETag)
    local_hub.files[REPO_FILE] = newer
    assert pull(REPO_FILE, tmp_path).read_bytes() == newer  # not the old bytes with the new ones appended
    assert local_hub.requests[-1] == ("GET", None)  # from the start, no range


def test_a_short_disk_is_refused_before_any_byte_is_written(local_hub: Hub, model_bytes: bytes, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    local_hub.files[REPO_FILE] = model_bytes
    import shutil

    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda _: real._replace(free=hub.FREE_MARGIN + 100))
    with pytest.raises(PullError, match=r"needs [0-9.]+ GiB more .* has [0-9.]+ GiB free"):
        pull(REPO_FILE, tmp_path)
    assert not any(m == "GET" for m, _ in local_hub.requests) and not list(tmp_path.glob("*.part"))


def test_names_and_missing_files_are_reported(local_hub: Hub, tmp_path: Path) -> None:
    assert resolve("q2").repo == hub.REPO and resolve("q2").filename.endswith("imatrix.gguf")
    assert resolve("me/ds4-test/sub/dir/x.gguf").filename == "sub/dir/x.gguf"
    with pytest.raises(PullError, match="give one of q2, q2-q4, q4, mtp or OWNER/REPO/FILE"):
        resolve("q3")
    with pytest.raises(PullError, match="has no file 'nothing.gguf'"):
        pull("me/ds4-test/nothing.gguf", tmp_path)
    local_hub.files["me/ds4-test/notes.gguf"] = b"not a gguf at all" * 100
    with pytest.raises(PullError, match="not a DS4 GGUF this engine can run"):
        pull("me/ds4-test/notes.gguf", tmp_path)


def test_the_pull_command(local_hub: Hub, model_bytes: bytes, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    local_hub.files[REPO_FILE] = model_bytes
    p = argparse.ArgumentParser()
    pull_cmd.add_arguments(p)
    assert pull_cmd.run(p.parse_args([REPO_FILE, "--dir", str(tmp_path)])) == 0
    out = capsys.readouterr()
    assert f"serve --model {tmp_path / 'tiny.gguf'}" in out.out and "100.0%" in out.err
    assert pull_cmd.run(p.parse_args(["me/ds4-test/missing.gguf", "--dir", str(tmp_path)])) == 1
    assert "has no file" in capsys.readouterr().err
