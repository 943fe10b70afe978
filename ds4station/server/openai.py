"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models and /v1/responses.

Chat Completions is what opencode, Continue and Cline speak; the Responses API is the only one Codex CLI
speaks. Both stream `reasoning`, `content` and tool calls as the chat StreamParser recognises them: each tool
call gets its own index, its id and name come first and its arguments follow in fragments; no DSML markup
ever reaches the client. Every response carries usage with `prompt_tokens_details.cached_tokens` and
llama.cpp's `timings`, the final stream chunk too.

Responses `custom` tools (Codex's freeform apply_patch) reach the model as functions with one string
parameter, `input`; their calls come back as `custom_tool_call` items whose input streams decoded, as
`response.custom_tool_call_input.delta` events.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from ds4station.engine import chat
from ds4station.engine.sampler import SamplingParams
from ds4station.engine.scheduler import Job, Text

from . import schemas as S
from .errors import ApiError, first_problem, from_validation
from .generation import (
    KEEPALIVE,
    ChatTurn,
    Run,
    ServerState,
    check_context,
    logit_bias,
    read_json,
    sse,
    start,
    submit,
    thinking_from,
)

router = APIRouter()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def validate(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e) from e


async def parse_request(request: Request, model: type[BaseModel]) -> Any:
    """The body, parsed and validated in a worker thread (a body of many MiB takes a while)."""
    body = await read_json(request, _state(request).max_body_bytes)
    return await run_in_threadpool(validate, model, body)


def _state(request: Request) -> ServerState:
    return request.app.state.ds4


def _sampling(req: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=getattr(req, "top_k", None) or 0, min_p=getattr(req, "min_p", None) or 0.0,
                    seed=getattr(req, "seed", None))


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def _max_tokens(*values: int | None) -> int | None:
    # Non-positive means "the server default", as llama.cpp and lucebox treat it.
    for v in values:
        if v is not None:
            return v if v > 0 else None
    return None


def stream_response(gen: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)


# ---- /v1/models ---------------------------------------------------------------------------------------------
@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    st = _state(request)
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": int(st.started_at),
                                        "owned_by": "ds4station", "context_length": st.ctx}]}


@router.get("/v1/models/{model_id}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    st = _state(request)
    if model_id != st.model_name:
        raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {st.model_name!r}",
                       code="model_not_found")
    return {"id": st.model_name, "object": "model", "created": int(st.started_at), "owned_by": "ds4station"}


# ---- /v1/chat/completions -----------------------------------------------------------------------------------
def chat_turn(req: S.ChatRequest) -> ChatTurn:
    messages: list[dict[str, Any]] = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        messages.append(msg)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice, forced = "auto", None
    if isinstance(req.tool_choice, S.NamedToolChoice):
        choice, forced = "function", req.tool_choice.function.name
    elif req.tool_choice is not None:
        choice = req.tool_choice
    return ChatTurn(messages=messages, tools=tools,
                    thinking=thinking_from(req.reasoning_effort, req.thinking, req.chat_template_kwargs),
                    tool_choice=choice, forced_tool=forced,
                    max_tokens=_max_tokens(req.max_completion_tokens, req.max_tokens),
                    sampling=_sampling(req), stop=_stops(req.stop), kind="chat", logit_bias=req.logit_bias)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    st = _state(request)
    req = await parse_request(request, S.ChatRequest)
    run = await start(st, chat_turn(req))
    cid = "chatcmpl-" + secrets.token_hex(12)
    model_name = req.model or st.model_name
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(_chat_stream(run, cid, model_name, include_usage))
    res = await run.collect(request)
    message: dict[str, Any] = {"role": "assistant", "content": res.content if res.content or not res.tool_calls
                               else None}
    if res.reasoning:
        message["reasoning_content"] = res.reasoning
    if res.tool_calls:
        message["tool_calls"] = res.tool_calls
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": res.finish_reason, "logprobs": None}],
            "usage": res.usage.openai(), "timings": res.usage.timings}


