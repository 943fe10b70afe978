"""The API server end to end: a real uvicorn server on a free port, the official `openai` and `anthropic` SDKs as
clients, the tiny random model on CPU. Covers chat (stream / non-stream, tools, reasoning), completions, models,
the Responses API, Anthropic messages and count_tokens, operations endpoints, live-KV reuse across a tool call
(with negative controls), cancellation on disconnect, the bounded queue, auth, CORS and determinism."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from ds4station.engine import chat
from ds4station.engine.demo import make_model
from ds4station.engine.scheduler import Scheduler, common_prefix
from ds4station.server.app import BackgroundServer, create_app
from ds4station.server.toolguide import ToolCallGuide

CTX = 2048
ROLLBACK = 512  # what `serve` asks for by default: agent turns roll back a few hundred tokens
SYSTEM = "You are a helpful assistant."
USER = "What is the weather in Paris?"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {}}}},
]
NO_THINK = {"thinking": False}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory):
    return make_model(tmp_path_factory.mktemp("model") / "tiny.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def engine(model_path):
    from ds4station.engine.engine import Engine

    return Engine.load(model_path, ctx=CTX, device="cpu", sessions=8, rollback=ROLLBACK)


def start_server(engine, model_path, *, sessions: int = 2, max_queue: int = 16, look_ahead: bool | None = None,
                 **kw) -> BackgroundServer:
    scheduler = Scheduler(lambda: engine, sessions=sessions, max_queue=max_queue, ctx=CTX, owns_engine=False,
                          look_ahead=look_ahead)
    app = create_app(scheduler, model_name="tiny", model_path=str(model_path), ctx=CTX, **kw)
    srv = BackgroundServer(app).start()
    assert srv.wait_ready(30) and scheduler.state == "ready"
    return srv


@pytest.fixture(scope="module")
def server(engine, model_path) -> Iterator[BackgroundServer]:
    srv = start_server(engine, model_path)
    yield srv
    srv.stop()


@pytest.fixture
def fresh(engine, model_path) -> Iterator:
    """A server of its own (empty live KV), sharing the loaded engine."""
    made: list[BackgroundServer] = []

    def make(**kw) -> BackgroundServer:
        made.append(start_server(engine, model_path, **kw))
        return made[-1]

    yield make
    for srv in made:
        srv.stop()


def oai(srv: BackgroundServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def ant(srv: BackgroundServer, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def base_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


@pytest.fixture(scope="module")
def call_tokens(engine) -> int:
    """max_tokens for a forced get_weather call: its DSML structure plus a few tokens for the values (the
    demo vocabulary spells DSML in many small tokens; every token is a CPU decode step)."""
    return ToolCallGuide(engine.tokenizer, [TOOLS[0]["function"]], 10**6).min_tokens + 6


def forced_weather(client: openai.OpenAI, messages: list[dict], budget: int, tools: list[dict] = TOOLS, **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=budget, temperature=0.8, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINK, **kw)


def turn_ids(engine, messages: list[dict], tools: list[dict], thinking: bool = False) -> list[int]:
    """Token ids of a conversation as the server renders it (no generation prompt): the previous turn."""
    return engine.tokenizer.encode(chat.render_prompt(messages, chat.canonical_tools(tools), thinking,
                                                      add_generation_prompt=False))


def first_difference(a: list[int], b: list[int]) -> int:
    return common_prefix(a, b)


def assistant_turn(message) -> dict:
    return {"role": "assistant", "content": message.content or "",
            "tool_calls": [tc.model_dump() for tc in message.tool_calls]}


# ---- basics ---------------------------------------------------------------------------------------------------
def test_models_health_status_metrics(server) -> None:
    models = oai(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    st = httpx.get(server.url + "/status").json()
    assert st["state"] == "ready" and st["model"]["ctx"] == CTX and st["model"]["config"]["n_layers"] == 6
    assert st["sessions"]["capacity"] == 2 and st["queue"]["capacity"] == 16 and st["route"]
    oai(server).chat.completions.create(model="tiny", messages=base_messages(), max_tokens=3, extra_body=NO_THINK)
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("ds4_http_requests_total", "ds4_generations_total", "ds4_time_to_first_token_seconds_bucket",
                 "ds4_time_per_output_token_seconds_bucket", "ds4_kv_bytes", "ds4_prefix_cache_hits_total",
                 "ds4_prefix_checkpoint_hits_total",
                 "ds4_completion_tokens_total"):
        assert name in metrics, name
    st = httpx.get(server.url + "/status").json()
    assert st["totals"]["requests"] >= 1 and st["sessions"]["kv_bytes"] > 0 and st["throughput"]["recent"]


def test_chat_stream_and_non_stream_agree_at_temperature_zero(server) -> None:
    client = oai(server)
    kw = dict(model="tiny", messages=base_messages(), max_tokens=12, temperature=0, extra_body=NO_THINK)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content  # byte-identical
    assert a.choices[0].finish_reason in ("length", "stop")
    assert a.usage.prompt_tokens_details.cached_tokens is not None
    timings = a.model_extra["timings"]
    assert timings["predicted_n"] == a.usage.completion_tokens and timings["prompt_n"] + timings["cache_n"] == \
        a.usage.prompt_tokens
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == a.choices[0].finish_reason
    assert "timings" in finals[0].model_extra
    usage_chunk = chunks[-1]
    assert usage_chunk.usage.completion_tokens == a.usage.completion_tokens
    assert usage_chunk.model_extra["timings"]["predicted_n"] == a.usage.completion_tokens


def test_decode_ahead_serves_the_same_agent_turns(engine, fresh, call_tokens) -> None:
    """Decode steps queued before their tokens are read (what a lone CUDA stage does: forced on here) give,
    through the API, the texts of the plain loop: streamed with tools offered, cut by a stop string, with a
    forced tool call; and the next turn of the conversation reuses as many tokens; /metrics counts the steps."""
    plain, ahead = fresh(), fresh(look_ahead=True)
    kw = dict(model="tiny", max_tokens=40, temperature=0, extra_body=NO_THINK)

    def turns(srv: BackgroundServer) -> list:
        client, out = oai(srv), []
        chunks = client.chat.completions.create(messages=base_messages(), tools=TOOLS, stream=True, **kw)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        out.append(text)
        stop = text[len(text) // 2:][:4]
        first = client.chat.completions.create(messages=base_messages(), tools=TOOLS, stop=[stop], **kw)
        cut = first.choices[0]
        out.append((cut.message.content, cut.finish_reason, first.usage.prompt_tokens))
        time.sleep(0.2)  # past the settling grace: the turn is settled
        follow = [*base_messages(), {"role": "assistant", "content": cut.message.content},
                  {"role": "user", "content": "And tomorrow?"}]
        again = client.chat.completions.create(messages=follow, tools=TOOLS, **kw)
        out.append((again.choices[0].message.content, again.usage.prompt_tokens_details.cached_tokens))
        call = client.chat.completions.create(messages=base_messages(), tools=TOOLS[:1], tool_choice="required",
                                              **{**kw, "max_tokens": call_tokens})
        out.append(call.choices[0].message.tool_calls[0].function.model_dump())
        return out

    want, got = turns(plain), turns(ahead)
    assert got == want and want[1][1] == "stop"
    assert want[2][1] >= want[1][2]  # turn 2 reused turn 1's prompt and (settled) answer
    metric = [line for line in httpx.get(ahead.url + "/metrics").text.splitlines()
              if line.startswith("ds4_decode_ahead_steps_total")]
    assert metric and float(metric[0].split()[-1]) > 0, metric
    assert _status(plain)["batch"]["ahead_steps"] == 0


def test_thinking_streams_reasoning_content(server) -> None:
    stream = oai(server).chat.completions.create(model="tiny", messages=base_messages(), max_tokens=8,
                                                 temperature=0, reasoning_effort="high", stream=True)
    reasoning = content = ""
    for c in stream:
        if c.choices:
            d = c.choices[0].delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
    assert reasoning  # the model starts inside <think>; its text arrives as reasoning, not content
    assert "<think>" not in content and "</think>" not in reasoning + content


def test_completions_endpoint(server) -> None:
    client = oai(server)
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    echo = client.completions.create(model="tiny", prompt="The quick", max_tokens=2, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("The quick")
    token = client.completions.create(model="tiny", prompt="The quick", max_tokens=3, temperature=0,
                                      logit_bias={"300": 100})
    word = server.server.config.app.state.ds4.tokenizer.decode([300])
    assert token.choices[0].text == word * 3  # +100 makes token 300 the argmax at every step


# ---- tool calls and live-KV reuse -----------------------------------------------------------------------------
def test_tool_call_stream_deltas(server, call_tokens) -> None:
    stream = forced_weather(oai(server), base_messages(), call_tokens, stream=True)
    deltas, finish = [], None
    for c in stream:
        if c.choices:
            deltas.append(c.choices[0].delta)
            finish = c.choices[0].finish_reason or finish
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls and calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    args = json.loads("".join(tc.function.arguments or "" for tc in calls))
    assert list(args) == ["city", "unit"] and args["unit"] in ("celsius", "fahrenheit")
    assert finish == "tool_calls"
    wire = json.dumps([d.model_dump() for d in deltas], ensure_ascii=False)
    assert "DSML" not in wire and "｜" not in wire  # no markup leaks


def test_tool_continuation_reuses_the_whole_previous_turn(engine, fresh, call_tokens) -> None:
    srv = fresh(sessions=2)
    client = oai(srv)
    msgs = base_messages()
    r1 = forced_weather(client, msgs, call_tokens)
    assert r1.choices[0].finish_reason == "tool_calls"
    call = r1.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)

    # an unrelated request in between takes the other slot and leaves this conversation's KV alone
    oai(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=3,
                                     extra_body=NO_THINK)
    # the agent runs its tool meanwhile: the server settles the finished turns while it is idle
    assert srv.server.config.app.state.ds4.scheduler.wait_idle(30)

    history = [*msgs, assistant_turn(r1.choices[0].message)]
    previous = turn_ids(engine, history, TOOLS)
    follow = [*history, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r2 = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=4,
                                        extra_body=NO_THINK)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(previous), (cached, len(previous))
    assert r2.model_extra["timings"]["prompt_n"] == r2.usage.prompt_tokens - cached

    # the same continuation with the tools and their JSON keys reordered (property order kept) still hits
    shuffled = [copy.deepcopy(t) for t in reversed(TOOLS)]
    for t in shuffled:
        t["function"] = dict(reversed(list(t["function"].items())))
        t["function"]["parameters"] = dict(reversed(list(t["function"]["parameters"].items())))
    reordered_call = json.loads(call.function.arguments)
    follow_r = copy.deepcopy(follow)
    follow_r[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(dict(reversed(list(reordered_call.items()))))
    r3 = client.chat.completions.create(model="tiny", messages=follow_r, tools=shuffled, max_tokens=4,
                                        extra_body=NO_THINK)
    assert r3.usage.prompt_tokens == r2.usage.prompt_tokens
    assert r3.usage.prompt_tokens_details.cached_tokens >= len(previous)

    # negative controls: a changed description or property order is a real change -> re-prefill from there
    changed = copy.deepcopy(TOOLS)
    changed[0]["function"]["description"] = "Get the weather of any city"
    d = first_difference(turn_ids(engine, history, changed), previous)
    r4 = client.chat.completions.create(model="tiny", messages=follow, tools=changed, max_tokens=2,
                                        extra_body=NO_THINK)
    assert r4.usage.prompt_tokens_details.cached_tokens <= d < len(previous)
    reordered = copy.deepcopy(TOOLS)
    props = reordered[0]["function"]["parameters"]["properties"]
    reordered[0]["function"]["parameters"]["properties"] = dict(reversed(list(props.items())))
    d = first_difference(turn_ids(engine, history, reordered), previous)
    r5 = client.chat.completions.create(model="tiny", messages=follow, tools=reordered, max_tokens=2,
                                        extra_body=NO_THINK)
    assert r5.usage.prompt_tokens_details.cached_tokens <= d < len(previous)


def test_responses_function_call_and_output(server, call_tokens) -> None:
    client = oai(server)
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    inp = [{"role": "user", "content": USER}]
    r1 = client.responses.create(model="tiny", instructions=SYSTEM, input=inp, tools=tools,
                                 max_output_tokens=call_tokens, tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0.8, reasoning={"effort": "none"})
    calls = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    prompt1 = r1.usage.input_tokens
    follow = [*inp, {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                     "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 degrees"}]
    events = list(client.responses.create(model="tiny", instructions=SYSTEM, input=follow, tools=tools,
                                          max_output_tokens=4, reasoning={"effort": "none"}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == sorted(e.sequence_number for e in events)
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens >= prompt1 + r1.usage.output_tokens - 8
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "".join(c.text for o in final.output if o.type == "message" for c in o.content)


def test_responses_stream_function_call_events(server, call_tokens) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    events = list(oai(server).responses.create(model="tiny", input=USER, tools=tools,
                                               max_output_tokens=call_tokens, tool_choice="required",
                                               reasoning={"effort": "none"}, stream=True))
    kinds = [e.type for e in events]
    i_added = kinds.index("response.output_item.added")
    assert events[i_added].item.type == "function_call" and events[i_added].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments and json.loads(done.arguments)
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    assert kinds[-1] == "response.completed"


def test_anthropic_messages_tool_use_and_continuation(server, call_tokens) -> None:
    client = ant(server)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    msgs = [{"role": "user", "content": USER}]
    r1 = client.messages.create(model="tiny", system=SYSTEM, max_tokens=call_tokens, messages=msgs, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0.8})  # this SDK no longer sends it itself
    assert r1.stop_reason == "tool_use"
    use = [b for b in r1.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and set(use[0].input) == {"city", "unit"}
    assert use[0].id.startswith("toolu_")
    follow = [*msgs, {"role": "assistant", "content": [b.model_dump() for b in r1.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "21 C"}]}]
    count = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=follow, tools=tools)
    with client.messages.stream(model="tiny", system=SYSTEM, max_tokens=4, messages=follow, tools=tools) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.stop_reason in ("max_tokens", "end_turn")
    assert final.usage.cache_read_input_tokens >= r1.usage.input_tokens + r1.usage.output_tokens - 8
    assert count.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_anthropic_text_and_thinking_blocks(server) -> None:
    client = ant(server)
    r = client.messages.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    assert r.content and r.content[0].type == "thinking" and r.content[0].thinking
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 6
    with client.messages.stream(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "enabled", "budget_tokens": 1024},
                                extra_body={"temperature": 0}) as s:
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in r.content]


# ---- operations ------------------------------------------------------------------------------------------------
def _status(srv: BackgroundServer) -> dict:
    return httpx.get(srv.url + "/status").json()


def long_body(engine, **kw) -> dict:
    """A request that keeps the engine busy: 1000 tokens with EOS biased away (a random model may end early)."""
    return {"model": "tiny", "messages": base_messages(), "max_tokens": 1000, "stream": True, "thinking": False,
            "seed": 7, "logit_bias": {str(engine.tokenizer.eos_id): -100}, **kw}


def test_status_shows_the_running_requests_rate_while_it_runs(engine, fresh) -> None:
    """/status reports the running request's phase, tokens so far and its rate in that phase (what the panel
    shows at its refresh rate), consistent with the tokens the client has received."""
    srv = fresh()
    received = 0
    seen = None
    with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + "/v1/chat/completions",
                                                       json=long_body(engine)) as r:
        for line in r.iter_lines():
            # chunks with text: each holds one token or more (the role chunk's content is "", and so is that of
            # a token whose bytes end inside a character)
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                received += 1
                if received == 20:
                    seen = _status(srv)["running"][0]
                    break
    assert seen is not None and seen["phase"] == "decode" and seen["generated"] >= 20
    assert seen["tokens_per_second"] > 0 and seen["phase_s"] > 0
    assert abs(seen["tokens_per_second"] - seen["generated"] / seen["phase_s"]) < 0.2 * seen["tokens_per_second"]


def test_disconnect_cancels_generation(engine, fresh) -> None:
    srv = fresh()
    body = long_body(engine)
    received = 0
    with httpx.Client(timeout=60) as http, http.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                received += 1
                if received >= 3:
                    break
    closed = time.monotonic()
    while _status(srv)["running"]:
        assert time.monotonic() - closed < 10, "generation kept running after the client left"
        time.sleep(0.02)
    st = _status(srv)
    assert st["totals"]["cancelled"] == 1
    rec = st["throughput"]["recent"][-1]
    # of 1000 tokens, only those decoded while the disconnect travelled through uvicorn (a step or two)
    assert rec["reason"] == "cancelled" and rec["completion_tokens"] <= received + 5, rec

    # a non-streaming client that gives up cancels too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 10
    while _status(srv)["totals"]["cancelled"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_concurrent_clients_all_complete(server) -> None:
    def one(i: int) -> str:
        r = oai(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"n{i}"}],
                                                max_tokens=3, temperature=0, extra_body=NO_THINK)
        return r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        reasons = list(pool.map(one, range(6)))
    assert len(reasons) == 6 and all(r in ("length", "stop") for r in reasons)


def test_full_queue_answers_503_with_retry_after_and_keepalives_flow(engine, fresh) -> None:
    srv = fresh(max_queue=1, keepalive_s=0.05, sessions=1)  # one running request: the next one waits
    body = long_body(engine)
    started, release = threading.Event(), threading.Event()
    raw_queued: list[str] = []

    held: list[str] = []

    def hold_engine() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            held.append(str(r.status_code))
            for line in r.iter_lines():
                if len(held) < 4:
                    held.append(line[:300])
                if '"content"' in line:
                    started.set()
                if release.is_set():
                    break  # leaving cancels this generation and frees the engine for the queued one

    def queued() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                          json={**body, "max_tokens": 2}) as r:
            for line in r.iter_lines():
                raw_queued.append(line)

    holder = threading.Thread(target=hold_engine)
    holder.start()
    assert started.wait(30), (held, _status(srv)["queue"], _status(srv)["state"])
    waiter = threading.Thread(target=queued)
    waiter.start()
    deadline = time.monotonic() + 10
    while _status(srv)["queue"]["length"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    refused = httpx.post(srv.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=10)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "server_busy"
    assert any(line.startswith(": keep-alive") for line in raw_queued)  # the waiting stream stays alive
    release.set()
    holder.join(60)
    waiter.join(60)
    assert raw_queued[-1] == "data: [DONE]" or raw_queued[-2] == "data: [DONE]"
    assert httpx.get(srv.url + "/health").status_code == 200


def test_api_key_is_enforced(fresh) -> None:
    srv = fresh(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        oai(srv, "wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError):
        ant(srv, "wrong").messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert oai(srv, "s3cret").models.list().data[0].id == "tiny"  # Authorization: Bearer
    r = ant(srv, "s3cret").messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert r.usage.output_tokens == 1  # x-api-key
    assert httpx.get(srv.url + "/health").status_code == 200  # liveness needs no key
    assert httpx.get(srv.url + "/status").status_code == 401
    assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_cors_is_off_unless_origins_are_named(server, fresh) -> None:
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers
    srv = fresh(cors=["http://app.example"])
    r = httpx.options(srv.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(srv.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "http://evil.example"


def test_health_is_503_while_loading_and_names_a_failed_load(model_path, tmp_path) -> None:
    from ds4station.engine.engine import Engine

    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return Engine.load(model_path, ctx=256, device="cpu")

    srv = BackgroundServer(create_app(Scheduler(slow_load, ctx=256), model_name="tiny", model_path=str(model_path),
                                      ctx=256)).start()
    try:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and r.headers["retry-after"]
        busy = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_not_ready"
        gate.set()
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        gate.set()
        srv.stop()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    srv = BackgroundServer(create_app(Scheduler(lambda: Engine.load(broken, ctx=256, device="cpu")), model_name="x",
                                      model_path=str(broken), ctx=256)).start()
    try:
        deadline = time.monotonic() + 30
        while (r := httpx.get(srv.url + "/health")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 503 and "broken.gguf" in r.json()["reason"]
    finally:
        srv.stop()


def test_serve_command_builds_a_working_server(model_path) -> None:
    import argparse

    from ds4station.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_path), "--ctx", "512", "--sessions", "1", "--api-key", "k"])
    assert args.host == "127.0.0.1" and args.port == 8000  # loopback unless told otherwise
    app, where = serve.build(args)
    srv = BackgroundServer(app).start()
    try:
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert oai(srv, "k").models.list().data[0].id == "tiny"
        st = httpx.get(srv.url + "/status", headers={"x-api-key": "k"}).json()
        assert st["model"]["ctx"] == 512 and st["sessions"]["capacity"] == 1
        stage = st["stages"][0]  # loading progress, reported in weight bytes (the panel draws it)
        assert stage["loaded_bytes"] == stage["weights_bytes"] > 0
    finally:
        srv.stop()
