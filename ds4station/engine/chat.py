"""The DS4 chat format: prompts from OpenAI-style messages, DSML tool calls, and the streaming output parser.

The format is the one DeepSeek-V4 was trained on, as written by DeepSeek's reference renderer
`encoding/encoding_dsv4.py` (shipped with the model; tests/golden holds its outputs):

    BOS {system}[\\n\\n## Tools ...] <｜User｜>{user}<｜Assistant｜>(<think> | </think>)
        [{reasoning}</think>]{content}[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>]<｜end▁of▁sentence｜> ...

- Tool results are no role of their own: they join the user turn as `<tool_result>...</tool_result>` blocks
  (in the order of the calls), separated from each other and from user text by a blank line.
- Thinking mode opens the assistant turn with `<think>`; reasoning of turns before the last user turn is
  dropped (and those turns open with `</think>`) unless tools are declared, when every turn keeps it.
- `developer` messages count as system text (OpenAI's newer name for it; the reference's own `developer`
  role belongs to DeepSeek's internal search pipeline).
- A system message may come anywhere (Claude Code sends one mid-conversation): its text goes in at its
  position, as the reference writes system text; one that follows a user turn joins that turn as a text
  block instead (the reference would glue it to the user text and open no assistant turn after it).

Tool schemas are rendered as `json.dumps` lines; `canonical_tools` makes that text independent of the order a
client sends tools and object keys in, except the order of each schema's `properties`, which the model follows
when it writes DSML parameters. `StreamParser` turns generated text into reasoning, content and tool-call
events as it is sampled, never showing a partial marker as text, and never DSML markup as content.

A prompt is rendered once, as segments (`prompt_segments`): the template's own markup, and text from the client
(messages, tool results, tool schemas, reasoning, tool-call names and arguments). `encode_prompt` encodes only
the markup with special tokens, so text a client sends (a file an agent read, this module included) cannot
forge a turn, a think tag or a tool call; `render_prompt` joins the same segments, for display and goldens.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .tokenizer import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER, Tokenizer

TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"
# An assistant turn puts a blank line between its content and its tool calls.
TOOL_CALLS_SEP = "\n\n"

TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"{TOOL_CALLS_START}" block like the following:\n\n'
    f"{TOOL_CALLS_START}\n"
    f'{INVOKE_START} name="$TOOL_NAME">\n'
    f'{PARAM_START} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_END}\n'
    "...\n"
    f"{INVOKE_END}\n"
    f'{INVOKE_START} name="$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_END}\n"
    f"{TOOL_CALLS_END}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_FOOTER = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
# Put right after BOS for reasoning_effort="max" in thinking mode (DeepSeek advises it only with a context of
# 384K tokens or more; ds4 enforces that, the caller should too).
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)


class ChatFormatError(ValueError):
    """The messages cannot be rendered as a DS4 prompt; the message says which and why."""


# ---- JSON that keeps what the client sent ----------------------------------------------------------------
class DuplicateKeys(list):
    """A JSON object with a repeated key, kept as its (key, value) pairs in order instead of a dict that
    would silently keep only the last value."""


def parse_json_preserving(text: str) -> Any:
    """json.loads, except that an object with a repeated key becomes DuplicateKeys (key order is kept
    everywhere, as with json.loads)."""
    def pairs_hook(pairs: list[tuple[str, Any]]) -> Any:
        return DuplicateKeys(pairs) if len({k for k, _ in pairs}) != len(pairs) else dict(pairs)

    return json.loads(text, object_pairs_hook=pairs_hook)


def has_duplicate_keys(value: Any) -> bool:
    if isinstance(value, DuplicateKeys):
        return True
    if isinstance(value, dict):
        return any(has_duplicate_keys(v) for v in value.values())
    if isinstance(value, list):
        return any(has_duplicate_keys(v) for v in value)
    return False


def dump_json(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False)`, the reference renderer's form, also for DuplicateKeys."""
    if isinstance(value, (dict, DuplicateKeys)):
        pairs = value.items() if isinstance(value, dict) else value
        return "{" + ", ".join(f"{dump_json(k)}: {dump_json(v)}" for k, v in pairs) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump_json(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(key)
    if isinstance(obj, DuplicateKeys):
        return next((v for k, v in obj if k == key), None)
    return None


# ---- prompt segments --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A piece of a rendered prompt. Markup is the template's own text: special-token text in it becomes control
    tokens. Everything else (message text, tool results, tool schemas, reasoning, tool-call names and
    arguments) came from the client and is encoded as plain text, so it cannot forge a turn or a tool call."""
    text: str
    markup: bool


def _markup(text: str) -> Segment:
    return Segment(text, True)


def _plain(text: str) -> Segment:
    return Segment(text, False)


def _interleave(groups: Iterable[list[Segment]], separator: Segment) -> list[Segment]:
    """The groups' segments in order, `separator` between two groups."""
    out: list[Segment] = []
    for n, group in enumerate(groups):
        out += [separator, *group] if n else group
    return out


def _joined(segments: Iterable[Segment]) -> str:
    return "".join(s.text for s in segments)


# ---- tools ------------------------------------------------------------------------------------------------
def _function(tool: Any) -> Any:
    """The function object of an OpenAI tool ({"type": "function", "function": {...}}) or a bare one."""
    fn = _get(tool, "function")
    return tool if fn is None else fn


def _tool_name(tool: Any) -> str:
    return str(_get(_function(tool), "name") or "")


def canonical_tools(tools: Iterable[Any]) -> list[Any]:
    """Tools in a canonical form for a stable prompt prefix: ordered by name (stable, so tools sharing a name
    keep their order and are not merged) with object keys sorted recursively, except the keys of every
    schema's `properties` (the model writes DSML arguments in that order). A tool holding a duplicated JSON
    key (DuplicateKeys, from parse_json_preserving) is left exactly as sent."""
    def canon(node: Any, is_properties: bool = False) -> Any:
        if isinstance(node, dict):
            keys = list(node) if is_properties else sorted(node)
            # Inside a `properties` map the values are schemas again; only the map's own keys keep order.
            return {k: canon(node[k], k == "properties" and not is_properties) for k in keys}
        if isinstance(node, list):
            return [canon(v) for v in node]
        return node

    return sorted((t if has_duplicate_keys(t) else canon(t) for t in tools), key=_tool_name)


def render_tools(tools: Iterable[Any]) -> str:
    """The `## Tools` section of the system prompt: the DSML instructions and one JSON line per tool."""
    return _joined(_tools_segments(tools))


def _tools_segments(tools: Iterable[Any]) -> list[Segment]:
    lines = [[_plain(dump_json(_function(t)))] for t in tools]  # the client's schemas: plain text
    return [_markup(TOOLS_HEADER), *_interleave(lines, _markup("\n")), _markup(TOOLS_FOOTER)]


def _call_arguments(arguments: Any) -> Mapping[str, Any]:
    if isinstance(arguments, Mapping):
        return arguments
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        value = None
    # Like the reference: text that is not a JSON object travels whole as one string argument.
    return value if isinstance(value, dict) else {"arguments": "" if arguments is None else str(arguments)}


def render_tool_calls(calls: Iterable[Mapping[str, Any]]) -> str:
    """DSML for an assistant's tool calls (OpenAI form, arguments a JSON string or a dict), including the
    blank line that separates it from the content. String arguments are written raw, others as JSON."""
    return _joined(_tool_calls_segments(calls))


def _tool_calls_segments(calls: Iterable[Mapping[str, Any]]) -> list[Segment]:
    """render_tool_calls as segments: the DSML tags are markup; names, parameter names and values came from
    the client (a replayed history can hold anything), so they are plain text."""
    invokes = []
    for call in calls:
        fn = call.get("function", call)
        params = []
        for key, value in _call_arguments(fn.get("arguments")).items():
            is_str = isinstance(value, str)
            params.append([_markup(f'{PARAM_START} name="'), _plain(str(key)),
                           _markup(f'" string="{"true" if is_str else "false"}">'),
                           _plain(value if is_str else dump_json(value)), _markup(PARAM_END)])
        invokes.append([_markup(f'{INVOKE_START} name="'), _plain(str(fn.get("name", ""))), _markup('">\n'),
                        *_interleave(params, _markup("\n")), _markup(f"\n{INVOKE_END}")])
    return [_markup(f"{TOOL_CALLS_SEP}{TOOL_CALLS_START}\n"), *_interleave(invokes, _markup("\n")),
            _markup(f"\n{TOOL_CALLS_END}")]


def _replayed_segments(dsml: str) -> list[Segment]:
    """The DSML the model sampled (StreamParser.tool_calls_text): only its DSML markers are markup. The model
    cannot sample the turn or think-start tokens (banned_tokens), so any such text in its arguments was spelled
    out character by character (e.g. copied from a file it read) and must stay plain text here too."""
    return [_markup(part) if part == DSML else _plain(part) for part in re.split(f"({re.escape(DSML)})", dsml)]


# ---- prompt -----------------------------------------------------------------------------------------------
@dataclass
class _Turn:
    role: str  # "system" | "user" | "assistant"
    text: str = ""  # system text or assistant content
    blocks: list[tuple[str | None, str]] = field(default_factory=list)  # user: (tool_call_id | None for text, text)
    reasoning: str = ""
    tool_calls: list[Mapping[str, Any]] = field(default_factory=list)


def _content_text(content: Any, joiner: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"message content must be a string or a list of text parts, not {type(content).__name__}")
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text", "output_text"):
            parts.append(part.get("text") or "")
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatFormatError(f"unsupported content part {kind!r}: DeepSeek-V4 takes text only")
    return joiner.join(parts)


def _turns(messages: Iterable[Mapping[str, Any]]) -> list[_Turn]:
    turns: list[_Turn] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in ("system", "developer"):
            text = _content_text(m.get("content"), "")
            if turns and turns[-1].role == "user":  # the format has no system turn between a user turn and
                turns[-1].blocks.append((None, text))  # the answer: it joins the user turn as a text block
            else:
                turns.append(_Turn("system", text=text))
        elif role in ("user", "tool", "function"):
            block = (None, _content_text(m.get("content"), "")) if role == "user" else \
                (m.get("tool_call_id") or "", _content_text(m.get("content"), "\n\n"))
            if turns and turns[-1].role == "user":  # consecutive user/tool messages share one user turn
                turns[-1].blocks.append(block)
            else:
                turns.append(_Turn("user", blocks=[block]))
        elif role == "assistant":
            turns.append(_Turn("assistant", text=_content_text(m.get("content"), ""),
                               reasoning=m.get("reasoning_content") or m.get("reasoning") or "",
                               tool_calls=list(m.get("tool_calls") or [])))
        else:
            raise ChatFormatError(f"messages[{i}] has unknown role {role!r}")
    _order_tool_results(turns)
    return turns


def _order_tool_results(turns: list[_Turn]) -> None:
    """Put each user turn's tool results in the order of the latest assistant's calls (as the reference)."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {c.get("id"): n for n, c in enumerate(turn.tool_calls) if c.get("id")}
        elif turn.role == "user":
            slots = [n for n, (call_id, _) in enumerate(turn.blocks) if call_id is not None]
            results = sorted((turn.blocks[n] for n in slots), key=lambda b: order.get(b[0], 0))
            for n, block in zip(slots, results, strict=True):
                turn.blocks[n] = block


def render_prompt(messages: Iterable[Mapping[str, Any]], tools: list[Any] | None = None, thinking: bool = False,
                  add_generation_prompt: bool = True, replay: Callable[[str], str | None] | None = None,
                  reasoning_effort: str | None = None) -> str:
    """The prompt text for OpenAI-style messages (system, developer, user, assistant with reasoning_content
    and tool_calls, tool), for display and goldens; encode a prompt with encode_prompt, never by encoding this
    text with special tokens allowed (client text would become control tokens). `tools` are rendered as given;
    pass them through canonical_tools first for a stable prefix. With add_generation_prompt a conversation
    ending in a user turn ends with the assistant opening (`<｜Assistant｜><think>` or `<｜Assistant｜></think>`).
    `replay(id)` may return the exact DSML the model sampled for the assistant turn whose first tool call has
    that id (StreamParser.tool_calls_text); it replaces the re-rendered calls so the prompt matches the tokens
    the model produced. reasoning_effort "max" adds DeepSeek's maximum-effort preamble in thinking mode;
    "high", "low" and None add nothing (the model has no other levels)."""
    return _joined(prompt_segments(messages, tools, thinking, add_generation_prompt, replay, reasoning_effort))


def encode_prompt(tokenizer: Tokenizer, messages: Iterable[Mapping[str, Any]], tools: list[Any] | None = None,
                  thinking: bool = False, add_generation_prompt: bool = True,
                  replay: Callable[[str], str | None] | None = None, reasoning_effort: str | None = None) -> list[int]:
    """The prompt token ids of render_prompt's text (same arguments): only the template's markup becomes
    control tokens, all client text is plain. For text holding no special-token text the ids equal
    tokenizer.encode(render_prompt(...)), token for token (live-KV prefix reuse relies on it)."""
    segments = prompt_segments(messages, tools, thinking, add_generation_prompt, replay, reasoning_effort)
    return tokenizer.encode_pieces((s.text, s.markup) for s in segments)


def prompt_segments(messages: Iterable[Mapping[str, Any]], tools: list[Any] | None = None, thinking: bool = False,
                    add_generation_prompt: bool = True, replay: Callable[[str], str | None] | None = None,
                    reasoning_effort: str | None = None) -> list[Segment]:
    """The prompt of render_prompt (same arguments) as markup and client-text segments, in order."""
    if reasoning_effort not in (None, "low", "high", "max"):
        raise ChatFormatError(f"reasoning_effort {reasoning_effort!r}: use low, high or max")
    turns = _turns(messages)
    if tools and (not turns or turns[0].role != "system"):
        turns.insert(0, _Turn("system"))
    keep_reasoning = bool(tools)
    last_user = max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)

    out = [_markup(BOS), _markup(REASONING_EFFORT_MAX if thinking and reasoning_effort == "max" else "")]
    for i, turn in enumerate(turns):
        if turn.role == "system":
            out.append(_plain(turn.text))
            if tools and i == 0:
                out += [_markup("\n\n"), *_tools_segments(tools)]
        elif turn.role == "user":
            blocks = [[_plain(text)] if call_id is None else
                      [_markup("<tool_result>"), _plain(text), _markup("</tool_result>")]
                      for call_id, text in turn.blocks]
            out += [_markup(USER), *_interleave(blocks, _markup("\n\n"))]
            following = turns[i + 1].role if i + 1 < len(turns) else None
            if following == "assistant" or (following is None and add_generation_prompt):
                out.append(_markup(ASSISTANT + (THINK_START if thinking and (keep_reasoning or i == last_user)
                                                else THINK_END)))
        else:
            if thinking and (keep_reasoning or i > last_user):
                out += [_plain(turn.reasoning), _markup(THINK_END)]
            out.append(_plain(turn.text))
            if turn.tool_calls:
                first_id = turn.tool_calls[0].get("id")
                sampled = replay(first_id) if replay is not None and first_id else None
                out += _replayed_segments(sampled) if sampled is not None else _tool_calls_segments(turn.tool_calls)
            out.append(_markup(EOS))
    return [s for s in out if s.text]


# ---- parsing generated text -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str  # the fragments of one call concatenate to its arguments, a JSON object


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd

_INVOKE_TAG = re.compile(re.escape(INVOKE_START) + r'\s+name="(.*)"\s*>', re.S)
_PARAM_TAG = re.compile(re.escape(PARAM_START) + r'\s+name="(.*?)"(?:\s+string="(true|false)")?\s*>', re.S)
_REASONING, _CONTENT, _BLOCK, _INVOKE, _VALUE, _DONE = range(6)
# Markers that end plain text, per state. The tool-call block may come with or without its blank line. In
# content, DSML anywhere else (with the "<" or "</" of its tag) is stray markup; a parser without tools treats
# DSML text as text (the DSML token is banned then, so the model spelled it out, e.g. quoting chat.py).
_STRAY_DSML = (f"</{DSML}", f"<{DSML}", DSML)
_TEXT_MARKERS = {_REASONING: (THINK_END, EOS),
                 _CONTENT: (TOOL_CALLS_SEP + TOOL_CALLS_START, TOOL_CALLS_START, EOS, *_STRAY_DSML)}
_TEXT_MARKERS_NO_TOOLS = {_REASONING: (THINK_END, EOS), _CONTENT: (EOS,)}


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_marker(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of `text` that a marker starts with (text to hold back)."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _json_chars(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class StreamParser:
    """Incremental parser of generated text. feed() pieces of any size (markers may be split anywhere) and
    get events; finish() at the end of generation flushes what was held back and closes an open tool call.
    Text is held back only while it could still be the start of a marker. In thinking mode the text is
    reasoning until `</think>`. Tool-call arguments stream as JSON fragments: string parameters as they are
    sampled, other values once complete (a value that is not valid JSON is passed on as a JSON string).
    `tool_calls_text` collects the exact DSML text of the calls, for render_prompt's replay.

    DSML markup never reaches content: DSML in content other than a tool-call block's opening tag ends the
    output there (the text before it is content, the rest is dropped) and sets `malformed`. So do a cut call
    (the output ends inside an invoke) and an invoke or parameter tag that cannot be parsed, though their
    events still come (a streamed call is closed as well as it can be). `malformed` is None for well-formed
    output, else a sentence saying what was wrong, for the server to report as the turn's finish state.
    With tools=False (no tool may be called, the DSML token is banned) DSML text is ordinary content. DSML in
    reasoning stays reasoning (the model may plan a call while thinking)."""

    def __init__(self, thinking: bool = False, new_call_id: Callable[[], str] = _new_call_id,
                 tools: bool = True) -> None:
        self.thinking = thinking  # the turn opened in reasoning (`<think>`)
        self._state = _REASONING if thinking else _CONTENT
        self._markers = _TEXT_MARKERS if tools else _TEXT_MARKERS_NO_TOOLS
        self._buf = ""
        self._final = False
        self._new_call_id = new_call_id
        self._calls = 0
        self._params = 0
        self._string_value = True
        self.tool_calls_text = ""
        self.malformed: str | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        self._final = True
        events = self.feed("")
        if self._state == _VALUE:  # generation stopped inside a value: close it with what we have,
            # less a partial closing tag the parser held back (it is markup, never argument text)
            rest = self._buf
            for n in range(min(len(PARAM_END) - 1, len(rest)), 0, -1):
                if rest.endswith(PARAM_END[:n]):
                    rest = rest[:-n]
                    break
            self._take(len(self._buf))
            self._end_value(rest, events)
            self._state = _INVOKE
        if self._state == _INVOKE:
            self._flag(f"the output ended inside tool call {self._calls - 1}, which was closed as it stood")
            self._end_call(events)
        self._buf = ""
        self._state = _DONE
        return events

    # ---- states -------------------------------------------------------------------------------------
    def _step(self, events: list[Event]) -> bool:
        """Consume what can be decided now; True if it made progress and should be called again."""
        if self._state in self._markers:
            return self._text(events)
        if self._state == _VALUE:
            return self._value(events)
        if self._state in (_BLOCK, _INVOKE):
            return self._markup(events)
        self._buf = ""  # _DONE: nothing after the end of the turn counts
        return False

    def _text(self, events: list[Event]) -> bool:
        markers = self._markers[self._state]
        found = [(self._buf.find(m), -len(m), m) for m in markers if m in self._buf]
        if found:
            pos, _, marker = min(found)  # earliest, then longest
            if marker in _STRAY_DSML and not self._final and TOOL_CALLS_START.startswith(self._buf[pos:]):
                found = []  # still possibly a block's opening tag: hold it back below
        if found:
            self._emit_text(self._buf[:pos], events)
            if marker in _STRAY_DSML:  # the rest is dropped: nothing after stray markup counts
                self._flag("the model wrote DSML markup outside a tool-call block; the output was cut there")
                self._state = _DONE
                return True
            self._buf = self._buf[pos + len(marker):]
            if marker == THINK_END:
                self._state = _CONTENT
            elif marker == EOS:
                self._state = _DONE
            else:
                self.tool_calls_text += marker
                self._state = _BLOCK
            return True
        keep = 0 if self._final else _partial_marker(self._buf, markers)
        self._emit_text(self._buf[:len(self._buf) - keep], events)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _emit_text(self, text: str, events: list[Event]) -> None:
        if text:
            events.append(ReasoningDelta(text) if self._state == _REASONING else ContentDelta(text))

    def _markup(self, events: list[Event]) -> bool:
        """Between the tags of a tool-call block: whitespace, tags, and (tolerated, dropped) stray text."""
        self._take(len(self._buf) - len(self._buf.lstrip()))
        buf = self._buf
        if not buf:
            return False
        if self._state == _INVOKE:
            if buf.startswith((TOOL_CALLS_END, INVOKE_START)):  # the invoke was never closed
                self._end_call(events)
                self._state = _BLOCK
                return True
            if buf.startswith(INVOKE_END):
                self._take(len(INVOKE_END))
                self._end_call(events)
                self._state = _BLOCK
                return True
            tags = (PARAM_START, INVOKE_END, TOOL_CALLS_END, INVOKE_START)
        else:
            if buf.startswith(TOOL_CALLS_END):
                self._take(len(TOOL_CALLS_END))
                self._state = _CONTENT
                return True
            tags = (INVOKE_START, TOOL_CALLS_END)
        if buf.startswith(tags[0]):  # an opening tag with attributes: wait for all of it
            end = buf.find(">")
            if end < 0:
                return self._wait_or_drop()
            tag = self._take(end + 1)
            if self._state == _INVOKE:
                self._start_param(tag, events)
            else:
                self._start_call(tag, events)
            return True
        if any(t.startswith(buf) for t in tags):
            return self._wait_or_drop()
        cut = buf.find("<", 1)
        self._take(cut if cut > 0 else len(buf))
        return True

    def _wait_or_drop(self) -> bool:
        if self._final:  # an incomplete tag at the end of generation is dropped
            self._take(len(self._buf))
        return False

    def _value(self, events: list[Event]) -> bool:
        pos = self._buf.find(PARAM_END)
        if pos >= 0:
            self._end_value(self._take(pos), events)
            self._take(len(PARAM_END))
            self._state = _INVOKE
            return True
        if self._string_value and not self._final:  # stream string values, holding back a partial end tag
            chunk = self._take(len(self._buf) - _partial_marker(self._buf, (PARAM_END,)))
            if chunk:
                events.append(ToolCallArgsDelta(self._calls - 1, _json_chars(chunk)))
        return False

    # ---- tool-call events ---------------------------------------------------------------------------
    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        self.tool_calls_text += text
        return text

    def _flag(self, why: str) -> None:
        if self.malformed is None:  # the first problem is the one that explains the rest
            self.malformed = why

    def _start_call(self, tag: str, events: list[Event]) -> None:
        match = _INVOKE_TAG.fullmatch(tag)
        name = match.group(1) if match else tag[len(INVOKE_START):-1].strip()
        if not match or not name:
            self._flag(f"tool call {self._calls} has a malformed invoke tag {tag!r}")
        events.append(ToolCallStart(self._calls, self._new_call_id(), name))
        self._calls += 1
        self._params = 0
        self._state = _INVOKE

    def _start_param(self, tag: str, events: list[Event]) -> None:
        match = _PARAM_TAG.fullmatch(tag)
        name = match.group(1) if match else tag[len(PARAM_START):-1].strip()
        if not match:
            self._flag(f"tool call {self._calls - 1} has a malformed parameter tag {tag!r}")
        self._string_value = not match or match.group(2) != "false"
        head = ("{" if self._params == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
        events.append(ToolCallArgsDelta(self._calls - 1, head + ('"' if self._string_value else "")))
        self._params += 1
        self._state = _VALUE

    def _end_value(self, rest: str, events: list[Event]) -> None:
        if self._string_value:
            fragment = _json_chars(rest) + '"'
        else:
            try:
                json.loads(rest)
                fragment = rest
            except ValueError:
                fragment = json.dumps(rest, ensure_ascii=False)
        events.append(ToolCallArgsDelta(self._calls - 1, fragment))

    def _end_call(self, events: list[Event]) -> None:
        events.append(ToolCallArgsDelta(self._calls - 1, "}" if self._params else "{}"))
        events.append(ToolCallEnd(self._calls - 1))


def parse_completion(text: str, thinking: bool = False,
                     new_call_id: Callable[[], str] = _new_call_id) -> tuple[str, str, list[dict[str, Any]]]:
    """(reasoning, content, tool_calls in OpenAI form) of a whole generated text."""
    parser = StreamParser(thinking, new_call_id)
    events = parser.feed(text) + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, ToolCallArgsDelta):
            calls[e.index]["function"]["arguments"] += e.fragment
    return reasoning, content, calls


def banned_tokens(tok: Any, thinking: bool, tools: bool) -> list[int]:
    """Tokens the model must not produce in an assistant turn: turn markers always, the think tags where they
    make no sense, and DSML when no tool may be called (tool_choice none, or no tools at all)."""
    from .tokenizer import ASSISTANT, BOS, DSML, THINK_END, THINK_START, USER

    banned = [tok.token_id(t) for t in (BOS, USER, ASSISTANT, THINK_START)]
    if not thinking:
        banned.append(tok.token_id(THINK_END))
    if not tools:
        banned.append(tok.token_id(DSML))
    return banned
