"""Disk KV checkpoints (serve --kv-disk-dir): long prompts' KV states saved to a bounded directory and restored,
after the live session was evicted or the server restarted, when a later prompt starts with one of them.

A checkpoint is one directory `DIR/<key>/` (key: a hash of the token ids):
- `stage<R>.kv`, written by stage R itself (each stage keeps only its own layers' KV, so it saves and loads
  only those; on a route over several machines the directory must exist on each of them): the magic
  `DS4KVST1`, a little-endian u32 header length, the header (JSON: format version, key, positions, layer
  range, KV dtype, and per tensor its name, dtype, shape, offset, bytes and CRC-32), the tensors' bytes.
  What a stage saves is `KVCache.state()`: the checkpoint rows of the current position (raw window,
  compressor and indexer frontiers) and the closed blocks' compressed rows and indexer keys, so a restored
  cache continues bit for bit as the saved one would have;
- `meta.json`, written by rank 0 last, once every stage has written its file: format version, the engine
  identity (the model file's fingerprint, the stages' layer ranges, compute and device kind, the KV dtype),
  the token ids, the bytes the entry counts against the budget. Its mtime is the entry's last use.

An entry without a readable meta.json (a save interrupted) is removed when the directory is scanned; an
entry whose files fail any check (magic, header, shapes, a CRC, a short file) is ignored with a log line and
removed, never loaded. Before a save, least recently used entries are removed until the new one fits the
budget (counted with `footprint.state_bytes` plus a fixed header allowance per file, an upper bound of what is
written), so the directory never holds more than the budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds4station.model.footprint import CHECKPOINT_MARGIN

MAGIC = b"DS4KVST1"
VERSION = 1
HEADER_MAX = 1 << 18  # a stage file's header is at most this long (about 90 bytes per tensor)
META_MAX = 1 << 26  # a meta.json longer than this is not read


def meta_bytes(n: int) -> int:
    """The most bytes meta.json takes for n tokens (token ids of at most 10 digits, the identity)."""
    return 12 * n + (1 << 16)
KEY_CHARS = 32  # hex digits of an entry's key
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StateFileError(ValueError):
    """A stage file that cannot be loaded (missing, truncated, corrupt, or saved for other layers)."""


def entry_key(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=KEY_CHARS // 2).hexdigest()


def stage_file(entry: str | os.PathLike[str], rank: int) -> Path:
    return Path(entry) / f"stage{rank}.kv"


# ---- one stage's file ----------------------------------------------------------------------------------
def write_state_file(path: Path, info: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Write `tensors` (any device) and `info` as a stage file, atomically (a temporary name, then rename);
    -> the bytes written."""
    blobs = []
    entries = []
    offset = 0
    for name, t in tensors:
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()  # no copy on the CPU
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": data.nbytes, "crc32": zlib.crc32(data)})
        blobs.append(data)
        offset += data.nbytes
    header = json.dumps({**info, "version": VERSION, "tensors": entries}).encode()
    if len(header) > HEADER_MAX:
        raise ValueError(f"state header of {len(header)} bytes exceeds {HEADER_MAX}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)
    return len(MAGIC) + 4 + len(header) + offset


def read_state_file(path: Path, expect: dict[str, Any], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tensors of a stage file, on `device`, after checking it: the magic, the header's version and every
    key of `expect` (key, positions, layers, dtype), each tensor's size and CRC-32. StateFileError says what
    is wrong."""
    try:
        with open(path, "rb") as f:
            raw = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(raw)
    except OSError as e:
        raise StateFileError(f"{path}: {e.strerror or e}") from None
    if got != len(raw):
        raise StateFileError(f"{path}: changed while read")
    head = len(MAGIC) + 4
    if len(raw) < head or raw[:len(MAGIC)] != MAGIC:
        raise StateFileError(f"{path}: not a ds4station KV state file")
    (hlen,) = struct.unpack("<I", raw[len(MAGIC):head])
    if hlen > HEADER_MAX or head + hlen > len(raw):
        raise StateFileError(f"{path}: truncated header")
    try:
        header = json.loads(raw[head:head + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StateFileError(f"{path}: unreadable header") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise StateFileError(f"{path}: format version {header.get('version') if isinstance(header, dict) else '?'}, "
                             f"this build reads {VERSION}")
    for k, want in expect.items():
        if header.get(k) != want:
            raise StateFileError(f"{path}: {k} is {header.get(k)!r}, expected {want!r}")
    base = head + hlen
    out: dict[str, torch.Tensor] = {}
    view = memoryview(raw)
    try:
        for e in header["tensors"]:
            lo, n = base + int(e["offset"]), int(e["nbytes"])
            if lo + n > len(raw):
                raise StateFileError(f"{path}: truncated at tensor {e['name']}")
            data = view[lo:lo + n]
            if zlib.crc32(data) != e["crc32"]:
                raise StateFileError(f"{path}: checksum mismatch in tensor {e['name']}")
            dtype = _DTYPES[e["dtype"]]
            t = torch.frombuffer(raw, dtype=torch.uint8, count=n, offset=lo) if n else torch.empty(0, dtype=torch.uint8)
            out[e["name"]] = t.view(dtype).reshape(e["shape"]).to(device)  # on the CPU: a view of `raw`
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, StateFileError):
            raise
        raise StateFileError(f"{path}: malformed tensor table ({type(e).__name__}: {e})") from None
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two sequences share from the start (slices compared 1,024 at a time, then one by one: a 100K-token
    prompt against a live session or a saved one costs a few C-speed compares, not 100K Python steps)."""
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    i, step = 0, 1024
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---- the directory (rank 0) ----------------------------------------------------------------------------
DEFAULT_BUDGET = 16 << 30
DEFAULT_MIN_TOKENS = 1024


@dataclass(frozen=True)
class DiskSettings:
    """serve's --kv-disk-dir, --kv-disk-budget and --kv-disk-min."""

    root: str
    budget: int = DEFAULT_BUDGET
    min_tokens: int = DEFAULT_MIN_TOKENS
    min_gain: int = 256

    def open(self, engine: Any) -> DiskKV:
        """The directory for this engine (its identity and byte formula)."""
        return DiskKV(self.root, self.budget, engine.state_identity(), entry_bytes=engine.state_bytes,
                      min_tokens=self.min_tokens, min_gain=self.min_gain, drop=getattr(engine, "drop_state", None))

@dataclass
class DiskEntry:
    key: str
    tokens: list[int]
    nbytes: int
    used: float  # meta.json's mtime: the last save or restore

    @property
    def n(self) -> int:
        return len(self.tokens)


class DiskKV:
    """The checkpoint directory as rank 0 keeps it: the entries of this engine's identity (others' count
    against the budget and are evicted like any), the budget, and the counters /status and /metrics show.

    `min_tokens`: shorter prompts are not saved; `min_gain`: an entry is restored only when it holds this many
    more tokens than the best live session (below a few hundred tokens a prefill is as quick as a file read).
    `entry_bytes(n)`: the bytes an entry of n positions takes at most (footprint.state_bytes over the route +
    header allowances); `save(path)` / `load(path, tokens)` run the engine's save and restore of one session
    into an entry directory (bool: every stage succeeded)."""

    def __init__(self, root: str | os.PathLike[str], budget: int, identity: dict[str, Any], *,
                 entry_bytes: Callable[[int], int], min_tokens: int = DEFAULT_MIN_TOKENS, min_gain: int = 256,
                 log: Callable[[str], None] | None = None, drop: Callable[[Path], None] | None = None) -> None:
        if budget <= 0 or min_tokens < 1:
            raise ValueError("the KV disk budget must be positive and the least prompt saved at least 1 token")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget, self.identity, self.min_tokens = budget, identity, min_tokens
        self.min_gain = min_gain  # restore only when the entry holds this many more tokens than a live session
        self.entry_bytes = entry_bytes
        self.drop = drop  # removes an entry's stage files on every stage (a route over several machines)
        self.log = log or (lambda msg: print(f"ds4station: kv-disk: {msg}", file=sys.stderr, flush=True))
        self.entries: dict[str, DiskEntry] = {}  # this engine's
        self.foreign: dict[str, DiskEntry] = {}  # other models' or routes' (kept, within the budget)
        self.hits = self.saves = self.failures = self.bytes_restored = 0
        self.scan()

    # ---- the index ---------------------------------------------------------------------------------
    def scan(self) -> None:
        """(Re)read the directory: valid entries indexed, incomplete or unreadable ones removed, then the
        least recently used removed while the total exceeds the budget (a budget lowered since)."""
        self.entries.clear()
        self.foreign.clear()
        for d in sorted(self.root.iterdir()):
            if not (d.is_dir() and len(d.name) == KEY_CHARS and all(c in "0123456789abcdef" for c in d.name)):
                continue  # not ours: never touched
            entry, why = self._read_meta(d)
            if entry is None:
                self.log(f"removed {d.name}: {why}")
                self._rmtree(d)
                continue
            (self.entries if why == "" else self.foreign)[entry.key] = entry
        self._evict(0)

    def _read_meta(self, d: Path) -> tuple[DiskEntry | None, str]:
        meta = d / "meta.json"
        try:
            if meta.stat().st_size > META_MAX:
                return None, "meta.json is too large"
            data = json.loads(meta.read_text())
            tokens = [int(t) for t in data["tokens"]]
            entry = DiskEntry(d.name, tokens, int(data["bytes"]), meta.stat().st_mtime)
            if data.get("version") != VERSION or entry_key(tokens) != d.name:
                return None, "meta.json does not match its entry"
        except FileNotFoundError:
            return None, "incomplete (no meta.json: a save was interrupted)"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"unreadable meta.json ({type(e).__name__})"
        return entry, "" if data.get("identity") == self.identity else "another model or route"

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in (*self.entries.values(), *self.foreign.values()))

    def _evict(self, room: int) -> bool:
        """Remove least recently used entries until `room` more bytes fit; False when they cannot."""
        if room > self.budget:
            return False
        pool = sorted((*self.entries.values(), *self.foreign.values()), key=lambda e: e.used)
        while self.used_bytes + room > self.budget and pool:
            self._remove(pool.pop(0))
        return self.used_bytes + room <= self.budget

    def _remove(self, entry: DiskEntry) -> None:
        self.entries.pop(entry.key, None)
        self.foreign.pop(entry.key, None)
        self._rmtree(self.root / entry.key)

    def _rmtree(self, d: Path) -> None:
        """An entry's directory, here and (through `drop`) on every stage's machine."""
        if self.drop is not None:
            try:
                self.drop(d)
            except Exception as e:  # the local copy still goes; a stage that is down has its own cleanup
                self.log(f"stage files of {d.name} not removed: {type(e).__name__}: {e}")
        shutil.rmtree(d, ignore_errors=True)

    def match(self, prompt: Sequence[int], limit: int) -> tuple[DiskEntry, int] | None:
        """The entry that serves the most of `prompt` (at most `limit` of its tokens), and how many: an entry
        restores to its own end or, through its checkpoint's margin, up to CHECKPOINT_MARGIN positions before
        it (a retry of the same prompt, a chat template that renders the last tokens otherwise)."""
        best: tuple[DiskEntry, int] | None = None
        for e in self.entries.values():
            n = min(common_prefix(e.tokens, prompt), limit)
            if n >= e.n - CHECKPOINT_MARGIN and n > 0 and (best is None or n > best[1]):
                best = (e, n)
        return best

    # ---- save and restore ----------------------------------------------------------------------------
    def save(self, tokens: Sequence[int], write: Callable[[Path], bool]) -> bool:
        """Save the session holding exactly `tokens` (`write(entry_dir)` has every stage write its file);
        False when it was not saved: shorter than `min_tokens`, or fewer than `min_tokens` beyond an entry it
        starts with (a conversation is saved again every `min_tokens` or so, not at every turn), larger than
        the whole budget, or a stage failed."""
        tokens = list(tokens)
        key = entry_key(tokens)
        if len(tokens) < self.min_tokens:
            return False
        if key in self.entries:  # the same prompt again: only its use is new
            self._touch(self.entries[key])
            return False
        near = self.match(tokens, len(tokens))
        if near is not None and len(tokens) - near[1] < self.min_tokens:
            self._touch(near[0])  # the next turn of a saved conversation: saved again once min_tokens newer
            return False
        nbytes = self.entry_bytes(len(tokens)) + meta_bytes(len(tokens))
        if not self._evict(nbytes):
            self.log(f"not saved: {len(tokens)} tokens need {nbytes / 2**20:.1f} MiB, over the whole budget "
                     f"({self.budget / 2**20:.1f} MiB)")
            return False
        d = self.root / key
        self.foreign.pop(key, None)  # the same tokens saved by another model or route: replaced
        self._rmtree(d)
        try:
            ok = write(d)
            if ok:
                meta = json.dumps({"version": VERSION, "identity": self.identity, "bytes": nbytes,
                                   "saved_at": time.time(), "tokens": tokens}, separators=(",", ":"))
                if len(meta) > meta_bytes(len(tokens)):
                    raise OSError(f"meta.json of {len(meta)} bytes exceeds its allowance")
                tmp = d / f"meta.json.tmp{os.getpid()}"
                tmp.write_text(meta)
                os.replace(tmp, d / "meta.json")
        except OSError as e:
            self.log(f"save of {len(tokens)} tokens failed: {e}")
            ok = False
        if not ok:
            self.failures += 1
            self._rmtree(d)
            return False
        self.entries[key] = DiskEntry(key, tokens, nbytes, (d / "meta.json").stat().st_mtime)
        self.saves += 1
        return True

    def restore(self, entry: DiskEntry, read: Callable[[Path, list[int]], bool]) -> bool:
        """Load `entry` into a fresh session (`read(entry_dir, tokens)` has every stage load its file); an entry
        that fails is removed (the stage that refused it logged why)."""
        if read(self.root / entry.key, entry.tokens):
            self.hits += 1
            self.bytes_restored += entry.nbytes
            self._touch(entry)
            return True
        self.failures += 1
        self.log(f"entry {entry.key} ({entry.n} tokens) could not be restored: removed")
        self._remove(entry)
        return False

    def _touch(self, entry: DiskEntry) -> None:
        meta = self.root / entry.key / "meta.json"
        try:
            os.utime(meta)
            entry.used = meta.stat().st_mtime
        except OSError:
            entry.used = time.time()

    def describe(self) -> dict[str, Any]:
        return {"dir": str(self.root), "budget_bytes": self.budget, "used_bytes": self.used_bytes,
                "entries": len(self.entries), "other_entries": len(self.foreign), "min_tokens": self.min_tokens,
                "hits": self.hits, "saves": self.saves, "failures": self.failures,
                "bytes_restored": self.bytes_restored}
