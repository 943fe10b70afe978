"""DS4 chat format: golden prompts, DSML round trips, the streaming parser, tool-schema canonicalisation.

Golden prompts (tests/golden/*.txt) were produced by DeepSeek's reference renderer `encoding/encoding_dsv4.py`
from the DeepSeek-V4 release (tools attached to the first system message, or to an empty one inserted at the
front, as servers built on it do). reference_case_{1,2}.{json,txt} are the release's own test vectors
(encoding/tests/test_input_N.json, test_output_N.txt), unchanged; the other cases are ours, rendered by it.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from ds4station.engine.chat import (
    TOOL_CALLS_END,
    ChatFormatError,
    ContentDelta,
    DuplicateKeys,
    ReasoningDelta,
    StreamParser,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    canonical_tools,
    dump_json,
    parse_completion,
    parse_json_preserving,
    render_prompt,
    render_tool_calls,
)
from ds4station.engine.tokenizer import ASSISTANT, EOS, THINK_END, THINK_START, USER

GOLDEN = Path(__file__).parent / "golden"


def _case(name: str) -> dict:
    data = json.loads((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))
    if name == "reference_case_1":
        return {"messages": data["messages"], "tools": data["tools"], "thinking": True}
    if name == "reference_case_2":
        return {"messages": data, "tools": None, "thinking": True}
    return data


GOLDEN_CASES = ["reference_case_1", "reference_case_2", "chat_tools_no_system", "thinking_no_tools_multiturn",
                "thinking_tools_history", "thinking_max_effort"]


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden_prompt(name: str) -> None:
    case = _case(name)
    expected = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
    prompt = render_prompt(case["messages"], tools=case["tools"], thinking=case["thinking"],
                           reasoning_effort=case.get("reasoning_effort"))
    assert prompt == expected


def _assistant_spans(prompt: str, opening: str) -> list[str]:
    """Each assistant turn as the model generated it: after the opening, up to the next user turn."""
    return [part.split(USER)[0] for part in prompt.split(ASSISTANT + opening)[1:]]


@pytest.mark.parametrize("name,opening", [("reference_case_1", THINK_START), ("chat_tools_no_system", THINK_END),
                                          ("thinking_tools_history", THINK_START)])
def test_golden_assistant_turns_parse_back(name: str, opening: str) -> None:
    case = _case(name)
    prompt = (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")
    assistants = [m for m in case["messages"] if m["role"] == "assistant"]
    spans = _assistant_spans(prompt, opening)
    assert len(spans) >= len(assistants)
    for message, span in zip(assistants, spans[:len(assistants)], strict=True):
        reasoning, content, calls = parse_completion(span, thinking=opening == THINK_START)
        assert reasoning == (message.get("reasoning_content") or "" if opening == THINK_START else "")
        assert content == (message.get("content") or "")
        sent = message.get("tool_calls") or []
        assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in sent]
        for got, want in zip(calls, sent, strict=True):
            try:
                want_args = json.loads(want["function"]["arguments"])
            except ValueError:  # not JSON: rendered as one string parameter named "arguments"
                want_args = {"arguments": want["function"]["arguments"]}
            assert json.loads(got["function"]["arguments"]) == want_args


def test_parsed_arguments_match_reference_text() -> None:
    # encoding_dsv4.decode_dsml_to_arguments joins parameters as '"k": v' with ", "; so do our fragments.
    prompt = (GOLDEN / "reference_case_1.txt").read_text(encoding="utf-8")
    _, _, calls = parse_completion(_assistant_spans(prompt, THINK_START)[0], thinking=True)
    assert calls[0]["function"]["arguments"] == '{"location": "Beijing", "unit": "celsius"}'


def test_generation_prompt_and_thinking_switch() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(messages, thinking=True).endswith(USER + "hi" + ASSISTANT + THINK_START)
    assert render_prompt(messages, thinking=False).endswith(USER + "hi" + ASSISTANT + THINK_END)
    assert render_prompt(messages, add_generation_prompt=False).endswith(USER + "hi")
    finished = [*messages, {"role": "assistant", "content": "hello", "reasoning_content": "r"}]
    assert render_prompt(finished, thinking=True).endswith(ASSISTANT + THINK_START + "r" + THINK_END + "hello" + EOS)


def test_reasoning_effort() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(messages, reasoning_effort="max") == render_prompt(messages)  # thinking only
    assert render_prompt(messages, thinking=True, reasoning_effort="high") == render_prompt(messages, thinking=True)
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        render_prompt(messages, reasoning_effort="extreme")


def test_content_parts_and_developer_role() -> None:
    as_text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
    as_parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_prompt(as_parts) == render_prompt(as_text)


def test_rejects_what_it_cannot_render() -> None:
    with pytest.raises(ChatFormatError, match="role"):
        render_prompt([{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatFormatError, match="image_url"):
        render_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatFormatError, match="dict"):
        render_prompt([{"role": "tool", "content": {"result": 1}}])


def test_replay_substitutes_sampled_dsml() -> None:
    case = _case("chat_tools_no_system")
    sampled = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke  name="get_weather">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    golden = (GOLDEN / "chat_tools_no_system.txt").read_text(encoding="utf-8")
    asked = []

    def replay(call_id: str) -> str | None:
        asked.append(call_id)
        return sampled if call_id == "call_a" else None

    prompt = render_prompt(case["messages"], tools=case["tools"], replay=replay)
    assert asked == ["call_a"]
    rendered = render_tool_calls(case["messages"][1]["tool_calls"])
    assert rendered in golden and prompt == golden.replace(rendered, sampled)
    assert render_prompt(case["messages"], tools=case["tools"], replay=lambda _: None) == golden


# ---- DSML round trips ---------------------------------------------------------------------------------------
CALLS = [
    {"id": "1", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(
        {"path": "/tmp/a b.txt", "text": 'line 1\nline "2" \\ <tag> & </think> ｜ 🎉', "mode": 420, "append": False})}},
    {"id": "2", "type": "function", "function": {"name": "query", "arguments": json.dumps(
        {"filters": {"tags": ["x", "y"], "since": None}, "limit": 2.5, "q": ""}, ensure_ascii=False)}},
    {"id": "3", "type": "function", "function": {"name": "no_args", "arguments": "{}"}},
    {"id": "4", "type": "function", "function": {"name": "dict_args", "arguments": {"k": [1, {"z": "é"}]}}},
]


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_calls_render_parse_round_trip(thinking: bool) -> None:
    text = ("thought" + THINK_END if thinking else "") + "Doing it." + render_tool_calls(CALLS) + EOS
    reasoning, content, calls = parse_completion(text, thinking=thinking)
    assert (reasoning, content) == ("thought" if thinking else "", "Doing it.")
    assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in CALLS]
    for got, sent in zip(calls, CALLS, strict=True):
        args = sent["function"]["arguments"]
        assert json.loads(got["function"]["arguments"]) == (args if isinstance(args, dict) else json.loads(args))
        assert got["id"].startswith("call_") and got["type"] == "function"
    assert len({c["id"] for c in calls}) == len(calls)


def test_unparseable_arguments_travel_as_one_string() -> None:
    text = render_tool_calls([{"function": {"name": "f", "arguments": "{broken"}}])
    assert '<｜DSML｜parameter name="arguments" string="true">{broken</｜DSML｜parameter>' in text
    _, _, calls = parse_completion(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"arguments": "{broken"}


# ---- streaming parser -----------------------------------------------------------------------------------------
def _counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def _merged(events: list) -> list:
    """Events with consecutive deltas of the same kind (and call) joined, so streams compare by meaning."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, (ReasoningDelta, ContentDelta)) and type(last) is type(e):
            out[-1] = type(e)(last.text + e.text)
        elif isinstance(e, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta) and last.index == e.index:
            out[-1] = ToolCallArgsDelta(e.index, last.fragment + e.fragment)
        else:
            out.append(e)
    return out