async def _chat_stream(run: Run, cid: str, model_name: str, include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())

    def body(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    def chunk(delta: dict[str, Any]) -> bytes:
        return sse(body(delta))

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for ev in run.events():
            if ev is None:
                yield KEEPALIVE
            elif isinstance(ev, chat.ReasoningDelta):
                yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, chat.ContentDelta):
                yield chunk({"content": ev.text})
            elif isinstance(ev, chat.ToolCallStart):
                yield chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                             "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, chat.ToolCallArgsDelta):
                yield chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
        assert run.usage is not None
        final = body({}, run.finish_reason)
        final["timings"] = run.usage.timings
        if not include_usage:  # llama.cpp puts the numbers on the last chunk; so do we
            final["usage"] = run.usage.openai()
        yield sse(final)
        if include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                       "choices": [], "usage": run.usage.openai(), "timings": run.usage.timings})
        yield sse("[DONE]")
    except ApiError as e:
        yield sse(e.openai_body())
        yield sse("[DONE]")
    finally:
        run.cancel()  # the client went away (or we are done): stop the engine within one step


# ---- /v1/completions ----------------------------------------------------------------------------------------
def _completion_prompt(tok: Any, prompt: str | list[str] | list[int]) -> tuple[list[int], str]:
    """(token ids with BOS first, text) of a completion prompt (runs in a worker thread)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = list(prompt)
        bad = [i for i in ids if not 0 <= i < tok.vocab_size]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{tok.vocab_size - 1})",
                           param="prompt")
        text = tok.decode(ids)
    else:
        text = prompt if isinstance(prompt, str) else "".join(prompt)
        ids = tok.encode(text)
    if not ids or ids[0] != tok.bos_id:
        ids = [tok.bos_id, *ids]
    return ids, text


@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    st = _state(request)
    req = await parse_request(request, S.CompletionRequest)
    tok = st.tokenizer
    texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
    check_context(st, text_chars=sum(map(len, texts)))
    ids, text = await run_in_threadpool(_completion_prompt, tok, req.prompt)
    check_context(st, len(ids))
    max_tokens = _max_tokens(req.max_tokens) or 16  # OpenAI's default for this endpoint
    job = Job(prompt=ids, max_tokens=min(max_tokens, st.ctx - len(ids)), sampling=_sampling(req),
              stop=_stops(req.stop), stop_tokens={tok.eos_id}, logit_bias=logit_bias(tok, req.logit_bias),
              kind="completion")
    run = Run(st, submit(st, job), parser=None)
    cid = "cmpl-" + secrets.token_hex(12)
    model_name = req.model or st.model_name
    echo = text if req.echo else ""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream_response(_completion_stream(run, cid, model_name, echo, include_usage))
    res = await run.collect(request)
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "text": echo + res.content, "logprobs": None,
                         "finish_reason": res.finish_reason}],
            "usage": res.usage.openai(), "timings": res.usage.timings}


async def _completion_stream(run: Run, cid: str, model_name: str, echo: str,
                             include_usage: bool) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
        return sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra})

    try:
        if echo:
            yield chunk(echo)
        async for ev in run.events():
            if ev is None:
                yield KEEPALIVE
            elif isinstance(ev, Text):
                yield chunk(ev.text)
        assert run.usage is not None
        extra = {"timings": run.usage.timings}
        if not include_usage:
            extra["usage"] = run.usage.openai()
        yield chunk("", run.finish_reason, **extra)
        if include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                       "choices": [], "usage": run.usage.openai(), "timings": run.usage.timings})
        yield sse("[DONE]")
    except ApiError as e:
        yield sse(e.openai_body())
        yield sse("[DONE]")
    finally:
        run.cancel()


# ---- /v1/responses (Codex) ----------------------------------------------------------------------------------
def custom_tool_function(tool: S.RespCustomTool) -> dict[str, Any]:
    """A custom tool as the function the model sees: one string parameter `input`, the grammar (if any) in
    the description."""
    description = tool.description or ""
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar":
        description += f"\n\nThe input must follow this {fmt.syntax} grammar:\n{fmt.definition}"
    parameters = {"type": "object", "required": ["input"], "properties": {
        "input": {"type": "string", "description": "the whole input of the tool, as raw text (not JSON)"}}}
    return {"type": "function", "function": {"name": tool.name, "description": description.strip(),
                                             "parameters": parameters}}


def model_function(namespace: S.RespNamespaceTool | None, tool: S.RespTool) -> dict[str, Any]:
    """A Responses tool as the function the model sees; a namespace member by its qualified name, the
    namespace's description before its own."""
    if isinstance(tool, S.RespCustomTool):
        fn = custom_tool_function(tool)
    else:
        fn = {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
    if namespace is not None:
        f = fn["function"]
        f["name"] = S.qualified(namespace.name, tool.name)
        if namespace.description:
            f["description"] = f"{namespace.description}\n\n{f.get('description') or ''}".strip()
    return fn


def responses_turn(req: S.ResponsesRequest) -> ChatTurn:
    """Responses input items -> chat messages. Consecutive assistant output (reasoning, message, function
    and custom tool calls) forms one assistant turn, as the model produced it; function_call_output and
    custom_tool_call_output items are tool results."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    assistant: dict[str, Any] | None = None

    def open_assistant() -> dict[str, Any]:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            messages.append(assistant)
        return assistant

    for i, raw in enumerate(items):
        where = f"input.{i}"
        if not isinstance(raw, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = raw.get("type", "message" if "role" in raw else None)
        try:
            if kind == "message":
                msg = S.RespMessage.model_validate(raw)
                if msg.role == "assistant":
                    a = open_assistant()
                    a["content"] += msg.text()
                else:
                    assistant = None
                    messages.append({"role": msg.role, "content": msg.text()})
            elif kind == "reasoning":
                item = S.RespReasoningItem.model_validate(raw)
                parts = item.content if item.content else item.summary  # the full text when we sent it
                a = open_assistant()
                a["reasoning_content"] = a.get("reasoning_content", "") + "".join(p.text or "" for p in parts)
            elif kind in ("function_call", "custom_tool_call"):
                if kind == "function_call":
                    call = S.RespFunctionCall.model_validate(raw)
                    arguments = call.arguments
                else:
                    call = S.RespCustomToolCall.model_validate(raw)
                    arguments = json.dumps({"input": call.input}, ensure_ascii=False)
                name = S.qualified(call.namespace, call.name)
                open_assistant().setdefault("tool_calls", []).append(
                    {"id": call.call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            elif kind in ("function_call_output", "custom_tool_call_output"):
                model = S.RespFunctionOutput if kind == "function_call_output" else S.RespCustomToolOutput
                out = model.model_validate(raw)
                assistant = None
                messages.append({"role": "tool", "tool_call_id": out.call_id, "content": out.text()})
            else:
                raise ApiError(400, f"{where}: item type {kind!r} is not supported by this server",
                               param=f"{where}.type")
        except ValidationError as e:
            loc, msg, _ = first_problem(e)
            raise ApiError(400, f"{where}.{loc}: {msg}" if loc else f"{where}: {msg}", code="invalid_request",
                           param=f"{where}.{loc}" if loc else where) from e
    flat = req.flat_tools()
    tools = [model_function(ns, t) for ns, t in flat if isinstance(t, S.RespFunctionTool)] + \
        [model_function(ns, t) for ns, t in flat if isinstance(t, S.RespCustomTool)]
    choice, forced = "auto", None
    if isinstance(req.tool_choice, S.RespNamedTool):
        choice, forced = "function", req.tool_choice.name
    elif req.tool_choice is not None:
        choice = req.tool_choice
    effort = req.reasoning.effort if req.reasoning else None
    return ChatTurn(messages=messages, tools=tools, thinking=thinking_from(effort, None, None),
                    tool_choice=choice, forced_tool=forced, max_tokens=_max_tokens(req.max_output_tokens),
                    sampling=_sampling(req), kind="responses")


def _resp_usage(run: Run) -> dict[str, Any]:
    """Usage as the SDK's ResponseUsage declares it. Every prefilled prompt token is written to the live KV,
    where the next turn of the conversation reuses it: those are the cache writes."""
    u = run.usage
    assert u is not None
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                     "cache_write_tokens": u.prompt_tokens - u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens, "timings": u.timings}


class _FreeformInput:
    """The `input` string of a custom tool call, decoded from its streamed function-call arguments
    (`{"input": "..."}`): feed() returns the text newly complete, finish() the whole input. Each fragment
    costs its own length (a patch of many KiB streams in thousands of fragments)."""

    _HEAD = re.compile(r'\s*\{\s*"input"\s*:\s*"')

    def __init__(self) -> None:
        self._fragments: list[str] = []
        self._pending = ""  # text not decoded yet: the opening `{"input": "`, then an escape cut in two
        self._started = False
        self._closed = False  # the string ended (or the arguments are not its shape): nothing more streams

    def feed(self, fragment: str) -> str:
        self._fragments.append(fragment)
        if self._closed:
            return ""
        s = self._pending + fragment
        if not self._started:
            head = self._HEAD.match(s)
            if head is None:
                # not (yet) the expected shape; the opening is a dozen characters: past that, it never will be
                self._closed, self._pending = len(s) > 32, s
                return ""
            self._started, s = True, s[head.end():]
        i = 0
        while i < len(s) and s[i] != '"':
            if s[i] != "\\":
                i += 1
                continue
            n = 2
            if s[i + 1:i + 2] == "u":  # \uXXXX, a high surrogate with its low half: one character
                n = 12 if s[i + 2:i + 4].lower() in ("d8", "d9", "da", "db") else 6
            if i + n > len(s):
                break
            i += n
        self._closed = i < len(s) and s[i] == '"'  # else stopped before an escape cut in two
        self._pending = s[i:]
        try:
            return json.loads('"' + s[:i] + '"')
        except ValueError:  # malformed escapes: stop streaming, finish() says what the input was
            self._closed = True
            return ""

    def finish(self) -> str:
        arguments = "".join(self._fragments)
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        if isinstance(value, dict) and isinstance(value.get("input"), str):
            return value["input"]
        strings = [v for v in value.values() if isinstance(v, str)] if isinstance(value, dict) else []
        if isinstance(value, dict) and len(value) == 1 and strings:
            return strings[0]
        return "" if value == {} else arguments


class _ResponseBuilder:
    """Turns parser events into Responses output items and, for streaming, the API's event sequence."""

    def __init__(self, req: S.ResponsesRequest, model_name: str) -> None:
        self.req = req
        self.id = "resp_" + secrets.token_hex(12)
        self.model = model_name
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # parser call index -> function_call / custom_tool_call item
        self.inputs: dict[int, _FreeformInput] = {}  # parser call index -> a custom call's input decoder
        flat = req.flat_tools()
        self.custom = {S.qualified(ns.name if ns else None, t.name) for ns, t in flat
                       if isinstance(t, S.RespCustomTool)}
        self.spaces = {S.qualified(ns.name, t.name): (ns.name, t.name) for ns, t in flat if ns is not None}

    def response(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        tools = [t.model_dump(exclude_none=True) for t in self.req.declared_tools()]
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.req.instructions, "metadata": self.req.metadata or {},
                "parallel_tool_calls": self.req.parallel_tool_calls if self.req.parallel_tool_calls is not None
                else True, "temperature": self.req.temperature, "top_p": self.req.top_p,
                "tool_choice": (self.req.tool_choice.model_dump() if isinstance(self.req.tool_choice, BaseModel)
                                else self.req.tool_choice or "auto"),
                "tools": tools, "max_output_tokens": self.req.max_output_tokens,
                "reasoning": {"effort": self.req.reasoning.effort if self.req.reasoning else None,
                              "summary": None},
                "text": {"format": {"type": "text"}}, "store": False, "truncation": "disabled"}

    def final(self, run: Run) -> dict[str, Any]:
        """The finished response, with its usage."""
        assert run.usage is not None
        status = "incomplete" if run.finish_reason == "length" else "completed"
        body = self.response(status, _resp_usage(run))
        body["timings"] = run.usage.timings
        return body

    def event(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **data}, event=kind)

    # Each method returns the stream events it implies (the non-streaming path ignores them).
    def _close_open(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None or item["type"] in ("function_call", "custom_tool_call"):
            return []
        idx = self.output.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=idx,
                               content_index=0, part=part)]
        else:
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=text))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def _text_item(self, kind: str) -> list[bytes]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close_open()
        if kind == "message":
            item = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress",
                    "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
        else:
            item = {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "status": "in_progress",
                    "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}
        self.output.append(item)
        self.open = item
        idx = len(self.output) - 1
        shown = {**item, "content": []}
        out.append(self.event("response.output_item.added", output_index=idx, item=shown))
        if kind == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def feed(self, ev: Any) -> list[bytes]:
        if isinstance(ev, (chat.ReasoningDelta, chat.ContentDelta)):
            kind = "reasoning" if isinstance(ev, chat.ReasoningDelta) else "message"
            out = self._text_item(kind)
            item = self.open
            assert item is not None
            item["content"][0]["text"] += ev.text
            idx = self.output.index(item)
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            return out + [self.event(name, item_id=item["id"], output_index=idx, content_index=0, delta=ev.text,
                                     **extra)]
        if isinstance(ev, chat.ToolCallStart):
            out = self._close_open()
            namespace, name = self.spaces.get(ev.name, (None, ev.name))
            if ev.name in self.custom:
                item = {"type": "custom_tool_call", "id": "ctc_" + secrets.token_hex(12), "call_id": ev.id,
                        "name": name, "input": "", "status": "in_progress"}
                self.inputs[ev.index] = _FreeformInput()
            else:
                item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12), "call_id": ev.id,
                        "name": name, "arguments": "", "status": "in_progress"}
            if namespace is not None:
                item["namespace"] = namespace
            self.output.append(item)
            self.calls[ev.index] = item
            self.open = item
            return out + [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]
        if isinstance(ev, chat.ToolCallArgsDelta):
            item = self.calls[ev.index]
            idx = self.output.index(item)
            if item["type"] == "custom_tool_call":
                return self._custom_input(item, idx, self.inputs[ev.index].feed(ev.fragment))
            item["arguments"] += ev.fragment
            return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                               delta=ev.fragment)]
        if isinstance(ev, chat.ToolCallEnd):
            item = self.calls[ev.index]
            item["status"] = "completed"
            idx = self.output.index(item)
            if self.open is item:
                self.open = None
            if item["type"] == "custom_tool_call":
                whole = self.inputs[ev.index].finish()
                # the streamed text is a prefix of the input unless the model wrote an odd call
                rest = whole[len(item["input"]):] if whole.startswith(item["input"]) else ""
                out = self._custom_input(item, idx, rest)
                item["input"] = whole
                return out + [self.event("response.custom_tool_call_input.done", item_id=item["id"],
                                         output_index=idx, input=whole),
                              self.event("response.output_item.done", output_index=idx, item=item)]
            return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=idx, item=item)]
        return []

    def _custom_input(self, item: dict[str, Any], idx: int, text: str) -> list[bytes]:
        if not text:
            return []
        item["input"] += text
        return [self.event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                           delta=text)]

    def finish(self) -> list[bytes]:
        out = self._close_open()
        for item in self.output:
            item["status"] = "completed"
        return out


@router.post("/v1/responses")
async def responses(request: Request) -> Any:
    st = _state(request)
    req = await parse_request(request, S.ResponsesRequest)
    run = await start(st, responses_turn(req))
    build = _ResponseBuilder(req, req.model or st.model_name)
    if req.stream:
        return stream_response(_responses_stream(run, build))
    async for ev in run.watched(request):
        build.feed(ev)
    build.finish()
    return JSONResponse(build.final(run))


async def _responses_stream(run: Run, build: _ResponseBuilder) -> AsyncIterator[bytes]:
    try:
        yield build.event("response.created", response=build.response("in_progress"))
        yield build.event("response.in_progress", response=build.response("in_progress"))
        async for ev in run.events():
            if ev is None:
                yield KEEPALIVE
                continue
            for chunk in build.feed(ev):
                yield chunk
        for chunk in build.finish():
            yield chunk
        body = build.final(run)
        yield build.event(f"response.{body['status']}", response=body)
    except ApiError as e:
        yield build.event("error", code=e.code, message=e.message, param=e.param)
    finally:
        run.cancel()
