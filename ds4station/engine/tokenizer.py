"""The DS4 tokenizer: special tokens, byte-level BPE from GGUF metadata, streaming detokenisation, demo vocab.

DeepSeek-V4-Flash ships a GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`) whose pre-tokenizer is
`tokenizer.ggml.pre = "joyai-llm"`: three regex splits applied one after the other, each re-splitting the pieces
of the previous one (llama.cpp's LLAMA_VOCAB_PRE_TYPE_JOYAI_LLM, the same Sequence of `Split(isolated)` as
DeepSeek-V3's tokenizer.json; ds4.c hand-codes the same shape). `Tokenizer` builds that with the `tokenizers`
library from the GGUF vocab and merges; control tokens are atomic (never split by BPE, matched in text).

`build_demo_vocab` makes the small deterministic vocabulary written into demo GGUFs: the DS4 special tokens,
the 256 byte tokens, then merges trained on a built-in English/code corpus.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
# DSML markup is not one token per tag: "｜DSML｜" is a single token and the rest ("<", "tool_calls>",
# " name=...") is ordinary BPE text, e.g. "<｜DSML｜invoke" = "<" + DSML + "invoke".
DSML = "｜DSML｜"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML)
EOS_ID = SPECIAL_TOKENS.index(EOS)  # 1, in every demo vocabulary
# Their ids in DeepSeek-V4-Flash's own 129280-entry vocabulary (the demo vocab numbers them 0..6 instead;
# the Tokenizer always looks them up by text).
FLASH_SPECIAL_IDS = {BOS: 0, EOS: 1, USER: 128803, ASSISTANT: 128804, THINK_START: 128821, THINK_END: 128822,
                     DSML: 128825}

# tokenizer.ggml.pre -> regexes applied in sequence, each as an isolated split of the previous pieces.
# "deepseek-v3" is the same pre-tokenizer under the name llama.cpp gives DeepSeek-V3.
_JOYAI_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {"joyai-llm": _JOYAI_SPLITS, "deepseek-v3": _JOYAI_SPLITS}

# Token types whose text is matched whole in the input instead of going through BPE.
_ATOMIC_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED)


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes map to themselves, the
    other 68 bytes to U+0100 onwards in byte order, so BPE merges work on strings without losing bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


BYTE_TO_UNICODE = _gpt2_byte_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}: ds4station implements "
                         f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))} (DeepSeek-V4 GGUFs use 'joyai-llm')")
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in PRE_TOKENIZER_SPLITS[pre]]
    # use_regex=False: ByteLevel only maps bytes to characters here; the splitting is done above.
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# ---- demo vocabulary ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoVocab:
    tokens: list[str]
    merges: list[str]  # "left right", rank order
    token_types: list[int]  # gguf TokenType values


# Training text for the demo merges: plain English and a little Python/JSON, so common words, indentation and
# punctuation runs get their own tokens. Changing it changes every demo GGUF (a test pins the result).
DEMO_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A station is a place where trains stop, and this one runs a
large language model on your own workstation. The model reads the prompt, thinks for a while, and then
writes an answer one token at a time. Each token is a short piece of text: a word, part of a word, a space
followed by a word, a number, or a run of punctuation. When the answer needs a tool, the model writes a
call with the name of the tool and its arguments, waits for the result, and continues from there.
Hello, world! How are you today? I am fine, thank you. What is the weather like in Paris and in Rome?
It is sunny and warm in the morning, with some clouds in the afternoon and a little rain in the evening.
Numbers such as 1, 12, 123, 2026 and 3.14159 are split into groups of at most three digits.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Request:
    def __init__(self, prompt: str, max_tokens: int = 256) -> None:
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output: list[int] = []

    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


if __name__ == "__main__":
    for i in range(10):
        print(f"fib({i}) = {fibonacci(i)}")

{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius", "days": 3}}
{"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
'''
# The demo model's larger vocabulary (model.config.DEMO) is trained on more text: DEMO_CORPUS, then a frozen
# copy of this project's own README, docs and panel / server code (English, Markdown, Python, JSON), so that
# agents' prompts tokenize to about 4 characters a token. Frozen: changing it changes the demo model (bump
# engine.demo.DEMO_VERSION).
DEMO_CORPUS_FILE = Path(__file__).with_name("demo_corpus.txt")


def demo_corpus(vocab_size: int) -> str:
    """The training text for a demo vocabulary of this size: the small one (the tiny test shape, 512) from
    DEMO_CORPUS alone, as pinned by the tests; a larger one from DEMO_CORPUS and DEMO_CORPUS_FILE."""
    return DEMO_CORPUS if vocab_size <= 512 else DEMO_CORPUS + "\n" + DEMO_CORPUS_FILE.read_text(encoding="utf-8")


def build_demo_vocab(vocab_size: int) -> DemoVocab:
    """A deterministic byte-level BPE vocabulary of exactly `vocab_size` entries: the DS4 special tokens
    (BOS id 0, EOS id 1), the 256 byte tokens in byte order, the merges trained on `demo_corpus(vocab_size)`
    with the joyai-llm pre-tokenizer, then unused placeholders if the corpus runs out of merges."""
    n_fixed = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_fixed:
        raise ValueError(f"vocab_size {vocab_size} is too small: the DS4 special tokens and the 256 byte tokens "
                         f"need {n_fixed}")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = _pre_tokenizer("joyai-llm")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    hf.train_from_iterator([demo_corpus(vocab_size)], trainer=trainer)
    model = hf.get_vocab(with_added_tokens=False)
    byte_tokens = [BYTE_TO_UNICODE[b] for b in range(256)]
    # The trainer numbers the alphabet first (in its own order), then each new token as a merge creates it.
    learned = sorted((i, t) for t, i in model.items() if t not in UNICODE_TO_BYTE)
    assert len(model) - len(learned) == 256, "demo corpus strayed outside the byte-level alphabet"
    tokens = [*SPECIAL_TOKENS, *byte_tokens, *(t for _, t in learned)]
    merges = [" ".join(pair) for pair in _trained_merges(hf)]
    n_pad = vocab_size - len(tokens)
    tokens += [f"<｜place▁holder▁no▁{i}｜>" for i in range(n_pad)]
    types = ([TokenType.CONTROL] * len(SPECIAL_TOKENS) + [TokenType.NORMAL] * (256 + len(learned))
             + [TokenType.UNUSED] * n_pad)
    return DemoVocab(tokens=tokens, merges=merges, token_types=[int(t) for t in types])


def _trained_merges(hf: HFTokenizer) -> list[tuple[str, str]]:
    merges = json.loads(hf.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def tokenizer_metadata(vocab: DemoVocab) -> dict[str, Any]:
    """The tokenizer.ggml.* GGUF entries for `vocab`, as DeepSeek-V4 GGUFs carry them."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "joyai-llm",
        "tokenizer.ggml.tokens": list(vocab.tokens),
        "tokenizer.ggml.merges": list(vocab.merges),
        "tokenizer.ggml.token_type": list(vocab.token_types),
        "tokenizer.ggml.bos_token_id": vocab.tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": vocab.tokens.index(EOS),
    }


