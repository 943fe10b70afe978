"""The DS4 tokenizer: demo vocabulary, GGUF metadata round trip, joyai-llm splitting, exact byte round trips,
atomic special tokens and streaming detokenisation."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys

import pytest
from gguf import GGUFReader, GGUFWriter, TokenType

from ds4station.engine.tokenizer import (
    ASSISTANT,
    BOS,
    BYTE_TO_UNICODE,
    DSML,
    EOS,
    FLASH_SPECIAL_IDS,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    UNICODE_TO_BYTE,
    USER,
    Tokenizer,
    _pre_tokenizer,
    build_demo_vocab,
    tokenizer_metadata,
)


@pytest.fixture(scope="module")
def vocab():
    return build_demo_vocab(512)


@pytest.fixture(scope="module")
def tok(vocab) -> Tokenizer:
    return Tokenizer.from_metadata(tokenizer_metadata(vocab))


def _digest(v) -> str:
    return hashlib.sha256(json.dumps([v.tokens, v.merges, v.token_types]).encode()).hexdigest()


# ---- demo vocabulary -----------------------------------------------------------------------------------------
def test_demo_vocab_layout(vocab) -> None:
    assert len(vocab.tokens) == len(vocab.token_types) == 512
    assert vocab.tokens[:7] == list(SPECIAL_TOKENS) and vocab.tokens[0] == BOS and vocab.tokens[1] == EOS
    assert vocab.tokens[7:263] == [BYTE_TO_UNICODE[b] for b in range(256)]
    assert vocab.token_types == [TokenType.CONTROL] * 7 + [TokenType.NORMAL] * 505
    assert len(set(vocab.tokens)) == 512
    known = set(vocab.tokens)
    for merge in vocab.merges:  # every merge joins two known tokens into a known token
        left, right = merge.split(" ")
        assert {left, right, left + right} <= known


# Pinned so a change of corpus, trainer or `tokenizers` version that would change demo GGUFs is noticed.
DEMO_512_SHA256 = "7658d9f6247cd9623f09d0e8dbb898831ba58a572f7696ce981cd9ac47011d8f"


def test_demo_vocab_is_deterministic(vocab) -> None:
    assert _digest(build_demo_vocab(512)) == _digest(vocab) == DEMO_512_SHA256
    code = ("import hashlib, json; from ds4station.engine.tokenizer import build_demo_vocab as b; v = b(512); "
            "print(hashlib.sha256(json.dumps([v.tokens, v.merges, v.token_types]).encode()).hexdigest())")
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert other_process.stdout.strip() == DEMO_512_SHA256


def test_demo_vocab_pads_large_sizes_and_refuses_tiny_ones() -> None:
    big = build_demo_vocab(129280)  # the Flash vocabulary size: the corpus runs out of merges first
    assert len(big.tokens) == 129280 and big.token_types[-1] == TokenType.UNUSED
    assert len(set(big.tokens)) == 129280
    tok = Tokenizer.from_metadata(tokenizer_metadata(big))
    assert tok.vocab_size == 129280 and tok.decode(tok.encode("pad check ✓")) == "pad check ✓"
    with pytest.raises(ValueError, match="too small"):
        build_demo_vocab(100)


# ---- metadata -------------------------------------------------------------------------------------------------
def test_metadata_round_trip_through_gguf(vocab, tok, tmp_path) -> None:
    meta = tokenizer_metadata(vocab)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "joyai-llm"
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (0, 1)
    path = tmp_path / "tok.gguf"
    writer = GGUFWriter(path, "deepseek4")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = {name: f.contents() for name, f in GGUFReader(path).fields.items() if name.startswith("tokenizer.")}
    assert read == meta
    again = Tokenizer.from_metadata(read)
    text = "Round trip: <｜User｜>héllo 世界 🎉<｜Assistant｜>"
    assert again.encode(text) == tok.encode(text) and again.decode(again.encode(text)) == text


def test_special_ids(tok, vocab) -> None:
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 512)
    assert [tok.user_id, tok.assistant_id, tok.think_start_id, tok.think_end_id, tok.dsml_id] == \
        [vocab.tokens.index(t) for t in (USER, ASSISTANT, THINK_START, THINK_END, DSML)]
    assert tok.token_id(DSML) == tok.dsml_id and tok.is_control(tok.dsml_id) and not tok.is_control(100)
    assert FLASH_SPECIAL_IDS[BOS] == 0 and FLASH_SPECIAL_IDS[EOS] == 1


@pytest.mark.parametrize("change,message", [
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "qwen2"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.bos_token_id": 512}, "bos_token_id"),
    ({"tokenizer.ggml.token_type": [1] * 3}, "token_type"),
    ({"tokenizer.ggml.merges": ["Ġ zzz"]}, "merges"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "merges"),
])
def test_bad_metadata_is_named(vocab, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_metadata({**tokenizer_metadata(vocab), **change})


def test_missing_key_and_missing_special_token(vocab) -> None:
    meta = tokenizer_metadata(vocab)
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        Tokenizer.from_metadata({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[tokens.index(DSML)] = "<｜not▁dsml｜>"
    with pytest.raises(ValueError, match="DSML"):
        Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens})


# ---- encoding -------------------------------------------------------------------------------------------------
def _pieces(text: str) -> list[str]:
    pieces = _pre_tokenizer("joyai-llm").pre_tokenize_str(text)
    return [bytes(UNICODE_TO_BYTE[c] for c in piece).decode() for piece, _ in pieces]


def test_joyai_pre_tokenizer_splits() -> None:
    # Digits in groups of at most 3; CJK/kana runs alone; a punctuation run keeps its newlines; a lone
    # leading space joins the next word, so "    int" is "   " + " int" (ds4.c documents the same shape).
    assert _pieces("abc 12345 你好こんにちは x") == ["abc", " ", "123", "45", " ", "你好こんにちは", " x"]
    assert _pieces("f(x);\n    int y") == ["f", "(x", ");\n", "   ", " int", " y"]
    assert _pieces("don't stop—now!!\n\n") == ["don", "'t", " stop", "—", "now", "!!\n\n"]


ROUND_TRIP = [
    "", " ", "  leading and trailing  ", "tabs\tand\r\nCRLF\n\n\n", "Hello, world! 123456789 3.14",
    "emoji 🎉👩‍👩‍👧 flags 🇮🇹", "CJK 中文字符 日本語のテキスト 한국어", "combining e\u0301 a\u0308 \u0915\u094d\u0937",
    "controls \x00\x01\x1b[31m\x7f \u200b\u2028\ufeff", "specials inline <｜User｜>x<think>y</think>｜DSML｜",
    "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">", "\U0010ffff\U000e0001 private \ue000",
]


def test_round_trip_fixed(tok) -> None:
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, allow_special=False)) == text


def test_round_trip_random_unicode(tok) -> None:
    rng = random.Random(1234)
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    pieces = [*SPECIAL_TOKENS, " ", "\n", "  "]
    for _ in range(200):
        chars = []
        for _ in range(rng.randrange(1, 40)):
            if rng.random() < 0.1:
                chars.append(rng.choice(pieces))
            else:
                lo, hi = rng.choice(ranges)
                chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_atomic(tok) -> None:
    for special in SPECIAL_TOKENS:
        assert tok.encode(special) == [tok.token_id(special)]
    ids = tok.encode("a<｜User｜>b</think>c｜DSML｜d")
    assert [i for i in ids if tok.is_control(i)] == [tok.user_id, tok.think_end_id, tok.dsml_id]
    # BPE never produces a control token from ordinary text, nor does it when specials are disallowed.
    plain = tok.encode(BOS + USER + THINK_START, allow_special=False)
    assert len(plain) > 3 and not any(tok.is_control(i) for i in plain)
    assert tok.decode(plain) == BOS + USER + THINK_START


def test_encode_pieces_matches_encode_and_keeps_plain_pieces_plain(tok) -> None:
    rng = random.Random(7)
    words = [*SPECIAL_TOKENS, "<", "｜", ">", "</", "think", "User", "a", " b", "\n\n", "é", "12", '"']
    for _ in range(300):
        pieces = [("".join(rng.choice(words) for _ in range(rng.randrange(0, 5))), rng.random() < 0.5)
                  for _ in range(rng.randrange(1, 6))]
        text = "".join(t for t, _ in pieces)
        ids = tok.encode_pieces(pieces)
        assert tok.decode(ids) == text
        assert not any(tok.is_control(i) for i in tok.encode_pieces([(t, False) for t, _ in pieces]))
        # Where every special token's text in the whole lies inside markup, the ids are encode()'s: piece
        # boundaries never change how the text is split.
        markup = [m for t, m in pieces for _ in t]  # per character
        specials = re.finditer("|".join(map(re.escape, sorted(SPECIAL_TOKENS, key=len, reverse=True))), text)
        if all(all(markup[match.start():match.end()]) for match in specials):
            assert ids == tok.encode(text), pieces
    assert tok.encode_pieces([(USER + "a" + EOS, True)]) == tok.encode(USER + "a" + EOS)
    assert tok.encode_pieces([(USER + "a" + EOS, False)]) == tok.encode(USER + "a" + EOS, allow_special=False)
    # a special token split across two markup pieces is still one token; plain text around it joins up
    assert tok.encode_pieces([("x <｜Us", True), ("er｜>", True)]) == tok.encode("x " + USER)
    ids = tok.encode_pieces([("hi ", True), (THINK_END + " there", False), (THINK_END, True)])
    assert ids == [*tok.encode("hi " + THINK_END + " there", allow_special=False), tok.think_end_id]


def test_token_pieces(tok) -> None:
    ids = tok.encode("héllo")
    assert b"".join(tok.token_bytes(i) for i in ids) == "héllo".encode()
    assert tok.token_to_piece(tok.user_id) == USER
    assert tok.token_to_piece(tok.token_id(BYTE_TO_UNICODE[0xC3])) == "\ufffd"  # half of a character


# ---- streaming ------------------------------------------------------------------------------------------------
def test_stream_decoder_holds_incomplete_characters(tok) -> None:
    text = "ok 🎉 中 é<think>"
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    outputs = [stream.push(i) for i in ids]
    assert "".join(outputs) + stream.flush() == text
    assert not any("\ufffd" in out for out in outputs)
    assert "" in outputs  # the emoji's first bytes came as tokens that produce no text yet
    # Every emitted prefix is a prefix of the text: nothing is emitted early and revised later.
    assert all(text.startswith("".join(outputs[:n])) for n in range(len(outputs) + 1))


def test_stream_decoder_replaces_impossible_bytes(tok) -> None:
    byte = {b: tok.token_id(BYTE_TO_UNICODE[b]) for b in (0xF0, 0x9F, 0xFF, ord("a"))}
    stream = tok.stream_decoder()
    assert stream.push(byte[0xFF]) == "\ufffd"
    assert stream.push(byte[0xF0]) == "" and stream.push(byte[0x9F]) == ""
    assert stream.push(byte[ord("a")]) == "\ufffda"  # the broken sequence ends, the new character comes out
    assert stream.push(byte[0xF0]) == "" and stream.flush() == "\ufffd"
    assert stream.push(byte[ord("a")]) == "a"