def _parse_chunks(chunks: list[str], thinking: bool) -> list:
    parser = StreamParser(thinking, new_call_id=_counter_ids())
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return _merged(events + parser.finish())


STREAM_TEXTS = {
    "thinking_tools": (True, "Let me think: a < b and </thin k>.\n\n" + THINK_END + "Sure.\n"
                       + render_tool_calls(CALLS[:2]) + EOS),
    "content_near_markers": (False, "a\n\nb <｜DSML x｜ </｜DSML tool ｜DSM L｜ < <｜end of it\n\n\n"
                             + render_tool_calls(CALLS[2:]) + "\nafter" + EOS + "ignored"),
    "no_separator_block": (False, "x<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\">"
                           "<｜DSML｜parameter name=\"n\" string=\"false\">[1, 2]</｜DSML｜parameter>"
                           "</｜DSML｜invoke></｜DSML｜tool_calls>"),
    "cut_mid_value": (True, "r" + THINK_END + render_tool_calls(CALLS[:1])[:-60]),
    # DSML outside a tool-call block: the output ends where it starts
    "stray_invoke": (False, 'Sure.\n\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS),
    "stray_after_block": (True, "r" + THINK_END + render_tool_calls(CALLS[2:3]) + "\nok </｜DSML｜tool_calls> x"),
    "stray_bare_marker": (False, "see ｜DSML｜ here"),
    "stray_partial_opener": (False, "x\n\n<｜DSML｜tool_ca"),
}


@pytest.mark.parametrize("name", sorted(STREAM_TEXTS))
def test_stream_parser_is_split_invariant(name: str) -> None:
    thinking, text = STREAM_TEXTS[name]
    whole = _parse_chunks([text], thinking)
    assert _parse_chunks(list(text), thinking) == whole
    for cut in range(1, len(text)):
        assert _parse_chunks([text[:cut], text[cut:]], thinking) == whole, f"split at {cut}"
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _parse_chunks(chunks, thinking) == whole
    # Whatever the split, every call is well formed: start, arguments that are one JSON object, end.
    starts = [e for e in whole if isinstance(e, ToolCallStart)]
    args = {e.index: e.fragment for e in whole if isinstance(e, ToolCallArgsDelta)}
    assert [e.index for e in whole if isinstance(e, ToolCallEnd)] == [s.index for s in starts]
    assert all(isinstance(json.loads(args[s.index]), dict) for s in starts)


def _malformed(chunks: list[str], thinking: bool) -> str | None:
    parser = StreamParser(thinking, new_call_id=_counter_ids())
    for chunk in chunks:
        parser.feed(chunk)
    parser.finish()
    return parser.malformed


@pytest.mark.parametrize("name", sorted(STREAM_TEXTS))
def test_malformed_is_split_invariant(name: str) -> None:
    thinking, text = STREAM_TEXTS[name]
    whole = _malformed([text], thinking)
    assert (whole is not None) == (name.startswith("stray") or name == "cut_mid_value")
    assert _malformed(list(text), thinking) == whole
    for cut in range(1, len(text)):
        assert _malformed([text[:cut], text[cut:]], thinking) == whole, f"split at {cut}"


def test_stray_dsml_never_reaches_content() -> None:
    expected = {"stray_invoke": [ContentDelta("Sure.\n\n")],
                "stray_after_block": [ReasoningDelta("r"), ToolCallStart(0, "call_0", "no_args"),
                                      ToolCallArgsDelta(0, "{}"), ToolCallEnd(0), ContentDelta("\nok ")],
                "stray_bare_marker": [ContentDelta("see ")],
                "stray_partial_opener": [ContentDelta("x\n\n")]}
    for name, events in expected.items():
        thinking, text = STREAM_TEXTS[name]
        assert _parse_chunks([text], thinking) == events, name
        assert "DSML" in _malformed([text], thinking), name
    parser = StreamParser()
    parser.feed("a <｜DSML｜invoke")
    assert parser.feed(' name="f">rest') == [] and parser.finish() == []  # nothing after the stray markup
    assert parser.tool_calls_text == ""  # and nothing to replay


def test_block_opener_split_anywhere_is_not_stray() -> None:
    block = render_tool_calls(CALLS[2:3])
    for cut in range(1, len(block)):
        parser = StreamParser(new_call_id=_counter_ids())
        events = parser.feed("a" + block[:cut]) + parser.feed(block[cut:]) + parser.finish()
        assert parser.malformed is None and ToolCallEnd(0) in events, cut


def test_without_tools_dsml_text_is_content() -> None:
    # The DSML token is banned when no tool may be called, so DSML text is the model spelling it out.
    text = "quote: " + render_tool_calls(CALLS[2:3]) + " ｜DSML｜ end"
    parser = StreamParser(tools=False)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert _merged(events) == [ContentDelta(text)] and parser.malformed is None
    reasoning = StreamParser(thinking=True, tools=False)
    assert _merged(reasoning.feed("a｜DSML｜b" + THINK_END + "c") + reasoning.finish()) == \
        [ReasoningDelta("a｜DSML｜b"), ContentDelta("c")]


def test_malformed_calls_are_flagged() -> None:
    def malformed(text: str) -> str | None:
        parser = StreamParser()
        parser.feed(text)
        parser.finish()
        return parser.malformed

    assert malformed("Doing it." + render_tool_calls(CALLS) + EOS) is None
    assert malformed(render_tool_calls(CALLS)[:-len(TOOL_CALLS_END)]) is None  # only the closing tag missing
    assert "ended inside tool call 0" in malformed(render_tool_calls(CALLS[:1])[:-60])
    assert "ended inside tool call 1" in malformed(render_tool_calls(CALLS[2:])[:-30])
    assert "invoke tag" in malformed("<｜DSML｜tool_calls><｜DSML｜invoke>x</｜DSML｜invoke></｜DSML｜tool_calls>")
    assert "invoke tag" in malformed('<｜DSML｜tool_calls><｜DSML｜invoke name="">'
                                     '</｜DSML｜invoke></｜DSML｜tool_calls>')
    assert "parameter tag" in malformed('<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter>1'
                                        '</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>')
    # the first problem is kept: the cut call explains the missing closing tags
    assert "tool call 0" in malformed('<｜DSML｜tool_calls><｜DSML｜invoke name="f">'
                                      '<｜DSML｜parameter name="a" string="true">x')


def test_stream_parser_events_in_detail() -> None:
    _, text = STREAM_TEXTS["content_near_markers"]
    events = _parse_chunks([text], thinking=False)
    assert events == [
        ContentDelta("a\n\nb <｜DSML x｜ </｜DSML tool ｜DSM L｜ < <｜end of it\n\n\n"),
        ToolCallStart(0, "call_0", "no_args"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0),
        ToolCallStart(1, "call_1", "dict_args"), ToolCallArgsDelta(1, '{"k": [1, {"z": "é"}]}'), ToolCallEnd(1),
        ContentDelta("\nafter"),
    ]
    _, text = STREAM_TEXTS["no_separator_block"]
    assert _parse_chunks([text], thinking=False) == [
        ContentDelta("x"), ToolCallStart(0, "call_0", "f"), ToolCallArgsDelta(0, '{"n": [1, 2]}'), ToolCallEnd(0)]


def test_stream_parser_holds_back_only_possible_markers() -> None:
    parser = StreamParser(thinking=False)
    assert parser.feed("x < y") == [ContentDelta("x < y")]
    assert parser.feed("ab <｜DS") == [ContentDelta("ab ")]
    assert parser.feed("L is fine") == [ContentDelta("<｜DSL is fine")]
    assert parser.feed("end\n") == [ContentDelta("end")]
    assert parser.feed("\n") == []
    assert parser.finish() == [ContentDelta("\n\n")]
    thinking = StreamParser(thinking=True)
    assert thinking.feed("hmm </thi") == [ReasoningDelta("hmm ")]
    assert thinking.feed("nk>ok") == [ContentDelta("ok")]


def test_stream_parser_streams_string_arguments_and_records_dsml() -> None:
    parser = StreamParser(thinking=False, new_call_id=lambda: "id")
    block = render_tool_calls([{"function": {"name": "f", "arguments": '{"s": "abc</x>", "n": 7}'}}])
    events = parser.feed(block[:block.index("abc") + 4])  # up to "abc<": the "<" may start the end tag
    assert events == [ToolCallStart(0, "id", "f"), ToolCallArgsDelta(0, '{"s": "'), ToolCallArgsDelta(0, "abc")]
    events = parser.feed(block[block.index("abc") + 4:]) + parser.finish()
    assert "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta)) == '</x>", "n": 7}'
    assert parser.tool_calls_text == block


