"""The scheduler on the real tiny model (CPU): live-KV prefix reuse and its policy, cancellation, the bounded
queue, sampling, stop strings, determinism, and forced tool calls written by the ToolCallGuide."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds4station.engine import chat
from ds4station.engine.demo import make_model
from ds4station.engine.sampler import SamplingParams as Sampling
from ds4station.engine.scheduler import (
    SHUTTING_DOWN,
    Finished,
    Job,
    LiveSession,
    NotReady,
    Prefill,
    QueueFull,
    Scheduler,
    SessionPool,
    Text,
    Timings,
)
from ds4station.server.toolguide import ToolCallGuide

CTX = 1024


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    from ds4station.engine.engine import Engine

    path = make_model(tmp_path_factory.mktemp("model") / "tiny.gguf", preset="tiny", seed=0, quant="q2")
    return Engine.load(path, ctx=CTX, device="cpu", sessions=8, rollback=512)


def _scheduler(engine, **kw) -> Scheduler:
    s = Scheduler(lambda: engine, ctx=CTX, owns_engine=False, **kw).start()
    assert s.ready.wait(30) and s.state == "ready", s.error
    return s


@pytest.fixture
def make_scheduler(engine) -> Iterator:
    made: list[Scheduler] = []

    def make(**kw) -> Scheduler:
        made.append(_scheduler(engine, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def prompt(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return [tok.bos_id, *tok.encode(text)]


def run(scheduler: Scheduler, *jobs: Job) -> list[tuple[str, Finished]]:
    """Submit jobs one after the other; each one's text and Finished event."""
    async def go() -> list[tuple[str, Finished]]:
        out = []
        for job in jobs:
            handle = scheduler.submit(job)
            text = []
            async for ev in handle.events():
                if isinstance(ev, Text):
                    text.append(ev.text)
            assert handle.finished is not None
            out.append(("".join(text), handle.finished))
        return out

    return asyncio.run(go())


def greedy(p: list[int], n: int = 6, **kw) -> Job:
    return Job(prompt=p, max_tokens=n, sampling=Sampling(temperature=0.0), **kw)


