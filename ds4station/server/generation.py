"""The dialect-independent path of a chat request: conversation -> prompt tokens -> scheduler -> parsed events.

The OpenAI, Responses and Anthropic front-ends translate their request into a `ChatTurn` (OpenAI-style
messages and tools, the thinking switch, tool choice, sampling) and their output from the events of a `Run`
(the chat StreamParser's reasoning / content / tool-call events, plus None as a keep-alive tick). Everything
that must be identical across dialects lives here: canonical tools, the DSML replay store (so a tool
continuation's prompt repeats the exact tokens the model sampled), the context-length check, banned tokens,
forced tool calls, usage and llama.cpp timings, and cancellation when the client goes away.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from ds4station.engine import chat
from ds4station.engine.sampler import SamplingParams
from ds4station.engine.scheduler import WARM, Finished, Handle, Job, NotReady, Prefill, QueueFull, Scheduler, Text

from .errors import ApiError
from .schemas import parse_body
from .toolguide import ToolCallGuide
from .warmup import WARMING

log = logging.getLogger(__name__)


class ReplayStore:
    """tool-call id -> the exact DSML text the model sampled for that assistant turn (bounded, LRU)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, str] = OrderedDict()
        self.hits = 0

    def put(self, call_id: str, dsml: str) -> None:
        self._items[call_id] = dsml
        self._items.move_to_end(call_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, call_id: str) -> str | None:
        text = self._items.get(call_id)
        if text is not None:
            self.hits += 1
            self._items.move_to_end(call_id)
        return text

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class ServerState:
    """What the request handlers share: the scheduler and the server's settings."""

    scheduler: Scheduler
    model_name: str
    model_path: str
    ctx: int
    default_max_tokens: int = 4096
    keepalive_s: float = 10.0
    max_body_bytes: int = 32 * 1024 * 1024
    api_key: str | None = None
    replay: ReplayStore = field(default_factory=ReplayStore)
    metrics: Any = None  # status.Metrics
    started_at: float = field(default_factory=time.time)
    # set once the server's own first requests (warmup.py) are done; /health says loading until then
    warm: threading.Event = field(default_factory=threading.Event)

    @property
    def tokenizer(self) -> Any:
        if self.scheduler.engine is None:
            raise ApiError(503, f"{self.scheduler.unavailable()}: try again when /health is ok",
                           code="model_not_ready", headers={"Retry-After": "5"})
        return self.scheduler.engine.tokenizer


@dataclass
class ChatTurn:
    """One chat request, in the common (OpenAI-style) form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # [{"type": "function", "function": {...}}]
    thinking: bool = True
    tool_choice: str = "auto"  # auto | none | required | function (with forced_tool)
    forced_tool: str | None = None
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    kind: str = "chat"
    call_id_prefix: str = "call_"
    logit_bias: dict[str, float] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict[str, float | int]
    reasoning_tokens: int = 0  # generated tokens up to and including the closing </think>

    def openai(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}, "timings": self.timings}


def thinking_from(effort: str | None, thinking: Any, template_kwargs: dict[str, Any] | None,
                  default: bool = True) -> bool:
    """The thinking switch from whichever knob a client uses (reasoning_effort, thinking, template kwargs)."""
    if template_kwargs:
        for key in ("thinking", "enable_thinking"):
            if isinstance(template_kwargs.get(key), bool):
                return template_kwargs[key]
    if isinstance(thinking, bool):
        return thinking
    if isinstance(getattr(thinking, "type", None), str):  # {"type": "enabled" | "adaptive" | "disabled"}
        return thinking.type != "disabled"
    if effort is not None:
        return effort not in ("none", "minimal")
    return default


def function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools]


# ---- preparing a prompt --------------------------------------------------------------------------------
def render(state: ServerState, turn: ChatTurn, thinking: bool) -> list[int]:
    """Prompt token ids for a turn (runs in a worker thread: tokenizing a long prompt takes a while). Only the
    template's own markup becomes control tokens; every text the client sent is encoded as plain text, so a
    message, tool result or schema holding `<｜User｜>` or a DSML block cannot forge a turn or a call."""
    tools = chat.canonical_tools(turn.tools) if turn.tools else None
    try:
        return chat.encode_prompt(state.tokenizer, turn.messages, tools, thinking, add_generation_prompt=True,
                                  replay=state.replay.get)
    except chat.ChatFormatError as e:
        raise ApiError(400, str(e), code="invalid_request", param="messages") from e


async def count_prompt(state: ServerState, turn: ChatTurn) -> int:
    return len(await run_in_threadpool(render, state, turn, turn.thinking))


def check_context(state: ServerState, prompt_tokens: int | None = None, *, text_chars: int = 0) -> None:
    """The prompt must leave room in the context. Before tokenizing, pass `text_chars` instead, the length
    of the conversation's text: no token spells more characters than the vocabulary's longest token, so a
    text longer than ctx times that cannot fit and is refused without spending seconds to tokenize it."""
    counted = f"{prompt_tokens} tokens"
    if prompt_tokens is None:
        prompt_tokens = -(-text_chars // _longest_token(state.tokenizer))
        counted = f"at least {prompt_tokens} tokens ({text_chars} characters)"
    if prompt_tokens >= state.ctx:
        raise ApiError(400, f"This model's maximum context length is {state.ctx} tokens. However, your messages "
                            f"resulted in {counted}. Please reduce the length of the messages.",
                       code="context_length_exceeded", param="messages")


@functools.lru_cache(maxsize=4)
def _longest_token(tok: Any) -> int:
    """Characters of the longest token (its bytes: a character is at least one byte)."""
    return max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))


def logit_bias(tok: Any, bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token id strings -> -100..100), checked against the vocabulary."""
    out = {int(k): float(v) for k, v in (bias or {}).items()}
    bad = [k for k in out if k >= tok.vocab_size]
    if bad:
        raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})",
                       param="logit_bias")
    return out


