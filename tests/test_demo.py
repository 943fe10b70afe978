"""The built-in demo model (engine/demo.py, model.config.DEMO): a file real agents' prompts fit in, with the
real model's tensor names, layer pattern and quant types, a vocabulary that tokenizes text to realistic
lengths, answers that end, and a cached file replaced when the demo's version changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds4station.engine import demo
from ds4station.engine.engine import Engine
from ds4station.engine.tokenizer import EOS_ID, Tokenizer
from ds4station.model.config import DEMO, TINY
from ds4station.model.gguf import GGUFFile
from ds4station.model.layout import model_tensors
from ds4station.planner import named_shape, shape_from_specs

# Not in the demo's training text: an agent's kind of prompt, instructions and a tool schema.
PROMPT = """You are an interactive command line tool that helps users with software engineering tasks. Use the
instructions below and the tools available to you to assist the user. When you are asked to fix a failing test,
first read the test and the code it exercises, then run the test to see the failure before changing anything.
Prefer small, focused edits; explain what you changed and why in one or two sentences at the end."""
TOOL = {"type": "function", "function": {"name": "edit_file", "description": "Replace one exact occurrence of a "
        "string in a file with another string. The old string must match the file's text exactly, including "
        "whitespace and indentation.", "parameters": {"type": "object", "properties": {
            "file_path": {"type": "string", "description": "The absolute path of the file to modify"},
            "old_string": {"type": "string", "description": "The text to replace"},
            "new_string": {"type": "string", "description": "The text to replace it with"}},
            "required": ["file_path", "old_string", "new_string"]}}}


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.make_model(tmp_path_factory.mktemp("demo") / "demo.gguf", preset=demo.DEMO_PRESET)


def test_the_demo_holds_agent_prompts_with_the_real_layout(demo_path: Path) -> None:
    f = GGUFFile.open(demo_path)
    assert f.config == DEMO and DEMO.context_length >= 131072 and DEMO.vocab_size == 8192
    specs = f.tensor_specs()
    layout = model_tensors(DEMO, "q2")
    assert [(s.name, s.shape, s.qtype) for s in specs] == [(s.name, s.shape, s.qtype) for s in layout]
    # the tiny shape's tensor names and quant types, layer by layer: only the vocabulary's sizes differ
    assert [(s.name, s.qtype) for s in specs] == [(s.name, s.qtype) for s in model_tensors(TINY, "q2")]
    assert shape_from_specs("demo", f.config, f.tensor_specs()).total_bytes == named_shape("demo-q2").total_bytes


def test_the_demo_vocabulary_tokenizes_text_to_realistic_lengths(demo_path: Path) -> None:
    tok = Tokenizer.from_metadata(GGUFFile.open(demo_path).metadata)
    assert tok.vocab_size == 8192
    for text, at_least in ((PROMPT, 3.8), (json.dumps(TOOL), 3.0)):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and len(text) / len(ids) >= at_least, len(text) / len(ids)
    tiny = Tokenizer.from_metadata(GGUFFile.open(demo.make_model(demo_path.with_name("tiny.gguf"))).metadata)
    assert len(tiny.encode(PROMPT)) > 2 * len(tok.encode(PROMPT))  # the 512-token test vocabulary: far longer


def test_the_demo_ends_its_answers(demo_path: Path) -> None:
    """Greedy and sampled answers reach EOS within a few dozen tokens (the head's EOS row, DEMO_EOS_GAIN), so an
    agent's turn ends as it does with a real model, not at max_tokens."""
    engine = Engine.load(str(demo_path), 2048, device="cpu", sessions=1)
    gen = torch.Generator().manual_seed(0)
    lengths = []
    try:
        for i in range(6):
            s = engine.new_session()
            logits = s.extend(torch.randint(300, 8000, (40 + 15 * i,), generator=gen).tolist())
            n = 0
            while n < 96:
                n += 1
                t = int(logits.argmax()) if i % 2 == 0 else int(torch.multinomial(logits.float().softmax(-1), 1,
                                                                                    generator=gen))
                if t == EOS_ID:
                    break
                logits = s.extend([t])
            lengths.append(n)
            s.close()
    finally:
        engine.close()
    assert max(lengths) < 96, lengths


def test_the_cached_demo_replaces_an_older_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "ds4station"
    cache.mkdir()
    old = cache / "demo-tiny-q2-v1.gguf"
    old.write_bytes(b"an older demo")
    keep = cache / "my-model.gguf"
    keep.write_bytes(b"not the demo's")
    path = demo.demo_model_path()
    assert path == cache / f"demo-q2-v{demo.DEMO_VERSION}.gguf" and GGUFFile.open(path).config == DEMO
    assert GGUFFile.open(path).has_mtp  # serve --draft mtp runs on the demo
    assert not old.exists() and keep.exists()
    assert demo.demo_model_path() == path  # then reused as it is
