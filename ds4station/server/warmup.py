"""The server's own first requests: one streamed request per API dialect through the whole ASGI stack
(middleware, routing, body validation, the chat template and tokenizer, the stream parser, the SSE writers),
made in this process once the engine is ready and before /health says so.

The scheduler's warm-up pays the engine's first-use costs; this pays the server's (each dialect's code path
and models on first use, the tokenizer's thread pool, ...), which on the H200 had the first request's client
wait ~30 ms longer than the later ones' beyond the engine's own time. The requests run under `WARMING` (a
context variable the request handlers inherit): their jobs are scheduler warm-ups (no stats, no trace, no
session left behind) and the request counter skips them.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message

log = logging.getLogger(__name__)

WARMING: contextvars.ContextVar[bool] = contextvars.ContextVar("ds4station_warming", default=False)

_TOOL = {"name": "get_time", "description": "The time in a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def requests(model: str) -> list[tuple[str, dict[str, Any], tuple[bytes, ...]]]:
    """(path, body, how a whole answer ends) of the warm-up requests: each dialect streamed, with a tool."""
    text = "warm up"
    return [
        ("/v1/chat/completions", {"model": model, "stream": True, "max_tokens": 2,
                                  "messages": [{"role": "system", "content": text}, {"role": "user", "content": text}],
                                  "tools": [{"type": "function", "function": _TOOL}]}, (b"data: [DONE]",)),
        ("/v1/messages", {"model": model, "stream": True, "max_tokens": 2, "system": text,
                          "messages": [{"role": "user", "content": text}],
                          "tools": [{"name": _TOOL["name"], "description": _TOOL["description"],
                                     "input_schema": _TOOL["parameters"]}]}, (b"event: message_stop",)),
        ("/v1/responses", {"model": model, "stream": True, "max_output_tokens": 16, "instructions": text,
                           "input": text, "tools": [{"type": "function", **_TOOL}]},
         (b"response.completed", b"response.incomplete")),
    ]


async def call(app: ASGIApp, path: str, body: dict[str, Any], api_key: str | None) -> tuple[int, bytes]:
    """POST `body` to `path` of `app` in this process, as a loopback client would; -> (status, response body)."""
    raw = json.dumps(body).encode()
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode()), (b"anthropic-version", b"2023-06-01")]
    if api_key:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent = False
    status, chunks = 500, []
    finished = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await finished.wait()  # a client that stays until the whole answer is in (a stream watches for this)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                finished.set()

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def warm(app: ASGIApp, model: str, api_key: str | None) -> list[str]:
    """Run the warm-up requests; -> what failed (an empty list when all answered 200). Never raises: a failed
    warm-up costs the first client its first-use costs, not the server."""
    token = WARMING.set(True)
    failed = []
    try:
        for path, body, ends in requests(model):
            try:
                status, text = await call(app, path, body, api_key)
            except Exception as exc:  # the server still serves; the log says why its first request may be slow
                failed.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            if status != 200:
                failed.append(f"{path}: {status} {text[:200].decode(errors='replace')}")
            elif not any(end in text for end in ends):
                failed.append(f"{path}: the stream did not finish: ...{text[-200:].decode(errors='replace')}")
    finally:
        WARMING.reset(token)
    for f in failed:
        log.warning("server warm-up request failed: %s", f)
    return failed
