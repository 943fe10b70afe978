"""The proposer on the issue's reference hosts, its optimality on small cases, refusals, and `ds4station plan`."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import re
from pathlib import Path

import pytest

from ds4station.commands import plan as plan_cmd
from ds4station.hardware import detect
from ds4station.model.footprint import FootprintSettings, named_shape, stage_footprint
from ds4station.model.route import parse_route
from ds4station.planner.devices import (
    CPU_BANDWIDTH,
    DeviceBudget,
    budgets_from_gpus,
    nominal_bandwidth,
    parse_gpu_spec,
)
from ds4station.planner.presets import PresetError, is_host_profile, load_host_profile, load_preset
from ds4station.planner.propose import PlanError, _Planner, evaluate, propose

GiB, MiB = 1 << 30, 1 << 20
FLASH_Q2 = named_shape("flash-q2")
HOST2_TREE = Path(__file__).parent / "fixtures" / "sysfs" / "rdna3-strix-halo"


def host1() -> tuple[list[DeviceBudget], int]:
    profile = load_host_profile("gfx906-workstation")
    assert profile.host_ram is not None
    return parse_gpu_spec(profile.gpus, profile.host_ram), profile.host_ram


def assert_fits(plan) -> None:  # type: ignore[no-untyped-def]
    for s in plan.stages:
        assert s.fits, f"{s.stage} predicts {s.footprint.predicted_bytes} > {s.available_bytes}"
        headroom = 3 * GiB // 2 if s.budget.desktop else 0
        assert s.footprint.predicted_bytes <= s.budget.total_bytes - headroom


# ---- reference host 1: 32 GiB + 5 x 16 GiB Vega 20, one on the desktop, 96 GiB RAM, q2 ----------------------
def test_host1_speed_fills_the_16gib_cards_at_32k() -> None:
    """What serve allocates (2 sessions, 2048-token prefill chunks, rollback 1024) leaves room for six layers on
    a 16 GiB card; the 32 GiB card takes the rest with the embedding and the head."""
    devices, ram = host1()
    assert [d.total_bytes // GiB for d in devices] == [32, 16, 16, 16, 16, 16]
    assert [d.desktop for d in devices] == [False, True, False, False, False, False]
    settings = load_preset("speed")
    assert (settings.footprint.sessions, settings.footprint.prefill_chunk, settings.footprint.rollback) == \
        (2, 2048, 1024)
    plan = propose(FLASH_Q2, devices, settings, host_ram=ram)
    assert plan.ctx == 32768 and not plan.streaming
    assert plan.layer_counts == [13, 6, 6, 6, 6, 6]
    assert str(plan.route).startswith("cuda:0=embed,0-12,output; cuda:1=13-18;")
    assert_fits(plan)
    seven = stage_footprint(FLASH_Q2, range(13, 20), 32768, settings.footprint).predicted_bytes
    assert seven > plan.stages[2].available_bytes  # a seventh layer does not fit a 16 GiB card
    # the desktop card is offered 16 GiB less the 1.5 GiB headroom and the 256 MiB reserve
    assert plan.stages[1].available_bytes == 16 * GiB - 3 * GiB // 2 - 256 * MiB


def test_host1_context_is_the_longest_that_keeps_the_margin_resident() -> None:
    devices, ram = host1()
    settings = load_preset("context")
    assert settings.spare_target == 512 * MiB
    plan = propose(FLASH_Q2, devices, settings, host_ram=ram)
    assert not plan.streaming and plan.ctx == 544_768
    assert plan.layer_counts == [14, 5, 6, 6, 6, 6]
    assert plan.stages[0].stage.embed and plan.stages[0].stage.output
    assert_fits(plan)
    assert min(s.spare_bytes for s in plan.stages) >= 512 * MiB  # the stated margin, not 0.00
    # it is the longest: one ctx_step more keeps the margin on no split
    p = _Planner(FLASH_Q2, devices, settings, ram)
    assert p.solve(p.fits(plan.ctx + 1024, 0, 512 * MiB), minimise=False) is None


def test_host1_native_context_with_a_2gib_expert_cache() -> None:
    devices, ram = host1()
    plan = propose(FLASH_Q2, devices, load_preset("context"), expert_cache=2 * GiB, host_ram=ram)
    assert plan.ctx == 1_048_576 and plan.streaming
    assert all(s.stage.expert_cache_bytes == 2 * GiB for s in plan.stages)
    assert sum(plan.layer_counts) == 43
    assert_fits(plan)
    # asking for the full context without naming a cache streams automatically, and says so
    auto = propose(FLASH_Q2, devices, load_preset("context"), ctx=1 << 20, host_ram=ram)
    assert auto.streaming and auto.ctx == 1 << 20 and "streaming routed experts" in auto.notes[0]


def test_expert_cache_below_one_layer_table_is_refused_with_the_minimum() -> None:
    devices, _ = host1()
    with pytest.raises(PlanError, match=r"minimum is 1728MiB \(1.69 GiB\)"):
        propose(FLASH_Q2, devices, load_preset("context"), expert_cache=GiB)


def test_desktop_headroom_is_configurable() -> None:
    devices, ram = host1()
    roomy = dataclasses.replace(load_preset("context"), desktop_headroom=0)
    tight = dataclasses.replace(load_preset("context"), desktop_headroom=4 * GiB)
    base = propose(FLASH_Q2, devices, load_preset("context"), host_ram=ram).ctx
    assert propose(FLASH_Q2, devices, roomy, host_ram=ram).ctx > base
    assert propose(FLASH_Q2, devices, tight, host_ram=ram).ctx < base


# ---- reference host 2: RX 7900 XT + Strix Halo with 96 GiB GTT ----------------------------------------------------
def test_host2_profile_fits_using_gtt() -> None:
    profile = load_host_profile("rdna3-strix-halo")
    devices = parse_gpu_spec(profile.gpus, profile.host_ram)
    plan = propose(FLASH_Q2, devices, load_preset("speed"), host_ram=profile.host_ram)
    assert_fits(plan)
    apu = plan.stages[-1]
    assert apu.budget.kind == "apu" and apu.stage.n_layers > 30
    assert apu.available_bytes > 90 * GiB


def test_host2_detected_from_sysfs_uses_gtt_not_the_carveout() -> None:
    gpus = detect(HOST2_TREE, use_nvml=False)
    budgets = budgets_from_gpus(gpus, host_ram=128 * GiB)
    xt, apu = budgets
    assert (xt.kind, apu.kind) == ("gpu", "apu")
    assert apu.total_bytes == 96 * GiB and apu.desktop  # not the 512 MiB VRAM carve-out
    assert apu.used_bytes == GiB  # GTT in use
    plan = propose(FLASH_Q2, budgets, load_preset("speed"), host_ram=128 * GiB)
    assert_fits(plan)
    assert plan.route.devices == ["0000:03:00.0", "0000:c4:00.0"]
    # with only the carve-out the model could not fit
    carveout = [xt, dataclasses.replace(apu, kind="gpu", total_bytes=512 * MiB, used_bytes=0)]
    with pytest.raises(PlanError, match="short by"):
        propose(FLASH_Q2, carveout, load_preset("speed"))


def test_where_a_cards_available_memory_comes_from() -> None:
    """The plan's "have" explained: VRAM less what others use or the desktop headroom, less the reserve; an
    APU's GTT capped by the host's RAM says so."""
    xt, apu = budgets_from_gpus(detect(HOST2_TREE, use_nvml=False), host_ram=64 * GiB)
    st = load_preset("speed")
    assert apu.total_bytes == 56 * GiB and apu.cap == ("of 96.00 GiB, capped at the host's 64.00 GiB of RAM less "
                                                       "8.00 GiB for the system")
    text = apu.explain_available(st.desktop_headroom, st.reserve)
    assert text == (f"56.00 GiB GTT ({apu.cap}) - 1.50 GiB desktop headroom - 0.25 GiB reserve = "
                    f"{apu.available(st.desktop_headroom, st.reserve) / GiB:.2f} GiB")
    assert xt.explain_available(st.desktop_headroom, st.reserve).startswith("19.98 GiB VRAM - 0.39 GiB in use by")
    roomy = budgets_from_gpus(detect(HOST2_TREE, use_nvml=False), host_ram=128 * GiB)[1]
    assert roomy.cap == ""
    assert roomy.explain_available(0, 0) == "96.00 GiB GTT - 1.00 GiB in use by other processes = 95.00 GiB"


def test_shared_system_ram_is_checked() -> None:
    devices = parse_gpu_spec("20GiB,96GiB:apu")
    with pytest.raises(PlanError, match="system RAM"):
        propose(FLASH_Q2, devices, load_preset("speed"), host_ram=64 * GiB)


def test_cpu_stage_from_spec() -> None:
    devices = parse_gpu_spec("24GiB,cpu", host_ram=96 * GiB)
    assert devices[1].device == "cpu" and devices[1].total_bytes == 88 * GiB
    plan = propose(FLASH_Q2, devices, load_preset("speed"), host_ram=96 * GiB)
    assert plan.route.devices == ["cuda:0", "cpu"] and plan.stages[1].stage.expert_cache_bytes == 0
    assert_fits(plan)


# ---- refusals ----------------------------------------------------------------------------------------------------
def test_refusal_says_by_how_much_and_what_helps() -> None:
    with pytest.raises(PlanError) as e:
        propose(FLASH_Q2, parse_gpu_spec("24GiB,24GiB"), load_preset("speed"))
    msg = str(e.value)
    # 80.76 GiB of weights + 2 sessions' KV (2.35) + 2 x (runtime 0.75, scratch 1.76) against 2 x (24 - 0.25) GiB
    short = float(re.search(r"short by ([0-9.]+) GiB", msg).group(1))  # type: ignore[union-attr]
    assert 40 < short < 41.5
    assert "--expert-cache 1728MiB" in msg and "another GPU with at least" in msg and "CPU stage" in msg


def test_refusal_when_the_total_fits_but_no_split_does() -> None:
    # 43 layers of ~1.85 GiB over many 2.5 GiB cards: plenty in total, but a card holds at most one layer and the
    # first card cannot also hold the 1.5 GiB embedding and head (one session, 512-token chunks).
    small = dataclasses.replace(load_preset("speed"), footprint=FootprintSettings(prefill_chunk=512, sessions=1,
                                                                                  rollback=0))
    with pytest.raises(PlanError, match="no contiguous split fits"):
        propose(FLASH_Q2, parse_gpu_spec("3GiBx60"), small)


# ---- optimality on small cases (brute force) ---------------------------------------------------------------------
def _splits(n_layers: int, n_devices: int):  # type: ignore[no-untyped-def]
    """Every assignment in device order: device 0 takes [0, k) with k >= 1, later devices >= 0 layers."""
    for cuts in itertools.combinations_with_replacement(range(1, n_layers + 1), n_devices - 1):
        bounds = (0,) + cuts + (n_layers,)
        yield [(j, bounds[j], bounds[j + 1]) for j in range(n_devices) if bounds[j + 1] > bounds[j]]


def test_speed_split_is_optimal_against_brute_force() -> None:
    model = named_shape("tiny-q2")
    settings = dataclasses.replace(load_preset("speed"), ctx=4096, reserve=0, min_ctx=1024, ctx_step=256,
                                   footprint=FootprintSettings(prefill_chunk=16, sessions=1, rollback=0,
                                                               runtime_overhead=0))
    rng = random.Random(0)
    feasible = 0
    for _ in range(30):
        devices = [DeviceBudget(f"cuda:{i}", "card", total_bytes=rng.randint(3 * MiB, 9 * MiB)) for i in range(4)]
        p = _Planner(model, devices, settings, None)
        best = None
        for split in _splits(6, 4):
            spares = [p.avail[j] - p.predicted(j, a, b, 4096, 0) for j, a, b in split]
            if min(spares) >= 0:
                key = (max(p.decode_cost(j, a, b) for j, a, b in split), -min(spares))
                best = key if best is None or key < best else best
        if best is None:
            with pytest.raises(PlanError):
                propose(model, devices, settings)
            continue
        feasible += 1
        plan = propose(model, devices, settings)
        assert (max(s.decode_read_bytes for s in plan.stages), -min(s.spare_bytes for s in plan.stages)) == best
    assert feasible >= 8  # the sizes above must exercise real choices, not only refusals


def test_evaluate_a_hand_written_route() -> None:
    devices, ram = host1()
    settings = load_preset("speed")
    proposed = propose(FLASH_Q2, devices, settings, host_ram=ram)
    again = evaluate(FLASH_Q2, parse_route(str(proposed.route), 43), devices, settings, 32768, host_ram=ram)
    assert [s.footprint for s in again.stages] == [s.footprint for s in proposed.stages]
    lopsided = parse_route("cuda:0=embed,0-20,output; cuda:1=21-42", 43)
    res = evaluate(FLASH_Q2, lopsided, devices[:2], settings, 32768)
    assert [s.fits for s in res.stages] == [False, False]
    fp = stage_footprint(FLASH_Q2, range(21, 43), 32768, settings.footprint)
    assert res.stages[1].footprint == fp


# ---- presets and SPEC --------------------------------------------------------------------------------------------
def test_speed_gives_a_faster_card_more_layers() -> None:
    even = propose(FLASH_Q2, parse_gpu_spec("64GiB,64GiB"), load_preset("speed"))
    fast_first = propose(FLASH_Q2, parse_gpu_spec("64GiB:bw=2000,64GiB:bw=1000"), load_preset("speed"))
    a, b = fast_first.layer_counts
    assert a > 1.5 * b and a + b == 43
    assert abs(even.layer_counts[0] - even.layer_counts[1]) <= 4  # equal cards: the head's card takes a few less
    # the slowest stage's time is what the split minimises
    times = [s.decode_ms for s in fast_first.stages]
    assert all(t is not None for t in times) and max(times) < 1.1 * min(times)
    assert nominal_bandwidth("AMD Radeon VII", "gfx906") == 1024 and nominal_bandwidth("NVIDIA H200", "sm_90") == 4800
    assert nominal_bandwidth("Mystery", "gfx1151") == 256 and nominal_bandwidth("Mystery", "gfx000") == 0


def test_a_cpu_stage_takes_only_what_the_cards_cannot_hold() -> None:
    """A CPU stage reads its weights far slower than a card (devices.CPU_BANDWIDTH against a card's hundreds of
    GB/s): the speed preset leaves it the layers the card has no room for, not half the model (before the CPU had
    a bandwidth it counted as fast as the card: 23 of 43 layers beside an 80 GiB card with 38 GiB spare)."""
    plan = propose(FLASH_Q2, parse_gpu_spec("80GiB,cpu:128GiB"), load_preset("speed"))
    card, cpu = plan.layer_counts
    assert card + cpu == 43 and cpu <= 6
    assert plan.stages[0].spare_bytes < 8 * GiB  # the card is filled first
    assert plan.stages[1].budget.bandwidth_gbs == CPU_BANDWIDTH
    as_fast = propose(FLASH_Q2, parse_gpu_spec("80GiB:bw=600,cpu:128GiB:bw=600"), load_preset("speed"))
    assert as_fast.layer_counts[1] > 15  # a CPU as fast as the card: the stages balanced again


def test_spec_parsing() -> None:
    d = parse_gpu_spec("32GiB, 16GiB:desktop, 16GiBx4")
    assert [x.device for x in d] == [f"cuda:{i}" for i in range(6)]
    assert [x.desktop for x in d] == [False, True] + [False] * 4
    assert parse_gpu_spec("96GiB:apu:desktop", host_ram=64 * GiB)[0].total_bytes == 56 * GiB
    fast = parse_gpu_spec("16GiB:bw=1024x2")
    assert len(fast) == 2 and fast[1].bandwidth_gbs == 1024
    cpu = parse_gpu_spec("cpu:64GiB:bw=90,cpu:32GiB")
    assert [(c.kind, c.total_bytes, c.bandwidth_gbs) for c in cpu] == [("cpu", 56 * GiB, 90), ("cpu", 24 * GiB,
                                                                                              CPU_BANDWIDTH)]
    for bad, msg in [("16GiB:fast", "unknown flag"), ("lots", "not a size"), ("cpu", "--host-ram"), ("", "empty"),
                     ("16GiB:bw=quick", "not a bandwidth"), ("cpu:64GiB:bw=0", "positive"),
                     ("cpu:64GiB:32GiB", "cpu\\[:SIZE\\]")]:
        with pytest.raises(ValueError, match=msg):
            parse_gpu_spec(bad)


def test_preset_files() -> None:
    speed, context = load_preset("speed"), load_preset("context")
    assert (speed.objective, speed.ctx, speed.expert_streaming) == ("speed", 32768, "never")
    assert (context.objective, context.ctx, context.expert_streaming) == ("context", None, "auto")
    assert context.expert_cache == 2 * GiB and speed.desktop_headroom == 3 * GiB // 2
    with pytest.raises(PresetError, match="is a host profile"):
        load_preset("gfx906-workstation")
    with pytest.raises(PresetError, match="known: context, gfx906-workstation"):
        load_preset("turbo")


def test_a_key_no_preset_or_host_profile_takes_is_refused_by_name(tmp_path: Path) -> None:
    """A misspelt knob must not quietly plan with the default."""
    typo = tmp_path / "mine.toml"
    typo.write_text('objective = "speed"\nprefil_chunk = 2048\n')
    with pytest.raises(PresetError, match="preset mine: unknown key 'prefil_chunk' \\(did you mean 'prefill_chunk'"):
        load_preset(str(typo))
    odd = tmp_path / "odd.toml"
    odd.write_text('objective = "speed"\nturbo_mode = true\n')
    with pytest.raises(PresetError, match="unknown key 'turbo_mode'; known keys: activation_factor, ctx"):
        load_preset(str(odd))
    host = tmp_path / "box.toml"
    host.write_text('kind = "host"\ngpus = "24GiB"\nhost_rams = "64GiB"\n')
    with pytest.raises(PresetError, match="host profile box.toml: unknown key 'host_rams' \\(did you mean 'host_ram'"):
        load_host_profile(str(host))
    # every shipped file uses only known keys
    for shipped in sorted((Path(__file__).parent.parent / "ds4station" / "presets").glob("*.toml")):
        (load_host_profile if is_host_profile(str(shipped)) else load_preset)(str(shipped))


# ---- the plan command --------------------------------------------------------------------------------------------
def _run_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    plan_cmd.add_arguments(p)
    rc = plan_cmd.run(p.parse_args(list(argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_command_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_plan(capsys, "--shape", "flash-q2", "--gpus", "32GiB,16GiB:desktop,16GiBx4",
                           "--host-ram", "96GiB", "--preset", "context", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["preset"] == "context" and d["ctx"] == 544_768
    assert parse_route(d["route"], 43).stages[0].last_layer == 13
    assert (d["sessions"], d["prefill_chunk"], d["rollback"], d["kv_dtype"]) == (1, 1024, 1024, "f32")
    keys = {"device", "first_layer", "last_layer", "embed", "output", "weights_bytes", "kv_bytes",
            "expert_cache_bytes", "predicted_bytes", "available_bytes"}
    assert all(keys <= set(s) for s in d["stages"])
    assert all(s["predicted_bytes"] <= s["available_bytes"] for s in d["stages"])


def test_plan_command_text_profile_ctx_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_plan(capsys, "--gpus", "gfx906-workstation", "--preset", "context", "--ctx", "1M",
                           "--expert-cache", "2GiB")
    assert rc == 0 and "context 1048576 tokens" in out and "cache=2GiB" in out
    rc, _, err = _run_plan(capsys, "--gpus", "16GiB")
    assert rc == 1 and "short by" in err
    with pytest.raises(SystemExit) as exit_:
        _run_plan(capsys, "--gpus", "16GiB", "--ctx", "lots")
    assert exit_.value.code == 2 and "--ctx: not a token count: 'lots'" in capsys.readouterr().err


def test_plan_command_auto_without_gpus(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds4station.hardware.nvidia.load_nvml", lambda: None)
    rc, _, err = _run_plan(capsys, "--sysfs-root", str(tmp_path))
    assert rc == 1 and "no GPU found" in err
    rc, out, _ = _run_plan(capsys, "--sysfs-root", str(HOST2_TREE), "--host-ram", "128GiB", "--json")
    assert rc == 0 and json.loads(out)["route"].startswith("0000:03:00.0=embed,0-")


def test_plan_command_reads_the_tensor_table_of_a_gguf(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ds4station.engine.demo import make_model

    path = make_model(tmp_path / "tiny.gguf", seed=3)
    rc, out, _ = _run_plan(capsys, "--model", str(path), "--gpus", "2GiB,2GiB", "--preset", "context", "--json")
    assert rc == 0
    from_file = json.loads(out)
    rc, out, _ = _run_plan(capsys, "--shape", "tiny-q2", "--gpus", "2GiB,2GiB", "--preset", "context", "--json")
    from_shape = json.loads(out)
    assert from_file["model"] == "tiny.gguf" and from_file["ctx"] == 4096
    assert from_file["stages"] == from_shape["stages"] and from_file["route"] == from_shape["route"]
    rc, _, err = _run_plan(capsys, "--model", str(tmp_path / "missing.gguf"), "--gpus", "2GiB")
    assert rc == 2 and "no such file" in err
