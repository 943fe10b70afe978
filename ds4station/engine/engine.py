"""The engine: one class for every configuration. It drives a route of stages (engine/stage.py); a route of
one stage runs in this process, a longer one starts or admits one worker process per further stage and runs
stage 0 itself (rank 0, the coordinator). The API server and `ds4station generate` drive it through the
scheduler (engine/scheduler.py), the same way for both.

    engine = Engine.load(path, ctx=4096)                                   # one stage, on the GPU if any
    engine = Engine.load(path, ctx=4096, route="cpu=embed,0-1,output; cpu=2-3; cpu=4-5")
    session = engine.new_session()
    logits = session.extend(prompt_ids)          # chunked prefill, pipelined through the stages

How it runs (see stage.py for the stage backends and the wire protocol):
- `Engine.load` resolves the device (`auto`: the GPU when one is visible) and the prefill chunk (per
  device: DEFAULT_GPU_CHUNK on a GPU, DEFAULT_CHUNK on the CPU), validates the route (and each streaming
  stage's expert cache: too small is refused before anything starts, with the minimum in the message) and,
  for a multi-stage route, opens a TCPStore (the rendezvous; remote workers join it with `ds4station worker
  --coordinator HOST:PORT --rank N`), publishes the settings, spawns `ds4station worker` for every local
  stage, pinned to its device, and loads stage 0 meanwhile. Every stage allocates its `sessions` KV slots
  and warms up (kernels compiled, decode graphs captured) before it reports ready; only when every worker
  is ready is the process group formed (gloo on CPU and where stages share a device, NCCL between distinct
  GPUs), so a worker that fails to load fails `load` with its own message, never a hang.
- A prefill of T tokens is cut into pieces of at most `chunk` tokens: stage 0 computes piece k+1 while
  stage 1 computes piece k, and so on down the chain; only the last piece's last position comes back.
  Activations travel as the HC state in 16 bits (default: fp16 with a power-of-two scale per row, see
  stage.pack) or 32 (fp32: bit-for-bit the single-process result).
- Failure handling: sends and receives are waited on by a helper thread while the calling thread polls a
  monitor that watches every worker (process exit for local children, heartbeat counters in the store for
  all). A dead or silent worker makes the request in flight fail within about `heartbeat_timeout` seconds
  with `StageDown` naming the stage; the engine then stays down (`health()` / `status()` say which stage)
  until it is closed (the scheduler then closes it and loads the route again, see scheduler.py). `close()`
  (also run at exit) stops every process it started.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ds4station.engine.weights import load_tensors
from ds4station.model.footprint import kv_bytes, state_bytes
from ds4station.model.gguf import GGUFError, GGUFFile, fingerprint
from ds4station.model.layout import MTP_PREFIX
from ds4station.model.route import Route, RouteError, Stage, parse_route, route_from_toml
from ds4station.model.sizes import parse_size

from .experts import PARTS, ExpertCacheTooSmall, expert_name, min_cache_bytes, too_small_message
from .gpu import SHORT_ROWS
from .kv import DEFAULT_CHUNK, dtype_name
from .model import RoundTrips
from .stage import (
    ACTIVATION_BITS,
    FLAG_ALL,
    FLAG_FAILED,
    FLAG_RESULT,
    FLAG_TAIL,
    HEADER_LEN,
    KV_DTYPES,
    MTP_IN_MODEL,
    OP_BATCH,
    OP_CHECKPOINT,
    OP_DRAFT,
    OP_DROP,
    OP_EXTEND,
    OP_FREE,
    OP_LOAD,
    OP_NEW,
    OP_REWIND,
    OP_SAVE,
    OP_SHUTDOWN,
    OP_STATUS,
    OP_TRUNCATE,
    Link,
    StageRunner,
    StageSettings,
    header,
    make_process_group,
    pack,
    payload_bytes,
    pin_env,
    resolve_device,
    shutdown_process_group,
    stage_label,
    tail_rows,
    unpack,
)

DEFAULT_GPU_CHUNK = 2048
DEFAULT_HEARTBEAT_TIMEOUT = 5.0
DEFAULT_JOIN_TIMEOUT = 300.0


class StageDown(RuntimeError):
    """A pipeline stage died or stopped answering; the message names it."""

    def __init__(self, rank: int, label: str, reason: str) -> None:
        super().__init__(f"pipeline {label} is down: {reason}")
        self.rank, self.label, self.reason = rank, label, reason


# ---- waiting on communication without ever blocking the caller ------------------------------------------
class _Pending:
    __slots__ = ("done", "error", "keep")

    def __init__(self, keep: Any) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.keep = keep  # the tensor being sent / received must outlive the operation


class _Waiter:
    """A daemon thread that completes communication in submission order while the engine thread polls for
    liveness: gloo completes a receive only inside `work.wait()`, which blocks; NCCL's wait() only orders
    the current stream, so there the thread polls `is_completed()` (the data is then really there). A
    daemon thread because a wait on a hung peer may never return, and the process must still exit."""

    def __init__(self, poll: bool = False) -> None:
        self._poll = poll
        self._q: queue.Queue[tuple[Any, _Pending] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pipeline-waiter", daemon=True)
        self._thread.start()

    def submit(self, work: Any, keep: Any) -> _Pending:
        p = _Pending(keep)
        self._q.put((work, p))
        return p

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            work, p = item
            try:
                while self._poll and not work.is_completed():
                    time.sleep(0.0002)
                work.wait()
            except BaseException as e:  # a peer that died: gloo reports "connection closed"
                p.error = e
            p.done.set()

    def close(self, timeout: float = 2.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)


# ---- the engine ----------------------------------------------------------------------------------------
class Session:
    """One sequence's KV, spread over the stages. `tokens` are the ids already in the KV, in order."""

    def __init__(self, engine: Engine, sid: int, activation_bits: int) -> None:
        self.engine, self.sid, self.activation_bits = engine, sid, activation_bits
        self._tokens: list[int] = []
        self._ahead: torch.Tensor | None = None  # a token `decode_batch` fed from the device, not read yet
        # The scheduler drops sessions by reference; the stages free their KV at the engine's next operation.
        self._finalizer = weakref.finalize(self, engine._release, sid)

    @property
    def tokens(self) -> list[int]:
        """The ids in the KV, in order. A token that `Engine.decode_batch` took on the device is read here when
        its caller has not `resolve`d it (which waits for every step queued behind it)."""
        if self._ahead is not None:
            self.resolve(int(self._ahead))
        return self._tokens

    @tokens.setter
    def tokens(self, tokens: list[int]) -> None:
        self._ahead, self._tokens = None, tokens

    @property
    def length(self) -> int:
        """How many tokens the KV holds, without reading a token fed from the device (safe from another thread:
        `tokens` would read it there, and its caller's `resolve` then finds nothing to resolve)."""
        return len(self._tokens) + (self._ahead is not None)

    def _feed_ahead(self, token: torch.Tensor) -> None:
        """`Engine.decode_batch` appended `token` (one element, on the device) without reading it; an earlier
        such token still unread is read first."""
        self.tokens  # noqa: B018 (reads it)
        self._ahead = token

    def resolve(self, token: int) -> None:
        """The value of the token `Engine.decode_batch` took on the device, as its caller read it."""
        if self._ahead is None:
            raise RuntimeError("no token fed from the device awaits its value")
        self._ahead = None
        self._tokens.append(token)

    def extend(self, tokens: Sequence[int], chunk: int | None = None) -> torch.Tensor:
        """Append tokens to the KV (prefill pieces of at most `chunk` pipelined through the stages);
        -> logits of the last one [vocab] (float32, on stage 0's device or the CPU)."""
        return self.engine._extend(self, list(tokens), chunk)

    def draft(self, token: int, k: int) -> list[int]:
        """Up to k tokens the MTP layer guesses after `token` (the token about to be fed), greedily (an engine
        loaded with `mtp`); nothing is appended."""
        return self.engine.draft_batch([self], [token], [k])[0]

    def verify(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens (at most one prefill chunk: a token and its drafts) -> the logits after each of them
        [T, vocab]: row i is what `extend` of tokens[:i + 1] would return. The caller truncates what it
        rejects."""
        return self.engine._extend(self, list(tokens), None, every=True)

    def truncate(self, n: int) -> bool:
        """Keep only the first n tokens; False (state unchanged) when the KV cannot roll back that far."""
        if not self.engine._truncate(self, n):
            return False
        del self.tokens[n:]
        return True

    def checkpoint(self) -> None:
        """Keep the KV state of the current position, so that `rewind` can come back to it from any later one."""
        self.engine._checkpoint(self)

    def rewind(self, n: int) -> int:
        """Roll back to at most n tokens: n itself when `truncate` can, else the checkpoint when it lies at or
        before n. -> the tokens kept, or -1 (state unchanged) when neither can."""
        k = self.engine._rewind(self, n)
        if k >= 0:
            del self.tokens[k:]
        return k

    def save_state(self, entry: str | os.PathLike[str]) -> bool:
        """Every stage writes its layers' KV state at the current position into the directory `entry` (a disk
        checkpoint, engine/kvdisk.py); False when one could not (its log line says why)."""
        return self.engine._save_load(self, OP_SAVE, str(entry), len(self.tokens))

    def load_state(self, entry: str | os.PathLike[str], tokens: Sequence[int]) -> bool:
        """This fresh session becomes the one saved in `entry`, holding `tokens`; False when any stage's file is
        missing, corrupt or saved for other layers: the session is then closed (other stages may hold their
        part), take a new one."""
        if self.tokens:
            raise ValueError("a KV state loads into a fresh session only")
        if not self.engine._save_load(self, OP_LOAD, str(entry), len(tokens)):
            self.close()
            return False
        self.tokens = list(tokens)
        return True

    def kv_bytes(self) -> int:
        """KV bytes of this session over all stages (each stage allocates the formula for its layers)."""
        return self.engine.session_kv_bytes

    def close(self) -> None:
        self._finalizer()


class Engine:
    """Rank 0 of a route: stage 0 in this process, one worker process (local or remote) per further stage."""

    def __init__(self, *, path: str, gguf: GGUFFile, route: Route, ctx: int, chunk: int, rollback: int, sessions: int,
                 kv_dtype: str, activation_bits: int, heartbeat_timeout: float, step_timeout: float | None,
                 verify_rows: int = 0, mtp: str = "") -> None:
        from .tokenizer import Tokenizer

        self.path, self.route, self.cfg = path, route, gguf.config
        self.ctx, self.chunk, self.rollback, self.kv_dtype_name = ctx, chunk, rollback, kv_dtype
        self.sessions = sessions
        self.verify_rows = verify_rows
        self.mtp = mtp  # StageSettings.mtp
        self.kv_dtype = KV_DTYPES[kv_dtype]
        self.activation_bits = activation_bits
        self.heartbeat_timeout, self.step_timeout = heartbeat_timeout, step_timeout
        self.tokenizer = Tokenizer.from_metadata(gguf.metadata)
        self.world = len(route)
        self.labels = [stage_label(i, s) for i, s in enumerate(route.stages)]
        self.session_kv_bytes = sum(kv_bytes(self.cfg, s.layers, ctx, dtype_name(self.kv_dtype), chunk=chunk,
                                             rollback=rollback) for s in route.stages)
        self.device = torch.device("cpu")
        self.runner: StageRunner | None = None
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.down: dict[int, str] = {}
        self.backend = "gloo"
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._address = ""
        self._link: Link | None = None
        self._pg: Any = None
        self._waiter: _Waiter | None = None
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()  # one pipeline operation at a time
        self._sids = itertools.count(1)
        self._released: list[int] = []
        self._closed = False
        # at garbage collection or interpreter exit without close(): still stop every started process
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, 2.0)

    # ---- loading -----------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike[str], ctx: int = 4096, route: str | Route | None = None, *,
             device: str = "auto", sessions: int = 1, chunk: int | None = None, rollback: int = 0,
             expert_cache: int | str | None = None, activation_bits: int = 16, kv_dtype: str = "float32",
             compute: str = "auto", warm: bool = True, progress: Callable[[int, int], None] | None = None,
             dist_addr: str = "127.0.0.1:0", remote: Iterable[int] = (), threads: int | None = None,
             prefetch: bool = True, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
             join_timeout: float = DEFAULT_JOIN_TIMEOUT, step_timeout: float | None = 600.0,
             round_trips: RoundTrips = RoundTrips(), verify_rows: int = 0, mtp: str | None = None) -> Engine:
        """Load `route` (text form, a .toml file or a Route; default: one stage on `device`, in this process).
        `sessions`: KV slots every stage allocates (live sessions at once); `chunk`: the prefill piece (None:
        per device, see default_chunk). `expert_cache` is the routed-expert cache of every stage that does not
        set its own `cache=`. Workers of the ranks in `remote` are not started here: they join with `ds4station
        worker --coordinator ADDR --rank N` (ADDR is `dist_addr`, printed when the engine waits for them).
        `compute` forces the stage backend (stage.choose_backend decides by default); `warm=False` skips the
        warm-up; `progress(loaded_bytes, total_bytes)` reports stage 0's weights as they load; `verify_rows`
        (a token and its drafts, with speculative decoding) has the warm-up capture the verification's graphs;
        `mtp`: load the MTP layer for `Session.draft` (MTP_IN_MODEL: from the model file, else the path of its
        own GGUF), on the stage that holds the output head."""
        path = str(path)
        gguf = GGUFFile.open(path)
        route = check_settings(gguf, ctx, route, expert_cache, activation_bits, device)
        mtp = check_mtp(gguf, mtp)
        chunk = default_chunk(route.stages[0].device) if chunk is None else chunk
        if chunk < 1 or rollback < 0:
            raise ValueError(f"prefill chunk {chunk} / rollback {rollback}: use a chunk >= 1 and a rollback >= 0")
        if sessions < 1:
            raise ValueError("at least one KV session is needed (sessions >= 1)")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        remote = sorted(set(remote))
        bad = [r for r in remote if not 0 < r < len(route)]
        if bad:
            raise RouteError(f"remote rank(s) {bad}: workers are ranks 1-{len(route) - 1} of this route")
        engine = cls(path=path, gguf=gguf, route=route, ctx=ctx, chunk=chunk, rollback=rollback, sessions=sessions,
                     kv_dtype=kv_dtype, activation_bits=activation_bits, heartbeat_timeout=heartbeat_timeout,
                     step_timeout=step_timeout, verify_rows=verify_rows, mtp=mtp)
        try:
            engine._start(gguf, remote, dist_addr, threads, prefetch, join_timeout, round_trips, compute, warm,
                          progress)
        except BaseException:
            engine.close()
            raise
        return engine

    def _start(self, gguf: GGUFFile, remote: list[int], dist_addr: str, threads: int | None, prefetch: bool,
               join_timeout: float, round_trips: RoundTrips, compute: str, warm: bool,
               progress: Callable[[int, int], None] | None) -> None:
        import datetime

        import torch.distributed as dist

        route = self.route
        devices = [s.device for s in route.stages]
        distinct_gpus = all(d != "cpu" for d in devices) and len(set(devices)) == len(devices)
        self.backend = "nccl" if distinct_gpus and torch.cuda.is_available() and self.world > 1 else "gloo"
        self.device = resolve_device(route.stages[0].device)
        settings = StageSettings(model=str(Path(self.path).resolve()), route=str(route), ctx=self.ctx,
                                 chunk=self.chunk, rollback=self.rollback, sessions=self.sessions,
                                 kv_dtype=self.kv_dtype_name, backend=self.backend, prefetch=prefetch,
                                 fp8_kv=round_trips.fp8_kv, indexer_fp4=round_trips.indexer_fp4, compute=compute,
                                 warm=warm, world=self.world, verify_rows=self.verify_rows, mtp=self.mtp)
        if self.world > 1:
            host, _, port = dist_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"distributed address {dist_addr!r}: expected HOST:PORT (port 0 = any free port)")
            self._store = dist.TCPStore(host.strip("[]"), int(port), None, True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=30))
            connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host.strip("[]")
            self._address = f"{connect_host}:{self._store.port}"
            self._store.set("config", settings.to_json())
            cpu_stages = sum(1 for s in route.stages if s.device == "cpu")
            per_worker = threads or max(1, (os.cpu_count() or 1) // max(1, cpu_stages))
            for rank in range(1, self.world):
                if rank not in remote:
                    self.procs[rank] = self._spawn(rank, per_worker)
            if remote:
                shown = socket.getfqdn() if host in ("0.0.0.0", "::", "[::]") else host
                print(f"ds4station: waiting for remote stage(s) {', '.join(self.labels[r] for r in remote)}; on each "
                      f"host run: ds4station worker --coordinator {shown}:{self._store.port} --rank N",
                      file=sys.stderr, flush=True)
        self.runner = StageRunner(gguf, route.stages[0], settings, self.device, rank=0, progress=progress)
        if self.world == 1:
            return
        self._await_ready(join_timeout)
        pg = make_process_group(self.backend, self._store, 0, self.world, self.device)
        self._link = Link(pg, self.backend, self.device)
        self._pg = pg
        self._waiter = _Waiter(poll=self.backend == "nccl")
        self._monitor = threading.Thread(target=self._watch, name="pipeline-monitor", daemon=True)
        self._monitor.start()

    def _spawn(self, rank: int, threads: int) -> subprocess.Popen[bytes]:
        env_updates, local_device = pin_env(self.route.stages[rank].device)
        env = {**os.environ, **env_updates}
        # the child must import this very package, wherever it was imported from here
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "ds4station.commands.worker", "--coordinator", self._address, "--rank",
               str(rank), "--device", local_device, "--threads", str(threads), "--parent-pid", str(os.getpid())]
        # its own session: a Ctrl-C in the terminal reaches the coordinator, which then stops the workers
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def _await_ready(self, join_timeout: float) -> None:
        """Wait until every worker has loaded its stage; a worker that fails names the reason."""
        deadline = time.monotonic() + join_timeout
        waiting = set(range(1, self.world))
        while waiting:
            for rank in sorted(waiting):
                with self._store_lock:
                    if self._store.check([f"error/{rank}"]):
                        raise RuntimeError(self._store.get(f"error/{rank}").decode())
                    if self._store.check([f"ready/{rank}"]):
                        waiting.discard(rank)
                        continue
                proc = self.procs.get(rank)
                if proc is not None and proc.poll() is not None:
                    raise StageDown(rank, self.labels[rank], f"the worker exited with code {proc.returncode} while "
                                                             "loading (its output is above)")
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(self.labels[r] for r in sorted(waiting))} did not join within "
                                   f"{join_timeout:.0f} s")
            time.sleep(0.05)

    # ---- liveness ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Every 0.2 s: local workers still running? every worker's heartbeat counter still moving?"""
        import datetime

        import torch.distributed as dist

        host, _, port = self._address.rpartition(":")
        store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=10))
        seen = {r: (-1, time.monotonic()) for r in range(1, self.world)}
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for rank in range(1, self.world):
                if rank in self.down:
                    continue
                proc = self.procs.get(rank)
                if proc is not None and proc.poll() is not None:
                    self._mark_down(rank, f"the worker process exited with code {proc.returncode}", store)
                    continue
                try:
                    beats = int(store.add(f"hb/{rank}", 0))
                except Exception as e:  # our own store failing: nothing sensible to watch any more
                    self._mark_down(rank, f"the coordinator's store failed: {e}", None)
                    continue
                if beats != seen[rank][0]:
                    seen[rank] = (beats, now)
                elif now - seen[rank][1] > self.heartbeat_timeout:
                    self._mark_down(rank, f"no heartbeat for {now - seen[rank][1]:.1f} s (hung, or its host is "
                                          "unreachable)", store)

    def _mark_down(self, rank: int, reason: str, store: Any) -> None:
        if store is not None:
            try:
                if store.check([f"error/{rank}"]):
                    reason += f"; it reported: {store.get(f'error/{rank}').decode()}"
            except Exception:
                pass
        self.down.setdefault(rank, reason)

    def _raise_if_down(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self.down:
            rank = min(self.down)
            raise StageDown(rank, self.labels[rank], self.down[rank])

    def _await(self, pending: list[_Pending], peer: int) -> None:
        """Wait for these operations, never longer than liveness allows; `peer` is blamed for a failure the
        monitor cannot attribute."""
        start = time.monotonic()
        for p in pending:
            while not p.done.wait(0.05):
                self._raise_if_down()
                if self.step_timeout is not None and time.monotonic() - start > self.step_timeout:
                    self.down.setdefault(peer, f"no answer within {self.step_timeout:.0f} s")
                    self._raise_if_down()
            if p.error is not None:
                self._lost(peer, p.error)

    def _lost(self, peer: int, error: BaseException) -> None:
        """A connection broke: give the monitor a moment to tell which stage went away, then raise."""
        t0 = time.monotonic()
        while not self.down and time.monotonic() - t0 < 2.0:
            time.sleep(0.05)
        self.down.setdefault(peer, f"connection lost ({str(error).splitlines()[0][:200]})")
        self._raise_if_down()

    def _isend(self, t: torch.Tensor, dst: int) -> _Pending:
        assert self._link is not None and self._waiter is not None
        try:
            work, keep = self._link.isend(t, dst)
        except RuntimeError as e:  # gloo refuses at once when the connection is already closed
            self._lost(dst, e)
            raise
        return self._waiter.submit(work, keep)

    def _irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> tuple[_Pending, torch.Tensor]:
        assert self._link is not None and self._waiter is not None
        try:
            work, buf = self._link.irecv(shape, dtype, src)
        except RuntimeError as e:
            self._lost(src, e)
            raise
        return self._waiter.submit(work, buf), buf

    def health(self) -> str | None:
        """None while every stage is up, else why the first stage that went down is down."""
        if not self.down:
            return None
        rank = min(self.down)
        return f"pipeline {self.labels[rank]} is down: {self.down[rank]}"

    # ---- sessions ----------------------------------------------------------------------------------
    @property
    def queues_steps(self) -> bool:
        """True when `Session.extend` returns before its step has run: one stage in this process on a CUDA
        device, whose graph replays and kernels are queued. The decode loop then makes and sends a token's text
        while the next step runs. (A route of several stages waits for the last one's answer.)"""
        return self.world == 1 and self.device.type == "cuda"

    @property
    def decodes_ahead(self) -> bool:
        """True when `decode_batch` queues a step whose tokens are still on the device (the previous step's
        picks): a stage that queues its steps (`queues_steps`) with its experts resident and no MTP layer (which
        records the token ids), unless DS4STATION_DECODE_AHEAD=0. The decode loop then queues the next step before
        it reads the tokens, so the GPU does not wait for the host between two steps: 0.3-1.2 ms less per step
        at 1-8 streams on a GPU-bound step (docs/PERFORMANCE.md, fortieth session)."""
        runner = self.runner
        return (self.queues_steps and runner is not None and runner.mtp is None and runner.experts is None
                and os.environ.get("DS4STATION_DECODE_AHEAD", "1") != "0")

    def new_session(self, activation_bits: int | None = None) -> Session:
        bits = self.activation_bits if activation_bits is None else activation_bits
        if bits not in ACTIVATION_BITS:
            raise ValueError(f"activation bits {bits}: use 16 or 32")
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            sid = next(self._sids)
            assert self.runner is not None
            self.runner.new_session(sid)
            self._broadcast(header(OP_NEW, sid))
        return Session(self, sid, bits)

    def _release(self, sid: int) -> None:  # a finalizer: any thread, any time; applied at the next operation
        self._released.append(sid)

    def _flush_released(self) -> None:
        while self._released:
            sid = self._released.pop()
            if self.runner is not None:
                self.runner.free(sid)
            if not self.down and not self._closed:
                self._broadcast(header(OP_FREE, sid))

    def _broadcast(self, hdr: torch.Tensor) -> list[_Pending]:
        """Send a header down the chain (each worker applies and forwards it); -> the pending send."""
        if self.world == 1:
            return []
        return [self._isend(hdr, 1)]

    def _extend(self, session: Session, tokens: list[int], chunk: int | None, every: bool = False) -> torch.Tensor:
        if not tokens:
            raise ValueError("extend needs at least one token")
        if every and len(tokens) > self.chunk:
            raise ValueError(f"a verification of {len(tokens)} tokens exceeds the prefill chunk {self.chunk}")
        runner = self.runner
        assert runner is not None
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            cache = runner.kv[session.sid]
            if cache.length + len(tokens) > self.ctx:  # checked before any stage moves
                raise ValueError(f"context full: {cache.length} + {len(tokens)} tokens exceed ctx {self.ctx}; "
                                 "start a new session or load with a larger --ctx")
            step = self.chunk if chunk is None else max(1, min(chunk, self.chunk))
            bits = session.activation_bits
            ids = torch.as_tensor(tokens, dtype=torch.long)
            pending: list[_Pending] = []
            logits: torch.Tensor | None = None
            # rank 0 applies the head and holds the MTP layer: each piece's last states come back to be recorded
            tails = self.world > 1 and runner.mtp is not None
            received: list[tuple[int, int, torch.Tensor]] = []  # (first position, rows, buffer) per piece
            p0 = cache.length
            for s in range(0, len(tokens), step):
                piece = ids[s: s + step]
                final = s + step >= len(tokens)
                out = runner.step(session.sid, piece, None, all_logits=every)
                if self.world == 1:  # the stage holds the head: `out` is the last position's logits
                    logits = out if final else None
                    continue
                payload = pack(piece, out, bits)
                flags = (FLAG_RESULT if final else 0) | (FLAG_ALL if every else 0) | (FLAG_TAIL if tails else 0)
                hdr = header(OP_EXTEND, session.sid, piece.numel(), bits, flags, payload=payload.numel())
                for t in (hdr, payload):
                    pending.append(self._isend(t, 1))
                if tails:
                    k = tail_rows(piece.numel(), every, self.cfg)
                    done, buf = self._irecv((payload_bytes(k, bits, self.cfg.hc_mult, self.cfg.dim),), torch.uint8,
                                            self.world - 1)
                    pending.append(done)
                    received.append((p0 + s + piece.numel() - k, k, buf))
            if tails:
                self._await(pending, self.world - 1)
                assert runner.mtp is not None
                for start, k, buf in received:
                    rows, X = unpack(buf, k, bits, self.cfg.hc_mult, self.cfg.dim)
                    runner.mtp.record(session.sid, start, rows, X)
                logits = runner.head(X if every else X[-1:])
                logits = logits if every else logits[0]
            elif self.world > 1:
                logits = self._result(bits, pending, len(tokens) if every else None)
            session.tokens += tokens
        assert logits is not None
        return logits

    def _result(self, bits: int, pending: list[_Pending], rows: int | None = None,
                record: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Receive the last stage's answer to the final piece: logits, or the state for our head (given to
        `record` first). -> [vocab]; with `rows` (a batched step) [rows, vocab]."""
        assert self.runner is not None
        last = self.world - 1
        cfg, n = self.cfg, rows or 1
        if self.route.stages[last].output:
            done, buf = self._irecv((n, cfg.vocab_size), torch.float32, last)
        else:
            done, buf = self._irecv((payload_bytes(n, bits, cfg.hc_mult, cfg.dim),), torch.uint8, last)
        pending.append(done)
        self._await(pending, last)
        if not self.route.stages[last].output:
            _, X = unpack(buf, n, bits, cfg.hc_mult, cfg.dim)
            if record is not None:
                record(X)
            buf = self.runner.head(X)
        return buf if rows else buf[0]

    def decode_batch(self, sessions: Sequence[Session], tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """One decode step of several sessions at once, token b appended to sessions[b] -> logits [B, vocab]
        (row b what `sessions[b].extend([tokens[b]])` gives). Every stage runs the B tokens as one batched
        step (kernel stages read each weight once for all of them), pipelined like a prefill piece.
        `tokens` may be a tensor [B] where the previous step's logits are (the picks of its sampler, queued
        behind it): each session's token is then the value its caller `resolve`s (read from a host copy it
        started before this call), and where `decodes_ahead` the step is queued without the host reading them
        (elsewhere they are read on the way: they travel to the next stage, or the MTP layer records them)."""
        runner = self.runner
        assert runner is not None
        ahead = isinstance(tokens, torch.Tensor)
        if ahead:
            tokens = tokens.reshape(-1).long()
            if self.world > 1 or runner.mtp is not None:
                tokens = tokens.cpu()
        if len(sessions) != len(tokens) or not sessions:
            raise ValueError(f"decode_batch needs one token per session ({len(tokens)} tokens, {len(sessions)} "
                             "sessions)")
        bits = {s.activation_bits for s in sessions}
        if len(bits) != 1:
            raise ValueError("a batched step carries one activation width: these sessions use " +
                             " and ".join(map(str, sorted(bits))))
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            for s in sessions:
                if runner.kv[s.sid].length + 1 > self.ctx:  # checked before any stage moves
                    raise ValueError(f"context full: {runner.kv[s.sid].length} + 1 tokens exceed ctx {self.ctx}; "
                                     "start a new session or load with a larger --ctx")
            sids = [s.sid for s in sessions]
            ids = tokens if ahead else torch.as_tensor(list(tokens), dtype=torch.long)
            p0 = [runner.kv[sid].length for sid in sids]
            out = runner.step_batch(sids, ids, None)
            if self.world == 1:
                logits = out
            else:
                b = bits.pop()
                body = pack(ids, out, b)
                body = torch.cat((torch.as_tensor(sids, dtype=torch.int64).view(torch.uint8).to(body.device), body))
                pending = [self._isend(t, 1) for t in (header(OP_BATCH, 0, len(sids), b, FLAG_RESULT,
                                                              payload=body.numel()), body)]
                # the MTP layer beside rank 0's head records the states the head reads
                record = None if runner.mtp is None else (lambda X: runner.record_batch(sids, p0, ids, X))
                logits = self._result(b, pending, len(sids), record)
            for b, s in enumerate(sessions):
                if ahead:
                    s._feed_ahead(ids[b])
                else:
                    s.tokens.append(int(tokens[b]))
        return logits

    @property
    def verify_rows_per_step(self) -> int:
        """The most rows (tokens and drafts over all requests) `verify_batch` takes in one step, 0 where it is
        not offered (a route of several stages verifies each request on its own)."""
        return SHORT_ROWS[-1] if self.world == 1 else 0

    def verify_batch(self, sessions: Sequence[Session], tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Several sessions' `verify` at once (tokens[i]: session i's token and its drafts), on a route of one
        stage: the kernel stage runs every row in one step (each weight read once for all of them), within
        `verify_rows_per_step`. -> each session's logits [n_i, vocab]; the caller truncates what it rejects."""
        runner = self.runner
        assert runner is not None
        if self.world != 1:
            raise ValueError("verify_batch runs on a route of one stage; verify each session on its own")
        if len(sessions) != len(tokens) or not sessions or any(not t for t in tokens):
            raise ValueError("verify_batch needs one non-empty token list per session")
        if len({s.sid for s in sessions}) != len(sessions):
            raise ValueError("verify_batch holds each session once")
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            for s, t in zip(sessions, tokens, strict=True):
                if runner.kv[s.sid].length + len(t) > self.ctx:  # checked before anything moves
                    raise ValueError(f"context full: {runner.kv[s.sid].length} + {len(t)} tokens exceed ctx "
                                     f"{self.ctx}; start a new session or load with a larger --ctx")
            outs = runner.verify_batch([s.sid for s in sessions], [list(t) for t in tokens])
            for s, t in zip(sessions, tokens, strict=True):
                s.tokens += [int(x) for x in t]
        return outs

    @property
    def has_mtp(self) -> bool:
        """Loaded with the MTP layer: sessions can `draft`."""
        return bool(self.mtp)

    def draft_batch(self, sessions: Sequence[Session], tokens: Sequence[int], ks: Sequence[int]) -> list[list[int]]:
        """Several sessions' `draft` at once (session i: up to ks[i] tokens after tokens[i]): where rank 0 holds
        the MTP layer (one stage, or the head applied here) in one step of the layer for all of them; on a route
        whose last stage holds it, one session after another."""
        runner = self.runner
        assert runner is not None
        if not self.mtp:
            raise RuntimeError("this engine was loaded without the MTP layer (Engine.load(..., mtp=...))")
        if len(sessions) != len(tokens) or len(sessions) != len(ks):
            raise ValueError(f"draft_batch needs one token and one draft length per session ({len(sessions)} "
                             f"sessions, {len(tokens)} tokens, {len(ks)} lengths)")
        if len({s.sid for s in sessions}) != len(sessions):
            raise ValueError("draft_batch holds each session once")
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            if runner.mtp is not None:
                return runner.draft([s.sid for s in sessions], [int(t) for t in tokens], [int(k) for k in ks])
            last, out = self.world - 1, []  # the MTP layer is on the last stage, beside the head
            for s, t, k in zip(sessions, tokens, ks, strict=True):
                if k <= 0:
                    out.append([])
                    continue
                pending = self._broadcast(header(OP_DRAFT, s.sid, k, arg=int(t)))
                done, buf = self._irecv((k,), torch.int64, last)
                pending.append(done)
                self._await(pending, last)
                out.append([int(x) for x in buf.tolist() if x >= 0])
            return out

    def _truncate(self, session: Session, n: int) -> bool:
        assert self.runner is not None
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            # every stage's cache has the same length and slack, so stage 0 decides for all of them
            if not self.runner.truncate(session.sid, n):
                return False
            self._broadcast(header(OP_TRUNCATE, session.sid, arg=n))
            return True

    def _checkpoint(self, session: Session) -> None:
        assert self.runner is not None
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            self.runner.checkpoint(session.sid)
            self._broadcast(header(OP_CHECKPOINT, session.sid))

    def _rewind(self, session: Session, n: int) -> int:
        assert self.runner is not None
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            k = self.runner.rewind(session.sid, n)  # every stage's cache agrees: stage 0 decides for all
            if k >= 0:
                self._broadcast(header(OP_REWIND, session.sid, arg=k))
            return k

    def _save_load(self, session: Session, op: int, entry: str, n: int) -> bool:
        assert self.runner is not None
        with self._lock:
            self._raise_if_down()
            self._flush_released()
            ok = (self.runner.save_state(session.sid, entry) if op == OP_SAVE
                  else self.runner.load_state(session.sid, entry, n))
            if self.world > 1:  # every further stage does its part and ORs its failure into the header
                body = _path_payload(entry)
                pending = [self._isend(t, 1) for t in (header(op, session.sid, arg=n, payload=body.numel()), body)]
                done, ack = self._irecv((HEADER_LEN,), torch.int64, self.world - 1)
                pending.append(done)
                self._await(pending, self.world - 1)
                ok = ok and not int(ack[4]) & FLAG_FAILED
            return ok

    def drop_state(self, entry: str | os.PathLike[str]) -> None:
        """Every stage removes its file of a disk checkpoint (each stage's directory may be on its own machine)."""
        assert self.runner is not None
        with self._lock:
            if self.down or self._closed:
                return
            self.runner.drop_state(str(entry))
            if self.world > 1:
                body = _path_payload(entry)
                for t in (header(OP_DROP, payload=body.numel()), body):
                    self._isend(t, 1)

    def state_identity(self) -> dict[str, Any]:
        """What a disk checkpoint must have been saved by to be loaded here: the model file's contents, each
        stage's layers, compute and device kind, the KV dtype and activation bits."""
        stats = self.stage_stats(refresh=False)
        stages = [[s.first_layer, s.last_layer + 1, st.get("compute"), str(st.get("torch_device", "")).split(":")[0]]
                  for s, st in zip(self.route.stages, stats, strict=True)]
        return {"model": fingerprint(self.path), "stages": stages, "kv_dtype": self.kv_dtype_name,
                "activation_bits": self.activation_bits}

    def state_bytes(self, n: int) -> int:
        """The most bytes a disk checkpoint of n positions takes over the route (state + file headers)."""
        from .kvdisk import HEADER_MAX

        return state_bytes(self.cfg, None, n, dtype_name(self.kv_dtype)) + self.world * (HEADER_MAX + 12)

    # ---- reporting ---------------------------------------------------------------------------------
    def stage_stats(self, refresh: bool = True) -> list[dict[str, Any]]:
        """Every stage's statistics (KV bytes per session, expert cache), in stage order. `refresh` asks the
        workers to publish theirs first (a round trip through the pipeline); otherwise what they last
        published is read (what /status does, from another thread)."""
        assert self.runner is not None
        if refresh and self.world > 1:
            with self._lock:
                self._raise_if_down()
                self._flush_released()
                pending = self._broadcast(header(OP_STATUS))
                pending.append(self._irecv((HEADER_LEN,), torch.int64, self.world - 1)[0])
                self._await(pending, self.world - 1)
        out = [self.runner.stats()]
        for rank in range(1, self.world):
            try:
                with self._store_lock:
                    out.append(json.loads(self._store.get(f"stats/{rank}")))
            except Exception as e:
                out.append({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        return out

    def status(self) -> dict[str, Any]:
        """What /status and /health show: route, per-stage state and memory, expert-cache totals, health."""
        stats = self.stage_stats(refresh=False)
        stages = []
        for rank, (stage, st) in enumerate(zip(self.route.stages, stats, strict=True)):
            proc = self.procs.get(rank)
            stages.append({**st, "stage": rank, "device": stage.device,
                           "layers": [stage.first_layer, stage.last_layer + 1],
                           "state": "down" if rank in self.down else "up", "reason": self.down.get(rank),
                           "pid": st.get("pid", proc.pid if proc else None),
                           "remote": rank > 0 and rank not in self.procs})
        caches = [s["expert_cache"] for s in stats if s.get("expert_cache")]
        total = None
        if caches:
            keys = ("lookups", "hits", "misses", "bytes_read", "prefetched", "evictions", "capacity_bytes")
            total = {k: sum(int(c[k]) for c in caches) for k in keys}
            total["stream_s"] = round(sum(float(c.get("stream_s", 0.0)) for c in caches), 4)
            total["gb_per_s"] = round(total["bytes_read"] / total["stream_s"] / 1e9, 3) if total["stream_s"] else 0.0
        return {"route": str(self.route), "backend": self.backend, "activation_bits": self.activation_bits,
                "stages": stages, "expert_cache": total, "health": self.health()}

    # ---- shutdown ----------------------------------------------------------------------------------
    def close(self, grace: float = 5.0) -> None:
        """Stop every worker this engine started (asked to shut down, then terminated, then killed)."""
        if self._closed:
            return
        asked = False
        if self.world > 1 and self._link is not None and not self.down:
            try:
                with self._lock:
                    pending = self._broadcast(header(OP_SHUTDOWN))
                    asked = pending[0].done.wait(2.0)
            except Exception:  # best effort: the processes are stopped below either way
                pass
        if asked and self._pg is not None:  # every stage acknowledged: all ranks release the group together
            shutdown_process_group(self._pg)
        self._closed = True
        self._stop.set()
        # a broken pipeline cannot shut down in order: no point waiting for the workers to finish
        _stop_processes(self.procs, grace if asked else 0.0)
        self._finalizer.detach()
        if self._waiter is not None:
            self._waiter.close()
        if self.down and self._pg is not None:
            try:  # NCCL kernels waiting on a dead peer would spin forever
                self._pg.abort()
            except Exception:
                pass
        # Release the process group here, in this thread, once its waits are over; left to interpreter
        # exit, a group with broken connections can abort the process ("terminate called ...").
        self._link = None
        self._pg = None
        if self.runner is not None:
            self.runner.close()
        self._store = None  # the store's server goes with it: remote workers notice and exit

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _path_payload(entry: str | os.PathLike[str]) -> torch.Tensor:
    """A disk checkpoint's directory as the uint8 payload of OP_SAVE / OP_LOAD / OP_DROP."""
    return torch.frombuffer(bytearray(str(entry).encode()), dtype=torch.uint8)


def _stop_processes(procs: dict[int, subprocess.Popen[bytes]], grace: float) -> None:
    """Give the workers `grace` seconds to finish (they were asked to shut down), then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace
    for proc in procs.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)  # a stopped (hung) worker only acts on SIGTERM once resumed
    for proc in procs.values():
        try:
            proc.wait(3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- helpers -------------------------------------------------------------------------------------------
def resolve_route(route: str | Route | None, n_layers: int, expert_cache: int | str | None = None,
                  device: str = "cpu") -> Route:
    """The route to run: the text form or a .toml file of [[stages]] (planner/route.py), or one stage on
    `device`; `expert_cache` fills in the cache of every stage that does not set its own."""
    if route is None:
        route = f"{device}=embed,0-{n_layers - 1},output"
    if isinstance(route, str) and route.strip().endswith(".toml"):
        toml = Path(route.strip())
        if not toml.is_file():
            raise RouteError(f"route file {toml} does not exist")
        route = route_from_toml(toml.read_text(), n_layers)
    r = parse_route(route, n_layers) if isinstance(route, str) else route
    if r.n_layers != n_layers:
        raise RouteError(f"the route covers {r.n_layers} layers, the model has {n_layers}")
    default = parse_size(expert_cache) if expert_cache not in (None, "", 0) else 0
    if default:
        r = Route(tuple(s if s.expert_cache_bytes else Stage(s.device, s.first_layer, s.last_layer, s.embed,
                                                             s.output, default) for s in r.stages), n_layers)
    last = len(r) - 1
    if r.output_stage not in (0, last):
        raise RouteError(f"the output head is on stage {r.output_stage}; put it on the first stage (with the "
                         f"embedding, the usual place) or on the last stage")
    return r


def check_expert_caches(gguf: GGUFFile, route: Route) -> None:
    """Refuse, before anything starts, a streaming stage whose cache cannot hold one layer's expert table, or
    whose layers store their experts in different types (one pool of slots holds one form)."""
    cfg = gguf.config
    for rank, stage in enumerate(route.stages):
        if not stage.streaming:
            continue
        kinds = {i: tuple(gguf.specs[expert_name(i, p)].qtype.name for p in PARTS) for i in stage.layers}
        if len(set(kinds.values())) > 1:
            first = next(i for i in stage.layers if kinds[i] != kinds[stage.first_layer])
            raise RouteError(f"{stage_label(rank, stage)} streams experts of layers {stage.first_layer}-"
                             f"{stage.last_layer}, stored as {'/'.join(kinds[stage.first_layer])} up to layer "
                             f"{first - 1} and {'/'.join(kinds[first])} from layer {first}: one expert cache holds "
                             f"one form; split the stage at layer {first} (two stages may share a device)")
        tensors = load_tensors(gguf, stage.layers, embed=False, output=False)
        need = min_cache_bytes(tensors, stage.layers)
        if stage.expert_cache_bytes < need:
            raise ExpertCacheTooSmall(too_small_message(stage.expert_cache_bytes, cfg.n_experts,
                                                        need // cfg.n_experts, f"{stage_label(rank, stage)}: "))


def check_mtp(gguf: GGUFFile, mtp: str | os.PathLike[str] | None) -> str:
    """The MTP layer (serve --draft mtp, --mtp FILE): MTP_IN_MODEL when the model file holds it,
    or the resolved path of its own GGUF, checked against the model's MTP layout (GGUFError names a missing or
    malformed tensor); "" for none. It runs beside the output head, on the stage that holds it
    (`Route.output_stage`)."""
    if not mtp:
        return ""
    if str(mtp) == MTP_IN_MODEL:
        if not gguf.has_mtp:
            raise GGUFError(f"{gguf.path}: the model file has no MTP layer (no {MTP_PREFIX}* tensors); give the "
                            "layer's own GGUF (--mtp FILE, e.g. `ds4station pull mtp`) or write a model with "
                            "`make-model --mtp`")
        return MTP_IN_MODEL
    path = Path(mtp).resolve()
    GGUFFile.open_mtp(path, gguf.config).release()
    return str(path)


def default_device() -> str:
    """What `--device auto` means: the first GPU torch sees (CUDA, or ROCm's HIP, which torch calls cuda
    too), else the CPU."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def default_chunk(device: str) -> int:
    """The prefill piece for a route whose first stage is on `device`: DEFAULT_GPU_CHUNK on a GPU (the chunk
    the bench measures at; H200: 1,661 tok/s at 2048 against 225 at 256 through the API), DEFAULT_CHUNK
    on the CPU (the reference's temporaries grow with the chunk and it gains nothing from a larger one)."""
    return DEFAULT_CHUNK if device == "cpu" else DEFAULT_GPU_CHUNK


def check_settings(model: GGUFFile | str | os.PathLike[str], ctx: int, route: str | Route | None = None,
                   expert_cache: int | str | None = None, activation_bits: int = 16, device: str = "auto") -> Route:
    """Validate the context, route, expert cache and activation bits against the file's header before anything
    loads (what `serve` checks before it starts listening). Raises RouteError / ExpertCacheTooSmall /
    ValueError with the message for the user; -> the route to run (one stage on `device` when none is given;
    `auto` resolved)."""
    gguf = model if isinstance(model, GGUFFile) else GGUFFile.open(model)
    limit = gguf.config.context_length
    if not 0 < ctx <= limit:
        raise ValueError(f"--ctx {ctx} is outside this model's context: use 1 to {limit:,} tokens")
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"--activation-bits {activation_bits}: use 16 or 32")
    device = default_device() if device == "auto" else "cuda:0" if device == "cuda" else device
    resolved = resolve_route(route, gguf.config.n_layers, expert_cache, device)
    first = resolved.stages[0].device  # the stage this process runs
    if first != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"device {first}: torch sees no GPU on this machine (CPU-only build, or no driver); use "
                         "--device cpu or auto")
    check_expert_caches(gguf, resolved)
    return resolved


__all__ = ["DEFAULT_GPU_CHUNK", "Engine", "Session", "StageDown", "check_expert_caches",
           "check_settings", "default_chunk", "default_device", "resolve_route"]
