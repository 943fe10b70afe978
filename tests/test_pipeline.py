"""The pipeline engine with real worker processes over gloo on the tiny model (engine/engine.py, stage.py,
commands/worker.py): exact tokens against the single-process engine, 16-bit activation tolerance, per-stage
KV bytes, a streaming worker stage, remote join with a refused cache, and a worker killed mid-generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine, StageDown
from ds4station.engine.experts import ExpertCacheTooSmall, min_cache_bytes
from ds4station.engine.model import OFF
from ds4station.engine.weights import load_tensors
from ds4station.model.footprint import kv_bytes
from ds4station.model.gguf import GGUFFile
from ds4station.model.route import RouteError, parse_route
from ds4station.model.sizes import format_size
from ds4station.ports import free_port

CTX, CHUNK = 128, 16
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]  # 40 tokens: 3 prefill pieces of <= 16
N_NEW = 6
# 16-bit activations (fp16 + a power-of-two scale per row, three stage boundaries), round trips off (see
# `reference`): the largest logit difference measured on the tiny model is ~6e-4 (logits have std ~1).
LOGIT_TOL_16 = 5e-3
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("pipe") / "tiny-q2.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def min_cache(model_path: Path) -> int:
    return min_cache_bytes(load_tensors(GGUFFile.open(model_path), range(2, 4), embed=False, output=False), range(2, 4))


@pytest.fixture(scope="module")
def reference(model_path: Path) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and every step's logits from the single-process engine (same prefill pieces).

    These tests run the model without its quantisation round trips (RoundTrips OFF): with them, a 16-bit
    perturbation now and then flips an FP8/FP4 rounding or an indexer top-k choice and a single step's
    logits jump by up to ~1 on this random model, so no tight 16-bit tolerance could be stated. Exactness
    in 32 bits does not depend on it (test_experts.py runs the round trips on through a streaming stage)."""
    engine = Engine.load(model_path, CTX, device="cpu", chunk=CHUNK, round_trips=OFF)
    assert engine.world == 1 and not engine.procs  # no route: one stage, in this process
    return greedy(engine.new_session(), N_NEW)


@pytest.fixture(scope="module")
def pipe(model_path: Path, min_cache: int):
    """Three stages in three processes; the middle one streams its experts through the smallest cache."""
    route = f"cpu=embed,0-1,output; cpu=2-3,cache={min_cache}; cpu=4-5"
    engine = Engine.load(model_path, CTX, route, activation_bits=32, chunk=CHUNK, round_trips=OFF)
    yield engine
    engine.close()
    assert all(p.poll() is not None for p in engine.procs.values())


def greedy(session, n: int) -> tuple[list[int], list[torch.Tensor]]:
    logits = [session.extend(PROMPT)]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits.append(session.extend([tokens[-1]]))
    return tokens, logits


def test_three_stages_fp32_give_exactly_the_single_process_tokens(pipe, reference) -> None:
    assert pipe.backend == "gloo" and len(pipe.procs) == 2
    tokens, logits = greedy(pipe.new_session(), N_NEW)
    assert tokens == reference[0]
    for got, want in zip(logits, reference[1], strict=True):
        assert torch.equal(got, want)  # 32-bit activations: bit for bit, streamed stage included


def test_16_bit_activations_stay_within_tolerance(pipe, reference) -> None:
    session = pipe.new_session(activation_bits=16)
    got = [session.extend(PROMPT)] + [session.extend([t]) for t in reference[0]]  # the reference's path
    diffs = [float((g - w).abs().max()) for g, w in zip(got, reference[1], strict=True)]
    assert max(diffs) < LOGIT_TOL_16, diffs
    assert max(diffs) > 0  # the 16-bit path was really taken
    assert [int(g.argmax()) for g in got[:-1]] == reference[0]


def test_each_stage_allocates_kv_for_its_own_layers_only(pipe, model_path: Path) -> None:
    cfg = GGUFFile.open(model_path).config
    session = pipe.new_session()
    session.extend(PROMPT[:5])
    stats = pipe.stage_stats()
    assert [s["rank"] for s in stats] == [0, 1, 2]
    total = 0
    for stage, st in zip(pipe.route.stages, stats, strict=True):
        got = st["sessions"][str(session.sid)]
        want = kv_bytes(cfg, stage.layers, CTX, chunk=CHUNK, rollback=0)
        assert got["kv_bytes"] == want
        assert got["tokens"] == 5
        assert want < kv_bytes(cfg, range(cfg.n_layers), CTX, chunk=CHUNK)
        total += want
    assert session.kv_bytes() == total == kv_bytes(cfg, range(cfg.n_layers), CTX, chunk=CHUNK)
    sid = session.sid
    del session  # the scheduler drops sessions by reference: every stage frees that KV
    assert all(str(sid) not in st["sessions"] for st in pipe.stage_stats())


