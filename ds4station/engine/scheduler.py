"""The request scheduler: one engine worker thread, a bounded request queue, and live KV sessions.

The scheduler owns everything between "a list of prompt token ids" and "a stream of text pieces":
- one worker thread runs the engine (torch is driven from one thread only); it also loads the engine, so
  the HTTP server answers /health while the weights load, and runs two short requests of its own before it
  says ready (first-use costs paid before the first client);
- requests beyond the running one wait in a bounded queue; a full queue raises `QueueFull` at once so
  the server can answer 503 + Retry-After instead of piling up work;
- up to `max_sessions` live KV states are kept; each request is served from the session with the longest
  common token prefix and only the suffix is prefilled (in chunks, checking for cancellation between
  chunks); a session that cannot roll back far enough (`truncate` returns False) is re-prefilled;
- the decode loop samples, detokenizes incrementally, applies stop tokens / stop strings / max tokens,
  and checks the request's cancel flag before every step, so a client that goes away stops the
  generation within one decode step; on an engine that queues its steps (`queues_steps`: one local CUDA
  stage) each sampled token is fed to the next step before its text is made and sent, so the two overlap;
- a finished turn is settled (its answer fed into the live KV as the next prompt will spell it) when no
  request arrives within SETTLE_GRACE, so settling never delays an unrelated request; a request that
  continues the turn before then settles it first (that prefill is its own work), so what it reuses does
  not depend on how fast the client came back;
- every finished request reports llama.cpp-style timings (cache_n, prompt_n, prompt_ms, predicted_n,
  predicted_ms), its cached prefix length and how the pool chose it (`Reuse`) to every observer (metrics,
  the request trace);
- supervision: when the engine reports a stage down (`health()`), the running and queued requests end with
  an error, and the worker closes the engine and loads it again (`max_restarts` attempts, with a doubling
  backoff, each logged to stderr); meanwhile the state is "restarting" and new requests are refused
  (`NotReady`), after the last failed attempt it is "failed" with the reason;
- `drain(grace)` (a graceful shutdown) refuses new requests, lets the open ones finish for up to `grace`
  seconds, then ends them with an error, so every open stream gets an error event instead of a cut.

The engine interface is deliberately narrow (`GenerationEngine` / `EngineSession` below): engine/engine.py's
`Engine` is what runs, on any route.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .sampler import Sampler, SamplingParams, StopScanner

# ---------------------------------------------------------------------------------------------------
# The engine interface the scheduler needs, and nothing more.


class EngineSession(Protocol):
    """One live KV state. `tokens` are the ids already in the KV, in order."""

    tokens: list[int]

    def extend(self, tokens: Sequence[int], chunk: int = ...) -> torch.Tensor:
        """Append tokens to the KV; return the logits of the last position ([vocab])."""

    def truncate(self, n: int) -> bool:
        """Keep only the first n tokens; False when the state cannot roll back that far."""

    def checkpoint(self) -> None:
        """Keep the state of the current position for `rewind`."""

    def rewind(self, n: int) -> int:
        """Roll back to n tokens, or else to the checkpoint when it is at or before n: -> the tokens kept,
        -1 (unchanged) when neither can be done."""

    def kv_bytes(self) -> int: ...

    def close(self) -> None:
        """Give the KV state back to the engine (its slot is reused by the next new session)."""


class GenerationEngine(Protocol):
    """What the scheduler and server use of an engine: a tokenizer (encode / decode / stream_decoder /
    eos_id) and sessions. Optional extras the server shows when present: `cfg` (ModelConfig), `device`,
    and `status() -> dict` with `route`, `stages`, `expert_cache` and `health` (None, or why a stage is down)."""

    tokenizer: Any

    def new_session(self) -> EngineSession: ...


# An engine may also offer `health() -> str | None` (None while every stage is up): the scheduler polls it to
# restart a route whose stage died, and `close()`, called when the scheduler stops or restarts it.


class Detokenizer(Protocol):
    """Incremental ids -> text; holds back bytes of an incomplete UTF-8 character."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


# ---------------------------------------------------------------------------------------------------
# Requests and the events they stream back.


class QueueFull(RuntimeError):
    """The bounded request queue is full; the server answers 503 with Retry-After."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("the server is busy: the request queue is full; retry later")
        self.retry_after = retry_after


class NotReady(RuntimeError):
    """The engine is loading, restarting, failed, or the server is shutting down."""


@dataclass
class Forced:
    """A guide's directive: append exactly these tokens (they count as generated output)."""

    tokens: list[int]


@dataclass
class Allowed:
    """A guide's directive: sample the next token from these ids only (bool mask over the vocabulary)."""

    mask: torch.Tensor


class Guide(Protocol):
    """Steers generation (e.g. a forced tool call): asked before every step, told every accepted token."""

    def next(self) -> Forced | Allowed | None: ...

    def accept(self, token: int) -> None: ...


