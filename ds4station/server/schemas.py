"""The request body and its pydantic schemas for the three API dialects (OpenAI Chat/Completions, OpenAI
Responses, Anthropic).

`parse_body` admits strict JSON only: no NaN/Infinity, nesting at most MAX_JSON_DEPTH deep, no lone UTF-16
surrogate in any string (the tokenizer cannot encode one). Validation is strict about types (a string where
a number belongs is a 400, not a silent coercion) and lenient about unknown fields (agents send many vendor
extensions; unknown fields are ignored). What the engine cannot honour (n > 1, logprobs, images, server-side
tools, seeds beyond 64 bits) is rejected here with a message naming the exact place, e.g.
`messages.2.content.0: images are not supported ...`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ds4station.engine.sampler import SEED_RANGE

from .errors import LOCATED, ApiError, first_problem

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
MAX_JSON_DEPTH = 100  # tool schemas nest a few dozen levels at most; json and the renderers recurse
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_TOKEN_ID = re.compile(r"^[0-9]{1,12}$")
TEXT_ONLY = "DeepSeek-V4 reads text only"


# ---------------------------------------------------------------------------------------------------
# The body


def parse_body(body: bytes | bytearray) -> dict[str, Any]:
    """The request body as a JSON object, or an ApiError (400) saying what is wrong and where. Runs in a
    worker thread: a body of many MiB takes a while."""
    try:
        value = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError as e:
        raise ApiError(400, f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    _check_json(value)
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (send a number or null)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large for a double")
    return value


def _check_json(root: dict[str, Any]) -> None:
    """Nesting depth and lone surrogates, without recursion (the depth is what is being checked)."""
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json",
                           param=path)
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                _check_text(key, where, "key")
            if isinstance(value, str):
                _check_text(value, where, "text")
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, where))


def _check_text(text: str, where: str, what: str) -> None:
    if text.isascii():  # the common case, and a fast one
        return
    bad = _SURROGATE.search(text)
    if bad:
        where = where.encode("utf-8", "backslashreplace").decode()  # the path may end in this very key
        raise ApiError(400, f"{where}: the {what} holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at "
                            f"character {bad.start()}, which is not valid Unicode: send the character itself "
                            "or a complete surrogate pair", code="invalid_request", param=where)


def located(path: str, message: str) -> PydanticCustomError:
    """A validation error at `path` (below the validator's own place): raise it from a validator that sees
    deeper than the field it validates; errors.first_problem reports the path."""
    return PydanticCustomError(LOCATED, "{message}", {"path": path, "message": message})


def unsupported_part(kind: str) -> str:
    """Why a content part or block of type `kind` cannot be taken."""
    if kind in ("image_url", "input_image", "image"):
        return f"images are not supported: {TEXT_ONLY}; describe the image in text or leave it out"
    if kind in ("file", "input_file", "document"):
        return f"files are not supported: {TEXT_ONLY}; send the file's text"
    return f"content of type {kind!r} is not supported: {TEXT_ONLY}"


def _parts_only(items: Any, key: str, kinds: tuple[str, ...], fields: tuple[str, ...] = ("content",)) -> None:
    """The part lists (`fields`) of each of the `items` (the request's `key`) hold parts of the given types
    only: a `located` error names the first other one (pydantic would report every member of the union that
    failed to match it instead)."""
    for i, item in enumerate(items if isinstance(items, list) else []):
        for field in fields:
            parts = item.get(field) if isinstance(item, dict) else None
            for j, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in kinds:
                    raise located(f"{key}.{i}.{field}.{j}", unsupported_part(kind))


def validation_problem(err: ValidationError, prefix: str) -> PydanticCustomError:
    """A nested model's validation error, re-raised from its parent's validator at `prefix`."""
    loc, msg, _ = first_problem(err)
    return located(f"{prefix}.{loc}" if loc else prefix, msg)


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

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_RANGE[0] <= v <= SEED_RANGE[1]:
            raise ValueError(f"seed {v} does not fit in 64 bits: use an integer from -2**63 to 2**64-1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not _TOKEN_ID.match(key):
                raise ValueError(f"logit_bias keys are token ids, got {key[:40]!r}")
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

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _parts_only(data.get("messages"), "messages", ("text", "input_text", "output_text"))
        return data

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


class CustomToolFormat(Strict):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    @model_validator(mode="after")
    def _grammar(self) -> CustomToolFormat:
        if self.type == "grammar" and (self.syntax is None or self.definition is None):
            raise ValueError("a grammar format needs its syntax (lark or regex) and definition")
        return self


class RespCustomTool(Strict):
    """A Responses API custom tool (Codex's freeform apply_patch): its input is one string, free text or
    in a grammar. The model sees it as a function with one string parameter, `input`."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: CustomToolFormat | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_tool_name(v)


class RespReasoning(Strict):
    effort: Effort | None = None
    summary: str | None = None


class RespNamedTool(Strict):
    type: Literal["function", "custom"]
    name: str


_RESP_MEMBERS: dict[str, type[BaseModel]] = {"function": RespFunctionTool, "custom": RespCustomTool}


class RespNamespaceTool(Strict):
    """Function and custom tools grouped under a name (Codex's multi_agent_v1). The model sees each member as
    `NAMESPACE.NAME`; its calls come back with the member's `name` and the `namespace` apart, and calls the
    client replays with a `namespace` are rendered by that qualified name again."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[dict[str, Any]]

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_tool_name(v)

    def members(self) -> list[RespFunctionTool | RespCustomTool]:
        out = []
        for i, t in enumerate(self.tools):
            kind = t.get("type")
            if kind not in _RESP_MEMBERS:
                raise located(f"tools.{i}.type", f"{kind!r}: a namespace holds function and custom tools")
            out.append(_RESP_MEMBERS[kind].model_validate(t))
        return out  # type: ignore[return-value]


_RESP_TOOLS: dict[str, type[BaseModel]] = {**_RESP_MEMBERS, "namespace": RespNamespaceTool}
RespTool = RespFunctionTool | RespCustomTool
RespTextKind = Literal["input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"]
RESP_TEXT_PARTS: tuple[str, ...] = get_args(RespTextKind)


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    # function and custom tools; the tools OpenAI runs itself (web_search, file_search, code_interpreter,
    # local_shell, ...) are refused by name: dropping them would leave the model not knowing what it lacks
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

    def declared_tools(self) -> list[RespFunctionTool | RespCustomTool | RespNamespaceTool]:
        """The tools, validated (by _check), in the order given."""
        return [_RESP_TOOLS[t["type"]].model_validate(t) for t in self.tools or []]  # type: ignore[misc]

    def flat_tools(self) -> list[tuple[RespNamespaceTool | None, RespTool]]:
        """Every function and custom tool with the namespace it is in (None at the top level), in order."""
        out: list[tuple[RespNamespaceTool | None, RespTool]] = []
        for t in self.declared_tools():
            out += [(t, m) for m in t.members()] if isinstance(t, RespNamespaceTool) else [(None, t)]
        return out

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict):  # message content; function and custom tool outputs
            _parts_only(data.get("input"), "input", RESP_TEXT_PARTS, ("content", "output"))
        return data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.previous_response_id:
            raise ValueError("previous_response_id is not supported: send the whole conversation in input")
        names = []
        for i, t in enumerate(self.tools or []):
            kind = t.get("type")
            if not isinstance(kind, str):
                raise located(f"tools.{i}.type", "must be a string")
            if kind not in _RESP_TOOLS:
                raise located(f"tools.{i}", f"{kind!r} is a tool OpenAI runs on its own servers, which this "
                                            "server cannot do: remove it from tools (function, custom and "
                                            "namespace tools are supported)")
            try:
                tool = _RESP_TOOLS[kind].model_validate(t)
                names += [qualified(tool.name, m.name) for m in tool.members()] \
                    if isinstance(tool, RespNamespaceTool) else [tool.name]  # type: ignore[attr-defined]
            except ValidationError as e:
                raise validation_problem(e, f"tools.{i}") from e
        _unique_names(names, "tools")
        if isinstance(self.tool_choice, RespNamedTool) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice \"required\" needs at least one tool")
        return self


class RespContentPart(Strict):
    type: RespTextKind
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


def qualified(namespace: str | None, name: str) -> str:
    """A namespaced tool's name as the model sees it."""
    return f"{namespace}.{name}" if namespace else name


class RespFunctionCall(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class RespFunctionOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[RespContentPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text or "" for p in self.output)


class RespCustomToolCall(Strict):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class RespCustomToolOutput(RespFunctionOutput):
    type: Literal["custom_tool_call_output"]  # type: ignore[assignment]


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
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation instruction (a Claude Code beta)
    content: str | list[ABlock]

    @model_validator(mode="after")
    def _system_is_text(self) -> AMessage:
        if self.role == "system" and not isinstance(self.content, str) and \
                any(not isinstance(b, AText) for b in self.content):
            raise ValueError("a system message takes text blocks only")
        return self


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


_ABLOCKS = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _anthropic_checks(data: Any) -> Any:
    """Before pydantic: name the first block this server cannot take (an image, also one inside a
    tool_result; a document; a server tool's result) and the first tool it cannot run (Anthropic's server
    tools such as web_search_20250305, and its schema-less tool types such as bash_20250124)."""
    if not isinstance(data, dict):
        return data
    system = data.get("system")
    for j, block in enumerate(system if isinstance(system, list) else []):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind != "text":
            raise located(f"system.{j}", unsupported_part(kind))
    messages = data.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(kind, str):
                continue
            if kind not in _ABLOCKS:
                raise located(f"messages.{i}.content.{j}", unsupported_part(kind)
                              if kind in ("image", "document") else
                              f"block type {kind!r} is not supported by this server")
            inner = block.get("content") if kind == "tool_result" else None
            for k, part in enumerate(inner if isinstance(inner, list) else []):
                sub = part.get("type") if isinstance(part, dict) else None
                if isinstance(sub, str) and sub != "text":
                    raise located(f"messages.{i}.content.{j}.content.{k}", unsupported_part(sub))
    tools = data.get("tools")
    for i, t in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(t, dict) and t.get("type") not in (None, "custom") and "input_schema" not in t:
            raise located(f"tools.{i}", f"{t.get('name', t['type'])!r} ({t['type']}) is a tool that only "
                                        "Anthropic's API implements, which this server cannot do: remove it, "
                                        "or declare it as a client tool with an input_schema")
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

    _checks = model_validator(mode="before")(_anthropic_checks)

    @model_validator(mode="after")
    def _check(self) -> MessagesRequest:
        if all(m.role == "system" for m in self.messages):
            raise ValueError("messages hold only system messages: a user message is needed to answer")
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

    _checks = model_validator(mode="before")(_anthropic_checks)

    def system_text(self) -> str | None:
        return MessagesRequest.system_text(self)  # type: ignore[arg-type]