def test_streaming_worker_cache_statistics_add_up(pipe, min_cache: int) -> None:
    greedy(pipe.new_session(), 2)
    cache = pipe.stage_stats()[1]["expert_cache"]
    assert cache["capacity_bytes"] == min_cache and cache["slots"] == 8
    assert cache["lookups"] > 0 and cache["evictions"] > 0  # two layers through one layer's worth of slots
    assert cache["hits"] + cache["misses"] == cache["lookups"]
    assert cache["bytes_read"] == cache["misses"] * cache["slot_bytes"]
    assert cache["used_slots"] <= cache["slots"]
    status = pipe.status()
    assert status["health"] is None and [s["state"] for s in status["stages"]] == ["up"] * 3
    assert status["expert_cache"]["misses"] == cache["misses"]
    assert status["stages"][0]["expert_cache"] is None and status["stages"][1]["remote"] is False


def test_truncate_rolls_every_stage_back(pipe, reference) -> None:
    session = pipe.new_session()
    greedy(session, 4)
    keep = len(PROMPT) + 1
    assert session.truncate(keep)
    assert len(session.tokens) == keep
    assert torch.equal(session.extend([reference[0][1]]), reference[1][2])  # the same steps once more
    assert torch.equal(session.extend([reference[0][2]]), reference[1][3])
    assert not session.truncate(0)  # further back than the rings hold: refused, unchanged
    assert len(session.tokens) == keep + 2


def test_rewind_brings_every_stage_back_to_the_prompt_checkpoint(pipe, reference) -> None:
    """Beyond what truncate can reach, every stage goes back to the checkpoint taken at the prompt's end and
    then gives exactly the reference's steps from there; a rewind below the checkpoint drops it."""
    p = len(PROMPT)
    fresh = pipe.new_session()  # the prompt's last token again, one step back (the same prefill pieces)
    fresh.extend(PROMPT)
    assert fresh.truncate(p - 1)
    last_alone = fresh.extend(PROMPT[p - 1:])
    fresh.close()
    session = pipe.new_session()
    session.extend(PROMPT)
    session.checkpoint()
    token = reference[0][0]
    for _ in range(3 * CHUNK):  # further than the rings' slack
        token = int(session.extend([token]).argmax())
    assert not session.truncate(p + 1)
    assert session.rewind(p + 1) == p and len(session.tokens) == p
    assert torch.equal(session.extend([reference[0][0]]), reference[1][1])  # the first answer step again
    assert torch.equal(session.extend([reference[0][1]]), reference[1][2])
    # below a position a checkpoint restored, truncate cannot go (only that position's window came back); the
    # checkpoint's margin can, and going below the checkpoint drops it
    assert not session.truncate(p - 1)
    assert session.rewind(p - 1) == p - 1 and session.rewind(p) == -1
    # a checkpoint also serves the positions just before it (a template's last tokens rendered otherwise)
    session.extend(PROMPT[p - 1:])
    session.checkpoint()
    for _ in range(3 * CHUNK):
        session.extend([5])
    assert session.rewind(p - 1) == p - 1
    assert torch.equal(session.extend(PROMPT[p - 1:]), last_alone)  # the prompt's last token again, exactly
    for _ in range(3 * CHUNK):
        session.extend([5])
    assert session.rewind(p - 1 - 16) == -1  # further back than the checkpoint's margin: unchanged


