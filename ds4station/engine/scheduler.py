"""The request scheduler: one engine worker thread, a bounded request queue, and live KV sessions.

The scheduler owns everything between "a list of prompt token ids" and "a stream of text pieces":
- one worker thread runs the engine (torch is driven from one thread only); it also loads the engine, so
  the HTTP server answers /health while the weights load, and runs two short requests of its own before it
  says ready (first-use costs paid before the first client);
- continuous batching: up to `batch` requests run at once (each holds one live session); every scheduler
  step samples the running requests' next tokens (the previous step's logits), prefills prompt pieces within
  `prefill_budget` tokens (the shortest remaining prompt first; a prompt that ends samples its first token
  before the next piece is queued), then runs one batched decode step for every request that continues with
  one token (`decode_batch`: each weight read once for all of them). A new request joins at the next step
  (a GPU's unfinished prompt pieces are waited for between two steps, before new requests are admitted, so
  one that arrived while they ran joins at once) and a finished one leaves at the end of its step. Requests
  beyond the batch wait in a bounded queue; a full queue raises `QueueFull` at once so
  the server can answer 503 + Retry-After instead of piling up work. `steps` is the step log (who decoded,
  who prefilled how much) and `batch_totals` its counters;
- up to `max_sessions` live KV states are kept; each request is served from the idle session with the
  longest common token prefix and only the suffix is prefilled (a session that cannot roll back far enough
  is re-prefilled); the cancel flag is checked before every step, so a client that goes away stops its
  generation within one step;
- each request samples, detokenizes incrementally and applies stop tokens / stop strings / max tokens; on
  an engine that queues its steps (`queues_steps`: one local CUDA stage) the batched step is launched
  before the step's texts are made and sent, so the two overlap; where the engine `decodes_ahead` (by default) and every
  running request samples freely, it is launched before the step's tokens are read, fed them where they were
  picked (`_looks_ahead`), so the GPU never waits for the host between two decode steps;
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

from .draft import DRAFT_SOURCES, LOOKUP_CONTEXT, MAX_DRAFT_TOKENS, LookupDrafter, MtpDrafter
from .kvdisk import DiskKV, DiskSettings, common_prefix
from .sampler import HostRead, Sampler, SamplingParams, StopScanner, host_ints

# ---------------------------------------------------------------------------------------------------
# The engine interface the scheduler needs, and nothing more.


class EngineSession(Protocol):
    """One live KV state. `tokens` are the ids already in the KV, in order."""

    tokens: list[int]

    @property
    def length(self) -> int:
        """len(tokens), readable from another thread (it never waits for the device)."""

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
    draft_n: int = 0  # drafted tokens verified (speculative decoding)
    draft_n_accepted: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """llama.cpp's `timings` object (with its draft counters when the request was drafted for)."""
        drafts = {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted} if self.draft_n else {}
        return {**drafts,
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

    # "hit" (a live prefix reused) | "disk" (a disk checkpoint restored) | "miss" (prefilled from scratch) |
    # "reset" (a rollback failed)
    outcome: str
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
# Most tokens an idle worker settles before it looks at the queue again: a request arriving meanwhile waits for
# at most that piece (H200, Flash, docs/PERFORMANCE.md: a 352-token piece took 0.33 s, a 1,024-token one 0.65 s).
SETTLE_PIECE = 256
STATUS_STEPS = 64  # the last steps of the step log that /status lists
# Seconds between the idle worker's looks at the engine's health (a stage that dies between requests).
HEALTH_POLL = 0.25
# Seconds `drain` waits for the requests it ended to report back (an engine stuck in a step cannot).
END_WAIT = 5.0
SHUTTING_DOWN = "the server is shutting down"


class _Discard:
    """Where a warm-up job's events go: nowhere (its Finished is kept, to tell a failed warm-up)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.finished: Finished | None = None

    def _post(self, event: Event) -> None:
        if isinstance(event, Finished):
            self.finished = event


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
    busy: bool = False  # a running request holds it: no other prompt may be served from it meanwhile

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens


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
    - With disk checkpoints (`disk`, engine/kvdisk.py): when a saved prompt starts this one and holds at least
      `disk.min_gain` more tokens than the best live prefix, it is restored into a free slot, else into the
      least recently used idle one, and only the rest is prefilled (a conversation evicted by other agents'
      requests, or one from before a restart); an entry that fails to load is removed and the prompt served
      as without it.
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
        self.disk: DiskKV | None = None  # disk checkpoints, when the server keeps them

    def available(self) -> bool:
        """A prompt can be served now: a slot is free or a live session is not held by a running request."""
        return len(self.slots) < self.capacity or any(not s.busy for s in self.slots)

    def acquire(self, prompt: Sequence[int]) -> tuple[LiveSession, int, Reuse]:
        """The session to serve `prompt` from, truncated to the reused prefix; that prefix's length; and why.
        Sessions held by running requests are not candidates (see `available`)."""
        limit = max(len(prompt) - 1, 0)  # at least one token must be prefilled to get logits
        idle = [s for s in self.slots if not s.busy]
        scored = [(min(common_prefix(s.tokens, prompt), limit), s.last_used, s) for s in idle]
        scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
        free = len(self.slots) < self.capacity
        restored = self._restore(prompt, limit, scored[0][0] if scored else 0, idle, free)
        if restored is not None:
            return restored
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
                lru = min(idle, key=lambda s: s.last_used)
                chosen = (min(common_prefix(lru.tokens, prompt), limit), lru,
                          "no free slot: the least recently used session was taken")
                taken = True
        if chosen is None:
            live = self._fresh()
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
            others = [s for s in idle if s is not live]
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
            live = self._fresh(victim)
            outcome, why, common = "reset", f"{why}, but it cannot roll back {discarded} tokens: prefilled from " \
                f"scratch ({kept})", 0
        if common > 0:
            self.hits += 1
        else:
            self.misses += 1
        live.last_used = time.monotonic()
        live.requests += 1
        return live, common, Reuse(outcome, why, discarded)

    def _restore(self, prompt: Sequence[int], limit: int, common: int, idle: list[LiveSession],
                 free: bool) -> tuple[LiveSession, int, Reuse] | None:
        """A disk checkpoint restored for `prompt` when one beats the best live prefix `common` (see the class)."""
        if self.disk is None:
            return None
        found = self.disk.match(prompt, limit)
        if found is None or found[1] < common + self.disk.min_gain:
            return None
        entry, n = found
        live = self._fresh(None if free else min(idle, key=lambda s: s.last_used))
        where = "a free slot" if free else "the least recently used session's slot"
        if not self.disk.restore(entry, live.session.load_state):  # type: ignore[attr-defined]
            self.slots.remove(live)  # its session was closed and the entry removed: choose again without it
            return self.acquire(prompt)
        if n < entry.n and live.session.rewind(n) != n:  # within its checkpoint's margin: always can
            raise RuntimeError(f"a session restored at {entry.n} tokens could not go back to {n}")
        self.hits += 1
        live.last_used = time.monotonic()
        live.requests += 1
        return live, n, Reuse("disk", f"restored {entry.n} tokens from a disk checkpoint into {where}"
                                      + (f", back to {n}" if n < entry.n else "") + f" (the best live prefix held "
                                      f"{common})", entry.n - n)

    def _fresh(self, victim: LiveSession | None = None) -> LiveSession:
        """A new, empty session: in a free slot, or in `victim`'s (its KV given back first)."""
        if victim is None:
            live = LiveSession(self.engine.new_session())
            self.slots.append(live)
            return live
        victim.session.close()
        live = self.slots[self.slots.index(victim)] = LiveSession(self.engine.new_session())
        return live

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
                out.append({"tokens": session.length, "kv_bytes": int(session.kv_bytes()),
                            "requests": s.requests, "idle_s": round(now - s.last_used, 3)})
        return out


# ---------------------------------------------------------------------------------------------------
# The scheduler


@dataclass
class _Stream:
    """One admitted request as the worker thread runs it: its session, how far its prompt is, its decode
    state. Only the worker thread changes it (/status reads a snapshot)."""

    job: Job
    handle: Handle
    live: LiveSession
    cached: int
    reuse: Reuse
    started: float
    todo: list[int]  # the prompt's tokens after the reused prefix
    timings: Timings
    done: int = 0  # of `todo`, prefilled
    phase: str = "prefill"  # prefill | decode
    logits: torch.Tensor | None = None  # of the last token fed
    t_decode: float | None = None
    sampler: Sampler | None = None
    detok: Detokenizer | None = None
    scanner: StopScanner | None = None
    bias: torch.Tensor | None = None  # banned tokens and logit_bias over the vocabulary
    raw: list[str] = field(default_factory=list)  # all decoded text, to name the stop string that matched
    outputs: list[int] = field(default_factory=list)  # every generated token, in order
    feed: list[int] = field(default_factory=list)  # accepted at this step, fed to the engine at this step
    unshown: list[int] = field(default_factory=list)  # accepted at this step, text not made yet
    forced: deque[int] = field(default_factory=deque)
    directive: Forced | Allowed | None = None
    ttft_ms: float = 0.0
    ended: str | None = None  # why it ends at the end of this step
    matched: str | None = None  # the stop string that ended it
    drafter: LookupDrafter | MtpDrafter | None = None  # speculative decoding's draft source, when the server drafts
    drafts: list[int] = field(default_factory=list)  # the drafts verified at the last step, after its token
    rows: torch.Tensor | None = None  # that verification's logits [1 + drafts, vocab]
    step_start: int = 0  # len(outputs) before this step's tokens

    @property
    def generated(self) -> int:
        return len(self.outputs)

    def describe(self, now: float) -> dict[str, Any]:
        """What /status shows of it, with the running phase's rate so far (what a panel shows meanwhile)."""
        decoding = self.phase == "decode" and self.t_decode is not None
        elapsed = max(now - (self.t_decode if decoding and self.t_decode else self.started), 1e-6)
        return {"id": self.job.id, "kind": self.job.kind, "phase": self.phase, "prompt_tokens": len(self.job.prompt),
                "cached_tokens": self.cached, "prefilled": self.done, "generated": self.generated,
                "phase_s": round(elapsed, 3),
                "tokens_per_second": round((self.generated if decoding else self.done) / elapsed, 2)}


@dataclass
class StepRecord:
    """One scheduler step (the step log): the requests that decoded in its batched step or its verification (of
    one request's drafts, or of several requests' together: `verified` names those whose drafts it verified),
    the prompt tokens each prefilling
    request got, and where the worker thread's time went (milliseconds of host time, so on a
    GPU that queues its work they show where the worker waited for it: `wait_ms` for the previous step's
    prompt pieces, `prefill_ms` issuing this step's pieces (a prompt's end waits for its logits), `sample_ms`
    choosing the next tokens (waits for the previous decode's logits), `forward_ms` issuing the decode,
    `show_ms` detokenising and sending); `at` is its start on the monotonic clock."""

    step: int
    decoded: list[int]
    prefilled: dict[int, int]
    at: float = 0.0
    verified: list[int] = field(default_factory=list)  # of `decoded`, those whose drafts it verified
    wait_ms: float = 0.0
    prefill_ms: float = 0.0
    sample_ms: float = 0.0
    forward_ms: float = 0.0
    show_ms: float = 0.0
    total_ms: float = 0.0
    ahead: bool = False  # its decode step was queued before the tokens it feeds were read (Scheduler._looks_ahead)

    def describe(self) -> dict[str, Any]:
        return {"step": self.step, "at": round(self.at, 4), "decoded": self.decoded, "verified": self.verified,
                "ahead": self.ahead,
                "prefilled": {str(k): v for k, v in self.prefilled.items()},
                **{k: round(getattr(self, k), 3)
                   for k in ("wait_ms", "prefill_ms", "sample_ms", "forward_ms", "show_ms", "total_ms")}}


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
    queue_ms: float = 0.0  # queued to admitted (its first step next)


class Scheduler:
    """Runs jobs on the engine in a dedicated thread, batched; see the module docstring."""

    def __init__(self, loader: Callable[[], GenerationEngine], *, sessions: int = 2, max_queue: int = 16,
                 prefill_chunk: int = 256, ctx: int | None = None, batch: int | None = None,
                 prefill_budget: int | None = None,
                 detokenizer: Callable[[GenerationEngine], Detokenizer] | None = None,
                 observers: Sequence[Callable[[Job, Finished], None]] = (), owns_engine: bool = True,
                 max_restarts: int = 0, restart_backoff: float = 1.0, kv_disk: DiskSettings | None = None,
                 draft: str = "off", draft_tokens: int = 4, look_ahead: bool | None = None) -> None:
        """`observers` are called from the worker thread with every finished request (metrics, the request
        trace; append to `observers` before `start`). `max_restarts`: attempts to load the engine again after a
        stage went down (0: the scheduler stays failed), the first after `restart_backoff` seconds, each
        further one after twice as long as the one before. `owns_engine=False`: `stop` (and a restart) leave
        the loaded engine open (tests share one between schedulers). `batch`: requests running at once (each
        holds a session; default and at most `sessions`); `prefill_budget`: prompt tokens prefilled per step
        over all prefilling requests, between two decode steps of the running ones (default `prefill_chunk`,
        at most `prefill_chunk`); `kv_disk`: keep disk KV checkpoints (engine/kvdisk.py; the engine must offer
        `state_identity`, `state_bytes` and its sessions `save_state` / `load_state`); `draft`: speculative
        decoding's draft source ("off", "lookup": engine/draft.py), up to `draft_tokens` drafted tokens verified
        per step for each request without a guide (the engine's sessions must offer `verify`); `look_ahead`: queue
        each decode step before the tokens it feeds are read (see _looks_ahead; default: the engine's
        `decodes_ahead`; True needs an engine with `decode_batch` of a tensor)."""
        batch = sessions if batch is None else batch
        budget = prefill_chunk if prefill_budget is None else prefill_budget
        if not 1 <= batch <= sessions:
            raise ValueError(f"batch {batch}: use 1 to {sessions} (each running request holds one of the "
                             f"{sessions} KV session(s))")
        if not 1 <= budget <= prefill_chunk:
            raise ValueError(f"prefill budget {budget}: use 1 to the prefill chunk, {prefill_chunk} tokens")
        if draft not in DRAFT_SOURCES:
            raise ValueError(f"draft source {draft!r}: use one of {', '.join(DRAFT_SOURCES)}")
        if not 1 <= draft_tokens <= min(MAX_DRAFT_TOKENS, prefill_chunk - 1):
            raise ValueError(f"draft tokens {draft_tokens}: use 1 to {min(MAX_DRAFT_TOKENS, prefill_chunk - 1)}")
        self.draft, self.draft_tokens = draft, draft_tokens
        self.look_ahead = look_ahead
        self._loader = loader
        self.kv_disk = kv_disk
        self.owns_engine = owns_engine
        self.capacity = sessions
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.batch = batch
        self.prefill_budget = budget
        self._streams: list[_Stream] = []  # the running requests, in order of admission
        self._fence: Any = None  # a CUDA event after the last step's unfinished prompt pieces
        self._fence_ms = 0.0  # waited for it before the next step (between steps: see _main), for its record
        self._verified: list[int] = []  # the requests whose drafts this step verified
        self.steps: deque[StepRecord] = deque(maxlen=256)  # the step log
        self.batch_totals = {"steps": 0, "decode_steps": 0, "decode_rows": 0, "prefill_tokens": 0, "max_batch": 0,
                             "ahead_steps": 0}
        self.draft_totals = {"steps": 0, "drafted": 0, "accepted": 0}  # verifications, drafted / accepted tokens
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
        for stream in list(self._streams):
            stream.job.cancel.set()
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
            if not self._streams:
                item = self._next()
                self._idle.clear()
                if item is None:
                    return
                if isinstance(item, str):  # a stage went down while the worker waited
                    self._recover(item)
                    continue
                try:
                    self._admit(*item)
                except Exception as e:  # the engine went down while the session was being set up
                    self._engine_failed(e, item)
                    continue
            # the previous step's prompt pieces are done: a request that arrived while they ran joins this step
            try:
                self._wait_fence()
            except Exception as e:  # the device failed under them
                self._engine_failed(e)
                continue
            stopping = self._admit_queued()
            while self._streams:
                self._step_guarded()
                if not stopping:
                    break
            if stopping:
                return

    def _load(self) -> None:
        self.engine = self._loader()
        # never more live sessions than the engine has KV slots (an engine loaded with fewer than asked for)
        self.pool = SessionPool(self.engine, min(self.capacity, getattr(self.engine, "sessions", self.capacity)))
        self.batch = min(self.batch, self.pool.capacity)
        if self.draft == "mtp" and not getattr(self.engine, "has_mtp", False):
            raise RuntimeError("--draft mtp needs the model's MTP layer: load the engine with it (serve --mtp FILE, "
                               "or a model file that holds it)")
        self._warm()
        if self.kv_disk is not None:  # after the warm-up: its prompts are neither saved nor restored
            self.pool.disk = self.kv_disk.open(self.engine)
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
        seeded draw, detokenizing, settling), run together so that a batched step is warm too, so the first
        real request meets no first-use costs (lazily loaded GPU kernels, first calls into the tokenizer);
        nothing of them stays in the pool or the stats."""
        assert self.pool is not None
        tok = self.engine.tokenizer  # type: ignore[union-attr]
        prompt = [tok.bos_id, *tok.encode("warm up", allow_special=False)]
        sinks = [_Discard(Job(prompt=prompt, max_tokens=2, sampling=sampling, stop_tokens={tok.eos_id},
                              banned_tokens=[tok.eos_id], logit_bias={tok.bos_id: -1.0}, kind=WARM))
                 for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=0))]
        waiting = list(sinks)
        while waiting or self._streams:  # together when the batch has room for both
            while waiting and self._can_admit():
                sink = waiting.pop(0)
                self._admit(sink.job, sink)  # type: ignore[arg-type]
            self._step()
        for sink in sinks:
            if sink.finished is not None and sink.finished.reason == "error":
                raise RuntimeError(f"the warm-up request failed: {sink.finished.error}")

    def _next(self) -> tuple[Job, Handle] | str | None:
        """The next queued item, or why the engine is down when a stage died while the worker waited. Turns
        still to settle wait for SETTLE_GRACE first: a request arriving right after the previous one (an
        agent's next call, another agent) is served before them, and the settling is only done when the
        worker would otherwise wait, one piece (SETTLE_PIECE tokens, or the prefill budget when smaller) at a
        time, so that a request arriving meanwhile waits for one piece at most (a random model's answers
        re-tokenise to several times their length: eight of them took 12 s to settle in one go on the H200)."""
        settling = False
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
                # after the grace, only a look between pieces: a request that comes meanwhile goes first
                return self._queue.get(timeout=SETTLE_GRACE) if not settling else self._queue.get_nowait()
            except queue.Empty:
                settling = True
                self._settle_turn(unsettled[0], limit=min(self.prefill_budget, SETTLE_PIECE))

    def _settle_turn(self, live: LiveSession, want: Sequence[int] | None = None, limit: int | None = None) -> None:
        """Settle the turn live holds (all of it, or with `limit` one piece of at most that many tokens: the turn
        stays unsettled until its last piece)."""
        turn, live.unsettled = live.unsettled, None
        if turn is None or live.session is None:
            return
        try:
            self._wait_fence()  # the last piece is done before the next is queued
            if not self._settle(live.session, *turn, want=want, limit=limit):
                live.unsettled = turn
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

    # ---- admitting requests -------------------------------------------------------------------------
    def _can_admit(self) -> bool:
        return len(self._streams) < self.batch and self.pool is not None and self.pool.available()

    def _admit_queued(self) -> bool:
        """Admit queued requests while the batch and the sessions have room (they join at the next step);
        -> True when the stop sentinel was taken."""
        while self._can_admit():
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            self._admit(*item)
        return False

    def _admit(self, job: Job, handle: Handle) -> None:
        """Give a request its live session (the longest reusable prefix) and start its prompt; it runs from
        the next step on."""
        assert self.pool is not None and self.engine is not None
        if self.state == "failed":  # queued while a restart was giving up
            job.ended = self.unavailable()
            job.cancel.set()
        if job.cancel.is_set():
            self._finish_unstarted(job, handle, reason="cancelled")
            return
        started = time.monotonic()
        try:
            for waiting in list(self.pool.slots):
                # a request that continues a turn not settled yet (it came within SETTLE_GRACE): settle it now
                # when the prompt spells the answer as settling would; that prefill is this request's own work
                if not waiting.busy and waiting.unsettled and \
                        common_prefix(waiting.tokens, job.prompt) >= waiting.unsettled[0]:
                    self._settle_turn(waiting, job.prompt)
            counts = (self.pool.hits, self.pool.misses, self.pool.resets, self.pool.checkpoint_hits)
            live, cached, reuse = self.pool.acquire(job.prompt)
            if job.kind == WARM:  # a warm-up leaves no count behind
                self.pool.hits, self.pool.misses, self.pool.resets, self.pool.checkpoint_hits = counts
        except Exception as e:
            if self._down() is not None:
                raise
            traceback.print_exc()
            self._conclude(job, handle, Finished("error", len(job.prompt), 0, Timings(), 0.0, 0.0,
                                                 error=f"{type(e).__name__}: {e}"))
            return
        live.unsettled = None  # taken as it is: the prompt's common prefix with what the KV holds is reused
        live.busy = True
        todo = job.prompt[cached:]
        self._streams.append(_Stream(job, handle, live, cached, reuse, started, todo,
                                     Timings(cache_n=cached, prompt_n=len(todo))))

    # ---- one step of every running request ------------------------------------------------------------
    def _step_guarded(self) -> None:
        """A step; an engine failure that is not one request's own ends every running request (_engine_failed)."""
        try:
            self._step()
        except Exception as e:
            self._engine_failed(e)

    def _engine_failed(self, e: Exception, admitting: tuple[Job, Handle] | None = None) -> None:
        """The engine failed in a way that is not one request's own (a stage down, a batched step, or setting up
        the session of the request being admitted): that request and every running one end with the error, and
        a route whose stage is down is restarted."""
        traceback.print_exc()
        down = self._down()
        error = f"{type(e).__name__}: {e}"
        if down is not None:
            self._begin_recovery(down)
            if self.state == "restarting":
                error += "; the route is restarting: retry shortly"
        if admitting is not None:
            job, handle = admitting
            self._conclude(job, handle, Finished("error", len(job.prompt), 0, Timings(), 0.0, 0.0, error=error))
        for stream in list(self._streams):
            self._fail(stream, error)
        if down is not None:
            self._recover(down)

    def _step(self) -> None:
        """One scheduler step: cancelled requests leave; every decoding request takes its next token(s) (from
        the previous step's logits); prompt pieces within the prefill budget, the shortest remaining prompt
        first, so a short request is not stuck behind a long one (a prompt that ends takes its first token
        at once, before the next piece is queued); then all that continue with one token run one batched
        decode step (several tokens, e.g. a forced tool call, run as their own prefill)."""
        clock = [time.monotonic()]

        def lap() -> float:  # milliseconds since the last lap
            now = time.monotonic()
            ms, clock[0] = (now - clock[0]) * 1000, now
            return ms

        started = clock[0] - self._fence_ms / 1000  # the step began with the wait between steps (see _main)
        for stream in list(self._streams):
            if stream.job.cancel.is_set():
                self._end(stream, "cancelled")
        self._wait_fence()  # (done between steps already, see _main)
        lap()
        wait_ms, self._fence_ms = self._fence_ms, 0.0
        queued = bool(getattr(self.engine, "queues_steps", False))
        # Prompt pieces hold the host while they are issued (~0.65 s a 1,024-token piece on the H200), as a step
        # that blocks does: the texts sampled before them go out first then.
        blocks = not queued or any(s.phase == "prefill" for s in self._streams)
        sample_ms = show_ms = 0.0

        def take(streams: list[_Stream]) -> None:  # their next tokens; before a step that blocks, their texts too
            nonlocal sample_ms, show_ms
            picks = [(stream, self._pick(stream)) for stream in streams if stream.ended is None]
            # every pick is queued before any is read: one wait for all of them, not one per request
            ids = iter(host_ints([t for _, t in picks if t is not None]))
            for stream, t in picks:
                self._choose(stream, None if t is None else next(ids))
            sample_ms += lap()
            if blocks:
                for stream in streams:
                    self._show(stream)
                show_ms += lap()

        ready = [s for s in self._streams if s.phase == "decode"]
        prefilled: dict[int, int] = {}
        prefill_ms = 0.0
        self._verified = []
        ahead = self._looks_ahead(ready)
        if ahead:  # the next step is queued before this one's tokens are read (see _looks_ahead)
            blocks = False
            read = HostRead([self._pick(stream) for stream in ready])
            sample_ms += lap()
            sessions = [stream.live.session for stream in ready]
            logits = self._engine_call(ready, lambda: self.engine.decode_batch(sessions, read.device))
            forward_ms = lap()
            decoded = []
            if logits is not None:
                for b, (stream, token) in enumerate(zip(ready, read.values(), strict=True)):
                    stream.live.session.resolve(token)
                    self._choose(stream, token)
                    stream.feed, stream.logits = [], logits[b]
                    decoded.append(stream.job.id)
            sample_ms += lap()
        else:
            # The running requests' tokens first: their logits are the previous step's, so sampling them waits
            # for nothing this step queues (their texts go out one prompt piece earlier than after it).
            take(ready)
            budget = self.prefill_budget
            for stream in sorted((s for s in self._streams if s.phase == "prefill"),
                                 key=lambda s: len(s.todo) - s.done):
                if budget <= 0:
                    break
                n = min(budget, len(stream.todo) - stream.done)
                piece = stream.todo[stream.done:stream.done + n]
                logits = self._engine_call([stream], lambda s=stream, p=piece: s.live.session.extend(p))
                if logits is None:
                    continue
                stream.logits = logits
                stream.done += n
                budget -= n
                prefilled[stream.job.id] = n
                stream.handle._post(Prefill(stream.done, len(stream.todo), stream.cached))
                if stream.done == len(stream.todo):
                    # its first token now, before a longer prompt's piece is queued behind it (a short request
                    # that arrived during a long prefill waits for that piece no longer than it must)
                    self._begin_decode(stream)
                    prefill_ms += lap()
                    take([stream])
                    ready.append(stream)
                else:
                    self._fence_after(logits)
            prefill_ms += lap()
            decoded = self._forward([s for s in ready if s.ended is None])
            forward_ms = lap()
        if not blocks:  # the decode step runs on the GPU while the texts are made and sent
            for stream in ready:
                self._show(stream)
        for stream in ready:
            if stream.ended is not None and stream in self._streams:
                self._end(stream, stream.ended)
        show_ms += lap()
        decoded = [i for i in decoded if i > 0]  # warm-up requests (negative ids) leave no statistics
        prefilled = {i: n for i, n in prefilled.items() if i > 0}
        if prefilled or decoded:
            self.batch_totals["steps"] += 1
            self.batch_totals["decode_rows"] += len(decoded)
            self.batch_totals["decode_steps"] += bool(decoded)
            self.batch_totals["prefill_tokens"] += sum(prefilled.values())
            self.batch_totals["max_batch"] = max(self.batch_totals["max_batch"], len(decoded))
            self.batch_totals["ahead_steps"] += ahead
            self.steps.append(StepRecord(self.batch_totals["steps"], decoded, prefilled, started,
                                         [i for i in self._verified if i > 0], wait_ms, prefill_ms, sample_ms,
                                         forward_ms, show_ms, (clock[0] - started) * 1000, ahead))

    def _looks_ahead(self, ready: list[_Stream]) -> bool:
        """Whether this step queues the decode step of `ready` (every running request, all decoding) before it
        reads their tokens: the tokens stay where the sampler picked them and the engine copies them into the
        step's inputs (`decode_batch` of a device tensor), so the GPU runs the next step while the host reads
        this one's tokens and sends their texts, instead of waiting for the host between two steps. Only where
        each request's token is known to continue it: no guide (its directive depends on the token before), no
        forced tokens or drafts, room in the context and under max_tokens for one more. A stop token or a stop
        string found after the step was queued leaves that token in the KV, which settling rolls back like any
        other divergence. The engine says whether it can (`decodes_ahead`; `look_ahead` overrides it)."""
        able = self.look_ahead
        if able is None:
            able = bool(getattr(self.engine, "decodes_ahead", False))
        if not able or not ready or len(ready) != len(self._streams) or not hasattr(self.engine, "decode_batch"):
            return False
        limit = getattr(self.engine, "ctx", None) or self.ctx
        return all(s.ended is None and s.job.guide is None and not s.forced and s.drafter is None and s.rows is None
                   and s.generated + 1 < s.job.max_tokens
                   and (not limit or len(s.live.session.tokens) + 1 <= limit) for s in ready)

    def _fence_after(self, logits: Any) -> None:
        """A GPU prefill piece returns once its kernels are queued: without a fence the loop would queue the next
        pieces (a whole prompt, a whole settling) ahead, and a request arriving meanwhile would wait behind all of
        them; the next piece or step waits for this one first (_wait_fence)."""
        if getattr(logits, "is_cuda", False):
            self._fence = torch.cuda.Event()
            self._fence.record()

    def _wait_fence(self) -> None:
        """Wait for the last step's unfinished prompt pieces (a GPU's queued work) before more are queued."""
        if self._fence is not None:
            t = time.monotonic()
            try:
                self._fence.synchronize()
            finally:
                self._fence = None
                self._fence_ms += (time.monotonic() - t) * 1000

    def _engine_call(self, streams: list[_Stream], call: Callable[[], Any]) -> Any:
        """Run an engine call for these requests; when it fails with the engine still up (the request's own
        fault, e.g. its context is full), they end with the error and None is returned."""
        try:
            return call()
        except Exception as e:
            if self._down() is not None:
                raise
            traceback.print_exc()
            for stream in streams:
                self._fail(stream, f"{type(e).__name__}: {e}")
            return None

    def _forward(self, feed: list[_Stream]) -> list[int]:
        """Feed every request its accepted tokens: one batched decode step for those with one token (the
        engine's `decode_batch` when it has one, else one after another); with a draft source, those with drafts
        verify them with their token (see _verify); -> the ids of the requests fed one token each in one step
        (the batched decode step's, or a verification's)."""
        singles = [s for s in feed if len(s.feed) == 1]
        ids = self._verify(singles)
        for stream in feed:
            if len(stream.feed) > 1:  # a run of forced tokens is a prefill
                logits = self._engine_call([stream], lambda s=stream: s.live.session.extend(s.feed,
                                                                                         chunk=self.prefill_chunk))
                if logits is not None:
                    stream.logits = logits
        decode_batch = getattr(self.engine, "decode_batch", None)
        if len(singles) > 1 and decode_batch is not None:
            limit = getattr(self.engine, "ctx", None) or self.ctx  # one full session must not fail the batch
            for s in [s for s in singles if limit and len(s.live.session.tokens) + 1 > limit]:
                self._fail(s, f"ValueError: context full: {len(s.live.session.tokens)} + 1 tokens exceed ctx "
                              f"{limit}; start a new session or load with a larger --ctx")
            singles = [s for s in singles if s in self._streams]
            if len(singles) > 1:
                logits = decode_batch([s.live.session for s in singles], [s.feed[0] for s in singles])
                for b, stream in enumerate(singles):
                    stream.logits = logits[b]
                ids += [s.job.id for s in singles]
                singles = []
        for stream in singles:
            logits = self._engine_call([stream], lambda s=stream: s.live.session.extend(s.feed,
                                                                                     chunk=self.prefill_chunk))
            if logits is not None:
                stream.logits = logits
                ids.append(stream.job.id)
        for stream in feed:
            stream.feed = []
        return ids

    def _verify(self, singles: list[_Stream]) -> list[int]:
        """Draft-and-verify for the requests that continue with one token (`singles`; those it feeds are taken
        out of it): a request decoding alone verifies its drafts with its token in one forward; several verify
        together in one step when the engine has `verify_batch` (every request's rows, with or without drafts,
        each weight read once for all of them; the drafts per request then fit the step's rows), else they take
        the batched decode step without drafts (a verification of its own would read every weight for one
        request). -> the ids of the requests a verification fed (one token each, plus their drafts): the lone
        request's, or a batched verification's."""
        drafting = [s for s in singles if s.drafter is not None]
        if not drafting:
            return []
        per_step = getattr(self.engine, "verify_rows_per_step", 0) if hasattr(self.engine, "verify_batch") else 0
        together = len(singles) > 1
        if together and per_step < 2 * len(singles):  # no room for a draft each: the batched decode step
            return []
        limit = per_step // len(singles) - 1 if together else self.draft_tokens
        drafts: dict[int, list[int]] = {}
        ks = [self._draft_len(s, limit) for s in drafting]
        # the MTP layer drafts for every request in one step; prompt lookup request by request
        mtp = [(s, k) for s, k in zip(drafting, ks, strict=True) if isinstance(s.drafter, MtpDrafter) and k > 0]
        calls = [([s for s, _ in mtp], lambda: MtpDrafter.propose_together([s.drafter for s, _ in mtp],
                                                                          [k for _, k in mtp]))] if mtp else []
        calls += [([s], lambda s=s, k=k: [s.drafter.propose(k)]) for s, k in zip(drafting, ks, strict=True)
                  if k > 0 and not isinstance(s.drafter, MtpDrafter)]
        for streams, call in calls:
            got = self._engine_call(streams, call)
            for i, stream in enumerate(streams):
                if got is None:  # the requests failed
                    singles.remove(stream)
                elif got[i]:
                    drafts[stream.job.id] = got[i]
        if not drafts:
            return []
        group = list(singles) if together else [s for s in singles if s.job.id in drafts]
        for stream in group:
            singles.remove(stream)
        if not together:  # the token and its drafts in one forward, every position's logits back
            stream = group[0]
            d = drafts[stream.job.id]
            rows = self._engine_call([stream], lambda: stream.live.session.verify(stream.feed + d))
            if rows is None:
                return []
            stream.rows, stream.drafts, stream.logits = rows, d, rows[0]
            self._verified = [stream.job.id]
            return [stream.job.id]
        outs = self._engine_call(group, lambda: self.engine.verify_batch(  # type: ignore[union-attr]
            [s.live.session for s in group], [s.feed + drafts.get(s.job.id, []) for s in group]))
        if outs is None:
            return []
        for stream, rows in zip(group, outs, strict=True):
            d = drafts.get(stream.job.id, [])
            stream.logits = rows[0]
            if d:
                stream.rows, stream.drafts = rows, d
        self._verified = [s.job.id for s in group if s.job.id in drafts]
        return [s.job.id for s in group]

    def _draft_len(self, stream: _Stream, limit: int) -> int:
        """How many drafts to verify with the request's next token: at most `limit`, no more than it may still
        generate beyond that token, nor than the context has room for."""
        room = (getattr(self.engine, "ctx", None) or self.ctx or 0) - len(stream.live.session.tokens) - 1
        return max(0, min(self.draft_tokens, limit, stream.job.max_tokens - stream.generated - 1, room))

    def _begin_decode(self, stream: _Stream) -> None:
        """The prompt is in the KV: time it, checkpoint it, and set up sampling and the text."""
        assert self.engine is not None and stream.logits is not None
        job, logits = stream.job, stream.logits
        if logits.is_cuda:  # graph replays return before the GPU is done: the prompt ends when its logits do
            torch.cuda.current_stream(logits.device).synchronize()
        stream.t_decode = time.monotonic()
        stream.timings.prompt_ms = (stream.t_decode - stream.started) * 1000
        stream.phase = "decode"
        # the prompt's end: the next turn comes back here however far beyond --rollback this answer runs
        stream.live.session.checkpoint()
        disk = self.pool.disk if self.pool is not None else None
        if disk is not None and job.kind != WARM and len(stream.live.tokens) >= disk.min_tokens:
            disk.save(stream.live.tokens, stream.live.session.save_state)  # type: ignore[attr-defined]
        stream.detok = self._make_detok(self.engine)
        stream.sampler = Sampler(job.sampling)
        if self.draft != "off" and job.guide is None and job.kind != WARM:
            stream.drafter = LookupDrafter() if self.draft == "lookup" else MtpDrafter(stream.live.session)
            stream.drafter.extend(stream.live.tokens[-LOOKUP_CONTEXT:])
        stream.scanner = StopScanner(job.stop)
        if job.banned_tokens or job.logit_bias:  # banned tokens (-inf) and the client's logit_bias, built once
            bias = torch.zeros(logits.numel(), dtype=torch.float32, device=logits.device)
            for token, value in job.logit_bias.items():
                bias[token] = value
            bias[job.banned_tokens] = float("-inf")
            stream.bias = bias
        if job.max_tokens <= 0:
            stream.ended = "length"

    def _pick(self, stream: _Stream) -> torch.Tensor | None:
        """The first half of a request's turn at a step: its guide's directive, and the token sampled from its
        logits (bias and the guide's allowed set applied) as a one-element tensor where the logits are, nothing
        waited for; None when its tokens are forced or come from a verification (see _choose)."""
        job = stream.job
        if not stream.forced and job.guide is not None:
            stream.directive = job.guide.next()
            if isinstance(stream.directive, Forced):
                stream.forced.extend(stream.directive.tokens)
        if stream.forced or stream.rows is not None:
            return None
        assert stream.logits is not None and stream.sampler is not None
        logits, directive = stream.logits, stream.directive
        if stream.bias is not None or isinstance(directive, Allowed):
            logits = logits.float() + stream.bias if stream.bias is not None else logits.float().clone()
            if isinstance(directive, Allowed):
                logits[~directive.mask.to(logits.device)] = float("-inf")
        return stream.sampler.pick(logits)

    def _choose(self, stream: _Stream, sampled: int | None) -> None:
        """The request's next accepted tokens: forced by its guide, else the verification's, else `sampled` (its
        _pick's value). Each is accounted for at once; a stop token or the token limit ends the request (a stop
        token's text is never shown); the rest is fed at this step and shown."""
        job = stream.job
        if stream.forced:
            n = min(len(stream.forced), job.max_tokens - stream.generated)
            tokens = [stream.forced.popleft() for _ in range(n)]
        elif stream.rows is not None:
            tokens = self._accept(stream)
        else:
            assert sampled is not None
            tokens = [sampled]
        tokens = tokens[:max(0, job.max_tokens - stream.generated)]
        if stream.drafter is not None:
            stream.drafter.extend(tokens)
        stream.step_start = stream.generated
        for token in tokens:
            if job.guide is not None:
                job.guide.accept(token)
            stream.outputs.append(token)
            if stream.generated == 1:
                stream.ttft_ms = (time.monotonic() - job.queued_at) * 1000
            stream.feed.append(token)
            if token in job.stop_tokens:
                stream.ended = "stop"
                break
            stream.unshown.append(token)
        if stream.ended is None and stream.generated >= job.max_tokens:
            stream.ended = "length"
        if stream.drafts:  # the accepted drafts are in the KV already: only the last token is fed
            stream.feed = stream.feed[-1:]
            stream.drafts, stream.rows = [], None

    def _accept(self, stream: _Stream) -> list[int]:
        """The tokens a verification gives: each draft the sampler accepts at its position, then the token
        the first rejection drew instead, or after the last draft one more from its row; the KV rows of the
        rejected drafts are dropped."""
        assert stream.rows is not None and stream.sampler is not None
        rows, drafts, out = stream.rows, stream.drafts, []
        for i in range(len(drafts) + 1):
            row = rows[i] if stream.bias is None else rows[i].float() + stream.bias
            if i == len(drafts):
                out.append(stream.sampler(row))
                break
            token, ok = stream.sampler.verify(row, drafts[i])
            out.append(token)
            if not ok:
                break
        accepted = len(out) - 1
        session = stream.live.session
        if accepted < len(drafts) and not session.truncate(len(session.tokens) - (len(drafts) - accepted)):
            raise RuntimeError("the KV could not drop the rejected drafts")  # within one chunk it always can
        stream.timings.draft_n += len(drafts)
        stream.timings.draft_n_accepted += accepted
        self.draft_totals["drafted"] += len(drafts)
        self.draft_totals["accepted"] += accepted
        self.draft_totals["steps"] += 1
        return out

    def _show(self, stream: _Stream) -> None:
        """Text of the tokens accepted at this step, through the stop-string scanner, to the client. A stop
        string ends the request; when the step was already queued its last token is in the KV one step early,
        which settling rolls back like any other divergence."""
        assert stream.detok is not None and stream.scanner is not None
        for j, token in enumerate(stream.unshown):
            piece = stream.detok.push(token)
            stream.raw.append(piece)
            shown = stream.scanner.feed(piece)
            if shown:
                stream.handle._post(Text(shown, 1))
            if stream.scanner.stopped:
                text = "".join(stream.raw)
                stream.matched = min((s for s in stream.job.stop if s and s in text), key=text.find)
                stream.ended = "stop"
                # a step of several tokens (drafts, forced ones): those after the stop string are not output
                del stream.outputs[stream.step_start + j + 1:]
                break
        stream.unshown = []

    def _end(self, stream: _Stream, reason: str) -> None:
        """The request is done: the rest of its text, its timings and Finished; its session is free again
        (its turn to be settled when the worker is idle, see _next)."""
        assert self.pool is not None
        job, t = stream.job, stream.timings
        now = time.monotonic()
        if stream.phase == "prefill":  # cancelled before its first token
            t.prompt_ms = (now - stream.started) * 1000
        else:
            assert stream.scanner is not None and stream.detok is not None and stream.t_decode is not None
            if not stream.scanner.stopped and reason != "cancelled":
                rest = stream.scanner.feed(stream.detok.flush()) + stream.scanner.flush()
                if rest:
                    stream.handle._post(Text(rest, 0))
            t.predicted_n = stream.generated
            t.predicted_ms = (now - stream.t_decode) * 1000
        self._streams.remove(stream)
        stream.live.busy = False
        fin = Finished(reason, len(job.prompt), stream.generated, t, (stream.started - job.queued_at) * 1000,
                       stream.ttft_ms, stop_string=stream.matched, reuse=stream.reuse, output=list(stream.outputs))
        self._conclude(job, stream.handle, fin)
        if job.kind == WARM:  # a warm-up leaves no session behind
            self.pool.drop(stream.live)
        elif reason != "cancelled" and stream.outputs:
            stream.live.unsettled = (len(job.prompt), list(stream.outputs))  # settled when the worker is idle

    def _fail(self, stream: _Stream, error: str) -> None:
        """The engine failed on this request: it ends with the error, and its half-extended KV is dropped (it
        must not serve a later prefix)."""
        assert self.pool is not None
        if stream in self._streams:
            self._streams.remove(stream)
        self.pool.drop(stream.live)
        self._conclude(stream.job, stream.handle, Finished("error", len(stream.job.prompt), 0, Timings(), 0.0, 0.0,
                                                           error=error))

    def _settle(self, session: EngineSession, prompt_len: int, outputs: list[int],
                want: Sequence[int] | None = None, limit: int | None = None) -> bool:
        """After the client has its answer: make the live KV hold this turn as the next prompt will spell it.

        The next request re-renders this turn from text and tokenizes it; sampled tokens need not be the
        tokenizer's canonical split of their own text (BPE could merge two sampled tokens into one), and the
        last sampled token (usually EOS) may be in the KV or not. Feeding the canonical tokens of the generated
        text keeps the whole turn inside the reusable prefix. The turn starts after a special token (the
        assistant opening), so its canonical split is independent of the prompt before it. `want`: the prompt
        of a request that continues this turn; nothing is done unless it spells the turn canonically too.
        `limit`: extend by at most that many tokens (one piece; a later call goes on from where it stopped).
        -> True when the turn is settled (or cannot be), False when pieces remain.
        """
        assert self.engine is not None
        tok = self.engine.tokenizer
        canon = tok.encode(tok.decode(outputs))
        if want is not None and list(want[prompt_len:prompt_len + len(canon)]) != canon:
            return True  # the waiting request spells this turn otherwise: it takes the KV as it is
        if self.ctx is not None and prompt_len + len(canon) > self.ctx:
            return True
        # what the KV holds of the turn: the sampled tokens (the last one perhaps not), or after an earlier
        # piece the canonical ones it was fed
        keep = prompt_len + common_prefix(canon, session.tokens[prompt_len:])
        if len(session.tokens) > keep and session.rewind(keep) < 0:
            return True  # cannot roll back that far; the next turn re-prefills from the divergence
        rest = canon[len(session.tokens) - prompt_len:]
        piece = rest if limit is None else rest[:max(1, limit)]
        if piece:
            self._fence_after(session.extend(piece, chunk=self.prefill_chunk))
        return len(piece) == len(rest)

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
                                         round((time.monotonic() - job.queued_at) * 1000, 3), time.time(),
                                         round(fin.queue_ms, 3)))
        for observe in self.observers:
            try:
                observe(job, fin)
            except Exception:  # metrics or the trace must never take the worker down
                traceback.print_exc()

    # ---- introspection ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        running = [stream.describe(now) for stream in list(self._streams)]
        totals = dict(self.batch_totals)
        last = self.steps[-1] if self.steps else None
        sessions = self.pool.describe() if self.pool is not None else []
        return {
            "state": self.state,
            "error": self.error,
            "restart": dict(self.restart) if self.restart else None,
            "restarts": self.restarts,
            "queue": {"length": self.queue_length(), "capacity": self.max_queue},
            "running": running,
            "batch": {"limit": self.batch, "prefill_budget": self.prefill_budget, **totals,
                      "mean_decode_batch": round(totals["decode_rows"] / totals["decode_steps"], 3)
                      if totals["decode_steps"] else 0.0,
                      "last_step": {"decoded": len(last.decoded), "prefill_tokens": sum(last.prefilled.values()),
                                    "ms": round(last.total_ms, 3)} if last else None,
                      "step_log": [r.describe() for r in list(self.steps)[-STATUS_STEPS:]]},
            "draft": {"source": self.draft, "tokens": self.draft_tokens, **self.draft_totals,
                      "acceptance": round(self.draft_totals["accepted"] / self.draft_totals["drafted"], 4)
                      if self.draft_totals["drafted"] else None,
                      "tokens_per_verify": round(1 + self.draft_totals["accepted"] / self.draft_totals["steps"], 3)
                      if self.draft_totals["steps"] else None},
            "sessions": {"capacity": self.capacity, "live": sessions,
                         "kv_bytes": sum(s["kv_bytes"] for s in sessions),
                         "prefix_hits": self.pool.hits if self.pool else 0,
                         "prefix_misses": self.pool.misses if self.pool else 0,
                         "resets": self.pool.resets if self.pool else 0,
                         "checkpoint_hits": self.pool.checkpoint_hits if self.pool else 0,
                         "disk": self.pool.disk.describe() if self.pool and self.pool.disk else None},
            "recent": [r.__dict__ for r in self.recent],
            "totals": dict(self.totals),
        }


def _default_detokenizer(engine: GenerationEngine) -> Detokenizer:
    return engine.tokenizer.stream_decoder()


def _log(message: str) -> None:
    print(f"ds4station: {message}", file=sys.stderr, flush=True)
