"""The request trace (`serve --trace FILE`, server/trace.py): a real server on the tiny model driven by the openai
SDK writes one valid JSON line per request, with the prompt's hash and length, the live-KV decision (miss, then
a hit that extends the session), the output as the client saw it and the tool calls; the file rotates by size
and keeps N old files."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import openai
import pytest

from ds4station.commands import serve
from ds4station.engine.demo import make_model
from ds4station.engine.scheduler import Scheduler
from ds4station.server.app import BackgroundServer
from ds4station.server.toolguide import ToolCallGuide
from ds4station.server.trace import RequestTrace, prompt_hash

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NO_THINK = {"thinking": False}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("trace") / "tiny.gguf", preset="tiny", seed=0, quant="q2")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_serve_trace_records_each_request_as_a_json_line(model_path: Path, tmp_path: Path) -> None:
    trace = tmp_path / "logs" / "trace.jsonl"
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_path), "--ctx", "1024", "--sessions", "1", "--device", "cpu",
                              "--trace", str(trace), "--trace-max-mb", "1"])
    app, _ = serve.build(args)
    srv = BackgroundServer(app).start()
    try:
        scheduler = app.state.ds4.scheduler
        assert srv.wait_ready(60) and scheduler.state == "ready"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = [{"role": "user", "content": "What is the weather in Paris?"}]
        a = client.chat.completions.create(model="tiny", messages=first, max_tokens=5, temperature=0,
                                           extra_body=NO_THINK)
        assert scheduler.wait_idle(30)  # the answer settles into the live KV: the next turn extends it
        follow = [*first, {"role": "assistant", "content": a.choices[0].message.content},
                  {"role": "user", "content": "And in Rome?"}]
        client.chat.completions.create(model="tiny", messages=follow, max_tokens=3, temperature=0,
                                       extra_body=NO_THINK)
        budget = ToolCallGuide(app.state.ds4.tokenizer, [WEATHER["function"]], 10**6).min_tokens + 6
        call = client.chat.completions.create(model="tiny", messages=first, tools=[WEATHER], max_tokens=budget,
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              temperature=0.8, seed=1, extra_body=NO_THINK)
        done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, temperature=0)
        again = client.chat.completions.create(model="tiny", messages=first, max_tokens=5, temperature=0,
                                               extra_body=NO_THINK)
    finally:
        srv.stop()
    recs = lines(trace)
    assert [r["kind"] for r in recs] == ["chat", "chat", "chat", "completion", "chat"]
    one, two, tool, comp, retry = recs
    for rec in recs:
        assert rec["time"].endswith("+00:00") and rec["finish_reason"] in ("length", "stop") and rec["error"] is None
        assert rec["prompt"]["tokens"] > 0 and len(rec["prompt"]["sha256"]) == 64
        assert rec["cache"]["reused"] + rec["cache"]["prefilled"] == rec["prompt"]["tokens"]
        assert set(rec["timings"]) == {"queue_ms", "prompt_ms", "ttft_ms", "predicted_ms", "total_ms"}
    assert one["cache"]["outcome"] == "miss" and one["cache"]["reused"] == 0
    assert two["cache"]["outcome"] == "hit" and "extends" in two["cache"]["why"]
    assert two["cache"]["reused"] >= one["prompt"]["tokens"]  # the whole first turn came from the live KV
    assert one["output"]["content"] == a.choices[0].message.content and one["output"]["tokens"] == 5
    assert one["prompt"]["sha256"] == retry["prompt"]["sha256"] != two["prompt"]["sha256"]
    assert retry["output"]["content"] == again.choices[0].message.content
    assert tool["output"]["tool_calls"] == [{"name": "get_weather",
                                             "arguments": call.choices[0].message.tool_calls[0].function.arguments}]
    assert comp["output"]["text"] == done.choices[0].text and "tool_calls" not in comp["output"]


def test_the_trace_rotates_by_size_and_keeps_n_files(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"n": -1}) + "\n")  # an existing trace is continued, not overwritten
    trace = RequestTrace(path, Scheduler(lambda: None), max_bytes=1000, keep=2)
    for n in range(20):
        trace.write({"n": n, "pad": "x" * 200})
    trace.close()
    files = [path, path.with_name("trace.jsonl.1"), path.with_name("trace.jsonl.2")]
    assert all(f.exists() and 0 < f.stat().st_size <= 1000 for f in files)
    assert not path.with_name("trace.jsonl.3").exists()
    kept = [r["n"] for f in reversed(files) for r in lines(f)]  # oldest kept file first
    assert kept == list(range(kept[0], 20)) and kept[0] > 0  # consecutive up to the newest; the oldest gone

    trace = RequestTrace(path, Scheduler(lambda: None), max_bytes=300, keep=0)
    trace.write({"pad": "y" * 200})
    trace.write({"pad": "z" * 200})  # no old files kept: the trace starts again
    trace.close()
    assert [r["pad"][0] for r in lines(path)] == ["z"]


def test_prompt_hash_is_of_the_token_ids_as_little_endian_uint32() -> None:
    ids = [1, 128803, 7]
    assert prompt_hash(ids) == hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in ids)).hexdigest()
    assert prompt_hash(ids) != prompt_hash([1, 128803, 8])