def test_a_disk_checkpoint_saves_and_restores_every_stage_in_its_own_process(pipe, reference, tmp_path: Path) -> None:
    """Each stage writes and reads its own file (stage<R>.kv); a restored session gives the reference's steps
    exactly; one stage's corrupt file fails the whole load (that worker logs why) and leaves the engine usable."""
    from ds4station.engine.kvdisk import stage_file

    session = pipe.new_session()
    session.extend(PROMPT)
    assert session.save_state(tmp_path / "e")
    session.close()
    assert all(stage_file(tmp_path / "e", r).is_file() for r in range(3))
    restored = pipe.new_session()
    assert restored.load_state(tmp_path / "e", PROMPT)
    steps = [restored.extend([t]) for t in reference[0]]
    assert all(torch.equal(g, w) for g, w in zip(steps, reference[1][1:], strict=True))
    restored.close()
    path = stage_file(tmp_path / "e", 1)
    data = bytearray(path.read_bytes())
    data[-8] ^= 1
    path.write_bytes(bytes(data))
    broken = pipe.new_session()
    assert not broken.load_state(tmp_path / "e", PROMPT)  # the worker's log line: test_kvdisk.py checks its form
    pipe.drop_state(tmp_path / "e")  # each stage removes its own file (its directory may be on its own machine)
    deadline = time.monotonic() + 10
    while (tmp_path / "e").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (tmp_path / "e").exists()
    tokens, _ = greedy(pipe.new_session(), 2)
    assert tokens == reference[0][:2]


def test_a_silent_worker_is_reported_down_by_its_missing_heartbeat(pipe) -> None:
    """A stopped (hung) worker: no exit, no broken connection, only missing heartbeats. This takes the shared
    3-stage pipeline down, so it is the last test to use `pipe`."""
    session = pipe.new_session()
    logits = session.extend(PROMPT[:4])
    pipe.heartbeat_timeout = 2.0
    os.kill(pipe.procs[2].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(StageDown, match=r"stage 2 \(cpu, layers 4-5\) is down: no heartbeat"):
        for _ in range(100):
            logits = session.extend([int(logits.argmax())])
    assert time.monotonic() - t0 < 2.0 + 3.0
    assert "no heartbeat" in (pipe.health() or "")


def test_route_and_cache_validation_before_anything_starts(model_path: Path, min_cache: int) -> None:
    with pytest.raises(ExpertCacheTooSmall, match=rf"stage 1 .*minimum.*{format_size(min_cache)}"):
        Engine.load(model_path, CTX, f"cpu=embed,0-1,output; cpu=2-5,cache={min_cache - 1}")
    with pytest.raises(RouteError, match="output head is on stage 1"):
        Engine.load(model_path, CTX, "cpu=embed,0-1; cpu=2-3,output; cpu=4-5")
    with pytest.raises(RouteError, match="gap"):
        Engine.load(model_path, CTX, "cpu=embed,0-1,output; cpu=3-5")
    with pytest.raises(ValueError, match="activation-bits 8"):
        Engine.load(model_path, CTX, "cpu=embed,0-5,output", activation_bits=8)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_remote_worker_with_too_small_cache_exits_nonzero_stating_the_minimum(model_path: Path) -> None:
    gguf = GGUFFile.open(model_path)
    need = min_cache_bytes(load_tensors(gguf, range(3, 6), embed=False, output=False), range(3, 6))
    port = free_port()
    failure: list[BaseException] = []

    def coordinator() -> None:
        try:
            Engine.load(model_path, CTX, "cpu=embed,0-2,output; cpu=3-5", dist_addr=f"127.0.0.1:{port}",
                                remote=[1], join_timeout=120)
        except BaseException as e:  # the worker's own message, relayed through the store
            failure.append(e)

    thread = threading.Thread(target=coordinator)
    thread.start()
    worker = subprocess.run([sys.executable, "-m", "ds4station.commands.worker", "--coordinator",
                             f"127.0.0.1:{port}", "--rank", "1", "--expert-cache", "100KiB"],
                            capture_output=True, text=True, timeout=180, env=_env())
    thread.join(60)
    assert worker.returncode == 2, worker.stderr
    assert "minimum" in worker.stderr and format_size(need) in worker.stderr and "8 experts" in worker.stderr
    assert failure and format_size(need) in str(failure[0])


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found.append(int(pid))
    return found


def test_killed_worker_fails_the_request_within_seconds_and_leaves_no_process(model_path: Path) -> None:
    engine = Engine.load(model_path, 512, "cpu=embed,0-1,output; cpu=2-3; cpu=4-5", chunk=CHUNK)
    address = engine._address
    try:
        assert engine.activation_bits == 16  # the default
        assert sorted(engine.procs) == [1, 2] and len(_processes_mentioning(address)) == 2
        session = engine.new_session()
        logits = session.extend(PROMPT[:8])
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.monotonic())
            os.kill(engine.procs[1].pid, signal.SIGKILL)

        timer = threading.Timer(0.5, kill)
        timer.start()
        with pytest.raises(StageDown) as err:
            for _ in range(400):  # decoding when the kill lands
                logits = session.extend([int(logits.argmax())])
        failed = time.monotonic()
        timer.join()
        assert killed and failed - killed[0] < 5.0
        assert err.value.rank == 1 and "stage 1 (cpu, layers 2-3)" in str(err.value)
        assert "exited" in str(err.value)
        assert "stage 1" in (engine.health() or "")
        assert engine.status()["stages"][1]["state"] == "down"
        t0 = time.monotonic()
        with pytest.raises(StageDown):  # later requests fail at once, they do not hang
            engine.new_session().extend([1, 2, 3])
        assert time.monotonic() - t0 < 1.0
    finally:
        engine.close()
    assert all(p.poll() is not None for p in engine.procs.values())
    assert _processes_mentioning(address) == []


