"""The one engine on the tiny q2 GGUF (the demo model's file format), one stage in this process: sessions on
preallocated KV slots, the backend choice, `generate` through the scheduler, the device and chunk defaults."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest
import torch

from ds4station.engine.demo import make_model
from ds4station.engine.engine import DEFAULT_GPU_CHUNK, Engine, check_settings, default_chunk
from ds4station.engine.kv import DEFAULT_CHUNK
from ds4station.engine.model import OFF
from ds4station.engine.stage import choose_backend
from ds4station.kernels import cpu
from ds4station.model.footprint import kv_bytes
from ds4station.model.route import parse_route


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model") / "tiny-q2.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def engine(gguf_path):
    # the round trips off: with them a last-bit difference between chunkings can flip an FP8 rounding (torch 2.11)
    e = Engine.load(gguf_path, ctx=128, device="cpu", sessions=3, chunk=16, rollback=16, round_trips=OFF)
    yield e
    e.close()


PROMPT = list(range(2, 50))  # 48 tokens: past the window, several compressed blocks


def full_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """Every position's logits from the engine's own stage model (prefill + head over the whole state)."""
    model = engine.runner.model
    return model.head(model.prefill(tokens, model.new_cache(len(tokens), chunk=len(tokens))))


def test_one_stage_runs_in_this_process_on_the_kernel_stage(engine) -> None:
    assert engine.world == 1 and not engine.procs
    assert engine.runner.compute == "kernels" and str(engine.route) == "cpu=embed,0-5,output"
    # every KV slot is allocated at load, as the formula says
    assert engine.runner.kv_bytes() == 3 * kv_bytes(engine.cfg, None, 128, "f32", chunk=16, rollback=16)


@pytest.mark.skipif(not cpu.int8_matvec("iq2_xxs"), reason="no integer-dot CPU kernels (x86 AVX2)")
def test_a_cpu_stage_decodes_through_the_integer_dot_by_default(engine, monkeypatch) -> None:
    """Without DS4STATION_CPU_INT8=0 (which the other tests set, for exact relations between decode and prefill) the
    routed experts of steps of up to 32 tokens (this engine's 16-token prefill chunks, the decode steps) run the
    integer dot, as on CUDA: the logits are the fp32 matvecs' within the activations' int8 rounding, not equal."""
    a, b = engine.new_session(), engine.new_session()
    try:
        monkeypatch.delenv("DS4STATION_CPU_INT8")
        got = [a.extend(PROMPT), a.extend([7])]
        monkeypatch.setenv("DS4STATION_CPU_INT8", "0")
        want = [b.extend(PROMPT), b.extend([7])]
        for g, w in zip(got, want, strict=True):
            assert 0 < float((g - w).norm() / w.norm()) < 0.05
    finally:
        a.close(), b.close()


def test_session_extend_in_chunks_and_steps_matches_full_forward(engine):
    full = full_logits(engine, PROMPT)
    s = engine.new_session()
    first = s.extend(PROMPT[:30], chunk=7)
    torch.testing.assert_close(first, full[29], rtol=0, atol=1e-4 * float(full.abs().max()))
    for i in range(30, len(PROMPT)):
        last = s.extend([PROMPT[i]])
        torch.testing.assert_close(last, full[i], rtol=0, atol=1e-4 * float(full.abs().max()))
    assert s.tokens == PROMPT
    assert s.kv_bytes() == kv_bytes(engine.cfg, None, 128, "f32", chunk=16, rollback=16)
    s.close()


def test_truncate_rolls_back_and_reextends(engine):
    s = engine.new_session()
    s.extend(PROMPT)
    assert not s.truncate(len(PROMPT) - 17)  # beyond rollback=16 (chunk 16): refused, unchanged
    assert s.tokens == PROMPT
    assert s.truncate(40)
    assert s.tokens == PROMPT[:40]
    again = s.extend(PROMPT[40:])
    fresh = engine.new_session()
    torch.testing.assert_close(again, fresh.extend(PROMPT), rtol=0, atol=1e-4 * float(again.abs().max()))
    s.close()
    fresh.close()


def test_sessions_take_slots_and_a_freed_slot_starts_empty(engine) -> None:
    sessions = [engine.new_session() for _ in range(3)]
    with pytest.raises(RuntimeError, match="all 3 KV slot"):
        engine.new_session()
    want = sessions[0].extend(PROMPT[:20])
    sessions[0].close()
    again = engine.new_session()  # the freed slot, reset: the same logits as a fresh start
    torch.testing.assert_close(again.extend(PROMPT[:20]), want, rtol=0, atol=0)
    del sessions[1]  # a session dropped without close() gives its slot back too
    extra = engine.new_session()
    for s in (again, extra, sessions[1]):
        s.close()


def test_load_reports_progress_in_weight_bytes(gguf_path) -> None:
    seen: list[tuple[int, int]] = []
    Engine.load(gguf_path, ctx=64, device="cpu", progress=lambda done, total: seen.append((done, total))).close()
    totals = {t for _, t in seen}
    assert len(totals) == 1 and seen[-1][0] == seen[-1][1] == totals.pop() > 0
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))  # grows with every tensor


def test_kernel_stage_serves_the_same_model(gguf_path) -> None:
    """The kernel stage (engine/gpu.py, the default; on the CPU its torch fallbacks) serves what the fp32
    reference slice (compute="reference") does, behind the same Session interface: its logits follow the
    reference through prefill, decode and a rollback."""
    from ds4station.engine.gpu import GpuStage

    ref = Engine.load(gguf_path, ctx=128, device="cpu", compute="reference")
    fast = Engine.load(gguf_path, ctx=128, device="cpu")
    assert isinstance(fast.runner.model, GpuStage) and fast.runner.compute == "kernels"
    a, b = ref.new_session(), fast.new_session()
    prompt = [0, *range(5, 45)]
    for step in (prompt, [7], [9], [11]):
        la, lb = a.extend(step), b.extend(step)
        assert (la - lb).abs().max() < 2e-2 * la.abs().max()  # FP8/FP4 round trips amplify 1e-6 differences
    assert b.truncate(len(prompt)) and b.tokens == prompt
    lb = b.extend([7])
    assert a.truncate(len(prompt)) and (a.extend([7]) - lb).abs().max() < 2e-2 * lb.abs().max()
    ref.close()
    fast.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_engine_is_warm_and_follows_the_reference(gguf_path) -> None:
    """On a GPU the default engine is the kernel stage, warmed at load (decode and short-prefill graphs
    captured once for the slots' pool, and the two slots' batched decode graph, before the first request, none
    after), and through prefill, short-prefill and
    decode graphs its logits follow the reference engine's on the same tokens (the int8-dot decode kernels
    are close, not bit-equal)."""
    from ds4station.engine.gpu import SHORT_ROWS, GpuStage

    ref = Engine.load(gguf_path, ctx=256, device="cpu", round_trips=OFF)
    gpu = Engine.load(gguf_path, ctx=256, sessions=2, round_trips=OFF)
    assert gpu.runner.compute == "kernels" and gpu.chunk == DEFAULT_GPU_CHUNK and gpu.runner.warm_s > 0
    model = gpu.runner.model
    graphs = 1 + len(SHORT_ROWS) + 1  # one bucket (ctx 256): decode + the short row classes, a batch of two
    assert isinstance(model, GpuStage) and len(model._graphs) == graphs
    a, b = ref.new_session(), gpu.new_session()
    prompt = [0, *range(5, 45)]
    la, lb = a.extend(prompt), b.extend(prompt)
    for _ in range(10):
        assert float((la - lb.cpu()).abs().max()) < 5e-2 * float(la.abs().max())
        token = int(la.argmax())  # both continue with the reference's choice
        la, lb = a.extend([token]), b.extend([token])
    la, lb = a.extend([7, 8, 9, 10, 11]), b.extend([7, 8, 9, 10, 11])  # a short turn: its static-step graph
    assert float((la - lb.cpu()).abs().max()) < 5e-2 * float(la.abs().max())
    assert len(model._graphs) == graphs  # no capture after ready
    ref.close()
    gpu.close()


def test_backend_is_chosen_in_one_place() -> None:
    route = parse_route("cpu=embed,0-1,output; cuda:0=2-3; cuda:1=4-5,cache=2GiB", 6)
    cpu, gpu, streaming = route.stages
    assert choose_backend(torch.device("cpu"), cpu) == "kernels"  # quantised weights on the CPU too
    assert choose_backend(torch.device("cuda:0"), gpu) == "kernels"
    assert choose_backend(torch.device("cuda:1"), streaming) == "kernels"
    assert choose_backend(torch.device("cpu"), cpu, "reference") == "reference"
    with pytest.raises(ValueError, match="streamed experts run on the kernel stage"):
        choose_backend(torch.device("cuda:1"), streaming, "reference")
    with pytest.raises(ValueError, match="compute 'fast'"):
        choose_backend(torch.device("cpu"), cpu, "fast")


def test_defaults_fit_the_machine(gguf_path) -> None:
    assert default_chunk("cpu") == DEFAULT_CHUNK and default_chunk("cuda:0") == DEFAULT_GPU_CHUNK
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(check_settings(gguf_path, 4096)) == f"{want}=embed,0-5,output"
    assert str(check_settings(gguf_path, 4096, device="cpu")) == "cpu=embed,0-5,output"
    with pytest.raises(ValueError, match=r"--ctx 1048576 is outside this model's context: use 1 to 4,096"):
        check_settings(gguf_path, 1 << 20)
    with pytest.raises(ValueError, match="outside"):
        Engine.load(gguf_path, ctx=0, device="cpu")


def _generate_args(path, *extra: str) -> argparse.Namespace:
    from ds4station.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(["--model", str(path), "--device", "cpu", *extra])


def test_generate_command_streams_text_and_speed(gguf_path, capsys):
    from ds4station.commands import generate

    args = _generate_args(gguf_path, "--prompt", "hello there", "--max-tokens", "5", "--temperature", "0.7",
                          "--seed", "3", "--ctx", "1K")
    assert args.ctx == 1024
    assert generate.run(args) == 0
    out, err = capsys.readouterr()
    assert "prompt:" in err and "tok/s" in err and "decode:" in err and "finish: length" in err
    assert generate.run(args) == 0
    assert capsys.readouterr().out == out  # same seed, same text
    args.seed = 4
    assert generate.run(args) == 0
    assert capsys.readouterr().out != out


def test_generate_refuses_a_context_beyond_the_model(gguf_path, capsys) -> None:
    from ds4station.commands import generate

    assert generate.run(_generate_args(gguf_path, "--prompt", "hi", "--ctx", "1M")) == 2
    assert "--ctx 1048576 is outside this model's context" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _generate_args(gguf_path, "--prompt", "hi", "--ctx", "lots")


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_generate_and_serve_give_the_same_tokens(gguf_path, capsys, chat: bool) -> None:
    """`generate` and `serve` run the same engine through the same scheduler: the same prompt and sampling
    settings give the same text (a sampled one, so the sampler and its seed are part of the check), over
    /v1/completions for a plain prompt and /v1/chat/completions for --chat, with the official client."""
    import openai

    from ds4station.commands import generate, serve
    from ds4station.server.app import BackgroundServer

    prompt, extra = "The station serves agents", ["--chat"] if chat else []
    assert generate.run(_generate_args(gguf_path, "--prompt", prompt, "--max-tokens", "24", "--temperature", "0.9",
                                       "--seed", "11", "--ctx", "1024", *extra)) == 0
    generated = capsys.readouterr().out.rstrip("\n")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    app, _ = serve.build(parser.parse_args(["--model", str(gguf_path), "--device", "cpu", "--ctx", "1K"]))
    srv = BackgroundServer(app).start()
    try:
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/health").status_code != 200:  # 503 while the engine loads
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        if chat:
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=24, temperature=0.9, seed=11,  # generate: no thinking
                                               extra_body={"chat_template_kwargs": {"thinking": False}})
            served = r.choices[0].message.content
        else:
            served = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.9,
                                               seed=11).choices[0].text
    finally:
        srv.stop()
    assert served and served == generated


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_gpu_device_without_a_gpu_is_refused_before_loading(gguf_path) -> None:
    with pytest.raises(ValueError, match="device cuda:0: torch sees no GPU"):
        check_settings(gguf_path, 1024, device="cuda")
