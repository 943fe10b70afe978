"""Forced tool calls: the guide that makes the model write a well-formed DSML call when the client demands one.

`tool_choice: "required"` / a named tool (OpenAI), `{"type": "any" | "tool"}` (Anthropic) promise the client a
tool call. The guide writes the DSML structure itself and lets the model choose everything a call is made of:
- the tool, when several qualify (sampling restricted to the names' tokens, a token trie);
- each parameter value (sampling restricted to what fits the parameter's JSON-schema type: plain text for
  strings, digits for numbers, `true`/`false` for booleans, the listed values for enums; tokens holding
  only part of a UTF-8 character, control characters and `<` are excluded). A string or number
  value ends when the model starts the end tag (`<` or `</`); the guide completes the tag.
Parameters are the schema's `required` ones (all of its properties when it lists none), in `properties` order,
the order the model was trained to write them in. The token budget (`max_tokens`) is split so the call always
closes inside it: a value that reaches its share is closed by the guide, never left broken. Object, array and
null parameters get their empty value (`{}`, `[]`, `null`): this guide does not generate nested JSON.

In thinking mode the call starts by closing the thinking phase with empty reasoning, so a client that sends
the turn back renders exactly the tokens the model holds. The parser and the replay store see the result
like any call the model wrote on its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds4station.engine.chat import (
    INVOKE_END,
    INVOKE_START,
    PARAM_END,
    PARAM_START,
    TOOL_CALLS_END,
    TOOL_CALLS_SEP,
    TOOL_CALLS_START,
)
from ds4station.engine.scheduler import Allowed, Forced
from ds4station.engine.tokenizer import THINK_END, Tokenizer

_MASKS: dict[int, dict[str, Any]] = {}


def _masks(tok: Tokenizer) -> dict[str, Any]:
    """Vocabulary masks, computed once per tokenizer (a pass over the vocabulary's bytes)."""
    cached = _MASKS.get(id(tok))
    if cached is not None and cached["tok"] is tok:
        return cached
    n = tok.vocab_size
    text_ok = torch.zeros(n, dtype=torch.bool)
    digits = torch.zeros(n, dtype=torch.bool)
    leading = torch.zeros(n, dtype=torch.bool)  # digit runs that may start a JSON number (no leading 0)
    closers: dict[int, str] = {}
    for i in range(n):
        if tok.is_control(i):
            continue
        b = tok.token_bytes(i)
        if not b or b.startswith(b"<|place") or b.startswith("<｜place".encode()):
            continue
        if b in (b"<", b"</"):
            closers[i] = b.decode()
        elif b"<" not in b and not any(c < 0x20 and c not in (0x09, 0x0A) for c in b) and _complete_utf8(b):
            text_ok[i] = True
            digits[i] = b.isdigit()
            leading[i] = b.isdigit() and not b.startswith(b"0")
    closer_mask = torch.zeros(n, dtype=torch.bool)
    closer_mask[list(closers)] = True
    entry = {"tok": tok, "text": text_ok, "digits": digits, "leading": leading, "closers": closers,
             "closer_mask": closer_mask}
    _MASKS[id(tok)] = entry
    return entry


def _complete_utf8(b: bytes) -> bool:
    # Value tokens must be whole characters: a value the client echoes back is then re-tokenised to the
    # same bytes, so the live KV keeps matching (a lone byte of a split character would come back as U+FFFD).
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _schema_params(schema: Mapping[str, Any] | None) -> list[tuple[str, Mapping[str, Any]]]:
    if not schema:
        return []
    props = schema.get("properties") or {}
    required = schema.get("required")
    names = [k for k in props if k in required] if required else list(props)
    return [(k, props[k] if isinstance(props[k], Mapping) else {}) for k in names]


def _kind(prop: Mapping[str, Any]) -> str:
    if isinstance(prop.get("enum"), list) and prop["enum"] and all(isinstance(v, str) for v in prop["enum"]):
        return "enum"
    typ = prop.get("type")
    if isinstance(typ, list):  # ["string", "null"] and the like: the first non-null type
        typ = next((t for t in typ if t != "null"), "null")
    return {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
            "object": "object", "array": "array", "null": "null"}.get(typ or "string", "string")


class ToolCallGuide:
    """A scheduler Guide (see engine/scheduler.py) that produces one complete DSML tool call."""

    def __init__(self, tok: Tokenizer, tools: Sequence[Mapping[str, Any]], max_tokens: int,
                 close_think: bool = False) -> None:
        """`tools`: the candidate functions ({"name", "parameters"}), one for a named tool_choice.
        `close_think`: the prompt opened a thinking phase; the call starts by closing it (empty reasoning)."""
        if not tools:
            raise ValueError("a forced tool call needs at least one tool")
        self.tok = tok
        self.m = _masks(tok)
        self.tools = {t["name"]: t for t in tools}
        self.max_tokens = max_tokens
        # steps: ("text", pieces) | ("ids", [token ids]) | ("choice", [candidate pieces]) | ("value", kind), where
        # pieces are (text, markup) pairs: the DSML tags are markup, the schema's parameter names and enum
        # values are the client's text, encoded plain (Tokenizer.encode_pieces) so they cannot force a control
        # token into the call
        self._plan: deque[tuple[str, Any]] = deque()
        self._choice: list[tuple[str, list[int]]] | None = None
        self._choice_pos = 0
        self._value_kind: str | None = None
        self._value_tokens = 0
        self._value_budget = 1
        self.done = False
        self._used = 0  # tokens generated so far
        # The block follows a blank line, as the reference renderer writes it (render_tool_calls).
        head = (THINK_END if close_think else "") + f"{TOOL_CALLS_SEP}{TOOL_CALLS_START}\n{INVOKE_START} name=\""
        # The smallest budget that fits the structure of the costliest candidate with one token per value.
        need = max(self._len([(head + f'{n}">\n', True)]) + fixed + values  # tool names: letters, digits, _.:-
                   for n in self.tools for _, values, fixed in [self._tool_plan(n, "")])
        self.min_tokens = need
        if max_tokens < need:
            raise ValueError(f"max_tokens {max_tokens} is too small for the forced tool call: its DSML structure "
                             f"alone needs {need} tokens")
        if len(self.tools) == 1:
            self._begin_tool(next(iter(self.tools)), prefix=head + f'{next(iter(self.tools))}">\n')
        else:
            self._plan.append(("text", [(head, True)]))
            self._plan.append(("choice", [[(f'{name}">\n', True)] for name in self.tools]))

    # ---- plan --------------------------------------------------------------------------------------
    def _tool_plan(self, name: str, prefix: str) -> tuple[list[tuple[str, Any]], int, int]:
        """The steps that write tool `name`'s call after `prefix`; the number of sampled values; and the
        tokens everything but those values takes (choices at their longest, each value's end tag, EOS)."""
        plan: list[tuple[str, Any]] = []
        text: list[tuple[str, bool]] = [(prefix, True)]
        values = 0
        for n, (key, prop) in enumerate(_schema_params(self.tools[name].get("parameters"))):
            kind = _kind(prop)
            is_str = kind in ("string", "enum")
            text += [(("\n" if n else "") + f'{PARAM_START} name="', True), (key, False),
                     (f'" string="{"true" if is_str else "false"}">', True)]
            if kind in ("object", "array", "null"):
                text.append(({"object": "{}", "array": "[]", "null": "null"}[kind] + PARAM_END, True))
                continue
            plan.append(("text", text))
            text = []
            if kind == "boolean":
                plan.append(("choice", [[(f"true{PARAM_END}", True)], [(f"false{PARAM_END}", True)]]))
            elif kind == "enum":
                plan.append(("choice", [[(f"{v}", False), (PARAM_END, True)] for v in prop["enum"]]))
            else:
                plan.append(("value", kind))
                values += 1
        plan.append(("text", text + [(f"\n{INVOKE_END}\n{TOOL_CALLS_END}", True)]))
        fixed = sum(self._len(a) if k == "text" else max(self._len(c) for c in a) for k, a in plan if k != "value")
        return plan, values, fixed + 1 + self._len([(PARAM_END, True)]) * values

    def _len(self, pieces: list[tuple[str, bool]]) -> int:
        return len(self.tok.encode_pieces(pieces))

    def _begin_tool(self, name: str, prefix: str = "") -> None:
        plan, values, fixed = self._tool_plan(name, prefix)
        self._plan.extend(plan)
        # Each value gets an equal share of what the structure leaves, so the call closes within max_tokens.
        spare = self.max_tokens - self._used - fixed
        self._value_budget = max(1, spare // values) if values else 0

    # ---- Guide protocol ----------------------------------------------------------------------------
    def next(self) -> Forced | Allowed | None:
        if self._choice is not None:
            return Allowed(self._choice_mask())
        if self._value_kind is not None:
            if self._value_tokens >= self._value_budget:
                return self._close_value(f"{PARAM_END}")
            if self._value_kind == "number":
                mask = (self.m["digits"] if self._value_tokens else self.m["leading"]).clone()
            else:
                mask = self.m["text"].clone()
            if self._value_tokens > 0:  # a value is never empty: the end tag may start from the 2nd token
                mask |= self.m["closer_mask"]
            return Allowed(mask)
        if not self._plan:
            if self.done:
                return None
            self.done = True
            return Forced([self.tok.eos_id])
        kind, arg = self._plan.popleft()
        if kind == "text":
            return Forced(self.tok.encode_pieces(arg))
        if kind == "ids":
            return Forced(list(arg))
        if kind == "choice":
            self._choice = [("".join(t for t, _ in c), self.tok.encode_pieces(c)) for c in arg]
            self._choice_pos = 0
            return self.next()
        self._value_kind, self._value_tokens = arg, 0
        return self.next()

    def accept(self, token: int) -> None:
        self._used += 1
        if self._choice is not None:
            self._choice = [(c, ids) for c, ids in self._choice if len(ids) > self._choice_pos
                            and ids[self._choice_pos] == token]
            self._choice_pos += 1
            if len(self._choice) == 1:
                text, ids = self._choice[0]
                rest = ids[self._choice_pos:]
                self._choice = None
                if rest:
                    self._plan.appendleft(("ids", rest))
                if text.endswith('">\n') and text[:-3] in self.tools:  # the tool is chosen: plan its params
                    self._used += len(rest)
                    self._begin_tool(text[:-3])
                    self._used -= len(rest)
            return
        if self._value_kind is not None:
            closer = self.m["closers"].get(token)
            if closer is not None:
                # the model started the end tag; the guide writes the rest of it
                self._plan.appendleft(("text", [(PARAM_END[len(closer):], True)]))
                self._value_kind = None
            else:
                self._value_tokens += 1

    def _close_value(self, text: str) -> Forced:
        # the value reached its share of the budget: the guide ends it
        self._value_kind = None
        return Forced(self.tok.encode_pieces([(text, True)]))

    def _choice_mask(self) -> torch.Tensor:
        assert self._choice is not None
        mask = torch.zeros(self.tok.vocab_size, dtype=torch.bool)
        mask[[ids[self._choice_pos] for _, ids in self._choice if len(ids) > self._choice_pos]] = True
        return mask