def test_a_worker_exits_by_itself_when_its_coordinator_dies(model_path: Path) -> None:
    """A coordinator killed outright cannot stop its workers; they notice (parent gone, store silent) and exit.
    Here a shell stands in as the worker's parent and the test process holds the store."""
    import datetime

    import torch.distributed as dist

    from ds4station.engine.stage import StageSettings

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    store.set("config", StageSettings(model=str(model_path), route="cpu=embed,0-2,output; cpu=3-5", ctx=64,
                                      chunk=CHUNK, rollback=0).to_json())
    worker_cmd = (f"{sys.executable} -m ds4station.commands.worker --coordinator 127.0.0.1:{store.port} "
                  f"--rank 1 --parent-pid $$ --threads 1 & echo $!; wait")
    parent = subprocess.Popen(["sh", "-c", worker_cmd], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        worker = int(parent.stdout.readline()) if parent.stdout else 0
        deadline = time.monotonic() + 120
        while not store.check(["ready/1"]) and time.monotonic() < deadline and _alive(worker):
            time.sleep(0.1)
        assert store.check(["ready/1"]) and _alive(worker)  # loaded, now waiting for rank 0 to join
        parent.kill()  # SIGKILL: the parent cannot clean up
        parent.wait()
        deadline = time.monotonic() + 5.0
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent, killed, can no longer reap it)


def test_single_stage_route_from_toml_runs_in_process_and_generates(model_path: Path, reference,
                                                                     tmp_path: Path) -> None:
    toml = tmp_path / "route.toml"
    toml.write_text(parse_route("cpu=embed,0-5,output", 6).to_toml())  # the TOML form of a route
    engine = Engine.load(model_path, CTX, route=str(toml), chunk=CHUNK, activation_bits=32, round_trips=OFF)
    try:
        assert engine.world == 1 and engine.procs == {}
        assert greedy(engine.new_session(), 2)[0] == reference[0][:2]
        assert parse_route(engine.status()["route"], 6) == engine.route
    finally:
        engine.close()


def test_activation_packing_exact_in_32_bits_bounded_and_overflow_free_in_16() -> None:
    from ds4station.engine.stage import pack, payload_bytes, unpack

    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor([3, 1, 4])
    X = torch.randn(3, 4, 256, generator=gen) * torch.tensor([1e-3, 1.0, 3e3, 1e6]).view(1, 4, 1)
    for bits in (32, 16):
        buf = pack(tokens, X, bits)
        assert buf.dtype == torch.uint8 and buf.numel() == payload_bytes(3, bits, 4, 256)
        t, Y = unpack(buf, 3, bits, 4, 256)
        assert torch.equal(t, tokens)
        if bits == 32:
            assert torch.equal(Y, X)
        else:  # fp16's 11-bit significand relative to each row's largest value, even at 1e6 (> fp16's 65504)
            assert torch.isfinite(Y).all()
            err = (Y - X).abs() / X.abs().amax(-1, keepdim=True)
            assert float(err.max()) <= 2.0**-11


