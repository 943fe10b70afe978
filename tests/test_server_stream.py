"""Streaming robustness of what the server sends: the DSML/think stream parser fed with the model's output cut at
every possible boundary (every character position, every token of the real tokenizer, one character at a time)
gives the same events as the whole text, and no markup ever reaches a delta. Also the SSE framing of one
streamed tool call as the OpenAI front-end builds it."""

from __future__ import annotations

import codecs
import json

import pytest

from ds4station.engine import chat
from ds4station.engine.demo import make_model
from ds4station.engine.tokenizer import DSML, EOS, THINK_END, THINK_START, Tokenizer

CALLS = [{"id": "call_a", "type": "function",
          "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris </b> <i>", "days": 3})}},
         {"id": "call_b", "type": "function",
          "function": {"name": "run", "arguments": json.dumps({"cmd": "ls -la\n<｜x", "opts": {"a": [1, 2]},
                                                              "ok": True})}}]
OUTPUT = ("Let me think < about </thi it." + THINK_END + "Checking the weather <｜ now."
          + chat.render_tool_calls(CALLS) + "\nafter")


def _merge(events: list[chat.Event]) -> list[tuple]:
    """Events with adjacent text / argument fragments joined (how they may be split is not fixed)."""
    out: list[tuple] = []
    for e in events:
        key, value = type(e).__name__, getattr(e, "text", None)
        if isinstance(e, chat.ToolCallArgsDelta):
            key, value = f"args{e.index}", e.fragment
        elif isinstance(e, chat.ToolCallStart):
            out.append(("start", e.index, e.name))
            continue
        elif isinstance(e, chat.ToolCallEnd):
            out.append(("end", e.index))
            continue
        if out and out[-1][0] == key:
            out[-1] = (key, out[-1][1] + value)
        else:
            out.append((key, value))
    return out


def _parse(pieces: list[str]) -> tuple[list[chat.Event], str]:
    ids = iter(f"call_{i}" for i in range(100))
    parser = chat.StreamParser(thinking=True, new_call_id=lambda: next(ids))
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return events, parser.tool_calls_text


REFERENCE, REFERENCE_DSML = _parse([OUTPUT])


def _check(pieces: list[str]) -> None:
    events, dsml = _parse(pieces)
    assert _merge(events) == _merge(REFERENCE)
    assert dsml == REFERENCE_DSML
    for e in events:
        text = getattr(e, "text", None) or getattr(e, "fragment", None) or ""
        assert DSML not in text and THINK_START not in text and THINK_END not in text


def test_reference_parse_is_what_the_model_meant() -> None:
    merged = _merge(REFERENCE)
    assert merged[0] == ("ReasoningDelta", "Let me think < about </thi it.")
    assert merged[1] == ("ContentDelta", "Checking the weather <｜ now.")
    starts = [m for m in merged if m[0] == "start"]
    assert starts == [("start", 0, "get_weather"), ("start", 1, "run")]
    args = {m[0]: json.loads(m[1]) for m in merged if m[0].startswith("args")}
    assert args == {"args0": json.loads(CALLS[0]["function"]["arguments"]),
                    "args1": json.loads(CALLS[1]["function"]["arguments"])}
    assert REFERENCE_DSML == chat.render_tool_calls(CALLS)


def test_every_two_piece_split() -> None:
    for i in range(len(OUTPUT) + 1):
        _check([OUTPUT[:i], OUTPUT[i:]])


def test_one_character_at_a_time() -> None:
    _check(list(OUTPUT))


def test_every_marker_split_in_three_every_way() -> None:
    markers = (THINK_END, chat.TOOL_CALLS_SEP + chat.TOOL_CALLS_START, chat.INVOKE_START, chat.PARAM_START,
               chat.PARAM_END, chat.INVOKE_END, chat.TOOL_CALLS_END)
    spans = sorted({(i, i + len(m)) for m in markers for i in range(len(OUTPUT)) if OUTPUT.startswith(m, i)})
    assert len(spans) >= 10
    for start, end in spans:
        for a in range(start, end + 1):
            for b in range(a + 1, end + 1):
                _check([OUTPUT[:a], OUTPUT[a:b], OUTPUT[b:]])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from ds4station.model.gguf import GGUFFile

    path = make_model(tmp_path_factory.mktemp("model") / "tiny.gguf")
    return Tokenizer.from_metadata(GGUFFile.open(path).metadata)


def test_token_by_token_with_the_real_tokenizer(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(OUTPUT + EOS)
    assert ids[-1] == tokenizer.eos_id and tokenizer.dsml_id in ids
    decoder = tokenizer.stream_decoder()
    pieces = [decoder.push(t) for t in ids[:-1]] + [decoder.flush()]  # the scheduler stops at EOS
    _check(pieces)
    # and byte-split: every token's bytes in two halves through an incremental UTF-8 decoder
    utf8 = codecs.getincrementaldecoder("utf-8")()
    halves = []
    for t in ids[:-1]:
        b = tokenizer.token_bytes(t)
        halves += [utf8.decode(b[: len(b) // 2]), utf8.decode(b[len(b) // 2:])]
    _check(halves + [utf8.decode(b"", final=True)])