def test_timings_are_llama_cpp_shaped() -> None:
    t = Timings(cache_n=10, prompt_n=20, prompt_ms=100.0, predicted_n=5, predicted_ms=50.0).as_dict()
    assert t["prompt_per_second"] == 200.0 and t["predicted_per_second"] == 100.0
    assert {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"} <= set(t)


# ---- live KV sessions -------------------------------------------------------------------------------------
def test_prefix_reuse_and_interleaved_request_keeps_the_session(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=2)
    p1 = prompt(engine, "The quick brown fox jumps over the lazy dog.")
    (_, f1), = run(s, greedy(p1))
    assert f1.cached_tokens == 0 and f1.timings.prompt_n == len(p1)
    assert f1.reuse is not None and (f1.reuse.outcome, f1.reuse.why) == ("miss", "no live session")
    p2 = p1 + engine.tokenizer.encode(" A station is a place")
    (_, f2), = run(s, greedy(p2))
    assert f2.cached_tokens >= len(p1)
    assert f2.timings.prompt_n == len(p2) - f2.cached_tokens
    assert f2.reuse is not None and f2.reuse.outcome == "hit"
    # an unrelated request takes the free slot instead of destroying the first conversation's KV
    (_, fq), = run(s, greedy(prompt(engine, "def fibonacci(n: int) -> int:")))
    assert fq.cached_tokens <= 1
    assert len(s.pool.slots) == 2
    assert fq.reuse is not None and "a free slot" in fq.reuse.why
    p3 = p2 + engine.tokenizer.encode(" where trains stop")
    (_, f3), = run(s, greedy(p3))
    assert f3.cached_tokens >= len(p2)


def test_one_session_unrelated_request_evicts(engine, make_scheduler) -> None:
    """Negative control for the test above: with a single slot the interleaved request must take it."""
    s = make_scheduler(sessions=1)
    p1 = prompt(engine, "The quick brown fox jumps over the lazy dog.")
    run(s, greedy(p1))
    run(s, greedy(prompt(engine, "def fibonacci(n: int) -> int:")))
    (_, f), = run(s, greedy(p1 + engine.tokenizer.encode(" A station")))
    assert f.cached_tokens < len(p1)


def test_rollback_beyond_the_engine_bound_falls_back_to_a_fresh_prefill(engine, make_scheduler) -> None:
    from ds4station.engine.tokenizer import DEMO_CORPUS

    s = make_scheduler(sessions=1)
    long = prompt(engine, DEMO_CORPUS)
    bound = max(s.pool.engine.chunk, s.pool.engine.rollback)  # what a slot can roll back
    assert len(long) > bound + 40, "the corpus must be longer than the rollback bound"
    run(s, greedy(long, 1))
    edited = long[:20] + engine.tokenizer.encode(" something else entirely")
    (out, f), = run(s, greedy(edited, 4))
    assert f.cached_tokens == 0 and s.pool.resets == 1  # truncate(20) was refused: re-prefilled from scratch
    assert f.reuse is not None and f.reuse.outcome == "reset" and "cannot roll back" in f.reuse.why
    assert "the least recently used session was taken" in f.reuse.why and "that slot started again" in f.reuse.why
    assert f.reuse.discarded > bound
    (fresh, _), = run(make_scheduler(sessions=1), greedy(edited, 4))
    assert out == fresh


def test_a_session_that_cannot_roll_back_is_kept_for_the_prompt_that_continues_it(tmp_path: Path) -> None:
    """An agent's side request edits its conversation further back than the rollback allows: it is prefilled
    in another slot, and the conversation's session stays whole for the agent's next main request (Claude
    Code's pattern: two requests per turn, the second diverging ~2K tokens before the end)."""
    from ds4station.engine.engine import Engine
    from ds4station.engine.tokenizer import DEMO_CORPUS

    path = make_model(tmp_path / "tiny.gguf", preset="tiny", seed=0, quant="q2")
    small = Engine.load(path, ctx=CTX, device="cpu", sessions=2, rollback=64, chunk=64)  # rolls back 64 at most
    try:
        main = prompt(small, DEMO_CORPUS)
        side = main[:-100] + small.tokenizer.encode(" a side question")  # keeps most of it, but 100 back
        assert len(main) - 100 > 100 + 2, "an edit that keeps more than it rolls back"
        s = _scheduler(small, sessions=2)
        try:
            run(s, greedy(main, 2))
            (_, f), = run(s, greedy(side, 2))
            assert f.reuse is not None and f.reuse.outcome == "reset" and "the live session kept" in f.reuse.why
            (_, again), = run(s, greedy(main, 2))  # the main conversation again: its session is still whole
            assert again.reuse is not None and again.reuse.outcome == "hit" and again.cached_tokens == len(main) - 1
        finally:
            s.stop()
        one = _scheduler(small, sessions=1)  # with a single slot there is nowhere else to go
        try:
            run(one, greedy(main, 2))
            (_, f1), = run(one, greedy(side, 2))
            assert f1.reuse is not None and "its only slot started again" in f1.reuse.why
        finally:
            one.stop()
    finally:
        small.close()


def test_the_next_turn_reuses_the_whole_prompt_after_an_answer_beyond_the_rollback(tmp_path: Path) -> None:
    """Turn 1's answer runs further than the rollback reaches; the client sends turn 2 with that answer
    changed (its reasoning dropped, say): the session goes back to its prompt checkpoint and turn 2 reuses
    all of turn 1's prompt, and its tokens are the ones a fresh prefill gives."""
    from ds4station.engine.engine import Engine
    from ds4station.engine.tokenizer import DEMO_CORPUS

    path = make_model(tmp_path / "tiny.gguf", preset="tiny", seed=0, quant="q2")
    small = Engine.load(path, ctx=CTX, device="cpu", sessions=2, rollback=64, chunk=64)
    try:
        turn1 = prompt(small, DEMO_CORPUS[:600])
        s = _scheduler(small, sessions=1)
        try:
            run(s, greedy(turn1, 150))  # 150 tokens of answer: more than the 64 the rings can roll back
            turn2 = turn1 + small.tokenizer.encode(" the answer, shortened by the client. And next?")
            (out, f), = run(s, greedy(turn2, 4))
            assert f.reuse is not None and f.reuse.outcome == "hit" and "prompt checkpoint" in f.reuse.why
            assert f.cached_tokens == len(turn1) and s.pool.resets == 0
            assert s.status()["sessions"]["checkpoint_hits"] == 1
        finally:
            s.stop()
        fresh = _scheduler(small, sessions=1)
        try:
            (want, f0), = run(fresh, greedy(turn2, 4))
            assert f0.cached_tokens == 0 and out == want
        finally:
            fresh.stop()
    finally:
        small.close()


def test_reused_prefix_gives_the_same_output_as_a_fresh_prefill(engine, make_scheduler) -> None:
    p1 = prompt(engine, "Hello, world! How are you today?")
    p2 = p1 + engine.tokenizer.encode(" I am fine, thank you.")
    warm = make_scheduler(sessions=1)
    run(warm, greedy(p1, 2))
    (reused, f_reused), = run(warm, greedy(p2, 8))
    assert f_reused.cached_tokens >= len(p1)
    (fresh, f_fresh), = run(make_scheduler(sessions=1), greedy(p2, 8))
    assert f_fresh.cached_tokens == 0
    assert reused == fresh


def test_the_live_kv_holds_the_turn_as_the_next_prompt_spells_it(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=1)
    p = prompt(engine, "Numbers such as 1, 12, 123")
    (text, f), = run(s, Job(prompt=p, max_tokens=12, sampling=Sampling(temperature=1.0, seed=3)))
    tok = engine.tokenizer
    assert s.wait_idle(30)
    held = s.pool.slots[0].tokens
    assert held[:len(p)] == p and len(held) > len(p) + 1
    assert tok.decode(held[len(p):]).startswith(text)  # the canonical tokens of what was generated
    assert held[len(p):] == tok.encode(tok.decode(held[len(p):]))


def test_temperature_zero_is_deterministic(engine, make_scheduler) -> None:
    p = prompt(engine, "It is sunny and warm in the morning")
    a = run(make_scheduler(sessions=1), greedy(p, 10))[0][0]
    b = run(make_scheduler(sessions=1), greedy(p, 10))[0][0]
    assert a == b and a


def test_seeded_sampling_is_deterministic(engine, make_scheduler) -> None:
    p = prompt(engine, "It is sunny and warm in the morning")
    job = lambda: Job(prompt=p, max_tokens=10, sampling=Sampling(temperature=1.0, top_p=0.9, seed=11))  # noqa: E731
    s = make_scheduler(sessions=1)
    assert run(s, job())[0][0] == run(s, job())[0][0]


def test_stop_string_cuts_the_output(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=1)
    p = prompt(engine, "The model reads the prompt, thinks for a while")
    (full, f), = run(s, greedy(p, 16))
    assert f.reason == "length" and len(full) >= 4
    stop = full[2:4]
    (cut, f2), = run(s, greedy(p, 16, stop=[stop]))
    assert cut == full[:full.index(stop)]
    assert f2.reason == "stop" and f2.stop_string == stop


# ---- cancellation and the queue ---------------------------------------------------------------------------
def test_cancel_stops_within_one_decode_step(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=1)

    async def go() -> tuple[int, Finished]:
        handle = s.submit(Job(prompt=prompt(engine, "Hello"), max_tokens=500, sampling=Sampling(temperature=1.0)))
        seen = 0
        async for ev in handle.events():
            if isinstance(ev, Text):
                seen += ev.tokens
                if seen >= 2:
                    handle.cancel()
        assert handle.finished is not None
        return seen, handle.finished

    seen, fin = asyncio.run(go())
    assert fin.reason == "cancelled"
    # the flag is read before every step: at most the step in flight when it was set finishes
    assert fin.completion_tokens <= seen + 2
    assert s.status()["totals"]["cancelled"] == 1


def test_bounded_queue_refuses_with_retry_after(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=1, max_queue=1)

    async def go() -> tuple[list[Finished], list[QueueFull]]:
        handles, refused = [], []
        for _ in range(4):
            try:
                handles.append(s.submit(Job(prompt=prompt(engine, "Hello"), max_tokens=8,
                                            sampling=Sampling(temperature=0.0))))
            except QueueFull as e:
                refused.append(e)
        done = []
        for h in handles:
            async for _ in h.events():
                pass
            done.append(h.finished)
        return done, refused

    done, refused = asyncio.run(go())
    assert refused and all(e.retry_after >= 1 for e in refused)
    assert 1 <= len(done) <= 2 and all(f.reason == "length" for f in done)


async def _finished(handle) -> Finished:
    while not isinstance(event := await handle.next(), Finished):
        pass
    return event


def test_drain_ends_what_outlives_the_grace_period_with_an_error_and_refuses_new_work(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=1)
    eos = engine.tokenizer.eos_id

    async def go() -> tuple[Finished, Finished, float]:
        running = s.submit(Job(prompt=prompt(engine, "Hello"), max_tokens=5000, banned_tokens=[eos]))
        queued = s.submit(greedy(prompt(engine, "World"), 4))
        while not isinstance(await running.next(), Text):  # decoding now
            pass
        drain = threading.Thread(target=s.drain, args=(0.2,))
        t0 = time.monotonic()
        drain.start()
        fins = await _finished(running), await _finished(queued)
        await asyncio.to_thread(drain.join, 30)
        with pytest.raises(NotReady, match="shutting down"):
            s.submit(greedy(prompt(engine, "late")))
        return *fins, time.monotonic() - t0

    running, queued, took = asyncio.run(go())
    for fin in (running, queued):  # an error, so a stream says so, never "cancelled" (a normal end to a client)
        assert fin.reason == "error" and fin.error == SHUTTING_DOWN
    assert 0 < running.completion_tokens < 5000 and queued.completion_tokens == 0
    assert took < 10
    assert s.state == "stopping" and s.status()["totals"]["errors"] == 2


def test_drain_lets_work_that_fits_in_the_grace_period_finish(engine, make_scheduler) -> None:
    s = make_scheduler(sessions=1)

    async def go() -> list[Finished]:
        handles = [s.submit(greedy(prompt(engine, text), 6)) for text in ("Hello", "World")]
        drain = threading.Thread(target=s.drain, args=(60.0,))
        drain.start()
        fins = [await _finished(h) for h in handles]
        await asyncio.to_thread(drain.join, 30)
        assert not drain.is_alive()  # returned as soon as nothing was open, not after 60 s
        return fins

    assert [f.reason for f in asyncio.run(go())] == ["length", "length"]


# ---- forced tool calls -------------------------------------------------------------------------------------
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"}, "verbose": {"type": "boolean"}, "extra": {"type": "object"}},
    "required": ["city", "unit", "days", "verbose", "extra"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}


def _guided(engine, make_scheduler, tools: list[dict], seed: int, spare: int) -> tuple[str, Finished]:
    """A forced call with `spare` tokens beyond its structure's minimum (the values share them)."""
    tok = engine.tokenizer
    p = tok.encode(chat.render_prompt([{"role": "user", "content": "Weather?"}], None, False))
    max_tokens = ToolCallGuide(tok, tools, 10**6).min_tokens + spare
    guide = ToolCallGuide(tok, tools, max_tokens)
    (text, fin), = run(make_scheduler(sessions=1),
                       Job(prompt=p, max_tokens=max_tokens, sampling=Sampling(temperature=1.0, seed=seed),
                           stop_tokens={tok.eos_id}, guide=guide))
    return text, fin


def test_forced_call_is_well_formed_and_typed(engine, make_scheduler) -> None:
    text, fin = _guided(engine, make_scheduler, [WEATHER], seed=0, spare=12)
    assert fin.reason == "stop"
    _, content, calls = chat.parse_completion(text)
    assert content == "" and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    assert list(args) == ["city", "unit", "days", "verbose", "extra"]  # schema order
    assert isinstance(args["city"], str) and args["city"] and "<" not in args["city"]
    assert args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["verbose"], bool) and args["extra"] == {}
    assert isinstance(args["days"], int)
    # exactly what the reference renderer writes for these arguments, so a replayed or re-rendered turn agree
    assert text == chat.render_tool_calls(calls)


