"""The engine on the tiny q2 GGUF (the demo model's file format): sessions, determinism, the CLI command."""

from __future__ import annotations

import pytest
import torch

from ds4station.engine.demo import make_model
from ds4station.engine.runtime import Engine, GenerationStats
from ds4station.engine.sampler import SamplingParams


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model") / "tiny-q2.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def engine(gguf_path):
    return Engine.load(gguf_path, ctx=128, chunk=16, rollback=16)


PROMPT = list(range(2, 50))  # 48 tokens: past the window, several compressed blocks


def test_session_extend_in_chunks_and_steps_matches_full_forward(engine):
    full = engine.model.forward(PROMPT)
    s = engine.new_session()
    first = s.extend(PROMPT[:30], chunk=7)
    torch.testing.assert_close(first, full[29], rtol=0, atol=1e-4 * float(full.abs().max()))
    for i in range(30, len(PROMPT)):
        last = s.extend([PROMPT[i]])
        torch.testing.assert_close(last, full[i], rtol=0, atol=1e-4 * float(full.abs().max()))
    assert s.tokens == PROMPT
    assert s.kv_bytes() == s.cache.nbytes() > 0


def test_truncate_rolls_back_and_reextends(engine):
    s = engine.new_session()
    s.extend(PROMPT)
    assert not s.truncate(len(PROMPT) - 17)  # beyond rollback=16 (chunk 16): refused, unchanged
    assert s.tokens == PROMPT
    assert s.truncate(40)
    assert s.tokens == PROMPT[:40]
    again = s.extend(PROMPT[40:])
    fresh = engine.new_session().extend(PROMPT)
    torch.testing.assert_close(again, fresh, rtol=0, atol=1e-4 * float(fresh.abs().max()))


def run_generation(engine, **kw) -> tuple[str, GenerationStats]:
    stats = GenerationStats()
    text = "".join(engine.generate(PROMPT[:20], SamplingParams(max_tokens=12, **kw), stats=stats))
    return text, stats


def test_generation_is_deterministic_for_a_seed(engine):
    a, stats = run_generation(engine, temperature=1.0, seed=7)
    assert a == run_generation(engine, temperature=1.0, seed=7)[0]
    assert stats.prompt_tokens == 20 and 1 <= stats.generated_tokens <= 12
    assert a != run_generation(engine, temperature=1.0, seed=8)[0]
    greedy = run_generation(engine, temperature=0.0)[0]
    assert greedy == run_generation(engine, temperature=0.0, seed=123)[0]


def test_generate_command_streams_text_and_speed(gguf_path, capsys):
    import argparse

    from ds4station.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--model", str(gguf_path), "--prompt", "hello there", "--max-tokens", "5",
                              "--temperature", "0.7", "--seed", "3", "--ctx", "64"])
    assert generate.run(args) == 0
    out, err = capsys.readouterr()
    assert "prompt:" in err and "tok/s" in err and "decode:" in err
    assert generate.run(args) == 0
    assert capsys.readouterr().out == out  # same seed, same text


def test_load_reports_progress_in_weight_bytes(gguf_path) -> None:
    seen: list[tuple[int, int]] = []
    Engine.load(gguf_path, ctx=64, progress=lambda done, total: seen.append((done, total)))
    totals = {t for _, t in seen}
    assert len(totals) == 1 and seen[-1][0] == seen[-1][1] == totals.pop() > 0
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))  # grows with every tensor


def test_fast_engine_serves_the_same_model(gguf_path) -> None:
    """Engine.load(fast=True) runs the kernel stage (engine/gpu.py; the default on a GPU) behind the same
    Session interface: its logits follow the reference engine's through prefill, decode and a rollback."""
    from ds4station.engine.gpu import GpuStage

    ref, fast = Engine.load(gguf_path, ctx=128), Engine.load(gguf_path, ctx=128, fast=True)
    assert isinstance(fast.model, GpuStage)
    a, b = ref.new_session(), fast.new_session()
    prompt = [0, *range(5, 45)]
    for step in (prompt, [7], [9], [11]):
        la, lb = a.extend(step), b.extend(step)
        assert (la - lb).abs().max() < 2e-2 * la.abs().max()  # FP8/FP4 round trips amplify 1e-6 differences
    assert b.truncate(len(prompt)) and b.tokens == prompt
    lb = b.extend([7])
    assert a.truncate(len(prompt)) and (a.extend([7]) - lb).abs().max() < 2e-2 * lb.abs().max()