# ---- the tokenizer ------------------------------------------------------------------------------------
class Tokenizer:
    """Byte-level BPE over a GGUF vocabulary. encode() matches control tokens whole; decode() maps every
    token back to its exact bytes, so decode(encode(s)) == s for any str that is valid Unicode."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                 bos_id: int, eos_id: int, pre: str = "joyai-llm") -> None:
        n = len(tokens)
        if len(token_types) != n:
            raise ValueError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
        for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
            if not 0 <= value < n:
                raise ValueError(f"tokenizer.ggml.{key} = {value} is outside the {n}-token vocabulary")
        self._tokens = list(tokens)
        self._types = [int(t) for t in token_types]
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self._ids = {t: i for i, t in enumerate(self._tokens)}
        missing = [t for t in SPECIAL_TOKENS if t not in self._ids]
        if missing:
            raise ValueError(f"the vocabulary lacks the DS4 special token(s) {missing}: not a DeepSeek-V4 tokenizer")
        pairs = []
        for rank, merge in enumerate(merges):
            cut = merge.find(" ", 1)  # like llama.cpp: the left part is never empty
            if cut < 0:
                raise ValueError(f"tokenizer.ggml.merges[{rank}] = {merge!r} is not 'left right'")
            pairs.append((merge[:cut], merge[cut + 1:]))
        try:
            bpe = models.BPE(vocab=self._ids, merges=pairs)
        except Exception as e:  # tokenizers reports merges that name unknown tokens this way
            raise ValueError(f"invalid BPE vocabulary/merges: {e}") from e
        self._hf = HFTokenizer(bpe)
        self._hf.pre_tokenizer = _pre_tokenizer(pre)
        self._hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                     for t, ty in zip(self._tokens, self._types, strict=True) if ty in _ATOMIC_TYPES])
        # Same tokenizer with control tokens encoded as plain text (for untrusted text that must not inject
        # turn markers); built on first use.
        self._plain: HFTokenizer | None = None
        self._atomic: re.Pattern[str] | None = None  # matches the atomic tokens' texts, built on first use
        self._bytes = [self._token_bytes(i) for i in range(n)]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (the tokenizer.ggml.* keys)."""
        def get(key: str) -> Any:
            if f"tokenizer.ggml.{key}" not in meta:
                raise ValueError(f"GGUF metadata lacks tokenizer.ggml.{key}")
            return meta[f"tokenizer.ggml.{key}"]

        model = get("model")
        if model != "gpt2":
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r}: DeepSeek-V4 uses the byte-level BPE "
                             "'gpt2' tokenizer")
        return cls(tokens=list(get("tokens")), merges=list(get("merges")), token_types=list(get("token_type")),
                   bos_id=int(get("bos_token_id")), eos_id=int(get("eos_token_id")), pre=str(get("pre")))

    # ---- ids --------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_id(self, text: str) -> int:
        """Id of the token whose text is exactly `text` (e.g. a special token)."""
        if text not in self._ids:
            raise KeyError(f"no token {text!r} in the vocabulary")
        return self._ids[text]

    @property
    def user_id(self) -> int:
        return self._ids[USER]

    @property
    def assistant_id(self) -> int:
        return self._ids[ASSISTANT]

    @property
    def think_start_id(self) -> int:
        return self._ids[THINK_START]

    @property
    def think_end_id(self) -> int:
        return self._ids[THINK_END]

    @property
    def dsml_id(self) -> int:
        return self._ids[DSML]

    def is_control(self, token_id: int) -> bool:
        return self._types[token_id] == TokenType.CONTROL

    # ---- text <-> ids ---------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With allow_special, the text of a special (control or user-defined) token
        such as BOS, `<｜User｜>` or `</think>` becomes that token; without, it is tokenised as ordinary text."""
        # encode_batch, not encode: the batch call releases the GIL while Rust tokenises, so a long prompt
        # tokenised in a worker thread does not stall the server's event loop (encode holds it throughout).
        if allow_special:
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        if self._plain is None:
            self._plain = HFTokenizer.from_str(self._hf.to_str())
            self._plain.encode_special_tokens = True
        return self._plain.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of the pieces' text joined, where only pieces flagged True (a template's own markup) may
        hold special tokens; the others are ordinary text however they read (client text cannot forge a turn
        marker). Like encode(), the text between two special tokens is encoded whole, across piece
        boundaries, so where every special token's text in the joined text lies inside markup the ids equal
        encode() of it: piece boundaries never change how ordinary text is split."""
        ids: list[int] = []
        plain: list[str] = []  # text since the last special token

        def flush() -> None:
            text = "".join(plain)
            if text:
                ids.extend(self.encode(text, allow_special=False))
            plain.clear()

        # Adjacent markup pieces are joined first, so a special token split across two of them still matches.
        for special, group in itertools.groupby(pieces, key=lambda piece: piece[1]):
            text = "".join(t for t, _ in group)
            if not special:
                plain.append(text)
                continue
            pos = 0
            for match in self._atomic_pattern().finditer(text):
                plain.append(text[pos:match.start()])
                flush()
                ids.append(self._ids[match.group()])
                pos = match.end()
            plain.append(text[pos:])
        flush()
        return ids

    def _atomic_pattern(self) -> re.Pattern[str]:
        if self._atomic is None:
            # Longest first: at one position the longest token wins, as in the tokenizers library's
            # leftmost-longest matching of added tokens.
            texts = sorted({t for t, ty in zip(self._tokens, self._types, strict=True) if ty in _ATOMIC_TYPES and t},
                           key=len, reverse=True)
            self._atomic = re.compile("|".join(map(re.escape, texts)))
        return self._atomic

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (may be part of a UTF-8 character)."""
        return self._bytes[token_id]

    def token_to_piece(self, token_id: int) -> str:
        """A token's text; bytes that are only part of a UTF-8 character show as U+FFFD."""
        return self._bytes[token_id].decode("utf-8", errors="replace")

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def _token_bytes(self, token_id: int) -> bytes:
        text = self._tokens[token_id]
        if self._types[token_id] in _ATOMIC_TYPES or not all(c in UNICODE_TO_BYTE for c in text):
            return text.encode("utf-8")  # added tokens are stored as plain text, not byte-mapped
        return bytes(UNICODE_TO_BYTE[c] for c in text)


class StreamDecoder:
    """Incremental detokeniser: push token ids, get text. Bytes of a UTF-8 character split across tokens are
    held back until the character is complete; bytes that can never form one come out as U+FFFD."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Text still held back (an incomplete character becomes U+FFFD); the decoder can be reused after."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