def test_forced_call_chooses_among_tools_and_fits_a_tight_budget(engine, make_scheduler) -> None:
    text, fin = _guided(engine, make_scheduler, [WEATHER, TIME], seed=5, spare=0)
    _, _, calls = chat.parse_completion(text)
    assert fin.reason == "stop" and len(calls) == 1
    assert calls[0]["function"]["name"] in ("get_weather", "get_time")
    json.loads(calls[0]["function"]["arguments"])


def test_forced_call_refuses_a_budget_below_its_structure(engine) -> None:
    with pytest.raises(ValueError, match="too small"):
        ToolCallGuide(engine.tokenizer, [WEATHER], 10)


def test_ready_means_the_request_loop_ran_and_left_nothing_behind(tmp_path) -> None:
    """Before ready the scheduler runs its own short requests through prefill, sampling and settling (first
    uses paid before the first client); they leave no live session, no statistics and no free KV slot lost."""
    from ds4station.engine.engine import Engine

    path = make_model(tmp_path / "tiny.gguf", preset="tiny", seed=0, quant="q2")
    engine = Engine.load(path, ctx=256, device="cpu", sessions=1)
    s = Scheduler(lambda: engine, ctx=256, sessions=1).start()
    try:
        assert s.ready.wait(30) and s.state == "ready", s.error
        assert next(engine._sids) == 3  # each warm-up request opened a session (ids 1 and 2)...
        st = s.status()
        # ...and forgotten
        assert st["sessions"]["live"] == [] and st["totals"]["requests"] == 0 and st["recent"] == []
        assert st["sessions"]["prefix_hits"] == st["sessions"]["prefix_misses"] == 0
        (text, fin), = run(s, Job(prompt=prompt(engine, "Hello"), max_tokens=4))  # the one slot is free again
        assert fin.reason in ("stop", "length") and s.status()["totals"]["requests"] == 1
    finally:
        s.stop()