def test_pin_env_gives_each_child_exactly_its_device() -> None:
    from ds4station.engine.stage import pin_env

    assert pin_env("cpu", {}) == ({"CUDA_VISIBLE_DEVICES": ""}, "cpu")
    assert pin_env("cuda:2", {}) == ({"CUDA_VISIBLE_DEVICES": "2"}, "cuda:0")
    # cuda:N counts the GPUs this process sees, as torch does here
    assert pin_env("cuda:1", {"CUDA_VISIBLE_DEVICES": "3,5"}) == ({"CUDA_VISIBLE_DEVICES": "5"}, "cuda:0")
    with pytest.raises(RouteError, match="only 2 GPU"):
        pin_env("cuda:2", {"CUDA_VISIBLE_DEVICES": "3,5"})
    uuid = "GPU-39b080e3-7bed-6984-1add-82e907c1890b"
    assert pin_env(uuid, {}) == ({"CUDA_VISIBLE_DEVICES": uuid}, "cuda:0")


def test_stages_on_the_kernel_stage_give_the_reference_tokens(model_path: Path, reference) -> None:
    """compute="kernels" runs every stage on engine/gpu.py's kernel stage (here its CPU path, the same code
    that launches the Triton kernels on a GPU): two processes, the same greedy tokens, logits to fp32
    rounding."""
    engine = Engine.load(model_path, CTX, "cpu=embed,0-2,output; cpu=3-5", activation_bits=32, chunk=CHUNK,
                                 round_trips=OFF, compute="kernels")
    try:
        assert engine.runner.compute == "kernels" and len(engine.procs) == 1
        tokens, logits = greedy(engine.new_session(), N_NEW)
        assert tokens == reference[0]
        for got, want in zip(logits, reference[1], strict=True):
            assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    finally:
        engine.close()
    with pytest.raises(ValueError, match="streamed experts run on the kernel stage"):
        Engine.load(model_path, CTX, "cpu=embed,0-5,output,cache=1GiB", chunk=CHUNK, compute="reference")


def test_process_group_shutdown_is_bounded() -> None:
    """An orderly stop releases the group; a shutdown that blocks (NCCL waiting on a peer) does not hold the
    process longer than the timeout."""
    import threading
    import time

    from ds4station.engine.stage import shutdown_process_group

    class Group:
        def __init__(self, block: bool) -> None:
            self.block, self.calls, self.release = block, 0, threading.Event()

        def shutdown(self) -> None:
            self.calls += 1
            if self.block:
                self.release.wait(30)

    quick = Group(block=False)
    shutdown_process_group(quick)
    assert quick.calls == 1
    stuck = Group(block=True)
    start = time.monotonic()
    shutdown_process_group(stuck, timeout=0.2)
    assert stuck.calls == 1 and time.monotonic() - start < 2
    stuck.release.set()


def test_a_batched_decode_step_runs_through_the_stages(model_path: Path) -> None:
    """decode_batch over a two-stage route (the head on the last stage, so logits travel back): every session
    gets the tokens and logits it gets alone, and every stage's cache advances by one per step."""
    route = "cpu=embed,0-2; cpu=3-5,output"
    with Engine.load(model_path, CTX, route, activation_bits=32, chunk=CHUNK, round_trips=OFF, sessions=3) as engine:
        prompts = [PROMPT, PROMPT[:-3], PROMPT[2:]]
        alone = []
        for p in prompts:
            s = engine.new_session()
            logits = s.extend(p)
            tokens = []
            for _ in range(6):
                tokens.append(int(logits.argmax()))
                logits = s.extend([tokens[-1]])
            alone.append((tokens, logits))
            s.close()
        sessions = [engine.new_session() for _ in prompts]
        logits = torch.stack([s.extend(p) for s, p in zip(sessions, prompts, strict=True)])
        got: list[list[int]] = [[] for _ in prompts]
        for _ in range(6):
            step = [int(row.argmax()) for row in logits]
            for g, t in zip(got, step, strict=True):
                g.append(t)
            logits = engine.decode_batch(sessions, step)
        assert logits.shape == (3, engine.cfg.vocab_size)
        assert got == [a[0] for a in alone]
        for row, (_, want) in zip(logits, alone, strict=True):
            assert torch.allclose(row, want, atol=1e-4 * want.abs().max().item(), rtol=0)
        lengths = [len(p) + 6 for p in prompts]
        assert [len(s.tokens) for s in sessions] == lengths
        worker = engine.stage_stats()[1]["sessions"]
        assert sorted(v["tokens"] for v in worker.values()) == sorted(lengths)
        with pytest.raises(ValueError, match="one token per session"):
            engine.decode_batch(sessions, [1, 2])