@dataclass
class Timings:
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        """llama.cpp's `timings` object."""
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_token_ms": round(self.prompt_ms / self.prompt_n, 3) if self.prompt_n else 0.0,
            "prompt_per_second": round(1000.0 * self.prompt_n / self.prompt_ms, 3) if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_token_ms": round(self.predicted_ms / self.predicted_n, 3) if self.predicted_n else 0.0,
            "predicted_per_second": (round(1000.0 * self.predicted_n / self.predicted_ms, 3)
                                     if self.predicted_ms > 0 else 0.0),
        }


@dataclass
class Job:
    """One generation request as the worker sees it."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # its max_tokens / stop are not used
    stop: list[str] = field(default_factory=list)
    stop_tokens: set[int] = field(default_factory=set)
    banned_tokens: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's logit_bias, added before sampling
    guide: Guide | None = None
    kind: str = "chat"  # label for metrics / status only

    id: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = 0.0
    ended: str | None = None  # why the server ended it (set with `cancel`): it finishes as an error, not cancelled


@dataclass
class Prefill:
    """Progress of the prompt prefill (lets the server keep a stream alive during a long prefill)."""

    done: int
    total: int
    cached: int


@dataclass
class Text:
    text: str
    tokens: int  # tokens this piece accounts for


@dataclass
class Reuse:
    """How the session pool served a prompt (SessionPool.acquire decides; the request trace records it)."""

    outcome: str  # "hit" (a live prefix reused) | "miss" (prefilled from scratch) | "reset" (a rollback failed)
    why: str
    discarded: int = 0  # tokens of the chosen session's divergent tail thrown away


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    queue_ms: float
    ttft_ms: float  # from being queued to the first generated token
    error: str | None = None
    stop_string: str | None = None  # the stop string that ended generation, if one did
    reuse: Reuse | None = None  # None when the request never reached the engine
    output: list[int] = field(default_factory=list)  # the generated token ids, in order

    @property
    def cached_tokens(self) -> int:
        return self.timings.cache_n


Event = Prefill | Text | Finished


WARM = "warm"  # the kind of the scheduler's own warm-up jobs (never recorded)
# Seconds a finished turn waits for the next request before the worker settles it (see Scheduler._next).
SETTLE_GRACE = 0.05
# Seconds between the idle worker's looks at the engine's health (a stage that dies between requests).
HEALTH_POLL = 0.25
# Seconds `drain` waits for the requests it ended to report back (an engine stuck in a step cannot).
END_WAIT = 5.0
SHUTTING_DOWN = "the server is shutting down"


class _Discard:
    """Where a warm-up job's events go: nowhere."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def _post(self, event: Event) -> None:
        pass


class Handle:
    """The async side of one submitted job: iterate its events, or cancel it."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished: Finished | None = None

    def _post(self, event: Event) -> None:  # called from the worker thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            self.job.cancel.set()

    def cancel(self) -> None:
        self.job.cancel.set()

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` passes first (the caller sends a keep-alive)."""
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(event, Finished):
            self.finished = event
        return event

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.next()
            assert event is not None
            yield event
            if isinstance(event, Finished):
                return


# ---------------------------------------------------------------------------------------------------
# Live KV sessions