def test_settling_waits_for_idle_and_never_delays_the_next_request(make_scheduler, engine, monkeypatch) -> None:
    """A finished turn is settled (its answer fed into the live KV) only when no request comes within
    SETTLE_GRACE: a request sent right after is served from the KV as it is; once idle, the turn is settled."""
    from ds4station.engine import scheduler as sched

    monkeypatch.setattr(sched, "SETTLE_GRACE", 1.0)  # long enough to look before it runs out, on any machine
    s = make_scheduler(sessions=2)
    p1 = prompt(engine, "The quick brown fox jumps over the lazy dog.")
    p2 = prompt(engine, "Something else entirely, sent right after.")

    async def back_to_back() -> list[Finished]:
        out = []
        for p in (p1, p2):
            handle = s.submit(greedy(p, 6))
            out += [ev async for ev in handle.events() if isinstance(ev, Finished)]
        return out

    first, _ = asyncio.run(back_to_back())
    live = next(x for x in s.pool.slots if x.tokens[:len(p1)] == p1)
    held = len(live.tokens)  # right after the second request: the first turn not settled yet...
    assert held == len(p1) + first.completion_tokens - 1 and live.unsettled is not None
    assert s.wait_idle(30)  # ...and settled once the worker had nothing else to do
    assert live.unsettled is None and len(live.tokens) >= held


