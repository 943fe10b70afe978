"""The three API dialects map onto the same conversation: Responses input items and Anthropic content blocks
become the OpenAI-style messages the DS4 renderer takes, so the same conversation renders to the same prompt
(and hits the same live KV) whichever API a client speaks. Agent tool types: Responses `custom` tools (Codex's
freeform apply_patch) round trip as custom_tool_call items through the openai SDK; server-side tools are
refused by name; images in tool results are a 400 naming the part; Responses usage has the SDK's fields."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from openai.types.responses import ResponseCustomToolCall
from pydantic import ValidationError
from test_server import ant, engine, model_path, oai, start_server  # noqa: F401  (fixtures shared with test_server)

from ds4station.engine import chat
from ds4station.server import schemas as S
from ds4station.server.anthropic import messages_turn
from ds4station.server.app import BackgroundServer
from ds4station.server.errors import from_validation
from ds4station.server.openai import _FreeformInput, chat_turn, custom_tool_function, responses_turn
from ds4station.server.toolguide import ToolCallGuide

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGS = json.dumps({"city": "Paris"})

OPENAI = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
                    {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "25 C"},
    {"role": "assistant", "content": "Warm in both."},
    {"role": "user", "content": "Thanks!"}],
    "tools": [{"type": "function",
               "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}]}

RESPONSES = {"instructions": "Be brief.", "input": [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Two calls."}]},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ARGS},
    {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": ARGS},
    {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
    {"type": "function_call_output", "call_id": "c2", "output": "25 C"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Warm in both."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks!"}]}],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}]}

ANTHROPIC = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
             "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two calls.", "signature": ""},
        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "c2", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "21 C"},
                                 {"type": "tool_result", "tool_use_id": "c2",
                                  "content": [{"type": "text", "text": "25 C"}]}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Warm in both."}]},
    {"role": "user", "content": "Thanks!"}],
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]}


def _prompt(turn) -> str:
    return chat.render_prompt(turn.messages, chat.canonical_tools(turn.tools), turn.thinking)


def test_all_three_dialects_render_the_same_prompt() -> None:
    openai_turn = chat_turn(S.ChatRequest.model_validate({**OPENAI, "reasoning_effort": "high"}))
    resp_turn = responses_turn(S.ResponsesRequest.model_validate({**RESPONSES, "reasoning": {"effort": "high"}}))
    ant_turn = messages_turn(S.MessagesRequest.model_validate(ANTHROPIC))
    reference = _prompt(openai_turn)
    assert "Two calls." in reference and "<tool_result>21 C</tool_result>" in reference
    assert _prompt(resp_turn) == reference
    assert _prompt(ant_turn) == reference


def test_tool_choice_and_thinking_knobs_map_across_dialects() -> None:
    t = chat_turn(S.ChatRequest.model_validate(
        {**OPENAI, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "thinking": False}))
    assert (t.tool_choice, t.forced_tool, t.thinking) == ("function", "get_weather", False)
    t = responses_turn(S.ResponsesRequest.model_validate({**RESPONSES, "tool_choice": "required"}))
    assert t.tool_choice == "required" and [x["function"]["name"] for x in t.tools] == ["get_weather"]
    t = messages_turn(S.MessagesRequest.model_validate({**ANTHROPIC, "tool_choice": {"type": "any"},
                                                        "thinking": {"type": "disabled"}}))
    assert (t.tool_choice, t.thinking, t.call_id_prefix) == ("required", False, "toolu_")
    t = chat_turn(S.ChatRequest.model_validate({**OPENAI, "max_tokens": 0, "max_completion_tokens": -1}))
    assert t.max_tokens is None  # non-positive means the server default


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi \"there\"\n*** End Patch"
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/'}}


def test_a_custom_tool_is_a_function_of_one_string_input() -> None:
    turn = responses_turn(S.ResponsesRequest.model_validate({"input": "edit", "tools": [APPLY_PATCH]}))
    (tool,) = turn.tools
    fn = tool["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert fn["parameters"]["properties"]["input"]["type"] == "string"
    assert "Edit files with a patch." in fn["description"] and "lark grammar" in fn["description"]
    assert 'start: "*** Begin Patch"' in fn["description"]  # the model sees the grammar it must follow
    forced = responses_turn(S.ResponsesRequest.model_validate(
        {"input": "edit", "tools": [APPLY_PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}}))
    assert (forced.tool_choice, forced.forced_tool) == ("function", "apply_patch")


def test_custom_tool_call_items_replay_as_the_function_call_the_model_wrote() -> None:
    """A custom_tool_call / custom_tool_call_output pair renders exactly like the function call of the same
    input and its result, so the next turn's prompt repeats what the model saw."""
    custom = responses_turn(S.ResponsesRequest.model_validate({"tools": [APPLY_PATCH], "input": [
        {"role": "user", "content": "edit"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH, "status": "completed"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"}]}))
    assert custom.messages[1]["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                              "arguments": json.dumps({"input": PATCH})}
    assert custom.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}
    prompt = _prompt(custom)
    assert "<tool_result>Done!</tool_result>" in prompt and '+hi "there"' in prompt  # a string parameter, as is


def _refusal(model: type, body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return from_validation(info.value).message


@pytest.mark.parametrize("kind", ["web_search", "web_search_preview", "file_search", "code_interpreter",
                                  "local_shell", "computer_use_preview", "image_generation", "mcp"])
def test_responses_server_tools_are_refused_by_name(kind: str) -> None:
    msg = _refusal(S.ResponsesRequest, {"input": "x", "tools": [APPLY_PATCH, {"type": kind}]})
    assert msg.startswith("tools.1: ") and repr(kind) in msg and "cannot" in msg


@pytest.mark.parametrize(("name", "kind"), [("web_search", "web_search_20250305"), ("bash", "bash_20250124"),
                                            ("code_execution", "code_execution_20250522")])
def test_anthropic_server_tools_are_refused_by_name(name: str, kind: str) -> None:
    body = {**ANTHROPIC, "tools": [*ANTHROPIC["tools"], {"type": kind, "name": name}]}
    msg = _refusal(S.MessagesRequest, body)
    assert msg.startswith("tools.1: ") and name in msg and kind in msg
    assert _refusal(S.CountTokensRequest, {k: body[k] for k in ("model", "messages", "tools")}) == msg


# ---- custom tools, refusals and usage against a real server -------------------------------------------------
CUSTOM_TOOLS = [APPLY_PATCH, {"type": "function", "name": "get_weather", "parameters": PARAMS}]


@pytest.fixture(scope="module")
def server(engine, model_path) -> Iterator[BackgroundServer]:  # noqa: F811
    srv = start_server(engine, model_path)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def patch_budget(engine) -> int:  # noqa: F811
    """max_output_tokens for a forced apply_patch call: its DSML structure and a little input."""
    fn = custom_tool_function(S.RespCustomTool.model_validate(APPLY_PATCH))["function"]
    return ToolCallGuide(engine.tokenizer, [fn], 10**6).min_tokens + 12


def forced_patch(client: openai.OpenAI, budget: int, input_items: str | list = "Add a.txt", **kw):
    return client.responses.create(model="tiny", input=input_items, tools=CUSTOM_TOOLS, max_output_tokens=budget,
                                   tool_choice={"type": "custom", "name": "apply_patch"}, temperature=0,
                                   reasoning={"effort": "none"}, **kw)


def test_custom_tool_call_round_trip_with_the_openai_sdk(server, patch_budget) -> None:
    client = oai(server)
    first = forced_patch(client, patch_budget)
    (call,) = first.output
    assert isinstance(call, ResponseCustomToolCall)  # the SDK's own type: custom_tool_call, input a string
    assert call.name == "apply_patch" and call.call_id.startswith("call_") and isinstance(call.input, str)
    assert call.input and not call.input.startswith("{")  # the input itself, not the JSON around it
    assert [t.type for t in first.tools] == ["custom", "function"]

    # the stream announces the item, streams its input decoded, and ends with the whole of it
    events = list(forced_patch(client, patch_budget, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "custom_tool_call" and added[0].item.input == ""
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    (item_done,) = [e for e in events if e.type == "response.output_item.done"]
    assert "".join(deltas) == done.input == item_done.item.input == call.input  # greedy: the same input again
    assert done.item_id == item_done.item.id == added[0].item.id
    assert not [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert events[-1].type == "response.completed" and events[-1].response.output[0].input == call.input
    with client.responses.stream(model="tiny", input="Add a.txt", tools=CUSTOM_TOOLS, temperature=0,
                                 max_output_tokens=patch_budget, reasoning={"effort": "none"},
                                 tool_choice={"type": "custom", "name": "apply_patch"}) as stream:
        assert stream.get_final_response().output[0].input == call.input

    # the next turn sends the call back with its output; the prompt repeats the DSML the model sampled
    history = [{"role": "user", "content": "Add a.txt"}, call.model_dump(exclude_none=True),
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    second = client.responses.create(model="tiny", tools=CUSTOM_TOOLS, max_output_tokens=2, temperature=0,
                                     reasoning={"effort": "none"}, input=history)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_server_tools_are_refused_through_the_sdks(server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai(server).responses.create(model="tiny", input="x", tools=[{"type": "web_search"}], max_output_tokens=1)
    assert "tools.0: 'web_search'" in err.value.message
    with pytest.raises(anthropic.BadRequestError) as aerr:
        ant(server).messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                    tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}])
    assert "tools.0: 'web_search' (web_search_20250305)" in aerr.value.message


def test_images_in_tool_results_are_a_400_naming_the_part(server) -> None:
    """What Claude Code sends after a screenshot tool: the whole turn used to fail with a pydantic dump."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as aerr:
        ant(server).messages.create(model="tiny", max_tokens=1, messages=[
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "here"}, image]}]}],
            tools=[{"name": "shot", "input_schema": {"type": "object", "properties": {}}}])
    message = aerr.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("messages.2.content.0.content.1: images are not supported") and "problems" not in message
    with pytest.raises(openai.BadRequestError) as err:
        oai(server).chat.completions.create(model="tiny", max_tokens=1, messages=[
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert err.value.body["message"].startswith("messages.2.content.0: images are not supported")  # type: ignore[index]
    assert err.value.body["param"] == "messages.2.content.0"  # type: ignore[index]


def test_responses_usage_fields_are_the_sdks(server) -> None:
    client = oai(server)
    thinking = client.responses.create(model="tiny", input="Think.", max_output_tokens=6, reasoning={"effort": "high"})
    usage = thinking.usage
    assert usage is not None and isinstance(usage.input_tokens_details.cache_write_tokens, int)
    assert usage.input_tokens_details.cached_tokens + usage.input_tokens_details.cache_write_tokens \
        == usage.input_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    reasoning = usage.output_tokens_details.reasoning_tokens
    if all(item.type == "reasoning" for item in thinking.output):  # ended while thinking: all of it
        assert reasoning == usage.output_tokens
        if thinking.status == "incomplete":  # cut off by the limit, not by a sampled end of text
            assert usage.output_tokens == 6
    else:
        assert 0 < reasoning <= usage.output_tokens
    again = client.responses.create(model="tiny", input="Think.", max_output_tokens=6, reasoning={"effort": "high"})
    assert again.usage.input_tokens_details.cached_tokens > 0  # the same prompt: the live KV holds it
    assert again.usage.input_tokens_details.cache_write_tokens == (again.usage.input_tokens
                                                                   - again.usage.input_tokens_details.cached_tokens)
    plain = client.responses.create(model="tiny", input="Say hi.", max_output_tokens=3, reasoning={"effort": "none"})
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    # Chat Completions reports the same count: the generated ids up to and including </think>
    chat_r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Think."}],
                                            max_tokens=6, reasoning_effort="high")
    details = chat_r.usage.completion_tokens_details
    assert details is not None and 0 < details.reasoning_tokens <= chat_r.usage.completion_tokens
    if not chat_r.choices[0].message.content:
        assert details.reasoning_tokens == chat_r.usage.completion_tokens


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11])
def test_freeform_input_decodes_whatever_the_fragments(cut: int) -> None:
    """A custom call's arguments split anywhere (inside escapes, a surrogate pair's escape) stream as the
    decoded input: what was streamed is a prefix of the input at every point, and all of it at the end."""
    text = 'a "quoted" \\ path\n\ttab \u00e9 \U0001f600 end'
    arguments = '{"input": ' + json.dumps(text) + "}"  # ensure_ascii: the emoji as \ud83d\ude00
    decoder = _FreeformInput()
    streamed = ""
    for at in range(0, len(arguments), cut):
        streamed += decoder.feed(arguments[at:at + cut])
        assert text.startswith(streamed)
    assert streamed == text == decoder.finish()
    odd = _FreeformInput()
    assert odd.feed('{"patch": "x"}') == "" and odd.finish() == "x"  # another name for the one string
    assert _FreeformInput().finish() == ""


def test_system_messages_mid_conversation_render_at_their_position() -> None:
    """Claude Code sends `role: "system"` inside `messages` (beta mid-conversation-system-2026-04-07): rendered
    where it stands, as the OpenAI path renders a system message there; after a user turn it joins that turn
    (the format has no system turn between a question and its answer), so the answer still opens."""
    ant_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]},
        {"role": "system", "content": [{"type": "text", "text": "Agents: explore, plan."},
                                       {"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "And Rome?"},
        {"role": "system", "content": "Answer in French."}]
    ant_turn = messages_turn(S.MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "system": "Top.", "messages": ant_messages}))
    openai_turn = chat_turn(S.ChatRequest.model_validate({"messages": [
        {"role": "system", "content": "Top."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "system", "content": "Agents: explore, plan.\n\nBe brief."},
        {"role": "user", "content": "And Rome?"}, {"role": "system", "content": "Answer in French."}],
        "thinking": False}))  # as Anthropic's default (no thinking config)
    prompt = _prompt(ant_turn)
    assert prompt == _prompt(openai_turn)
    assert prompt == (f"{chat.BOS}Top.{chat.USER}Weather in Paris?{chat.ASSISTANT}{chat.THINK_END}Sunny.{chat.EOS}"
                      f"Agents: explore, plan.\n\nBe brief.{chat.USER}And Rome?\n\nAnswer in French."
                      f"{chat.ASSISTANT}{chat.THINK_END}")
    with pytest.raises(ValidationError, match="text blocks only"):
        S.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]})


def test_claude_code_shaped_request_and_connectivity_check(server) -> None:  # noqa: F811
    """A mid-conversation system message with Claude Code's beta header through the anthropic SDK, and the
    `HEAD /` / `GET /` it and other clients probe first."""
    import httpx

    client = ant(server)
    msg = client.messages.create(model="tiny", max_tokens=3, system="You are a coding agent.", messages=[
        {"role": "user", "content": "List the files."},
        {"role": "system", "content": "Available agents: explore, plan."}],  # type: ignore[list-item]
        extra_headers={"anthropic-beta": "mid-conversation-system-2026-04-07"})
    assert msg.role == "assistant" and msg.usage.output_tokens >= 1
    head = httpx.head(server.url + "/")
    got = httpx.get(server.url + "/")
    assert head.status_code == 200 and got.status_code == 200 and got.json()["name"] == "ds4station"


# ---- namespace tools (Codex's multi_agent_v1) -------------------------------------------------------------
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning and managing sub-agents.",
          "tools": [{"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
                     "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                                    "required": ["target"]}},
                    {"type": "custom", "name": "note", "description": "Write a note."}]}


def test_a_namespace_s_tools_are_functions_by_their_qualified_names() -> None:
    req = S.ResponsesRequest.model_validate({"input": "x", "tools": [APPLY_PATCH, AGENTS, PARAMS_TOOL]})
    turn = responses_turn(req)
    names = [t["function"]["name"] for t in turn.tools]
    assert names == ["multi_agent_v1.close_agent", "get_weather", "apply_patch", "multi_agent_v1.note"]
    close = turn.tools[0]["function"]
    assert close["description"] == "Tools for spawning and managing sub-agents.\n\nClose an agent."
    assert "multi_agent_v1.close_agent" in _prompt(turn)
    # a call the client replays with its namespace is rendered by the qualified name again
    replay = responses_turn(S.ResponsesRequest.model_validate({"tools": [AGENTS], "input": [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "multi_agent_v1",
         "arguments": '{"target": "a1"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "closed"}]}))
    assert replay.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"
    with pytest.raises(ValidationError, match="duplicate tool name 'multi_agent_v1.close_agent'"):
        S.ResponsesRequest.model_validate({"input": "x", "tools": [AGENTS, AGENTS]})
    assert "a namespace holds function and custom tools" in _refusal(S.ResponsesRequest, {"input": "x", "tools": [
        {**AGENTS, "tools": [{"type": "web_search"}]}]})


PARAMS_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}


def test_a_namespaced_call_comes_back_with_its_namespace(server) -> None:
    """Forced, the model calls a namespace's function: the SDK's function_call item carries the member's
    name and the namespace apart, streamed or not, and replays as the same call."""
    client = oai(server)
    kw = dict(model="tiny", input="close a1", tools=[AGENTS], temperature=0, max_output_tokens=160,
              reasoning={"effort": "none"}, tool_choice={"type": "function", "name": "multi_agent_v1.close_agent"})
    first = client.responses.create(**kw)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert (call.name, call.namespace) == ("close_agent", "multi_agent_v1")
    events = list(client.responses.create(**kw, stream=True))
    (added,) = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert (added.item.name, added.item.namespace) == ("close_agent", "multi_agent_v1")
    replay = responses_turn(S.ResponsesRequest.model_validate({"tools": [AGENTS], "input": [
        {"role": "user", "content": "close a1"}, call.model_dump(exclude_none=True)]}))
    assert replay.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"