@dataclass
class LiveSession:
    session: EngineSession
    last_used: float = 0.0
    requests: int = 0
    unsettled: tuple[int, list[int]] | None = None  # (prompt length, generated tokens) of a turn to settle

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionPool:
    """Up to `capacity` live KV states and the policy that picks one for a prompt.

    - The session with the longest common token prefix wins (ties: the most recently used).
    - A session the prompt merely extends is used as is.
    - Otherwise truncating it in place throws away its divergent tail; that is done only when the session
      holds the whole prompt (a retry) or when it keeps at least as much as it discards (an edit of the same
      conversation). An unrelated prompt (say another agent sharing only the system prompt) takes a free
      slot instead, so it never destroys another agent's session while a slot is free; with no slot free
      it takes the least recently used one.
    - Further back than the rollback allows, a session whose prompt checkpoint (taken at the end of every
      prompt) lies within the shared prefix goes back to it: the next turn of a conversation reuses the
      whole earlier prompt whatever came after it (the client dropped the reasoning, edited the answer).
    - When the chosen session cannot roll back that far (`rewind` -1: its state is unchanged), it is
      kept as it is, for a later prompt that continues it (an agent's main conversation, when a side request
      edited it further back than the rollback allows), and the prompt is prefilled from scratch in a free
      slot, else in the least recently used other one; with a single slot, that slot starts again.
    """

    def __init__(self, engine: GenerationEngine, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("at least one live KV session is needed (--sessions >= 1)")
        self.engine = engine
        self.capacity = capacity
        self.slots: list[LiveSession] = []
        self.hits = 0  # requests that reused a cached prefix
        self.misses = 0
        self.resets = 0  # truncations that failed and fell back to a fresh prefill
        self.checkpoint_hits = 0  # hits served from a session's prompt checkpoint, beyond the rollback

    def acquire(self, prompt: Sequence[int]) -> tuple[LiveSession, int, Reuse]:
        """The session to serve `prompt` from, truncated to the reused prefix; that prefix's length; and why."""
        limit = max(len(prompt) - 1, 0)  # at least one token must be prefilled to get logits
        scored = [(min(common_prefix(s.tokens, prompt), limit), s.last_used, s) for s in self.slots]
        scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
        free = len(self.slots) < self.capacity
        chosen: tuple[int, LiveSession, str] | None = None
        taken = False  # the chosen session is given up (not kept for a prompt that continues it)
        if scored:
            common, _, best = scored[0]
            discard = len(best.tokens) - common
            # in place: a pure extension, a retry of a prompt the session already holds whole, or an edit
            # that keeps at least as much as it throws away
            if discard == 0:
                chosen = (common, best, "the prompt extends a live session")
            elif common > 0 and common == limit:
                chosen = (common, best, "a live session holds the whole prompt (a retry)")
            elif common > 0 and common >= discard:
                chosen = (common, best, "an edit: the live session keeps at least as much as it rolls back")
            elif not free:  # the least recently used session is given up for this prompt
                lru = min(self.slots, key=lambda s: s.last_used)
                chosen = (min(common_prefix(lru.tokens, prompt), limit), lru,
                          "no free slot: the least recently used session was taken")
                taken = True
        if chosen is None:
            live = LiveSession(self.engine.new_session())
            self.slots.append(live)
            why = "no live session shares a prefix worth keeping: a free slot" if scored else "no live session"
            chosen = (0, live, why)
        common, live, why = chosen
        discarded = len(live.tokens) - common
        kept_to = live.session.rewind(common) if discarded > 0 else common
        reach = max(getattr(self.engine, "chunk", 0), getattr(self.engine, "rollback", 0))  # what truncate reaches
        if kept_to >= 0 and discarded > reach:  # beyond the rollback: the session's prompt checkpoint served
            why = f"{why}; {discarded} tokens back is beyond the rollback: from its prompt checkpoint at {kept_to}"
            discarded += common - kept_to
            common = kept_to
            self.checkpoint_hits += kept_to > 0
        outcome = "hit" if common > 0 else "miss"
        if kept_to < 0:  # its state is unchanged: it may be kept
            self.resets += 1
            others = [s for s in self.slots if s is not live]
            victim: LiveSession | None
            if taken:  # given up for this prompt anyway
                victim, kept = live, "that slot started again"
            elif len(self.slots) < self.capacity:  # kept for a prompt that continues it
                victim, kept = None, "the live session kept, a free slot used"
            elif others:  # likewise, at the cost of the least recently used other one
                victim = min(others, key=lambda s: s.last_used)
                kept = "the live session kept, the least recently used other one replaced"
            else:
                victim, kept = live, "its only slot started again"
            if victim is None:
                live = LiveSession(self.engine.new_session())
                self.slots.append(live)
            else:
                victim.session.close()  # give its KV back before taking a new one
                live = self.slots[self.slots.index(victim)] = LiveSession(self.engine.new_session())
            outcome, why, common = "reset", f"{why}, but it cannot roll back {discarded} tokens: prefilled from " \
                f"scratch ({kept})", 0
        if common > 0:
            self.hits += 1
        else:
            self.misses += 1
        live.last_used = time.monotonic()
        live.requests += 1
        return live, common, Reuse(outcome, why, discarded)

    def drop(self, live: LiveSession) -> None:
        """Forget a session whose state can no longer be trusted (the engine failed while extending it)."""
        if live in self.slots:
            self.slots.remove(live)
            live.session.close()

    def describe(self) -> list[dict[str, Any]]:
        """Called from the HTTP thread while the worker runs: reads only, tolerates a slot being replaced."""
        now = time.monotonic()
        out = []
        for s in list(self.slots):
            session = s.session
            if session is not None:
                out.append({"tokens": len(session.tokens), "kv_bytes": int(session.kv_bytes()),
                            "requests": s.requests, "idle_s": round(now - s.last_used, 3)})
        return out


# ---------------------------------------------------------------------------------------------------
# The scheduler


@dataclass
class RequestRecord:
    """What /status shows about a finished request."""

    id: int
    kind: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_per_second: float
    predicted_per_second: float
    ttft_ms: float
    total_ms: float  # queued to finished
    finished_at: float


class Scheduler:
    """Runs jobs one at a time on the engine in a dedicated thread; see the module docstring."""

    def __init__(self, loader: Callable[[], GenerationEngine], *, sessions: int = 2, max_queue: int = 16,
                 prefill_chunk: int = 256, ctx: int | None = None,
                 detokenizer: Callable[[GenerationEngine], Detokenizer] | None = None,
                 observers: Sequence[Callable[[Job, Finished], None]] = (), owns_engine: bool = True,
                 max_restarts: int = 0, restart_backoff: float = 1.0) -> None:
        """`observers` are called from the worker thread with every finished request (metrics, the request
        trace; append to `observers` before `start`). `max_restarts`: attempts to load the engine again after a
        stage went down (0: the scheduler stays failed), the first after `restart_backoff` seconds, each
        further one after twice as long as the one before. `owns_engine=False`: `stop` (and a restart) leave
        the loaded engine open (tests share one between schedulers)."""
        self._loader = loader
        self.owns_engine = owns_engine
        self.capacity = sessions
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.ctx = ctx
        self._make_detok = detokenizer or _default_detokenizer
        self.observers = list(observers)
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.engine: GenerationEngine | None = None
        self.pool: SessionPool | None = None
        self.state = "loading"  # loading | ready | restarting | failed | stopping | stopped
        self.load_error: str | None = None  # why the first load failed (nothing was ever served)
        self.error: str | None = None
        self.restart: dict[str, Any] | None = None  # while restarting: the attempt, its limit, the reason
        self.restarts = 0  # restarts that brought the engine back
        self.load_progress: tuple[int, int] | None = None  # (loaded, total) weight bytes while loading
        self.ready = threading.Event()
        self._queue: queue.Queue[tuple[Job, Handle] | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._warm_ids = itertools.count(1)
        self._running: dict[str, Any] | None = None
        self.recent: deque[RequestRecord] = deque(maxlen=32)
        self.totals = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                       "cancelled": 0, "errors": 0}
        self._thread = threading.Thread(target=self._main, name="ds4-engine", daemon=True)
        self._idle = threading.Event()  # set while the worker waits for work (nothing running or settling)
        # `state` and the submitted-but-unfinished jobs change under this lock; waiters hear of every finish
        self._guard = threading.Condition()
        self._open: dict[int, tuple[Job, Handle]] = {}
        self._closing = threading.Event()  # drain or stop: no restarts any more

    def report_load(self, loaded: int, total: int) -> None:
        """Progress callback for the loader (engine.Engine.load's `progress`)."""
        self.load_progress = (loaded, total)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        """Start the worker (it loads the engine first); starting twice is harmless."""
        if not self._thread.is_alive() and self.state == "loading":
            self._thread.start()
        return self

    def drain(self, grace: float, now: threading.Event | None = None) -> None:
        """A graceful shutdown: refuse new requests (NotReady), let the submitted ones finish for up to `grace`
        seconds (or until `now` is set), then end the rest with an error, so every open stream ends with an
        error event rather than a cut connection; returns once they reported back (END_WAIT at most: an engine
        stuck in a step cannot). Call `stop` afterwards."""
        now = now or threading.Event()
        with self._guard:
            self._closing.set()
            if self.state not in ("failed", "stopped"):
                self.state = "stopping"
            deadline = time.monotonic() + grace
            while self._open and not now.is_set() and (left := deadline - time.monotonic()) > 0:
                self._guard.wait(min(left, 0.1))
            if not self._open:
                return
            when = "at once" if now.is_set() else f"after the {grace:g} s grace period"
            _log(f"shutting down: ending {len(self._open)} request(s) still open {when}")
            for job, _ in self._open.values():
                job.ended = SHUTTING_DOWN
                job.cancel.set()
            deadline = time.monotonic() + END_WAIT
            while self._open and (left := deadline - time.monotonic()) > 0:
                self._guard.wait(min(left, 0.1))

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel queued work and stop the worker after the running step."""
        self._closing.set()
        if self._running is not None:
            self._running["job"].cancel.set()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel.set()
                self._finish_unstarted(*item, reason="cancelled")
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._discard_engine()  # the live KV back, and the engine stops its worker processes
        with self._guard:
            if self.state != "failed":
                self.state = "stopped"

    # ---- submitting ------------------------------------------------------------------------------
    def submit(self, job: Job) -> Handle:
        """Queue a job; its events arrive on the returned handle. Raises NotReady or QueueFull."""
        with self._guard:
            if self.state != "ready":
                raise NotReady(self.unavailable())
            handle = Handle(job, asyncio.get_running_loop())
            job.id = -next(self._warm_ids) if job.kind == WARM else next(self._ids)  # clients' ids count from 1
            job.queued_at = time.monotonic()
            try:
                self._queue.put_nowait((job, handle))
            except queue.Full:
                raise QueueFull(retry_after=self._retry_after()) from None
            self._open[job.id] = (job, handle)
        return handle

    def unavailable(self) -> str:
        """Why requests are refused while the state is not "ready" (what NotReady and /health say)."""
        if self.state == "stopping":
            return SHUTTING_DOWN
        if self.state == "restarting" and self.restart is not None:
            r = self.restart
            return (f"the route is restarting after a failure ({r['reason']}), attempt {r['attempt']} of "
                    f"{r['attempts']}: retry shortly")
        if self.state == "loading":
            return "the model is loading"
        return self.error or f"the model is {self.state}"

    def _retry_after(self) -> int:
        """Seconds a client should wait: the queue length times the recent mean request time (at least 1)."""
        times = [r.total_ms / 1000.0 for r in self.recent] or [1.0]
        return max(1, int(round(self.queue_length() * sum(times) / len(times))))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the worker has nothing to do (finished requests also settle their KV after replying)."""
        return self._idle.wait(timeout)

    def queue_length(self) -> int:
        return self._queue.qsize()

    # ---- the worker ------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._load()
        except Exception as e:  # a missing or damaged model file: /health says why (and serve exits)
            self._discard_engine()
            with self._guard:
                self.error = f"loading the model failed: {type(e).__name__}: {e}"
                self.load_error = self.error
                self.state = "failed"
            self.ready.set()
            return
        with self._guard:
            if self.state == "loading":  # not if a drain began meanwhile
                self.state = "ready"
        self.ready.set()
        while True:
            item = self._next()
            self._idle.clear()
            if item is None:
                return
            if isinstance(item, str):  # a stage went down while the worker waited
                self._recover(item)
                continue
            job, handle = item
            if self.state == "failed":  # queued while a restart was giving up
                job.ended = self.unavailable()
                job.cancel.set()
            if job.cancel.is_set():
                self._finish_unstarted(job, handle, reason="cancelled")
                continue
            try:
                self._run(job, handle)
            except Exception as e:
                # The engine failed on this request: report it to the client; keep serving others, or, when a
                # stage is down, restart the route (the state says so before the client hears of the error).
                traceback.print_exc()
                self._running = None
                down = self._down()
                error = f"{type(e).__name__}: {e}"
                if down is not None:
                    self._begin_recovery(down)
                    if self.state == "restarting":
                        error += "; the route is restarting: retry shortly"
                self._conclude(job, handle, Finished("error", len(job.prompt), 0, Timings(), 0.0, 0.0,
                                                     error=error))
                if down is not None:
                    self._recover(down)

    def _load(self) -> None:
        self.engine = self._loader()
        self.pool = SessionPool(self.engine, self.capacity)
        self._warm()
        # A full collection now, while nobody waits: the warm-up's garbage goes and the collector's counts
        # start from zero, so the next full pass (~75-80 ms over the demo model's ~250K live objects on a
        # CI CPU) does not land on the first requests. (gc.freeze() also made every later pass cheap, but
        # /health under 20 MiB request bodies then stalled past 100 ms in some test-suite runs.)
        gc.collect()

    def _discard_engine(self) -> None:
        """Give the live KV back and close the engine (when it is ours); nothing is left to serve from."""
        engine, pool = self.engine, self.pool
        self.engine, self.pool = None, None
        if pool is not None:
            for live in list(pool.slots):
                pool.drop(live)
        close = getattr(engine, "close", None)  # the engine stops its worker processes
        if close is not None and self.owns_engine:
            try:
                close()
            except Exception:  # a broken engine may fail to close in order; its processes are stopped anyway
                traceback.print_exc()

    def _down(self) -> str | None:
        """Why the engine is down (a stage died or hangs), or None while it is up or cannot tell."""
        health = getattr(self.engine, "health", None)
        if not callable(health):
            return None
        try:
            return health()
        except Exception as e:
            return f"the engine's health check failed: {type(e).__name__}: {e}"

    def _begin_recovery(self, reason: str) -> None:
        with self._guard:
            if self.state != "ready":  # already recovering, failed, or shutting down (no restart then)
                return
            if self.max_restarts and not self._closing.is_set():
                self.state = "restarting"
                self.restart = {"attempt": 1, "attempts": self.max_restarts, "reason": reason}
            else:
                self.state, self.error = "failed", reason

    def _recover(self, reason: str) -> None:
        """A stage is down: end every queued request, close the engine and load it again, up to `max_restarts`
        times with a doubling backoff (each attempt logged); "failed" with the reason when none succeeds."""
        self._begin_recovery(reason)
        self._fail_queued(reason if self.state == "stopping" else self.unavailable())
        if self.state != "restarting":
            return
        self._discard_engine()
        last = ""
        for attempt in range(1, self.max_restarts + 1):
            delay = self.restart_backoff * 2 ** (attempt - 1)
            with self._guard:
                self.restart = {"attempt": attempt, "attempts": self.max_restarts, "reason": reason,
                                "next_try_at": round(time.time() + delay, 3)}
            _log(f"{reason}: restarting the route in {delay:g} s (attempt {attempt} of {self.max_restarts})")
            if self._closing.wait(delay):
                return
            t0 = time.monotonic()
            try:
                self._load()
            except Exception as e:
                last = f"{type(e).__name__}: {e}"
                _log(f"restart attempt {attempt} of {self.max_restarts} failed: {last}")
                self._discard_engine()
                continue
            with self._guard:
                if self._closing.is_set():
                    return
                self.state, self.error, self.restart = "ready", None, None
                self.restarts += 1
            _log(f"the route is serving again (restart attempt {attempt}, loaded in {time.monotonic() - t0:.1f} s)")
            return
        with self._guard:
            self.state, self.restart = "failed", None
            self.error = (f"{reason}; the route did not come back after {self.max_restarts} restart attempt(s) "
                          f"(last: {last}); restart serve")
        _log(self.error)

    def _fail_queued(self, error: str) -> None:
        stop = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # stop() is waiting for the worker: keep its sentinel
                stop = True
                continue
            job, handle = item
            job.ended = error
            self._finish_unstarted(job, handle, reason="cancelled")
        if stop:
            self._queue.put_nowait(None)

    def _warm(self) -> None:
        """Before ready: two short requests through the whole loop (prefill, a biased greedy pick and a
        seeded draw, detokenizing, settling), so the first real request meets no first-use costs (lazily
        loaded GPU kernels, first calls into the tokenizer); nothing of them stays in the pool or the stats."""
        tok = self.engine.tokenizer  # type: ignore[union-attr]
        prompt = [tok.bos_id, *tok.encode("warm up", allow_special=False)]
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=0)):
            job = Job(prompt=prompt, max_tokens=2, sampling=sampling, stop_tokens={tok.eos_id},
                      banned_tokens=[tok.eos_id], logit_bias={tok.bos_id: -1.0}, kind=WARM)
            self._run(job, _Discard(job))  # type: ignore[arg-type]

    def _next(self) -> tuple[Job, Handle] | str | None:
        """The next queued item, or why the engine is down when a stage died while the worker waited. Turns
        still to settle wait for SETTLE_GRACE first: a request arriving right after the previous one (an
        agent's next call, another agent) is served before them, and the settling is only done when the
        worker would otherwise wait."""
        while True:
            unsettled = [live for live in (self.pool.slots if self.pool else []) if live.unsettled]
            if not unsettled:
                if self._queue.empty():
                    self._idle.set()
                try:
                    return self._queue.get(timeout=HEALTH_POLL)
                except queue.Empty:
                    down = self._down() if self.state == "ready" else None
                    if down is not None:
                        return down
                    continue
            try:
                return self._queue.get(timeout=SETTLE_GRACE)
            except queue.Empty:
                for live in unsettled:
                    self._settle_turn(live)

    def _settle_turn(self, live: LiveSession, want: Sequence[int] | None = None) -> None:
        turn, live.unsettled = live.unsettled, None
        if turn is None or live.session is None:
            return
        try:
            self._settle(live.session, *turn, want=want)
        except Exception:  # the client has its answer already; only this live KV is lost
            traceback.print_exc()
            assert self.pool is not None
            self.pool.drop(live)

    def _finish_unstarted(self, job: Job, handle: Handle, reason: str) -> None:
        fin = Finished(reason, len(job.prompt), 0, Timings(), (time.monotonic() - job.queued_at) * 1000, 0.0)
        self._conclude(job, handle, fin)

    def _conclude(self, job: Job, handle: Handle, fin: Finished) -> None:
        """Report a finished job: to the observers and the stats, to its client, and to `drain`."""
        if fin.reason == "cancelled" and job.ended:
            fin.reason, fin.error = "error", job.ended
        self._record(job, fin)
        handle._post(fin)
        with self._guard:
            self._open.pop(job.id, None)
            self._guard.notify_all()

    def _run(self, job: Job, handle: Handle) -> None:
        assert self.pool is not None and self.engine is not None
        started = time.monotonic()
        counts = (self.pool.hits, self.pool.misses, self.pool.resets, self.pool.checkpoint_hits)
        for waiting in list(self.pool.slots):
            # a request that continues a turn not settled yet (it came within SETTLE_GRACE): settle it now
            # when the prompt spells the answer as settling would; that prefill is this request's own work
            if waiting.unsettled and common_prefix(waiting.tokens, job.prompt) >= waiting.unsettled[0]:
                self._settle_turn(waiting, job.prompt)
        live, cached, reuse = self.pool.acquire(job.prompt)
        live.unsettled = None  # taken as it is: the prompt's common prefix with what the KV holds is reused
        try:
            self._generate(job, handle, live, cached, reuse, started)
        except Exception:
            self.pool.drop(live)  # a half-extended KV must not serve a later prefix
            raise
        finally:
            if job.kind == WARM:  # a warm-up leaves no session and no count behind
                self.pool.drop(live)
                self.pool.hits, self.pool.misses, self.pool.resets, self.pool.checkpoint_hits = counts

    def _generate(self, job: Job, handle: Handle, live: LiveSession, cached: int, reuse: Reuse,
                  started: float) -> None:
        assert self.engine is not None
        queue_ms = (started - job.queued_at) * 1000
        session = live.session
        todo = job.prompt[cached:]
        timings = Timings(cache_n=cached, prompt_n=len(todo))
        self._running = {"job": job, "phase": "prefill", "prompt_tokens": len(job.prompt), "cached": cached,
                         "done": 0, "generated": 0, "t0": started, "t_decode": None}
        outputs: list[int] = []  # every generated token, in order

        def finish(reason: str, completion: int, ttft_ms: float, stop_string: str | None = None) -> Finished:
            fin = Finished(reason, len(job.prompt), completion, timings, queue_ms, ttft_ms, stop_string=stop_string,
                           reuse=reuse, output=list(outputs))
            self._running = None
            self._conclude(job, handle, fin)
            return fin

        # ---- chunked prefill: the cancel flag is checked between chunks
        logits: torch.Tensor | None = None
        for start in range(0, len(todo), self.prefill_chunk):
            if job.cancel.is_set():
                timings.prompt_ms = (time.monotonic() - started) * 1000
                finish("cancelled", 0, 0.0)
                return
            logits = session.extend(todo[start:start + self.prefill_chunk])
            self._running["done"] = start + len(todo[start:start + self.prefill_chunk])
            handle._post(Prefill(self._running["done"], len(todo), cached))
        assert logits is not None
        if logits.is_cuda:  # graph replays return before the GPU is done: the prompt ends when its logits do
            torch.cuda.current_stream(logits.device).synchronize()
        t_prompt = time.monotonic()
        timings.prompt_ms = (t_prompt - started) * 1000
        self._running["phase"], self._running["t_decode"] = "decode", t_prompt
        # the prompt's end: the next turn comes back here however far beyond --rollback this answer runs
        session.checkpoint()

        # ---- decode
        detok = self._make_detok(self.engine)
        sampler = Sampler(job.sampling)
        scanner = StopScanner(job.stop)
        raw: list[str] = []  # all decoded text, to name the stop string that matched
        bias: torch.Tensor | None = None  # banned tokens (-inf) and the client's logit_bias, built once
        if job.banned_tokens or job.logit_bias:
            bias = torch.zeros(logits.numel(), dtype=torch.float32, device=logits.device)
            for token, value in job.logit_bias.items():
                bias[token] = value
            bias[job.banned_tokens] = float("-inf")
        generated = 0
        ttft_ms = 0.0
        reason = "length"
        tail: list[int] = []  # accepted tokens not yet fed into the KV
        forced: deque[int] = deque()
        directive: Forced | Allowed | None = None
        matched: str | None = None
        # overlap host work with the GPU when the engine queues its steps (not under a guide, which decides
        # the next token from the accepted ones)
        queued = bool(getattr(self.engine, "queues_steps", False)) and job.guide is None

        def take(token: int) -> str | None:
            """Account for one generated token; the finish reason when it ends the generation."""
            nonlocal generated, ttft_ms, matched
            if job.guide is not None:
                job.guide.accept(token)
            generated += 1
            if generated == 1:
                ttft_ms = (time.monotonic() - job.queued_at) * 1000
            outputs.append(token)
            self._running["generated"] = generated
            if token in job.stop_tokens:
                return "stop"
            piece = detok.push(token)
            raw.append(piece)
            shown = scanner.feed(piece)
            if shown:
                handle._post(Text(shown, 1))
            if scanner.stopped:
                text = "".join(raw)
                matched = min((s for s in job.stop if s and s in text), key=text.find)
                return "stop"
            return None

        while generated < job.max_tokens:
            if job.cancel.is_set():
                reason = "cancelled"
                break
            if tail:
                # one forward for everything accepted since the last one (a run of forced tokens is a prefill)
                logits = session.extend(tail, chunk=self.prefill_chunk)
                tail = []
            if not forced and job.guide is not None:
                directive = job.guide.next()
                if isinstance(directive, Forced):
                    forced.extend(directive.tokens)
            batch_fed = False
            if forced:
                batch = [forced.popleft() for _ in range(min(len(forced), job.max_tokens - generated))]
            else:
                step_logits = logits
                if bias is not None or isinstance(directive, Allowed):
                    step_logits = logits.float() + bias if bias is not None else logits.float().clone()
                    if isinstance(directive, Allowed):
                        step_logits[~directive.mask.to(step_logits.device)] = float("-inf")
                batch = [sampler(step_logits)]
                if queued and 0 < generated < job.max_tokens - 1:
                    # the next step is queued before this token's text is made and sent, so the two overlap
                    # (not for the first token, whose text goes out first); a token that ends the generation
                    # (a stop token or string) is then in the KV one step early, which settling rolls back
                    # like any other divergence
                    logits = session.extend(batch, chunk=self.prefill_chunk)
                    batch_fed = True
            ended = None
            for token in batch:
                if not batch_fed:
                    tail.append(token)
                ended = take(token)
                if ended:
                    break
            if ended:
                reason = ended
                break
        if not scanner.stopped and reason != "cancelled":
            rest = scanner.feed(detok.flush()) + scanner.flush()
            if rest:
                handle._post(Text(rest, 0))
        timings.predicted_n = generated
        timings.predicted_ms = (time.monotonic() - t_prompt) * 1000
        finish(reason, generated, ttft_ms, matched)
        if reason != "cancelled" and outputs:
            live.unsettled = (len(job.prompt), outputs)  # settled when the worker is idle (see _next)

    def _settle(self, session: EngineSession, prompt_len: int, outputs: list[int],
                want: Sequence[int] | None = None) -> None:
        """After the client has its answer: make the live KV hold this turn as the next prompt will spell it.

        The next request re-renders this turn from text and tokenizes it; sampled tokens need not be the
        tokenizer's canonical split of their own text (BPE could merge two sampled tokens into one), and the
        last sampled token (usually EOS) may be in the KV or not. Feeding the canonical tokens of the generated
        text keeps the whole turn inside the reusable prefix. The turn starts after a special token (the
        assistant opening), so its canonical split is independent of the prompt before it. `want`: the prompt
        of a request that continues this turn; nothing is done unless it spells the turn canonically too.
        """
        assert self.engine is not None
        tok = self.engine.tokenizer
        canon = tok.encode(tok.decode(outputs))
        if want is not None and list(want[prompt_len:prompt_len + len(canon)]) != canon:
            return  # the waiting request spells this turn otherwise: it takes the KV as it is
        same = common_prefix(canon, outputs)
        keep = prompt_len + same
        if self.ctx is not None and prompt_len + len(canon) > self.ctx:
            return
        if len(session.tokens) > keep and session.rewind(keep) < 0:
            return  # cannot roll back that far; the next turn re-prefills from the divergence
        rest = canon[len(session.tokens) - prompt_len:]
        if rest:
            session.extend(rest, chunk=self.prefill_chunk)

    def _record(self, job: Job, fin: Finished) -> None:
        if job.kind == WARM:
            return
        t = fin.timings
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += fin.prompt_tokens
        self.totals["cached_tokens"] += t.cache_n
        self.totals["completion_tokens"] += fin.completion_tokens
        self.totals["cancelled"] += fin.reason == "cancelled"
        self.totals["errors"] += fin.reason == "error"
        d = t.as_dict()
        self.recent.append(RequestRecord(job.id, job.kind, fin.reason, fin.prompt_tokens, t.cache_n,
                                         fin.completion_tokens, float(d["prompt_per_second"]),
                                         float(d["predicted_per_second"]), round(fin.ttft_ms, 3),
                                         round((time.monotonic() - job.queued_at) * 1000, 3), time.time()))
        for observe in self.observers:
            try:
                observe(job, fin)
            except Exception:  # metrics or the trace must never take the worker down
                traceback.print_exc()

    # ---- introspection ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        running = None
        if self._running is not None:
            r = self._running
            # the running phase's rate so far: what a panel shows while the request is still going
            decoding = r["phase"] == "decode" and r["t_decode"] is not None
            since = r["t_decode"] if decoding else r["t0"]
            elapsed = max(time.monotonic() - since, 1e-6)
            running = {"id": r["job"].id, "kind": r["job"].kind, "phase": r["phase"],
                       "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached"],
                       "prefilled": r["done"], "generated": r["generated"], "phase_s": round(elapsed, 3),
                       "tokens_per_second": round((r["generated"] if decoding else r["done"]) / elapsed, 2)}
        sessions = self.pool.describe() if self.pool is not None else []
        return {
            "state": self.state,
            "error": self.error,
            "restart": dict(self.restart) if self.restart else None,
            "restarts": self.restarts,
            "queue": {"length": self.queue_length(), "capacity": self.max_queue},
            "running": running,
            "sessions": {"capacity": self.capacity, "live": sessions,
                         "kv_bytes": sum(s["kv_bytes"] for s in sessions),
                         "prefix_hits": self.pool.hits if self.pool else 0,
                         "prefix_misses": self.pool.misses if self.pool else 0,
                         "resets": self.pool.resets if self.pool else 0,
                         "checkpoint_hits": self.pool.checkpoint_hits if self.pool else 0},
            "recent": [r.__dict__ for r in self.recent],
            "totals": dict(self.totals),
        }


def _default_detokenizer(engine: GenerationEngine) -> Detokenizer:
    return engine.tokenizer.stream_decoder()


def _log(message: str) -> None:
    print(f"ds4station: {message}", file=sys.stderr, flush=True)