def test_settling_goes_a_piece_at_a_time_and_yields_to_a_request(engine) -> None:
    """An idle worker settles a turn in pieces (of the prefill budget here), looking at the queue between them: a
    request that arrives meanwhile is taken after the piece in hand (eight long turns once held a request for
    12 s); the pieces end where settling it in one go ends."""
    tok = engine.tokenizer
    p = prompt(engine, "The quick brown fox")
    # the answer as a model may sample it: one token per character, not the tokenizer's own split of its text
    outputs = [t for ch in tok.decode(tok.encode(" jumps over the lazy dog, twice.")) for t in tok.encode(ch)]
    canon = tok.encode(tok.decode(outputs))
    same = next(i for i, (a, b) in enumerate(zip(canon, outputs, strict=False)) if a != b)
    assert len(canon) < len(outputs) - 6 and len(canon) - same > 6  # several pieces of 3

    s = Scheduler(lambda: engine, ctx=CTX, owns_engine=False, sessions=2, prefill_budget=3)  # not started:
    s._load()  # the test is the worker
    one_go, pieces = s.pool._fresh(), s.pool._fresh()
    for live in (one_go, pieces):
        live.session.extend(p + outputs[:-1])  # the last sampled token is not in the KV yet
        live.unsettled = (len(p), outputs)
    s._settle_turn(one_go)
    assert one_go.unsettled is None and one_go.tokens == p + canon

    grown: list[int] = []
    settle = s._settle

    def spy(session, *args, **kw):
        before = len(session.tokens)
        done = settle(session, *args, **kw)
        grown.append(len(session.tokens) - before)
        if len(grown) == 2:
            s._queue.put("a request")  # arrives during the second piece
        return done

    s._settle = spy
    assert s._next() == "a request"  # taken after the second piece, the turn not settled yet
    assert len(grown) == 2 and pieces.unsettled is not None
    while pieces.unsettled is not None:  # the worker idle again: the rest, piece by piece
        s._settle_turn(pieces, limit=s.prefill_budget)
    assert pieces.tokens == p + canon and len(grown) == -(-(len(canon) - same) // 3)
    assert grown[0] < 0 and all(0 < n <= 3 for n in grown[1:])  # the first one rolled the KV back to `same`
    for live in (one_go, pieces):
        s.pool.drop(live)


def test_a_request_continuing_an_unsettled_turn_settles_it_first(make_scheduler, engine, monkeypatch) -> None:
    """The next turn of a conversation, sent before SETTLE_GRACE ran out (a fast agent), reuses the whole
    previous turn as the prompt spells it, as it would after settling; one that spells the answer otherwise
    takes the KV as it is."""
    from ds4station.engine import scheduler as sched

    monkeypatch.setattr(sched, "SETTLE_GRACE", 5.0)  # never runs out during the test
    tok = engine.tokenizer
    p1 = prompt(engine, "The quick brown fox jumps over the lazy dog.")

    def conversation(follow) -> tuple[Finished, Finished]:  # two turns, the second sent at once
        s = make_scheduler(sessions=1)

        async def go() -> tuple[Finished, Finished]:
            done = []
            for p in (p1, None):
                handle = s.submit(greedy(p if p is not None else follow(done[0]), 8))
                done += [ev async for ev in handle.events() if isinstance(ev, Finished)]
            return done[0], done[1]

        return asyncio.run(go())

    def canon(fin: Finished) -> list[int]:
        return tok.encode(tok.decode(fin.output))

    first, second = conversation(lambda fin: p1 + canon(fin) + tok.encode(" and then"))
    assert second.cached_tokens == len(p1) + len(canon(first))
    # an edited answer: no settling for it, the KV's common prefix is reused as it is
    first, second = conversation(lambda fin: p1 + tok.encode(" Something else.") + tok.encode(" and then"))
    assert len(p1) <= second.cached_tokens < len(p1) + len(canon(first))


class _QueuedSteps:
    """The CPU engine, presented as one whose steps are queued (what a local CUDA stage is): the decode loop
    then feeds each sampled token before making its text (tests the loop's order; CPU steps still block)."""

    queues_steps = True

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


@pytest.mark.parametrize("ahead", [False, True], ids=["queued", "ahead"])
def test_overlapped_decode_matches_the_plain_loop(engine, ahead: bool) -> None:
    """An engine whose steps are queued: each sampled token is fed before its text is made ("queued"), or with
    `look_ahead` (a lone CUDA stage's default: `decodes_ahead`) each decode step is queued with the tokens it
    feeds still where they were picked, before the host reads them ("ahead"). Same texts, tokens, stop
    reasons as the plain loop, greedy and seeded sampling, for every way a request ends (a stop token or a
    stop string found after the next step was queued leaves a token in the KV that settling rolls back: the
    next turn still reuses the whole conversation)."""
    assert engine.queues_steps is False  # a CPU stage blocks: nothing to overlap
    assert engine.decodes_ahead is False
    plain = _scheduler(engine, sessions=1)
    queued = Scheduler(lambda: _QueuedSteps(engine), ctx=CTX, owns_engine=False, sessions=1,
                       look_ahead=ahead).start()
    assert queued.ready.wait(30) and queued.state == "ready", queued.error
    try:
        p = prompt(engine, "The quick brown fox jumps over the lazy dog.")
        (text, ref), = run(plain, greedy(p, 12))
        stop_token = ref.output[4]
        stop_string = text[len(text) // 2:][:3]
        sampled = Job(prompt=p, max_tokens=12, sampling=Sampling(temperature=0.9, top_p=0.95, seed=7))
        cases = [greedy(p, 12), greedy(p, 12, stop_tokens={stop_token}), greedy(p, 12, stop_tokens={ref.output[1]}),
                 greedy(p, 12, stop=[stop_string]), greedy(p, 1), greedy(p, 2), sampled]
        for job in cases:  # each run gets its own copy (a Job is consumed)
            (want_text, want), = run(plain, dataclasses.replace(job))
            (got_text, got), = run(queued, dataclasses.replace(job))
            assert (got_text, got.reason, got.output, got.stop_string) == \
                (want_text, want.reason, want.output, want.stop_string)
            # the next turn (this answer + more) reuses the whole conversation in both, once settled
            follow = p + got.output[:got.completion_tokens - (got.reason == "stop" and got.stop_string is None)]
            follow += engine.tokenizer.encode(" and then")
            time.sleep(0.2)  # past SETTLE_GRACE: the turn is settled
            (_, fw), = run(plain, greedy(follow, 2))
            (_, fq), = run(queued, greedy(follow, 2))
            assert fq.cached_tokens == fw.cached_tokens >= len(p)
        assert ref.reason == "length"
        ahead_steps = [r for r in queued.steps if r.ahead]
        assert bool(ahead_steps) == ahead and queued.batch_totals["ahead_steps"] == len(ahead_steps)
        assert not any(r.ahead for r in plain.steps)
    finally:
        plain.stop()
        queued.stop()


# ---- many requests at once (continuous batching) -------------------------------------------------------
def run_together(scheduler: Scheduler, *jobs: Job, gap: float = 0.0) -> list[tuple[str, Finished]]:
    """Submit jobs at once (or `gap` seconds apart) and collect them concurrently."""
    async def go() -> list[tuple[str, Finished]]:
        async def one(job: Job, delay: float) -> tuple[str, Finished]:
            await asyncio.sleep(delay)
            handle = scheduler.submit(job)
            text = [ev.text async for ev in handle.events() if isinstance(ev, Text)]
            assert handle.finished is not None
            return "".join(text), handle.finished

        return list(await asyncio.gather(*(one(job, i * gap) for i, job in enumerate(jobs))))

    return asyncio.run(go())


def _batch_jobs(engine) -> list[Job]:
    texts = ["The quick brown fox jumps over the lazy dog.", "def fibonacci(n: int) -> int:",
             "A station is a place where trains stop", "Once upon a time"]
    jobs = [greedy(prompt(engine, t), 16) for t in texts[:2]]
    jobs += [Job(prompt=prompt(engine, t), max_tokens=16, sampling=Sampling(temperature=0.9, top_p=0.95, seed=11 + i))
             for i, t in enumerate(texts[2:])]
    jobs[1].stop_tokens = {engine.tokenizer.eos_id}
    return jobs


def test_batched_decode_gives_each_request_the_tokens_it_gets_alone(engine, make_scheduler, monkeypatch) -> None:
    """Four requests at once (two greedy, two sampled with their own seeds) decode in shared steps, and each
    gets exactly the text and tokens it gets when it runs alone; a step's tokens, greedy and sampled, are read
    from the device together (one wait for all of them)."""
    from ds4station.engine import scheduler as scheduler_module
    from ds4station.engine.sampler import host_ints

    alone = [run(make_scheduler(sessions=1), dataclasses.replace(job))[0] for job in _batch_jobs(engine)]
    reads: list[int] = []  # the picks each read took

    def counted(ts):  # noqa: ANN001, ANN202
        reads.append(len(ts))
        return host_ints(ts)

    monkeypatch.setattr(scheduler_module, "host_ints", counted)
    s = make_scheduler(sessions=4)
    together = run_together(s, *(dataclasses.replace(job) for job in _batch_jobs(engine)))
    assert max(reads) == 4
    assert [(t, f.output, f.reason) for t, f in together] == [(t, f.output, f.reason) for t, f in alone]
    assert max(len(r.decoded) for r in s.steps) == 4  # they really shared steps
    st = s.status()["batch"]
    assert st["limit"] == 4 and st["max_batch"] == 4 and st["mean_decode_batch"] > 1.5
    assert st["decode_rows"] == sum(len(r.decoded) for r in s.steps)


def test_decode_ahead_gives_each_request_the_tokens_it_gets_alone(engine, make_scheduler) -> None:
    """Four requests at once (greedy and seeded sampling, one ending at a stop token) with every decode step
    queued before its tokens are read: each gets the tokens it gets alone; steps that hold a prompt piece or a
    forced tool call's request run the usual way (they need the token before the next step), the rest ahead;
    the step log and /status say which."""
    alone = [run(make_scheduler(sessions=1), dataclasses.replace(job))[0] for job in _batch_jobs(engine)]
    s = make_scheduler(sessions=4, look_ahead=True)
    together = run_together(s, *(dataclasses.replace(job) for job in _batch_jobs(engine)))
    assert [(t, f.output, f.reason) for t, f in together] == [(t, f.output, f.reason) for t, f in alone]
    steps = s.status()["batch"]["step_log"]
    assert any(r["ahead"] and len(r["decoded"]) == 4 for r in steps)
    assert not any(r["ahead"] and r["prefilled"] for r in steps)
    assert s.status()["batch"]["ahead_steps"] == sum(r.ahead for r in s.steps) > 0
    # a forced tool call's request (its guide picks the next token's set from the token before) never steps ahead
    n = ToolCallGuide(engine.tokenizer, [WEATHER], 10**6).min_tokens + 12
    before = s.batch_totals["ahead_steps"]
    (_, f), = run(s, greedy(prompt(engine, "Weather?"), n, guide=ToolCallGuide(engine.tokenizer, [WEATHER], n)))
    assert f.completion_tokens > 4 and s.batch_totals["ahead_steps"] == before


def test_decode_ahead_is_the_default_on_a_lone_queueing_stage(engine, monkeypatch) -> None:
    """`decodes_ahead`: only where the stage queues its steps (a lone CUDA stage; faked here), by default, and
    not with DS4STATION_DECODE_AHEAD=0."""
    from ds4station.engine.engine import Engine

    monkeypatch.delenv("DS4STATION_DECODE_AHEAD", raising=False)
    assert engine.decodes_ahead is False  # the CPU stage does not queue its steps
    monkeypatch.setattr(Engine, "queues_steps", property(lambda self: True))
    assert engine.decodes_ahead is True
    monkeypatch.setenv("DS4STATION_DECODE_AHEAD", "0")
    assert engine.decodes_ahead is False
    monkeypatch.setenv("DS4STATION_DECODE_AHEAD", "1")
    assert engine.decodes_ahead is True
    monkeypatch.setattr(engine.runner, "mtp", object())  # the MTP layer records the ids: never ahead
    assert engine.decodes_ahead is False


def test_a_token_fed_from_the_device_is_resolved_or_read(engine) -> None:
    """Engine.decode_batch of a tensor of tokens: the step runs without the host reading them; each session's
    token is the value its caller resolves, or read when `tokens` is asked for first; a session with nothing
    pending refuses a value. Same logits as the step of host ints. /status (the HTTP thread, while the worker
    steps ahead) counts the pending token without reading it: reading it there left the worker's `resolve`
    nothing to resolve (H100, concurrent streams)."""
    import torch

    a, b, c, d = (engine.new_session() for _ in range(4))
    try:
        p = prompt(engine, "Once upon a time")
        for s in (a, b, c, d):
            s.extend(p)
        want = engine.decode_batch([a, b], [5, 9])
        got = engine.decode_batch([c, d], torch.tensor([5, 9]))
        assert torch.equal(got, want)
        pool = SessionPool(engine, 2)  # what /status describes
        pool.slots.append(LiveSession(c))
        assert pool.describe()[0]["tokens"] == c.length == len(a.tokens) and c._ahead is not None
        c.resolve(5)
        assert c.tokens == a.tokens and d.tokens == b.tokens  # d's read from the tensor
        with pytest.raises(RuntimeError, match="no token fed from the device"):
            c.resolve(5)
    finally:
        for s in (a, b, c, d):
            s.close()


def test_batch_limit_keeps_the_rest_waiting(engine, make_scheduler) -> None:
    """--batch 2 with four sessions: at most two requests in a step; the others wait in the queue and join as
    places free up, and all of them still get their own tokens."""
    alone = [run(make_scheduler(sessions=1), dataclasses.replace(job))[0] for job in _batch_jobs(engine)]
    s = make_scheduler(sessions=4, batch=2)
    together = run_together(s, *(dataclasses.replace(job) for job in _batch_jobs(engine)))
    assert [f.output for _, f in together] == [f.output for _, f in alone]
    assert max(len(r.decoded) for r in s.steps) == 2
    with pytest.raises(ValueError, match="batch 3: use 1 to 2"):
        Scheduler(lambda: engine, sessions=2, batch=3)
    with pytest.raises(ValueError, match="prefill budget 300: use 1 to the prefill chunk, 256"):
        Scheduler(lambda: engine, sessions=2, prefill_chunk=256, prefill_budget=300)


def test_a_long_prefill_is_interleaved_with_a_running_stream(engine, make_scheduler) -> None:
    """A long prompt arriving while a stream decodes is prefilled in budget-sized pieces between that stream's
    decode steps (the step log shows both in the same steps), and the stream's tokens are unchanged."""
    from ds4station.engine.tokenizer import DEMO_CORPUS

    stream = greedy(prompt(engine, "The quick brown fox jumps over the lazy dog."), 40)
    long = greedy(prompt(engine, DEMO_CORPUS)[:700], 4)
    (want_text, want), = run(make_scheduler(sessions=1), dataclasses.replace(stream))
    (_, long_alone), = run(make_scheduler(sessions=1), dataclasses.replace(long))
    s = make_scheduler(sessions=2, prefill_budget=64)
    jobs = dataclasses.replace(stream), dataclasses.replace(long)
    (text, got), (_, long_got) = run_together(s, *jobs, gap=0.15)
    assert (text, got.output) == (want_text, want.output)
    assert long_got.output == long_alone.output
    mixed = [r for r in s.steps if r.decoded == [jobs[0].id] and jobs[1].id in r.prefilled]
    assert len(mixed) >= 3, list(s.steps)
    assert all(n <= 64 for r in s.steps for n in r.prefilled.values())


def test_a_short_request_is_not_stuck_behind_a_long_prefill(engine, make_scheduler) -> None:
    """The shortest remaining prompt goes first within the budget: a short request that arrives during a long
    prefill gets its first token before the long prompt is done."""
    from ds4station.engine.tokenizer import DEMO_CORPUS

    s = make_scheduler(sessions=2, prefill_budget=32)
    long = greedy(prompt(engine, DEMO_CORPUS)[:900], 2)
    short = greedy(prompt(engine, "hi"), 2)
    (_, fl), (_, fs) = run_together(s, long, short, gap=0.1)
    assert fs.ttft_ms + 100 < fl.ttft_ms  # queued 100 ms later, first token well before the long one


def test_the_step_log_says_where_each_step_went(engine, make_scheduler) -> None:
    """/status lists the recent steps with their prefill and decode work and where the worker's time went
    (the parts within the step's total), and each recent request says how long it waited to be admitted."""
    s = make_scheduler(sessions=2, prefill_budget=8)
    run_together(s, *(dataclasses.replace(job) for job in _batch_jobs(engine)[:2]))
    st = s.status()
    steps = st["batch"]["step_log"]
    assert steps and len(steps) == min(len(s.steps), 64) and steps[-1]["step"] == st["batch"]["steps"]
    assert any(sum(r["prefilled"].values()) == 8 for r in steps)  # the budget split the prompts into pieces
    assert any(len(r["decoded"]) == 2 for r in steps)  # and both decoded in one step
    for r in steps:
        parts = r["wait_ms"] + r["prefill_ms"] + r["sample_ms"] + r["forward_ms"] + r["show_ms"]
        assert all(r[k] >= 0 for k in ("wait_ms", "prefill_ms", "sample_ms", "forward_ms", "show_ms"))
        assert parts <= r["total_ms"] + 0.01 and r["total_ms"] <= parts + 50  # the parts cover the step
    ats = [r["at"] for r in steps]
    assert ats == sorted(ats)
    assert st["batch"]["last_step"]["ms"] == steps[-1]["total_ms"]
    assert all(r["queue_ms"] >= 0 for r in st["recent"][-2:])


@pytest.mark.parametrize("queued", [False, True], ids=["blocking", "queued"])
def test_a_prompt_that_ends_takes_its_first_token_before_the_next_piece(engine, monkeypatch, queued: bool) -> None:
    """In the step where a short request's prompt ends, its first token is sampled and sent before the long
    prompt's piece of that step runs (also on an engine whose steps are queued: issuing a piece holds the
    host, 0.65 s on the H200 for 1,024 tokens, which held the first token's text back), so a request arriving
    during a long prefill waits for the piece already running, not also for the next one; and every running
    request's token is sampled and sent before the step's pieces are prefilled (here: the short request's
    later tokens)."""
    from ds4station.engine import scheduler as scheduler_module
    from ds4station.engine.tokenizer import DEMO_CORPUS

    log: list[tuple[str, int]] = []
    post, choose = scheduler_module.Handle._post, Scheduler._choose

    def logged_post(self, event) -> None:  # noqa: ANN001
        if isinstance(event, (Prefill, Text)):
            log.append((type(event).__name__.lower(), self.job.id))
        post(self, event)

    def logged_choose(self, stream, sampled) -> None:  # noqa: ANN001
        log.append(("choose", stream.job.id))
        choose(self, stream, sampled)

    monkeypatch.setattr(scheduler_module.Handle, "_post", logged_post)
    monkeypatch.setattr(Scheduler, "_choose", logged_choose)
    s = Scheduler(lambda: _QueuedSteps(engine) if queued else engine, ctx=CTX, owns_engine=False, sessions=2,
                  prefill_budget=32).start()
    assert s.ready.wait(30) and s.state == "ready", s.error
    try:
        long = greedy(prompt(engine, DEMO_CORPUS)[:700], 2)
        short = greedy(prompt(engine, "hi"), 6)
        run_together(s, long, short, gap=0.1)
    finally:
        s.stop()
    first = log.index(("prefill", short.id))  # the step its whole prompt went in
    after = log[first + 1:]
    nxt = after.index(("prefill", long.id))  # the long prompt's piece of that same step
    assert ("choose", short.id) in after[:nxt] and ("text", short.id) in after[:nxt], log
    # its next token, sampled while the long prompt still prefills, goes out before that step's piece too
    then = after[nxt + 1:]
    piece = then.index(("prefill", long.id))
    assert ("choose", short.id) in then[:piece] and ("text", short.id) in then[:piece], log
