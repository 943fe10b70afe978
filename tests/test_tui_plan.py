"""The plan the control panel edits (ds4station/tui/planning.py) on fake hardware: proposals, moved layer
boundaries with the fit recomputed, context and cache changes, refusals that say why, and serve arguments."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ds4station.hardware import detect
from ds4station.planner import evaluate, named_shape, parse_gpu_spec
from ds4station.planner.launch import read_launch
from ds4station.tui.app import plan_budgets
from ds4station.tui.planning import ModelChoice, PlanEditor, demo_model, serve_args
from ds4station.tui.telemetry import Throughput, bar, chart, spark, time_axis

HOST1 = Path(__file__).parent / "fixtures" / "sysfs" / "gfx906-workstation"
GiB = 1 << 30


@pytest.fixture(scope="module")
def flash_editor_budgets():  # type: ignore[no-untyped-def]
    return plan_budgets(detect(HOST1, use_nvml=False), 64 * GiB, "speed")


def test_cpu_only_machine_gets_a_cpu_route_for_the_demo_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ed = PlanEditor(demo_model(), plan_budgets([], 32 * GiB, "speed"), 32 * GiB)
    assert ed.fits and ed.plan is not None
    assert str(ed.plan.route) == "cpu=embed,0-5,output"
    assert ed.plan.ctx == 32768  # the speed preset's context (the demo model takes up to 131072)
    args = serve_args(ed.plan, ed.model, 8123, launch_dir=str(tmp_path))
    assert args == ["--host", "127.0.0.1", "--port", "8123", "--plan", str(tmp_path / "launch-8123.toml")]
    launch = read_launch(args[-1])  # the plan, as serve will run it: the demo model, the route, every size
    assert launch.model == "" and launch.route == "cpu=embed,0-5,output" and launch.ctx == 32768
    fs = ed.plan.footprint
    assert (launch.sessions, launch.prefill_chunk, launch.rollback) == (fs.sessions, fs.prefill_chunk, fs.rollback)


def test_budgets_order_matches_the_plan_command(flash_editor_budgets) -> None:  # type: ignore[no-untyped-def]
    # roomiest first: the 32 GiB MI50 (it holds embed/output), then the idle Radeon VIIs, the desktop card
    # (1.5 GiB headroom), and last the card another process fills with 15 GiB
    labels = [b.label for b in flash_editor_budgets]
    assert labels[0].startswith("AMD Instinct MI50") and len(labels) == 6
    room = [b.available() for b in flash_editor_budgets]
    assert room == sorted(room, reverse=True)
    assert flash_editor_budgets[-2].desktop is True and flash_editor_budgets[-1].device == "0000:09:00.0"


def test_moving_a_boundary_recomputes_the_fit_and_refuses_an_overfull_stage(flash_editor_budgets) -> None:  # type: ignore[no-untyped-def]
    ed = PlanEditor(ModelChoice("flash", named_shape("flash-q2")), flash_editor_budgets, 64 * GiB)
    assert ed.fits and ed.plan is not None
    before = ed.plan
    s0, s1 = before.stages[0], before.stages[1]
    ed.set_ctx(10**9)  # refused, and not made: a notice, the plan as it was, still launchable
    assert ed.notice is not None and ed.fits and ed.plan is before
    ed.move_boundary(0, -1)  # stage 0 gives its last layer to stage 1 (made: the notice goes)
    assert ed.notice is None
    assert ed.edited and ed.plan is not None
    a0, a1 = ed.plan.stages[0], ed.plan.stages[1]
    assert (a0.stage.last_layer, a1.stage.first_layer) == (s0.stage.last_layer - 1, s1.stage.first_layer - 1)
    # the recomputed fit is the planner's own accounting of the new route
    budgets = [a.budget for a in ed.plan.stages]
    settings = dataclasses.replace(ed.settings, footprint=ed.plan.footprint)  # the proposal's chunk (it fell back)
    assert ed.plan.footprint.prefill_chunk < ed.settings.footprint.prefill_chunk
    ref = evaluate(ed.model.shape, ed.plan.route, budgets, settings, ed.plan.ctx, 64 * GiB)
    assert [s.footprint.predicted_bytes for s in ed.plan.stages] == [s.footprint.predicted_bytes for s in ref.stages]
    assert a0.footprint.weights_bytes < s0.footprint.weights_bytes < a0.footprint.weights_bytes + 2 * GiB
    assert a1.footprint.predicted_bytes > s1.footprint.predicted_bytes
    # stage 1 (a 16 GiB card with ~1.5 GiB spare) cannot take a ~1.8 GiB layer: refused, and why
    assert not ed.fits and ed.refusal is not None and not ed.plan.stages[1].fits
    assert "stage 1" in ed.refusal and "short by" in ed.refusal and "GiB" in ed.refusal
    short = -ed.plan.stages[1].spare_bytes
    assert f"short by {short / GiB:.2f} GiB" in ed.refusal
    ed.move_boundary(0, +1)  # moved back: the proposal's split, which fits
    assert ed.fits and [s.footprint for s in ed.plan.stages] == [s.footprint for s in before.stages]
    ed.move_boundary(0, -1)
    ed.propose()  # r: back to the proposal
    assert ed.fits and not ed.edited and str(ed.plan.route) == str(before.route)


def test_a_small_model_is_not_spread_over_idle_cards(flash_editor_budgets) -> None:  # type: ignore[no-untyped-def]
    ed = PlanEditor(demo_model(), flash_editor_budgets, 64 * GiB)
    assert ed.plan is not None and ed.plan.layer_counts == [6]  # one card holds it: one stage
    assert any("the whole model fits on" in n for n in ed.plan.notes)
    # every card is accounted for: left out because it is not needed, or because it has no room
    reasons = {d.device: why for d, why in ed.plan.excluded}
    assert len(reasons) == len(flash_editor_budgets) - 1
    assert reasons["0000:09:00.0"].startswith("only 0.73 GiB available: 15.00 GiB in use by other processes")
    assert sum(why.startswith("not needed") for why in reasons.values()) == 4


def test_a_boundary_that_would_empty_a_stage_is_refused() -> None:
    ed = PlanEditor(demo_model(), parse_gpu_spec("1100MiBx6"), 64 * GiB)  # one layer per card: forced
    assert ed.plan is not None and ed.plan.layer_counts[1] == 1
    route = str(ed.plan.route)
    ed.move_boundary(0, +1)  # stage 0 would take stage 1's only layer
    assert ed.notice is not None and "stage 1" in ed.notice and "no layers" in ed.notice
    assert str(ed.plan.route) == route  # the plan is unchanged
    assert ed.fits and ed.refusal is None  # and still launchable: a refused edit blocks nothing
    cpu = PlanEditor(demo_model(), parse_gpu_spec("cpu", 32 * GiB), 32 * GiB)
    cpu.move_boundary(0, 1)
    assert cpu.notice is not None and "single stage" in cpu.notice and cpu.fits


def test_context_changes_recheck_the_route_and_refusals_say_what_would_help(flash_editor_budgets) -> None:  # type: ignore[no-untyped-def]
    ed = PlanEditor(ModelChoice("flash", named_shape("flash-q2")), flash_editor_budgets, 64 * GiB)
    assert ed.plan is not None and ed.plan.ctx == 32768
    ed.set_ctx(16384)
    assert ed.fits and ed.plan.ctx == 16384
    ed.set_ctx(65536)  # resident weights reach ~37K tokens on these cards
    assert not ed.fits and ed.plan is None
    assert "does not fit" in ed.refusal and "What would help" in ed.refusal  # type: ignore[operator]
    ed.set_expert_cache(2 * GiB)  # streaming the routed experts makes room
    assert ed.fits and ed.plan is not None and ed.plan.streaming and ed.plan.ctx == 65536
    ed.set_expert_cache(1 << 20)
    assert "minimum" in ed.notice  # type: ignore[operator]
    ed.set_ctx(10**9)
    assert "outside" in ed.notice  # type: ignore[operator]
    ed.set_preset("context")
    assert ed.fits and ed.preset == "context" and ed.plan.ctx > 32768


def test_multi_stage_routes_launch_through_the_launch_file(flash_editor_budgets, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ed = PlanEditor(ModelChoice("flash", named_shape("flash-q2"), "/models/flash.gguf"), flash_editor_budgets,
                    64 * GiB)
    assert ed.plan is not None and len(ed.plan.stages) > 1
    launch = read_launch(serve_args(ed.plan, ed.model, 1, launch_dir=str(tmp_path))[-1])
    assert launch.route == str(ed.plan.route) and launch.ctx == ed.plan.ctx


def test_spark_and_bar_scale_values() -> None:
    assert spark([0, 50, 100], 0, 100) == "▁▅█"
    assert spark([None, 1.0], 0, 1) == " █"
    assert spark([1, 2, 3, 4], width=2) == "▆█"
    assert bar(0.5, 4) == "██  " and bar(1.5, 3) == "███" and bar(0.0, 2) == "  "
    assert bar(0.5, 1) == "▌" and bar(1 / 32, 1) == " "  # half a cell; under half an eighth rounds to empty


def test_the_live_view_shows_the_expert_cache() -> None:
    from rich.console import Console

    from ds4station.tui.widgets.live_panel import live_view

    status = {"expert_cache": {"lookups": 40, "hits": 30, "misses": 10, "bytes_read": 10 * 7077888,
                               "gb_per_s": 12.5}, "kv": {"ctx": 4096}, "sessions": {}, "queue": {}}
    console = Console(width=120, record=True)
    console.print(live_view(status, Throughput(), []))
    text = console.export_text()
    assert "cache hit rate 75%, 10 misses, 0.07 GiB streamed at 12.5 GB/s" in text
    running = {"id": 4, "phase": "decode", "prefilled": 900, "generated": 120, "tokens_per_second": 21.5}
    console = Console(width=120, record=True)
    console.print(live_view({**status, "running": [running], "batch": {"limit": 2, "mean_decode_batch": 1.5}},
                            Throughput(), []))
    assert "running 1/2: #4 decode 120 tok 21.5/s; batch mean 1.5" in console.export_text()  # while it runs
    console = Console(width=160, record=True)
    batch = {"limit": 2, "mean_decode_batch": 1.5, "decode_steps": 200, "ahead_steps": 190}
    console.print(live_view({**status, "running": [running], "batch": batch}, Throughput(), []))
    assert "batch mean 1.5, 95% of steps ahead" in console.export_text()  # decode steps queued before their tokens
    sessions = {"capacity": 2, "live": [], "prefix_hits": 7, "prefix_misses": 3, "checkpoint_hits": 2,
                "disk": {"hits": 1, "entries": 4, "used_bytes": 3 * 2**29}}
    console = Console(width=80, record=True)
    console.print(live_view({**status, "sessions": sessions}, Throughput(), []))
    text = console.export_text()
    assert "sessions 0/2; reused 7/10" in text
    assert "reuse   prompt checkpoints 2, disk 1 (4 saved, 1.50 GiB)" in text
    draft = {"source": "lookup", "drafted": 40, "accepted": 30, "tokens_per_verify": 3.5}
    console = Console(width=120, record=True)
    console.print(live_view({**status, "running": [running], "batch": {"limit": 2}, "draft": draft},
                            Throughput(), []))
    assert "running 1/2: #4 decode 120 tok 21.5/s; drafts 30/40 accepted, 3.50 tok per verify" \
        in console.export_text()


def test_charts_over_a_time_axis() -> None:
    now = 10_000.0
    # one point every 2 s over the last two minutes, rising 0..60: 30 columns of 4 s each
    points = [(now - 120 + 2 * i, float(i)) for i in range(61)]
    rows = chart(points, now, 30, height=2)
    assert len(rows) == 2 and all(len(r) == 30 for r in rows)
    assert rows[0][-1] == "█" and rows[1][-1] == "█"  # the latest, the top of the scale, is the last column
    assert rows[0][0] == " " and rows[1][1] in "▁▂"  # the oldest are low; the first column has no point
    assert rows[1].index("█") == 14  # column 14's point (29 of 60) rounds to half the height: the bottom row full
    gap = chart([(now - 60, 5.0), (now - 59, None), (now, 5.0)], now, 12, height=1)[0]
    assert gap == "      █    █"  # 10 s a column: a column without a point is blank; equal values fill the scale
    assert chart([(now - 500, 9.0)], now, 8, 1) == ["        "]  # older than the span: not shown
    # a request's rate and the idle refresh after it in one column: the column keeps the rate
    assert chart([(now - 3.0, 80.0), (now - 2.0, 0.0), (now, 0.0)], now, 10, 1)[0][-1] == "█"
    axis = time_axis(40)
    assert axis.startswith("-2m") and axis.endswith("now") and axis[19:23].strip() == "-1m" and len(axis) == 40
    assert time_axis(30, 90).split() == ["-90s", "-45s", "now"]


def test_throughput_over_time_follows_the_running_request() -> None:
    tp = Throughput()
    tp.add(100.0, None)  # no server: nothing
    tp.add(101.0, {"running": [{"phase": "prefill", "tokens_per_second": 900.0}]})
    tp.add(102.0, {"running": [{"phase": "decode", "tokens_per_second": 30.0}]})
    done = {"id": 1, "finished_at": 102.5, "prompt_per_second": 850.0, "predicted_per_second": 29.0}
    tp.add(103.0, {"running": []}, [done])  # finished between two refreshes: at its own time
    tp.add(104.0, {"running": []})  # idle
    assert list(tp.prefill) == [(101.0, 900.0), (102.0, 0.0), (102.5, 850.0), (104.0, 0.0)]
    assert list(tp.decode) == [(101.0, 0.0), (102.0, 30.0), (102.5, 29.0), (104.0, 0.0)]


def test_dropping_a_card_re_proposes_without_it_and_adding_it_back(flash_editor_budgets) -> None:  # type: ignore[no-untyped-def]
    ed = PlanEditor(demo_model(), flash_editor_budgets, 64 * GiB)  # the demo: one card of the six
    assert ed.plan is not None
    used = [s.budget.device for s in ed.plan.stages]
    drop = used[-1]
    ed.set_dropped({drop})
    assert ed.plan is not None and drop not in [s.budget.device for s in ed.plan.stages]
    assert (drop, "dropped here (the plan's Cards list adds it back)") in [(d.device, why) for d, why in
                                                                          ed.plan.excluded]
    ed.set_dropped(set())
    assert [s.budget.device for s in ed.plan.stages] == used
    before = ed.plan
    ed.set_dropped({b.device for b in flash_editor_budgets})  # every card: refused, nothing changes
    assert ed.plan is before and ed.notice == "at least one device must stay in the route"
    ed.set_dropped({"0000:ff:00.0"})
    assert ed.plan is before and ed.notice is not None and "no such device" in ed.notice


def test_client_snippets_are_valid_as_printed() -> None:
    import json
    import shlex

    import tomllib

    from ds4station.tui.widgets.server_panel import client_snippets

    key = "k3y with 'quotes' & $dollars"
    s = client_snippets("http://127.0.0.1:8123", "DeepSeek-V4-Flash q2", key)
    oc = json.loads(s["opencode"])
    provider = oc["provider"]["ds4"]
    assert provider["options"] == {"baseURL": "http://127.0.0.1:8123/v1", "apiKey": key}
    assert oc["model"] == "ds4/DeepSeek-V4-Flash q2" and "DeepSeek-V4-Flash q2" in provider["models"]
    words = shlex.split(s["Claude Code"])
    assert words[-1] == "claude" and dict(w.split("=", 1) for w in words[:-1]) == {
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:8123", "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": "DeepSeek-V4-Flash q2"}
    codex = tomllib.loads(s["Codex"])
    assert codex["model"] == "DeepSeek-V4-Flash q2" and codex["model_provider"] == "ds4"
    assert codex["web_search"] == "disabled"  # Codex would send OpenAI's hosted web_search, which is refused
    assert codex["model_providers"]["ds4"] == {"name": "ds4station", "base_url": "http://127.0.0.1:8123/v1",
                                               "wire_api": "responses", "env_key": "DS4_API_KEY"}
    bare = client_snippets("http://h:1", "m", None)
    assert "apiKey" not in json.loads(bare["opencode"])["provider"]["ds4"]["options"]
    assert "env_key" not in tomllib.loads(bare["Codex"])["model_providers"]["ds4"]


def test_the_plan_names_cards_as_the_gpu_panel_numbers_them(flash_editor_budgets) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console

    from ds4station.tui.widgets.plan_view import plan_body

    ed = PlanEditor(ModelChoice("flash", named_shape("flash-q2"), "/f.gguf"), flash_editor_budgets, 64 * GiB)
    console = Console(width=200, record=True)
    console.print(plan_body(ed))
    text = console.export_text()
    # number (the GPU panel's #), name, short bus id, and the display mark on the desktop card
    assert "0 AMD Instinct MI50/MI60 (Vega 20) 03:00.0" in text and "1 AMD Radeon VII 06:00.0 ◆" in text
    assert "2 09:00.0: only 0.73 GiB available" in text  # left out, and why (by number and bus id)


def test_the_readme_s_client_setups_are_the_panel_s_snippets() -> None:
    """README's Claude Code / Codex / opencode setups are client_snippets' output (the settings tests/agents runs
    the real clients with) for serve's default address and the demo model, verbatim."""
    from ds4station.tui.widgets.server_panel import client_snippets

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    s = client_snippets("http://127.0.0.1:8000", "demo-q2-v2", None)
    assert f"```sh\n{s['Claude Code']} -p \"Say hello.\"\n```" in readme
    assert f"```toml\n{s['Codex']}\n```" in readme and f"```json\n{s['opencode']}\n```" in readme