def test_finish_closes_interrupted_output() -> None:
    reasoning, content, calls = parse_completion("still thinking", thinking=True)
    assert (reasoning, content, calls) == ("still thinking", "", [])
    _, _, calls = parse_completion('<｜DSML｜tool_calls><｜DSML｜invoke name="f">'
                                   '<｜DSML｜parameter name="a" string="false">not json</｜DSML｜parameter>'
                                   '<｜DSML｜parameter name="b" string="true">cut "here')
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": "not json", "b": 'cut "here'}
    _, _, calls = parse_completion('<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜param')
    assert calls[0]["function"]["arguments"] == "{}"
    # cut inside the closing tag of a value: the partial tag is markup, not argument text
    for cut in range(1, len("</｜DSML｜parameter>")):
        _, _, calls = parse_completion('<｜DSML｜tool_calls><｜DSML｜invoke name="f">'
                                       '<｜DSML｜parameter name="a" string="true">abc' + "</｜DSML｜parameter>"[:cut])
        assert json.loads(calls[0]["function"]["arguments"]) == {"a": "abc"}, cut


def test_tolerates_unclosed_invoke_and_stray_text() -> None:
    text = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="x" string="true">1'
            '</｜DSML｜parameter>\nstray <b>text</b>\n<｜DSML｜invoke name="b">\n</｜DSML｜invoke>\n'
            '</｜DSML｜tool_calls>')
    for chunks in ([text], list(text)):
        assert _parse_chunks(chunks, thinking=False) == [
            ToolCallStart(0, "call_0", "a"), ToolCallArgsDelta(0, '{"x": "1"}'), ToolCallEnd(0),
            ToolCallStart(1, "call_1", "b"), ToolCallArgsDelta(1, "{}"), ToolCallEnd(1)]