async def start(state: ServerState, turn: ChatTurn) -> Run:
    """Render, check and queue a chat turn; raises ApiError for a bad request or a full queue."""
    thinking = turn.thinking
    # every message's content is in the prompt (reasoning of earlier turns may not be)
    check_context(state, text_chars=sum(len(m.get("content") or "") for m in turn.messages))
    prompt = await run_in_threadpool(render, state, turn, thinking)
    check_context(state, len(prompt))
    room = state.ctx - len(prompt)
    requested = turn.max_tokens if turn.max_tokens and turn.max_tokens > 0 else state.default_max_tokens
    max_tokens = min(requested, room)
    tok = state.tokenizer
    guide = None
    if turn.tool_choice in ("required", "function"):
        fns = function_tools(turn.tools)
        if turn.forced_tool:
            fns = [f for f in fns if f["name"] == turn.forced_tool]
        try:
            guide = ToolCallGuide(tok, fns, max_tokens, close_think=thinking)
        except ValueError as e:
            if max_tokens == requested:
                raise ApiError(400, str(e), code="max_tokens_too_small", param="max_tokens") from e
            need = str(e).partition(": ")[2] or str(e)  # "its DSML structure alone needs N tokens"
            raise ApiError(400, f"the prompt takes {len(prompt)} of the context's {state.ctx} tokens and leaves "
                                f"{room} for the answer, too few for the forced tool call ({need}): shorten the "
                                "conversation", code="context_length_exceeded", param="messages") from e
    tools = bool(turn.tools) and turn.tool_choice != "none"
    job = Job(prompt=prompt, max_tokens=max_tokens, sampling=turn.sampling, stop=turn.stop,
              stop_tokens={tok.eos_id}, banned_tokens=chat.banned_tokens(tok, thinking, tools),
              logit_bias=logit_bias(tok, turn.logit_bias), guide=guide, kind=WARM if WARMING.get() else turn.kind)
    handle = submit(state, job)
    prefix = turn.call_id_prefix
    parser = chat.StreamParser(thinking, new_call_id=lambda: prefix + secrets.token_hex(12), tools=tools)
    return Run(state, handle, parser)


def submit(state: ServerState, job: Job) -> Handle:
    try:
        return state.scheduler.submit(job)
    except QueueFull as e:
        raise ApiError(503, str(e), code="server_busy", headers={"Retry-After": str(e.retry_after)}) from e
    except NotReady as e:
        raise ApiError(503, str(e), code="model_not_ready", headers={"Retry-After": "5"}) from e


# ---- a running request ----------------------------------------------------------------------------------
@dataclass
class Result:
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]  # OpenAI form
    finish_reason: str
    usage: Usage


