"""Getting the model: resumable downloads of DS4 GGUF files from the Hugging Face hub (`ds4station pull`).

The published Flash files live in antirez/deepseek-v4-gguf (KNOWN below). huggingface_hub gives the file's
URL (HF_ENDPOINT honoured) and the user's token (HF_TOKEN or `hf auth login`); the transfer itself is a ranged
HTTP GET written here, because huggingface_hub's own download (2.x) deletes a partial file when it fails, so
an interrupted 81 GB download would start again from zero, and refuses plain-HTTP files over 50 GB without
the hf_xet package. Here a download goes to FILE.part, a later run resumes it with a Range request (checking
the server still has the same file, by ETag), the free space is checked before any byte is written, and the
finished file is opened as a DS4 GGUF (its header and tensor table checked against the layout, as
`ds4station inspect` does) before it takes its final name. No torch here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ds4station import __version__
from ds4station.cache import cache_dir
from ds4station.model.sizes import format_size, gib

REPO = "antirez/deepseek-v4-gguf"
# name -> (file in REPO, what it is); the names `ds4station pull` takes
KNOWN: dict[str, tuple[str, str]] = {
    "q2": ("DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf",
           "2-bit routed experts, ~81 GB: the common file (96-128 GB of RAM, or VRAM plus streaming)"),
    "q2-q4": ("DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-"
              "chat-v2-imatrix-fixed.gguf", "2-bit experts, 4-bit in layers 37-42, ~98 GB"),
    "q4": ("DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2-imatrix.gguf",
           "4-bit routed experts, ~153 GB"),
    "mtp": ("DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf", "the MTP (next-token prediction) head, ~3.5 GB"),
}
FREE_MARGIN = 1 << 30  # left free on the disk after the download


class PullError(RuntimeError):
    """A download that cannot go on; the message says why and what to do."""


def models_dir() -> Path:
    return cache_dir() / "models"


@dataclass(frozen=True)
class Remote:
    repo: str
    filename: str
    revision: str = "main"


def resolve(what: str, revision: str = "main") -> Remote:
    """`q2` / `q2-q4` / `q4` / `mtp`, or REPO/FILE (owner/name/path/in/repo.gguf)."""
    if what in KNOWN:
        return Remote(REPO, KNOWN[what][0], revision)
    parts = what.split("/")
    if len(parts) < 3 or not all(parts):
        raise PullError(f"{what!r}: give one of {', '.join(KNOWN)} or OWNER/REPO/FILE "
                        f"(e.g. {REPO}/{KNOWN['q2'][0]})")
    return Remote("/".join(parts[:2]), "/".join(parts[2:]), revision)


def _headers(token: str | None) -> dict[str, str]:
    from huggingface_hub import get_token

    token = token or get_token()
    headers = {"user-agent": f"ds4station/{__version__}", "accept-encoding": "identity"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


def _url(remote: Remote) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(remote.repo, remote.filename, revision=remote.revision,
                      endpoint=os.environ.get("HF_ENDPOINT") or None)


def _check(response: httpx.Response, remote: Remote) -> None:
    if response.status_code in (401, 403):
        raise PullError(f"{remote.repo}: access refused ({response.status_code}); log in with `hf auth login` or "
                        "give --token / HF_TOKEN")
    if response.status_code == 404:
        raise PullError(f"{remote.repo} has no file {remote.filename!r} at {remote.revision}")
    if response.status_code >= 400:
        raise PullError(f"{response.request.url}: HTTP {response.status_code}")


def pull(what: str, directory: str | Path | None = None, *, token: str | None = None, revision: str = "main",
         progress: Callable[[int, int], None] | None = None, timeout: float = 30.0) -> Path:
    """Download `what` into `directory` (default: the cache's models/), resuming FILE.part; -> the checked
    file. `progress(done, total)` is called as bytes arrive."""
    from ds4station.model.gguf import GGUFError, GGUFFile

    remote = resolve(what, revision)
    out_dir = Path(directory) if directory else models_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / Path(remote.filename).name
    part = dest.with_name(dest.name + ".part")
    meta = dest.with_name(dest.name + ".part.json")
    if dest.exists():
        GGUFFile.open(dest)  # a file already here is checked all the same
        return dest
    url, headers = _url(remote), _headers(token)
    with httpx.Client(follow_redirects=True, timeout=timeout, headers=headers) as client:
        try:
            head = client.head(url)
        except httpx.TransportError as e:
            raise PullError(f"cannot reach {url}: {e}") from e
        _check(head, remote)
        size = int(head.headers.get("x-linked-size") or head.headers.get("content-length") or 0)
        etag = head.headers.get("x-linked-etag") or head.headers.get("etag") or ""
        have = part.stat().st_size if part.exists() else 0
        if have and (not meta.exists() or json.loads(meta.read_text()).get("etag") != etag or have > size):
            have = 0  # not the same file any more (or no record of it): start again
            part.unlink()
        need = size - have
        free = shutil.disk_usage(out_dir).free
        if size and need + FREE_MARGIN > free:
            raise PullError(f"{dest.name} needs {gib(need)} more ({format_size(size)} in all) but {out_dir} has "
                            f"{gib(free)} free (keeping {format_size(FREE_MARGIN)} spare); free space or give --dir")
        meta.write_text(json.dumps({"url": url, "etag": etag, "size": size}))
        request_headers = {"range": f"bytes={have}-"} if have else {}
        try:
            with client.stream("GET", url, headers=request_headers) as r:
                _check(r, remote)
                if have and r.status_code != 206:  # the server ignored the range: from the start
                    have = 0
                with part.open("r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    done = have
                    for block in r.iter_bytes():  # as they arrive: a cut connection loses nothing received
                        f.write(block)
                        done += len(block)
                        if progress:
                            progress(done, size)
        except httpx.TransportError as e:
            got = part.stat().st_size if part.exists() else 0
            raise PullError(f"the download of {dest.name} stopped at {gib(got)} of {gib(size)} ({e}); run the same "
                            "command again to resume it") from e
    got = part.stat().st_size
    if size and got != size:
        raise PullError(f"{dest.name}: the download ended at {got} of {size} bytes; run the same command to resume")
    try:
        if remote.filename == KNOWN["mtp"][0]:  # a head for the model, not a model: a GGUF, its layout aside
            with part.open("rb") as f:
                if f.read(4) != b"GGUF":
                    raise GGUFError("no GGUF magic at the start of the file")
        else:
            GGUFFile.open(part)
    except GGUFError as e:
        raise PullError(f"{dest.name} downloaded but is not a DS4 GGUF this engine can run: {e} (kept as "
                        f"{part})") from e
    part.replace(dest)
    meta.unlink(missing_ok=True)
    return dest


class ProgressLine:
    """`done / total` as one line on stderr, rewritten at most every 0.5 s (and at the end)."""

    def __init__(self, name: str) -> None:
        self.name, self.t0, self.last, self.start = name, time.monotonic(), 0.0, None

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = done
        if now - self.last < 0.5 and done < total:
            return
        self.last = now
        rate = (done - self.start) / max(now - self.t0, 1e-6)
        pct = f"{100 * done / total:5.1f}%" if total else ""
        print(f"\r{self.name}: {gib(done)} / {gib(total)} {pct} at {rate / 1e6:.0f} MB/s", end="", file=sys.stderr,
              flush=True)
        if total and done >= total:
            print(file=sys.stderr)


__all__ = ["KNOWN", "REPO", "ProgressLine", "PullError", "Remote", "models_dir", "pull", "resolve"]
