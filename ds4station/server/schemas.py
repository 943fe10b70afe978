"""Pydantic request schemas for the three API dialects (OpenAI Chat/Completions, OpenAI Responses, Anthropic).

Validation is strict about types (a string where a number belongs is a 400, not a silent coercion) and
lenient about unknown fields (agents send many vendor extensions; unknown fields are ignored). Ranges that
the engine cannot honour (n > 1, logprobs, images) are rejected here with a message naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _check_schema(schema: Any, where: str) -> None:
    """A tool's parameter schema must be a JSON-schema object; DSML renders its `properties` in order."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object")
    typ = schema.get("type", "object")
    if typ != "object":
        raise ValueError(f"{where}.type must be \"object\", got {typ!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"{where}.properties must be an object")
    for key, sub in props.items():
        if not isinstance(sub, dict):
            raise ValueError(f"{where}.properties.{key} must be a schema object")
    req = schema.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise ValueError(f"{where}.required must be a list of property names")


def _check_tool_name(name: str) -> str:
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r} must be 1-128 characters of letters, digits, _ . : -")
    return name


def _unique_names(names: list[str], where: str) -> None:
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise ValueError(f"{where}: duplicate tool name {n!r}")
        seen.add(n)


# ---------------------------------------------------------------------------------------------------
# OpenAI Chat Completions


class TextPart(Strict):
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionSpec(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_tool_name(v)

    @field_validator("parameters")
    @classmethod
    def _params(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            _check_schema(v, "parameters")
        return v


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role \"tool\" needs tool_call_id")
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class SamplingFields(Strict):
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int | None = Field(None, ge=1, le=1, description="only one choice per request is generated")
    logprobs: Literal[False] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias[{key}] = {value} is outside -100..100")
        return v


def _stops(v: str | list[str] | None) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if len(stops) > 16:
        raise ValueError("at most 16 stop strings")
    return stops


class ChatRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    reasoning_effort: Effort | None = None
    thinking: Thinking | bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or []]
        _unique_names(names, "tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice \"required\" needs at least one tool")
        _stops(self.stop)
        return self


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int]
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("prompt: only one prompt per request is supported")
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this model")
        _stops(self.stop)
        return self


# ---------------------------------------------------------------------------------------------------
# OpenAI Responses API (Codex CLI)


class RespFunctionTool(FunctionSpec):
    """A Responses API function tool: the function's fields at the top level, beside `type`."""

    type: Literal["function"]


class RespReasoning(Strict):
    effort: Effort | None = None
    summary: str | None = None


class RespNamedTool(Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    # Non-function tools (web_search, local_shell, ...) are not something this server can run; they are
    # dropped when the tool list is normalised, function tools are validated here.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | RespNamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    reasoning: RespReasoning | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None

    def function_tools(self) -> list[RespFunctionTool]:
        return [RespFunctionTool.model_validate(t) for t in self.tools or [] if t.get("type") == "function"]

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.previous_response_id:
            raise ValueError("previous_response_id is not supported: send the whole conversation in input")
        for i, t in enumerate(self.tools or []):
            if not isinstance(t.get("type"), str):
                raise ValueError(f"tools[{i}].type must be a string")
        names = [t.name for t in self.function_tools()]
        _unique_names(names, "tools")
        if isinstance(self.tool_choice, RespNamedTool) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice \"required\" needs at least one function tool")
        return self


class RespContentPart(Strict):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class RespMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[RespContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or p.refusal or "" for p in self.content)


class RespFunctionCall(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class RespFunctionOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[RespContentPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text or "" for p in self.output)


class RespReasoningItem(Strict):
    type: Literal["reasoning"]
    summary: list[RespContentPart] = Field(default_factory=list)
    content: list[RespContentPart] | None = None


# ---------------------------------------------------------------------------------------------------
# Anthropic Messages (Claude Code)


class AText(Strict):
    type: Literal["text"]
    text: str


class AThinking(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ARedactedThinking(Strict):
    type: Literal["redacted_thinking"]
    data: str


class AToolUse(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AToolResult(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AText] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


ABlock = AText | AThinking | ARedactedThinking | AToolUse | AToolResult


class AMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ABlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, block in enumerate(v):
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in ("text", "thinking", "redacted_thinking", "tool_use", "tool_result"):
                    raise ValueError(f"content[{i}]: block type {kind!r} is not supported by this server")
        return v


class ATool(Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_tool_name(v)

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_schema(v, "input_schema")
        return v


class AToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AThinkingConfig(Strict):
    # enabled / adaptive / disabled, and whatever variants the API grows: anything but "disabled" thinks
    type: str
    budget_tokens: int | None = None


def _client_tools_only(data: Any) -> Any:
    """Drop Anthropic server tools (web_search_..., code_execution_...: a `type` and no input_schema); this
    server cannot run them, and refusing the whole request would break clients that always send them."""
    if isinstance(data, dict) and isinstance(data.get("tools"), list):
        data = {**data, "tools": [t for t in data["tools"] if not (
            isinstance(t, dict) and t.get("type") not in (None, "custom") and "input_schema" not in t)]}
    return data


class MessagesRequest(Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[AText] | None = None
    tools: list[ATool] | None = None
    tool_choice: AToolChoice | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    thinking: AThinkingConfig | None = None
    metadata: dict[str, Any] | None = None

    _server_tools = model_validator(mode="before")(_client_tools_only)

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        names = [t.name for t in self.tools or []]
        _unique_names(names, "tools")
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            if not self.tool_choice.name or self.tool_choice.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        if self.tool_choice is not None and self.tool_choice.type == "any" and not names:
            raise ValueError("tool_choice \"any\" needs at least one tool")
        if self.stop_sequences is not None and len(self.stop_sequences) > 16:
            raise ValueError("at most 16 stop_sequences")
        return self

    def system_text(self) -> str | None:
        if self.system is None:
            return None
        if isinstance(self.system, str):
            return self.system
        return "\n\n".join(b.text for b in self.system)


class CountTokensRequest(Strict):
    model: str
    messages: list[AMessage] = Field(min_length=1)
    system: str | list[AText] | None = None
    tools: list[ATool] | None = None
    thinking: AThinkingConfig | None = None

    _server_tools = model_validator(mode="before")(_client_tools_only)

    def system_text(self) -> str | None:
        return MessagesRequest.system_text(self)  # type: ignore[arg-type]