class Run:
    """A queued/running generation: iterate `events()` (parsed deltas, None = keep-alive due) or `collect()`."""

    def __init__(self, state: ServerState, handle: Handle, parser: chat.StreamParser | None) -> None:
        self.state = state
        self.handle = handle
        self.parser = parser
        self.finish_reason = "stop"
        self.usage: Usage | None = None
        self.tool_call_ids: list[str] = []
        self.first_event_at: float | None = None
        self.thinking = parser is not None and parser.thinking

    def cancel(self) -> None:
        self.handle.cancel()

    async def events(self) -> AsyncIterator[Any]:
        """Parser events (or `Text` when there is no parser), None when a keep-alive is due, until finished."""
        keepalive = self.state.keepalive_s
        last = time.monotonic()
        while True:
            wait = max(0.01, keepalive - (time.monotonic() - last))
            event = await self.handle.next(timeout=wait)
            if event is None or isinstance(event, Prefill):
                if time.monotonic() - last >= keepalive:
                    last = time.monotonic()
                    yield None
                continue
            if isinstance(event, Text):
                out = self.parser.feed(event.text) if self.parser is not None else [event]
            else:
                assert isinstance(event, Finished)
                out = self.parser.finish() if self.parser is not None else []
            for item in out:
                if isinstance(item, chat.ToolCallStart):
                    self.tool_call_ids.append(item.id)
                last = time.monotonic()
                yield item
            if isinstance(event, Finished):
                self._finished(event)
                return

    def _finished(self, fin: Finished) -> None:
        if fin.reason == "error":
            if self.state.scheduler.state in ("restarting", "stopping", "failed"):
                # the engine went away under this request (a stage died, or the server is shutting down): not
                # the request's fault, and worth a retry once /health is ok again
                raise ApiError(503, f"generation failed: {fin.error}", code="engine_unavailable",
                               headers={"Retry-After": "5"})
            raise ApiError(500, f"generation failed: {fin.error}", code="engine_error")
        malformed = self.parser.malformed if self.parser is not None else None
        if malformed and fin.reason != "length":
            log.warning("the model's output ended in malformed DSML: %s", malformed)
            if self.tool_call_ids:  # a call the client cannot trust: an error, never finish_reason tool_calls
                raise ApiError(502, f"the model wrote a malformed tool call: {malformed}", code="malformed_tool_call")
        if self.parser is not None and self.tool_call_ids and self.parser.tool_calls_text:
            self.state.replay.put(self.tool_call_ids[0], self.parser.tool_calls_text)
        if fin.reason == "length":
            self.finish_reason = "length"
        elif self.tool_call_ids:
            self.finish_reason = "tool_calls"
        else:
            self.finish_reason = "stop"
        self.usage = Usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens, fin.timings.as_dict(),
                           self._reasoning_tokens(fin.output))

    def _reasoning_tokens(self, output: list[int]) -> int:
        """Exact, from the generated ids: a thinking turn reasons up to its </think> token (all of it when it
        never closes); a turn opened without thinking has none."""
        if not self.thinking:
            return 0
        end = self.state.tokenizer.token_id(chat.THINK_END)
        return output.index(end) + 1 if end in output else len(output)

    async def watched(self, request: Request) -> AsyncIterator[Any]:
        """events() without keep-alive ticks, for a non-streaming response: a client that disconnects
        meanwhile cancels the generation (nothing is being written that would notice it)."""
        watcher = asyncio.create_task(watch_disconnect(request, self.cancel))
        try:
            async for ev in self.events():
                if ev is not None:
                    yield ev
        finally:
            watcher.cancel()
            self.cancel()  # no-op when finished; stops the engine when we leave early

    async def collect(self, request: Request) -> Result:
        """Run to the end and gather the output (non-streaming)."""
        reasoning, content, calls = [], [], []
        async for ev in self.watched(request):
            if isinstance(ev, chat.ReasoningDelta):
                reasoning.append(ev.text)
            elif isinstance(ev, (chat.ContentDelta, Text)):
                content.append(ev.text)
            elif isinstance(ev, chat.ToolCallStart):
                calls.append({"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
            elif isinstance(ev, chat.ToolCallArgsDelta):
                calls[ev.index]["function"]["arguments"] += ev.fragment
        assert self.usage is not None
        return Result("".join(reasoning), "".join(content), calls, self.finish_reason, self.usage)


async def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away (the body is already read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


# ---- small helpers shared by the front-ends --------------------------------------------------------------
def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False))
            + "\n\n").encode()


KEEPALIVE = b": keep-alive\n\n"


async def read_json(request: Request, limit: int) -> Any:
    """The request body as a JSON object (schemas.parse_body), refusing bodies over `limit` bytes before
    reading them whole; parsed in a worker thread, so a body of many MiB does not hold up the event loop."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    if not body:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")

    def parse() -> dict[str, Any]:
        value = parse_body(body)
        if b'"tools"' in body and _tools_repeat_a_key(bytes(body)):
            # json.loads keeps the last of repeated keys; a schema that says two things must not be guessed at
            raise ApiError(400, "tools: a tool schema repeats a JSON key", code="invalid_tools", param="tools")
        return value

    return await run_in_threadpool(parse)


def _tools_repeat_a_key(body: bytes) -> bool:
    raw = chat.parse_json_preserving(body.decode())
    if isinstance(raw, chat.DuplicateKeys):  # the top level itself repeats a key: look at every "tools"
        found = [v for k, v in raw if k == "tools"]
        return len(found) > 1 or any(chat.has_duplicate_keys(v) for v in found)
    return chat.has_duplicate_keys(raw.get("tools"))
