"""Anthropic Messages endpoints for Claude Code: POST /v1/messages (stream and not) and /v1/messages/count_tokens.

Requests become the same ChatTurn as the OpenAI endpoints: thinking blocks are the assistant's reasoning,
tool_use blocks its tool calls (their ids key the DSML replay store), tool_result blocks the tool messages.
Output comes back as thinking, text and tool_use content blocks; streaming sends message_start, then per
block content_block_start / _delta / _stop, then message_delta (stop reason, usage) and message_stop, with
ping events as the keep-alive. Errors use Anthropic's `{"type": "error", "error": {...}}` shape.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from ds4station.engine import chat
from ds4station.engine.sampler import SamplingParams

from . import schemas as S
from .errors import ApiError
from .generation import ChatTurn, Run, ServerState, count_prompt, sse, start
from .openai import parse_request, stream_response

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.ds4


def _messages(system: str | None, messages: list[S.AMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for m in messages:
        blocks = [S.AText(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "system":  # text blocks only (schemas.AMessage); rendered at its position (engine/chat.py)
            out.append({"role": "system", "content": "\n\n".join(b.text for b in blocks if isinstance(b, S.AText))})
            continue
        if m.role == "user":
            for b in blocks:
                if isinstance(b, S.AToolResult):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                elif isinstance(b, S.AText):
                    out.append({"role": "user", "content": b.text})
                else:
                    raise ApiError(400, f"a user message cannot carry a {b.type} block", param="messages")
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        reasoning = []
        for b in blocks:
            if isinstance(b, S.AThinking):
                reasoning.append(b.thinking)
            elif isinstance(b, S.AText):
                msg["content"] += b.text
            elif isinstance(b, S.AToolUse):
                msg.setdefault("tool_calls", []).append(
                    {"id": b.id, "type": "function",
                     "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif isinstance(b, S.AToolResult):
                raise ApiError(400, "an assistant message cannot carry a tool_result block", param="messages")
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append(msg)
    return out


def _tools(tools: list[S.ATool] | None) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, **({"description": t.description}
                                                                   if t.description is not None else {}),
                                              "parameters": t.input_schema}} for t in tools or []]


def _thinking(cfg: S.AThinkingConfig | None) -> bool:
    # Anthropic's thinking is opt-in: off unless the request enables it.
    return cfg is not None and cfg.type != "disabled"


def messages_turn(req: S.MessagesRequest) -> ChatTurn:
    choice, forced = "auto", None
    if req.tool_choice is not None:
        choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[req.tool_choice.type]
        forced = req.tool_choice.name if req.tool_choice.type == "tool" else None
    sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0)
    return ChatTurn(messages=_messages(req.system_text(), req.messages), tools=_tools(req.tools),
                    thinking=_thinking(req.thinking), tool_choice=choice, forced_tool=forced,
                    max_tokens=req.max_tokens, sampling=sampling, stop=list(req.stop_sequences or []),
                    kind="messages", call_id_prefix="toolu_")


def _stop_reason(run: Run) -> tuple[str, str | None]:
    fin = run.handle.finished
    if run.finish_reason == "length":
        return "max_tokens", None
    if run.finish_reason == "tool_calls":
        return "tool_use", None
    if fin is not None and fin.stop_string is not None:
        return "stop_sequence", fin.stop_string
    return "end_turn", None


def _usage(run: Run) -> dict[str, Any]:
    u = run.usage
    assert u is not None
    # Anthropic counts cache reads apart from input_tokens.
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:  # a call cut short by max_tokens
        return {}
    return value if isinstance(value, dict) else {}


@router.post("/v1/messages")
async def messages(request: Request) -> Any:
    st = _state(request)
    req = await parse_request(request, S.MessagesRequest)
    run = await start(st, messages_turn(req))
    mid = "msg_" + secrets.token_hex(12)
    model_name = req.model
    if req.stream:
        return stream_response(_stream(run, mid, model_name))
    res = await run.collect(request)
    content: list[dict[str, Any]] = []
    if res.reasoning:
        content.append({"type": "thinking", "thinking": res.reasoning, "signature": ""})
    if res.content:
        content.append({"type": "text", "text": res.content})
    for call in res.tool_calls:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    reason, sequence = _stop_reason(run)
    return {"id": mid, "type": "message", "role": "assistant", "model": model_name, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(run), "timings": res.usage.timings}


async def _stream(run: Run, mid: str, model_name: str) -> AsyncIterator[bytes]:
    def event(kind: str, **data: Any) -> bytes:
        return sse({"type": kind, **data}, event=kind)

    index = -1
    open_kind: str | None = None  # "thinking" | "text" | "tool_use"
    calls: dict[int, int] = {}  # parser call index -> content block index
    try:
        yield event("message_start", message={
            "id": mid, "type": "message", "role": "assistant", "model": model_name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(run.handle.job.prompt), "output_tokens": 0,
                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}})
        async for ev in run.events():
            if ev is None:
                yield event("ping")
                continue
            kind = ("thinking" if isinstance(ev, chat.ReasoningDelta) else "text" if isinstance(ev, chat.ContentDelta)
                    else "tool_use")
            if isinstance(ev, (chat.ReasoningDelta, chat.ContentDelta)) and open_kind != kind:
                if open_kind is not None:
                    yield event("content_block_stop", index=index)
                index += 1
                open_kind = kind
                block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                    {"type": "text", "text": ""}
                yield event("content_block_start", index=index, content_block=block)
            if isinstance(ev, chat.ReasoningDelta):
                yield event("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, chat.ContentDelta):
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": ev.text})
            elif isinstance(ev, chat.ToolCallStart):
                if open_kind is not None:
                    yield event("content_block_stop", index=index)
                index += 1
                open_kind = "tool_use"
                calls[ev.index] = index
                yield event("content_block_start", index=index,
                            content_block={"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            elif isinstance(ev, chat.ToolCallArgsDelta):
                yield event("content_block_delta", index=calls[ev.index],
                            delta={"type": "input_json_delta", "partial_json": ev.fragment})
            elif isinstance(ev, chat.ToolCallEnd):
                yield event("content_block_stop", index=calls[ev.index])
                open_kind = None
        if open_kind is not None:
            yield event("content_block_stop", index=index)
        reason, sequence = _stop_reason(run)
        assert run.usage is not None
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=_usage(run),
                    timings=run.usage.timings)
        yield event("message_stop")
    except ApiError as e:
        yield sse(e.anthropic_body(), event="error")
    finally:
        run.cancel()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    st = _state(request)
    req = await parse_request(request, S.CountTokensRequest)
    turn = ChatTurn(messages=_messages(req.system_text(), req.messages), tools=_tools(req.tools),
                    thinking=_thinking(req.thinking), kind="count_tokens")
    return {"input_tokens": await count_prompt(st, turn)}