def test_dsml_inside_reasoning_stays_reasoning() -> None:
    block = render_tool_calls(CALLS[1:])
    reasoning, content, calls = parse_completion("plan:" + block + THINK_END + "done", thinking=True)
    assert (reasoning, content, calls) == ("plan:" + block, "done", [])


# ---- tool schemas ---------------------------------------------------------------------------------------------
def _tool(name: str, properties: dict, **extra) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": {"type": "object", "properties": properties, **extra}}}


def test_canonical_tools_ignores_tool_and_key_order_but_keeps_properties_order() -> None:
    props = {"zeta": {"type": "string", "description": "z"}, "alpha": {"type": "integer", "minimum": 0},
             "mid": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"},
                                                                                  "b": {"type": "number"}}}}}
    a = [_tool("search", props, required=["zeta"]), _tool("fetch", {"url": {"type": "string"}})]
    shuffled_props = {k: dict(reversed(list(v.items()))) for k, v in props.items()}
    b = [{"function": {"parameters": {"required": ["zeta"], "properties": shuffled_props, "type": "object"},
                       "description": "search tool", "name": "search"}, "type": "function"},
         {"type": "function", "function": {"name": "fetch", "parameters": {"properties": {"url": {"type": "string"}},
                                                                           "type": "object"},
                                           "description": "fetch tool"}}]
    canon = canonical_tools(a)
    assert dump_json(canon) == dump_json(canonical_tools(b))
    assert [t["function"]["name"] for t in canon] == ["fetch", "search"]
    params = canon[1]["function"]["parameters"]
    assert list(params) == ["properties", "required", "type"]
    assert list(params["properties"]) == ["zeta", "alpha", "mid"]  # the model's argument order
    assert list(params["properties"]["zeta"]) == ["description", "type"]
    assert list(params["properties"]["mid"]["items"]["properties"]) == ["y", "b"]
    assert render_prompt([{"role": "user", "content": "q"}], tools=canonical_tools(a)) == \
        render_prompt([{"role": "user", "content": "q"}], tools=canonical_tools(b))


