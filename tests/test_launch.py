"""The plan is the launch (planner/launch.py): `plan --out` writes a launch file, `serve --plan` runs exactly it
against a real server, a file with an unknown key or a flag that contradicts it is refused, and for several
launch files the engine allocates what the footprint predicts: exactly for KV and expert slots, within 3% for
the weights it holds (torch fallbacks of the kernel stage on the CPU, every stage in its own process)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import httpx
import openai
import pytest

from ds4station.commands import plan as plan_cmd
from ds4station.commands import serve
from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine
from ds4station.model.gguf import GGUFFile
from ds4station.model.route import parse_route
from ds4station.planner import evaluate, load_preset, parse_gpu_spec, shape_from_specs
from ds4station.planner.launch import Launch, LaunchError, read_launch, write_launch
from ds4station.server.app import BackgroundServer

GiB = 1 << 30


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("launch") / "tiny.gguf", preset="tiny", seed=0, quant="q2")


def _plan(*argv: str) -> int:
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    return plan_cmd.run(p.parse_args(list(argv)))


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_launch_files_round_trip_and_refuse_what_they_do_not_take(tmp_path: Path) -> None:
    launch = Launch("cpu=embed,0-5,output", 4096, 3, 512, 256, "f16", "/m/x.gguf", "speed")
    assert read_launch(write_launch(tmp_path / "a.toml", launch)) == launch
    demo = dataclasses.replace(launch, model="")
    assert read_launch(write_launch(tmp_path / "d.toml", demo)).model == ""  # the built-in demo model
    shape = dataclasses.replace(launch, model=None)  # planned for a named shape: serve needs --model
    text = write_launch(tmp_path / "s.toml", shape).read_text()
    assert "model =" not in text and read_launch(tmp_path / "s.toml").model is None
    bad = tmp_path / "bad.toml"
    for body, msg in [('route = "cpu=embed,0-5,output"\nctx = 4096\nsesions = 2\n',
                       r"unknown key 'sesions' \(did you mean 'sessions'"),
                      ('route = "cpu=embed,0-5,output"\nctx = 4096\nturbo = 1\n', "unknown key 'turbo'; known keys"),
                      ('kind = "preset"\nroute = "x"\nctx = 4096\n', 'kind = \'preset\''),
                      ('ctx = 4096\n', "route is missing"),
                      ('route = "cpu=embed,0-5,output"\nctx = "long"\n', "ctx = 'long'"),
                      ('route = "cpu=embed,0-5,output"\nctx = 4096\nkv_dtype = "fp8"\n', "kv_dtype = 'fp8'"),
                      ('route = "cpu=embed,0-5,output"\nctx = 4096\nsessions = 0\n', "sessions = 0"),
                      ("route = [", "launch file")]:
        bad.write_text(body)
        with pytest.raises(LaunchError, match=msg):
            read_launch(bad)
    with pytest.raises(LaunchError, match="no such file"):
        read_launch(tmp_path / "missing.toml")


def test_plan_out_then_serve_plan_serves_exactly_that(model_path: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.toml"
    assert _plan("--model", str(model_path), "--gpus", "cpu", "--host-ram", "16GiB", "--sessions", "3",
                 "--prefill-chunk", "64", "--rollback", "128", "--out", str(out)) == 0
    assert f"serve --plan {out}" in capsys.readouterr().out
    launch = read_launch(out)
    assert (launch.model, launch.route, launch.sessions, launch.prefill_chunk, launch.rollback) == \
        (str(model_path), "cpu=embed,0-5,output", 3, 64, 128)
    app, where = serve.build(_serve_args("--plan", str(out)))
    srv = BackgroundServer(app).start()
    try:
        assert srv.wait_ready(60)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           temperature=0)  # greedy: the same 3 tokens every run
        assert r.usage.completion_tokens == 3
        st = httpx.get(srv.url + "/status").json()
        assert st["model"]["ctx"] == launch.ctx and st["sessions"]["capacity"] == 3
        stage = st["stages"][0]
        f = GGUFFile.open(model_path)
        settings = load_preset("speed")
        settings = dataclasses.replace(settings, footprint=dataclasses.replace(
            settings.footprint, sessions=3, prefill_chunk=64, rollback=128))
        shape = shape_from_specs(f.path.name, f.config, f.tensor_specs())
        predicted = evaluate(shape, parse_route(launch.route, 6), parse_gpu_spec("cpu", 16 * GiB), settings,
                             launch.ctx).stages[0].footprint
        assert stage["kv_allocated_bytes"] == predicted.kv_bytes  # what the plan counted, as allocated
    finally:
        srv.stop()


def test_serve_plan_refuses_flags_that_contradict_it(model_path: Path, tmp_path: Path) -> None:
    out = write_launch(tmp_path / "p.toml", Launch("cpu=embed,0-5,output", 1024, 2, 64, 128, "f32", str(model_path)))
    for flags, msg in [(["--ctx", "2048"], "sets ctx = 1024 but --ctx 2048"),
                       (["--sessions", "4"], "sets sessions = 2 but --sessions 4"),
                       (["--route", "cpu=embed,0-5"], "--route"),
                       (["--expert-cache", "1GiB"], "drop --expert-cache"),
                       (["--model", str(tmp_path / "other.gguf")], "--model")]:
        with pytest.raises(ValueError, match=msg):
            serve.build(_serve_args("--plan", str(out), *flags))
    agree = _serve_args("--plan", str(out), "--ctx", "1024", "--port", "0")  # the same value is fine
    serve.apply_launch(agree)
    assert (agree.ctx, agree.sessions, agree.prefill_chunk, agree.rollback, agree.model) == \
        (1024, 2, 64, 128, str(model_path))
    shape = write_launch(tmp_path / "shape.toml", Launch("cpu=embed,0-5,output", 1024, 2, 64, 128, "f32", None))
    with pytest.raises(ValueError, match="names no model file"):
        serve.build(_serve_args("--plan", str(shape)))
    demo = write_launch(tmp_path / "demo.toml", Launch("cpu=embed,0-5,output", 1024, 2, 64, 128, "f32", ""))
    with pytest.raises(ValueError, match="built-in demo model but --model"):
        serve.build(_serve_args("--plan", str(demo), "--model", str(model_path)))


CASES = {  # route, sessions: each stage of the route a CPU process (the kernel stage's torch fallbacks)
    "one stage, one session": ("cpu=embed,0-5,output", 1),
    "one stage, three sessions": ("cpu=embed,0-5,output", 3),
    "streaming, two sessions": ("cpu=embed,0-5,output,cache=600KiB", 2),
    "three stages, streaming middle, three sessions": ("cpu=embed,0-1,output; cpu=2-3,cache=500KiB; cpu=4-5", 3),
}


@pytest.mark.parametrize("case", CASES)
def test_the_engine_allocates_what_the_launch_file_predicts(model_path: Path, tmp_path: Path, case: str) -> None:
    route_text, sessions = CASES[case]
    launch = Launch(route_text, 2048, sessions, 64, 128, "f32", str(model_path))
    f = GGUFFile.open(model_path)
    shape = shape_from_specs(f.path.name, f.config, f.tensor_specs())
    route = parse_route(launch.route, 6)
    settings = load_preset("speed")
    settings = dataclasses.replace(settings, footprint=dataclasses.replace(
        settings.footprint, sessions=sessions, prefill_chunk=64, rollback=128))
    budgets = parse_gpu_spec(",".join(["cpu"] * len(route.stages)), 64 * GiB)
    predicted = [s.footprint for s in evaluate(shape, route, budgets, settings, launch.ctx).stages]
    engine = Engine.load(model_path, launch.ctx, launch.route, sessions=sessions, chunk=64, rollback=128,
                         activation_bits=32)
    try:
        session = engine.new_session()
        session.extend(list(range(5, 80)))  # a prompt through every stage: the caches fill, nothing grows
        stats = engine.stage_stats()
        deadline = time.monotonic() + 10
        while len(stats) < len(route.stages) and time.monotonic() < deadline:
            stats = engine.stage_stats()
        for want, got in zip(predicted, stats, strict=True):
            assert got["kv_allocated_bytes"] == want.kv_bytes  # every session's slot, exactly
            cache = got["expert_cache"]
            assert (cache["device_bytes"] if cache else 0) == want.expert_cache_bytes  # slots + table, exactly
            held = got["weights_held_bytes"]
            assert abs(held - want.weights_bytes) <= 0.03 * want.weights_bytes, (held, want.weights_bytes)
            total = held + got["kv_allocated_bytes"] + (cache["device_bytes"] if cache else 0)
            plan_total = want.weights_bytes + want.kv_bytes + want.expert_cache_bytes
            assert abs(total - plan_total) <= 0.03 * plan_total
    finally:
        engine.close()


def test_the_host_memory_guard_refuses_or_warns_by_name_and_amount(model_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """serve checks what the route draws on system RAM against what is available (a small host, faked by the
    amount psutil would report): refused before anything binds, or warned about, with the amounts."""
    args = ["--model", str(model_path), "--route", "cpu=embed,0-5,output,cache=600KiB", "--ctx", "2048"]
    monkeypatch.setattr(serve, "available_ram", lambda: 100 << 20)
    with pytest.raises(ValueError, match=r"needs [0-9.]+ GiB of system RAM \([0-9.]+ GiB for the CPU/APU stages\) "
                                         r"but 100MiB available RAM is there \(short by"):
        serve.build(_serve_args(*args))
    monkeypatch.setattr(serve, "available_ram", lambda: 2 * GiB)
    serve.build(_serve_args(*args))
    err = capsys.readouterr().err
    assert "below the 8GiB host reserve" in err and "the streamed experts no cache holds" in err

    from ds4station.planner.propose import HostNeed, host_messages

    need = HostNeed(shared_bytes=0, pinned_bytes=108 << 20, page_cache_bytes=60 * GiB)
    errors, warnings = host_messages(need, 64 * GiB)  # 60 GiB of experts no cache holds, 64 GiB of RAM
    assert not errors and len(warnings) == 1 and "60.00 GiB" in warnings[0] and "read the disk" in warnings[0]
    assert host_messages(need, 128 * GiB) == ([], [])
    errors, _ = host_messages(need, 64 << 20, what="RAM")
    assert "0.11 GiB of pinned staging" in errors[0] and "short by" in errors[0]


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) << 10
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_loaded_stage_stops_holding_the_files_pages(model_path: Path) -> None:
    """A CPU stage repacks its weights into its own buffers; the pages of the file it read while doing so
    are released (GGUFFile.release), so its resident memory is its share of the file once, not twice, and a
    view read afterwards still reads the same bytes."""
    f = GGUFFile.open(model_path)
    name = "blk.3.ffn_gate_exps.weight"
    first = bytes(f.raw(name))
    assert _mapped_rss(model_path) >= len(first)  # touched: resident in this process
    f.release()
    assert _mapped_rss(model_path) < len(first)
    assert bytes(f.raw(name)) == first  # faulted back in from the page cache, unchanged
    engine = Engine.load(model_path, 512, device="cpu", chunk=64)
    try:
        held = engine.runner.held
        assert _mapped_rss(model_path) < 0.25 * held  # the stage's copies count; the file's pages do not
        assert len(engine.new_session().extend(list(range(5, 40)))) == engine.cfg.vocab_size
    finally:
        engine.close()


def test_plan_draft_mtp_counts_the_layer_and_serve_plan_runs_it(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --draft mtp` counts the MTP layer on the stage holding the head and writes `draft = "mtp"`
    (and `mtp` for the layer's own file); `serve --plan` then drafts with it, and what the engine allocates for
    the layer is what the plan predicted (within 3%, as the weights are checked). Without a layer to count,
    plan refuses; a launch file's bad draft, or an `mtp` without draft = "mtp", is refused by key."""
    mtp_model = make_model(tmp_path / "tiny-mtp.gguf", preset="tiny", seed=0, mtp=True)
    plain = make_model(tmp_path / "tiny.gguf", preset="tiny", seed=0)
    out = tmp_path / "plan.toml"
    args = ("--gpus", "cpu", "--host-ram", "16GiB", "--sessions", "2", "--prefill-chunk", "64", "--rollback", "128")
    assert _plan("--model", str(mtp_model), *args, "--draft", "mtp", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "the MTP layer (--draft mtp) is on stage 0" in printed
    launch = read_launch(out)
    assert launch.draft == "mtp" and launch.mtp is None and 'draft = "mtp"' in out.read_text()
    assert _plan("--model", str(plain), *args, "--draft", "mtp") == 2
    assert "has no MTP layer" in capsys.readouterr().err
    args_ns = _serve_args("--plan", str(out))
    app, _ = serve.build(args_ns)
    assert args_ns.draft == "mtp"
    srv = BackgroundServer(app).start()
    try:
        assert srv.wait_ready(60)
        st = httpx.get(srv.url + "/status").json()
        assert st["draft"]["source"] == "mtp"
        f = GGUFFile.open(mtp_model)
        settings = load_preset("speed")
        settings = dataclasses.replace(settings, footprint=dataclasses.replace(
            settings.footprint, sessions=2, prefill_chunk=64, rollback=128, mtp=True))
        shape = shape_from_specs(f.path.name, f.config, f.tensor_specs(), f.mtp_specs())
        predicted = evaluate(shape, parse_route(launch.route, 6), parse_gpu_spec("cpu", 16 * GiB), settings,
                             launch.ctx).stages[0].footprint
        got = st["stages"][0]
        assert abs(got["mtp_bytes"] - predicted.mtp_bytes) <= 0.03 * predicted.mtp_bytes, (got, predicted)
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="sets draft = 'mtp' but --draft lookup"):
        serve.build(_serve_args("--plan", str(out), "--draft", "lookup"))
    bad = tmp_path / "bad.toml"
    for body, msg in [('route = "cpu=embed,0-5,output"\nctx = 4096\ndraft = "medusa"\n', "draft = 'medusa'"),
                      ('route = "cpu=embed,0-5,output"\nctx = 4096\nmtp = "/m.gguf"\n', 'for draft = "mtp"')]:
        bad.write_text(body)
        with pytest.raises(LaunchError, match=msg):
            read_launch(bad)
    full = Launch("cpu=embed,0-5,output", 4096, 2, 64, 128, "f32", str(plain), "speed", "mtp", "/m/mtp.gguf")
    assert read_launch(write_launch(tmp_path / "full.toml", full)) == full
