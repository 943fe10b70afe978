"""The request trace (`serve --trace FILE`): one JSON line per finished request, for debugging an agent session.

A line holds when the request finished, its id and kind (chat, messages, responses, completion), the prompt's
length and the SHA-256 of its token ids (equal hashes: the same rendered prompt), how the live KV served it
(tokens reused and prefilled, and why: hit / miss / reset as the scheduler's SessionPool decided, with the
tokens of a divergent tail it rolled back), the output (its text and, for chat kinds, the reasoning, content
and tool calls as the stream parser reads them), the finish reason and error, and the timings. The file is
rotated by size: at `max_bytes` it becomes FILE.1 (FILE.1 becomes FILE.2, ...), `keep` old files are kept.
The scheduler's worker thread writes it (an observer of every finished request).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import Any

from ds4station.engine import chat
from ds4station.engine.scheduler import Finished, Job, Scheduler


def prompt_hash(prompt: list[int]) -> str:
    """SHA-256 of the token ids as little-endian uint32 (the same on every machine)."""
    ids = array("I", prompt)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256(ids.tobytes()).hexdigest()


class RequestTrace:
    """Appends a JSON line per finished request to `path`, rotating by size (see the module docstring)."""

    def __init__(self, path: str | Path, scheduler: Scheduler, max_bytes: int, keep: int) -> None:
        if max_bytes < 1 or keep < 0:
            raise ValueError(f"trace size {max_bytes} / kept files {keep}: use a size > 0 and keep >= 0")
        self.path = Path(path)
        self.scheduler = scheduler  # its engine's tokenizer decodes the outputs
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")  # an existing trace is continued
        self._size = self._file.tell()

    def observe(self, job: Job, fin: Finished) -> None:
        """The scheduler's observer: one line for this request."""
        self.write(self.record(job, fin))

    def record(self, job: Job, fin: Finished) -> dict[str, Any]:
        t = fin.timings
        reuse = fin.reuse
        return {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "id": job.id, "kind": job.kind,
            "prompt": {"tokens": len(job.prompt), "sha256": prompt_hash(job.prompt)},
            "cache": None if reuse is None else {"outcome": reuse.outcome, "why": reuse.why, "reused": t.cache_n,
                                                 "prefilled": t.prompt_n, "discarded": reuse.discarded},
            "max_tokens": job.max_tokens,
            "finish_reason": fin.reason, "error": fin.error, "stop_string": fin.stop_string,
            "output": self._output(job, fin),
            "timings": {"queue_ms": round(fin.queue_ms, 3), "prompt_ms": round(t.prompt_ms, 3),
                        "ttft_ms": round(fin.ttft_ms, 3), "predicted_ms": round(t.predicted_ms, 3),
                        "total_ms": round((time.monotonic() - job.queued_at) * 1000, 3)},
        }

    def _output(self, job: Job, fin: Finished) -> dict[str, Any]:
        ids = fin.output[:-1] if fin.output and fin.output[-1] in job.stop_tokens else fin.output
        out: dict[str, Any] = {"tokens": fin.completion_tokens}
        tok = getattr(self.scheduler.engine, "tokenizer", None)
        if tok is None:  # the engine went away (a failed restart): nothing to decode with
            return out
        out["text"] = text = tok.decode(ids)
        if job.kind != "completion":
            thinking = bool(job.prompt) and job.prompt[-1] == tok.think_start_id
            reasoning, content, calls = chat.parse_completion(text, thinking)
            out.update(reasoning=reasoning, content=content,
                       tool_calls=[{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                   for c in calls])
        return out

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock:
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()  # a trace is read while the server runs (tail -f)
            self._size += len(line)

    def _rotate(self) -> None:
        self._file.close()
        if self.keep:
            for n in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{n}")
                if older.exists():
                    older.replace(self.path.with_name(f"{self.path.name}.{n + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._file = self.path.open("wb")
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._file.close()