def test_drafts_in_the_plan_count_the_mtp_layer_and_reach_the_launch_file(flash_editor_budgets, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The plan's drafts setting: "mtp" counts the model's MTP layer on the stage holding the output head (a
    hand-edited route is kept and re-checked) and the launch file runs serve --draft mtp; "lookup" costs
    nothing; a model without the layer refuses "mtp", and a change to such a model turns it off."""
    ed = PlanEditor(ModelChoice("flash", named_shape("flash-q2")), flash_editor_budgets, 64 * GiB)
    assert ed.fits and ed.plan is not None and ed.draft == "off"
    ed.move_boundary(0, -1)
    ed.move_boundary(0, 1)  # an edited route (the proposal's layers), kept through the drafts change
    before = ed.plan
    assert ed.edited and before.footprint.mtp is False
    ed.set_draft("mtp")
    assert ed.draft == "mtp" and ed.notice is None and ed.edited and ed.plan is not before
    head = next(i for i, s in enumerate(ed.plan.route.stages) if s.output)
    added = [a.footprint.predicted_bytes - b.footprint.predicted_bytes for a, b in zip(ed.plan.stages, before.stages,
                                                                                       strict=True)]
    assert ed.plan.footprint.mtp and ed.plan.stages[head].footprint.mtp_bytes > 1 * GiB
    assert added[head] >= ed.plan.stages[head].footprint.mtp_bytes and all(a == 0 for i, a in enumerate(added)
                                                                            if i != head)
    ed.model = dataclasses.replace(ed.model, path=str(tmp_path / "flash.gguf"))  # as if opened from its file
    launch = read_launch(serve_args(ed.plan, ed.model, 8124, launch_dir=str(tmp_path), draft=ed.draft)[-1])
    assert launch.draft == "mtp" and launch.route == str(ed.plan.route)
    ed.set_draft("lookup")  # no extra weights
    assert ed.draft == "lookup" and not ed.plan.footprint.mtp
    assert [s.footprint.predicted_bytes for s in ed.plan.stages] == [s.footprint.predicted_bytes for s in before.stages]
    assert read_launch(serve_args(ed.plan, ed.model, 8125, launch_dir=str(tmp_path), draft=ed.draft)[-1]).draft == \
        "lookup"
    ed.set_draft("mtp")
    ed.set_preset("context")  # a new preset keeps the drafts and counts the layer again
    assert ed.draft == "mtp" and ed.plan is not None and ed.plan.footprint.mtp
    ed.set_draft("fast")
    assert ed.draft == "mtp" and "use one of off, lookup, mtp" in (ed.notice or "")
    plain = ModelChoice("flash without MTP", dataclasses.replace(named_shape("flash-q2"), mtp_specs=()), "x.gguf")
    ed.set_model(plain)  # a file without the MTP layer: drafts off, said so
    assert ed.draft == "off" and not ed.plan.footprint.mtp and "no MTP layer" in (ed.notice or "")
    ed.set_draft("mtp")  # refused, nothing changes
    assert ed.draft == "off" and "no MTP layer" in (ed.notice or "") and not ed.plan.footprint.mtp