def test_property_named_properties() -> None:
    tool = _tool("t", {"properties": {"type": "object", "properties": {"b": {}, "a": {}}}, "a": {"type": "string"}})
    props = canonical_tools([tool])[0]["function"]["parameters"]["properties"]
    assert list(props) == ["properties", "a"]
    assert list(props["properties"]) == ["properties", "type"]
    assert list(props["properties"]["properties"]) == ["b", "a"]


def test_duplicates_are_left_as_sent() -> None:
    first, second = _tool("dup", {"b": {}, "a": {}}), _tool("dup", {"x": {}})
    raw = '{"type": "function", "function": {"name": "keys", "parameters": {"type": "object", "type": "string"}}}'
    parsed = parse_json_preserving(raw)
    assert isinstance(parsed["function"]["parameters"], DuplicateKeys)
    canon = canonical_tools([second, parsed, first])
    # Stable by name: same-named tools keep their relative order and both stay.
    assert [t["function"]["name"] for t in canon] == ["dup", "dup", "keys"]
    assert canon[0]["function"]["parameters"]["properties"] == {"x": {}}
    assert canon[2] is parsed
    assert dump_json(canon[2]) == raw  # rendered exactly as sent, both "type" keys included
    line = '{"name": "keys", "parameters": {"type": "object", "type": "string"}}'
    assert "\n" + line + "\n" in render_prompt([{"role": "user", "content": "q"}], tools=[parsed])


def test_parse_json_preserving_matches_json_without_duplicates() -> None:
    text = '{"b": [1, {"d": null, "c": "é"}], "a": {"z": 1, "y": 2.5}}'
    value = parse_json_preserving(text)
    assert value == json.loads(text) and list(value) == ["b", "a"]
    assert dump_json(value) == json.dumps(json.loads(text), ensure_ascii=False)
    nested = parse_json_preserving('{"a": {"k": 1, "k": 2}}')
    assert nested["a"] == DuplicateKeys([("k", 1), ("k", 2)])
