"""Bad input never breaks the server: a corpus of malformed, mistyped, out-of-range and oversized requests, each
answered with a 4xx in the shape its SDK expects (OpenAI's `{"error": ...}`, Anthropic's `{"type": "error"}`
under /v1/messages), and the server still healthy and serving afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_server import CTX, engine, model_path, start_server  # noqa: F401  (fixtures shared with test_server)

from ds4station.server.app import BackgroundServer

BODY_LIMIT = 64 * 1024
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ATOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT, COMP, RESP, MSG, COUNT = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                "/v1/messages/count_tokens")


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 2, **kw}


def msg(**kw) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": USER, **kw}


# (id, method, path, body: dict | bytes | None, expected status)
CORPUS = [
    ("malformed-json", "POST", CHAT, b'{"messages": [', 400),
    ("not-an-object", "POST", CHAT, b"[1, 2]", 400),
    ("empty-body", "POST", CHAT, b"", 400),
    ("not-utf8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400),
    ("no-messages", "POST", CHAT, {"model": "tiny"}, 400),
    ("empty-messages", "POST", CHAT, chat(messages=[]), 400),
    ("messages-not-list", "POST", CHAT, chat(messages="hi"), 400),
    ("bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400),
    ("user-without-content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400),
    ("content-wrong-type", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400),
    ("image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), 400),
    ("temperature-range", "POST", CHAT, chat(temperature=5), 400),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), 400),
    ("top-k-negative", "POST", CHAT, chat(top_k=-1), 400),
    ("max-tokens-string", "POST", CHAT, chat(max_tokens="ten"), 400),
    ("n-two", "POST", CHAT, chat(n=2), 400),
    ("stream-string", "POST", CHAT, chat(stream="yes"), 400),
    ("too-many-stops", "POST", CHAT, chat(stop=[str(i) for i in range(20)]), 400),
    ("logprobs", "POST", CHAT, chat(logprobs=True), 400),
    ("bad-effort", "POST", CHAT, chat(reasoning_effort="ultra"), 400),
    ("logit-bias-key", "POST", CHAT, chat(logit_bias={"abc": 1}), 400),
    ("logit-bias-range", "POST", CHAT, chat(logit_bias={"5": 500}), 400),
    ("logit-bias-vocab", "POST", CHAT, chat(logit_bias={"99999": 1}), 400),
    ("tools-not-list", "POST", CHAT, chat(tools={"a": 1}), 400),
    ("tool-type", "POST", CHAT, chat(tools=[{"type": "retrieval"}]), 400),
    ("tool-name-space", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), 400),
    ("tool-schema-not-object", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), 400),
    ("tool-properties-not-object", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": [1]}}}]), 400),
    ("duplicate-tool-names", "POST", CHAT, chat(tools=[TOOL, TOOL]), 400),
    ("duplicate-schema-key", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
     b'{"name": "f", "parameters": {"type": "object", "type": "object", "properties": {}}}}]}', 400),
    ("tool-choice-unknown", "POST", CHAT,
     chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), 400),
    ("required-without-tools", "POST", CHAT, chat(tool_choice="required"), 400),
    ("tool-msg-without-id", "POST", CHAT, chat(messages=[*USER, {"role": "tool", "content": "x"}]), 400),
    ("tool-calls-on-user", "POST", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400),
    ("forced-call-budget", "POST", CHAT, chat(tools=[TOOL], tool_choice="required", max_tokens=3), 400),
    ("context-exceeded", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * (4 * CTX)}]), 400),
    ("completion-no-prompt", "POST", COMP, {"model": "tiny"}, 400),
    ("completion-token-range", "POST", COMP, {"model": "tiny", "prompt": [99999]}, 400),
    ("completion-suffix", "POST", COMP, {"model": "tiny", "prompt": "a", "suffix": "b"}, 400),
    ("completion-many-prompts", "POST", COMP, {"model": "tiny", "prompt": ["a", "b"]}, 400),
    ("responses-no-input", "POST", RESP, {"model": "tiny"}, 400),
    ("responses-item-type", "POST", RESP, {"model": "tiny", "input": [{"type": "web_search_call"}]}, 400),
    ("responses-previous-id", "POST", RESP, {"model": "tiny", "input": "x", "previous_response_id": "r1"}, 400),
    ("responses-call-without-id", "POST", RESP,
     {"model": "tiny", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400),
    ("anthropic-no-max-tokens", "POST", MSG, {"model": "tiny", "messages": USER}, 400),
    ("anthropic-only-system", "POST", MSG, msg(messages=[{"role": "system", "content": "x"}]), 400),
    ("anthropic-image-block", "POST", MSG, msg(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400),
    ("anthropic-tool-no-schema", "POST", MSG, msg(tools=[{"name": "f"}]), 400),
    ("anthropic-tool-choice-unknown", "POST", MSG, msg(tools=[ATOOL], tool_choice={"type": "tool", "name": "x"}),
     400),
    ("anthropic-result-in-assistant", "POST", MSG, msg(messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]), 400),
    ("anthropic-malformed-json", "POST", MSG, b'{"model": ', 400),
    ("count-tokens-empty", "POST", COUNT, {"model": "tiny", "messages": []}, 400),
    ("wrong-method", "GET", CHAT, None, 405),
    ("unknown-route", "POST", "/v1/nope", {}, 404),
    ("body-too-large", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]), 413),
]


@pytest.fixture(scope="module")
def server(engine, model_path) -> Iterator[BackgroundServer]:  # noqa: F811
    srv = start_server(engine, model_path, max_body_bytes=BODY_LIMIT)
    yield srv
    srv.stop()


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 30 and len({c[0] for c in CORPUS}) == len(CORPUS)


@pytest.mark.parametrize(("name", "method", "path", "body", "status"), CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_input_gets_a_shaped_4xx(server, name: str, method: str, path: str, body, status: int) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {} if body is None else {"json": body}
    r = httpx.request(method, server.url + path, timeout=30, headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, (r.status_code, r.text[:300])
    data = r.json()
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and data["error"]["type"] and data["error"]["message"]
    else:
        assert isinstance(data["error"]["message"], str) and data["error"]["type"]
    if name == "context-exceeded":
        assert data["error"]["code"] == "context_length_exceeded"
        assert str(CTX) in data["error"]["message"]  # the limit and the prompt's token count are named


def test_server_is_healthy_after_the_corpus(server) -> None:
    """Runs after the corpus (tests run in file order) on the same server."""
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = httpx.post(server.url + CHAT, json=chat(thinking=False), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(server.url + "/metrics").text
    assert 'status="400"' in metrics and 'status="500"' not in metrics
