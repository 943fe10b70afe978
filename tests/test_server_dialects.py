"""The three API dialects map onto the same conversation: Responses input items and Anthropic content blocks
become the OpenAI-style messages the DS4 renderer takes, so the same conversation renders to the same prompt
(and hits the same live KV) whichever API a client speaks."""

from __future__ import annotations

import json

from ds4station.engine import chat
from ds4station.server import schemas as S
from ds4station.server.anthropic import messages_turn
from ds4station.server.openai import chat_turn, responses_turn

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
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS},
              {"type": "web_search"}]}

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
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS},
              {"type": "web_search_20250305", "name": "web_search"}]}


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
