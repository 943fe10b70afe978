"""Speculative decoding (issue 21, items 1-4 without the MTP head): prompt-lookup drafts (engine/draft.py),
the engine's verification forward (`Session.verify`, every position's logits, also through worker processes),
the acceptance rule (`Sampler.verify`: greedy exact, sampled by the standard rule, checked by a chi-square
test), and the scheduler's draft-and-verify decode on the tiny model: greedy output identical to plain decode
for every k, an oracle draft accepted whole, a garbage draft never, and the counters in timings, /status and
/metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ds4station.engine import scheduler as scheduler_module
from ds4station.engine.demo import make_model
from ds4station.engine.draft import LookupDrafter
from ds4station.engine.engine import Engine
from ds4station.engine.sampler import Sampler, SamplingParams, filtered_probs
from ds4station.engine.scheduler import Finished, Job, Scheduler

CTX, CHUNK = 1024, 64
# a prompt that repeats itself, so prompt lookup finds drafts; the tiny random model's output often loops too
PROMPT = [1] + [17, 23, 99, 5, 61, 7, 300, 42] * 6 + [17, 23, 99]
N_NEW = 40



@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("draft") / "tiny-q2.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    with Engine.load(model_path, CTX, device="cpu", chunk=CHUNK, sessions=2) as e:
        yield e


# ---- the draft source ---------------------------------------------------------------------------------------
def test_lookup_drafts_what_followed_the_longest_earlier_match() -> None:
    d = LookupDrafter(ngram=3)
    d.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert d.propose(2) == [4, 9]  # "1 2 3" occurred at the start: what followed it
    d.extend([7])
    assert d.propose(4) == []  # 7 never occurred before
    d.extend([2, 3])
    assert d.propose(3) == [7, 2, 3]  # "7 2 3" is new; "2 3" last occurred just before the 7
    whole = LookupDrafter(ngram=3)
    whole.extend(d.tokens)
    assert whole._last == d._last  # incremental indexing equals indexing at once
    assert LookupDrafter().propose(3) == [] and LookupDrafter(ngram=1).propose(1) == []
    with pytest.raises(ValueError):
        LookupDrafter(ngram=0)


# ---- the acceptance rule ------------------------------------------------------------------------------------
def test_greedy_verification_accepts_exactly_the_argmax() -> None:
    s = Sampler(SamplingParams(temperature=0.0))
    logits = torch.tensor([0.1, 2.0, 0.5, -1.0])
    assert s.verify(logits, 1) == (1, True)
    assert s.verify(logits, 2) == (1, False)


def test_sampled_verification_keeps_the_target_distribution() -> None:
    """Emitted tokens over 20,000 verifications of a fixed draft follow the target distribution: a chi-square
    test over 8 tokens (7 degrees of freedom) stays below 24.32, its critical value at significance 0.001;
    the acceptance rate is p(draft). Fixed seeds: the test is deterministic."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    logits = torch.tensor([1.0, 0.2, 2.1, -0.5, 0.7, 1.5, -2.0, 0.0])
    p = filtered_probs(logits, params)
    s = Sampler(params)
    trials, draft = 20000, 2
    counts = torch.zeros(8)
    accepted = 0
    for _ in range(trials):
        token, ok = s.verify(logits, draft)
        counts[token] += 1
        accepted += ok
    expected = p * trials
    seen = expected > 0
    assert counts[~seen].sum() == 0  # what top-p removed is never emitted
    chi2 = float((((counts - expected) ** 2)[seen] / expected[seen]).sum())
    assert chi2 < 24.32, (chi2, counts, expected)
    assert abs(accepted / trials - float(p[draft])) < 0.02


# ---- the verification forward -------------------------------------------------------------------------------
def test_verify_gives_every_positions_logits_as_extend_does(engine: Engine) -> None:
    a, b = engine.new_session(), engine.new_session()
    a.extend(PROMPT)
    b.extend(PROMPT)
    more = [5, 61, 7, 300]
    rows = a.verify(more)
    assert rows.shape == (4, engine.cfg.vocab_size) and len(a.tokens) == len(PROMPT) + 4
    for i, t in enumerate(more):
        one = b.extend([t])
        assert torch.allclose(rows[i], one, atol=1e-4 * one.abs().max().item(), rtol=0)
        assert int(rows[i].argmax()) == int(one.argmax())
    with pytest.raises(ValueError, match="exceeds the prefill chunk"):
        a.verify(list(range(5, 5 + CHUNK + 1)))
    a.close()
    b.close()


def test_verify_through_worker_processes(model_path: Path) -> None:
    route = "cpu=embed,0-2; cpu=3-5,output"
    with Engine.load(model_path, 256, route, activation_bits=32, chunk=CHUNK) as pipe, \
            Engine.load(model_path, 256, device="cpu", chunk=CHUNK) as one:
        a, b = pipe.new_session(), one.new_session()
        a.extend(PROMPT)
        b.extend(PROMPT)
        rows, want = a.verify([5, 61, 7]), b.verify([5, 61, 7])
        assert rows.shape == want.shape == (3, pipe.cfg.vocab_size)
        assert torch.allclose(rows, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    route = "cpu=embed,0-2,output; cpu=3-5"  # the head on rank 0: every position's state comes back
    with Engine.load(model_path, 256, route, activation_bits=32, chunk=CHUNK) as pipe:
        a = pipe.new_session()
        a.extend(PROMPT)
        assert torch.allclose(a.verify([5, 61, 7]), want, atol=1e-5 * want.abs().max().item(), rtol=0)


# ---- the scheduler's draft-and-verify decode ----------------------------------------------------------------
def generate(engine: Engine, prompt: list[int], n: int, sampling: SamplingParams | None = None,
             stop: list[str] | None = None, **kw) -> tuple[list[int], Finished, dict]:
    s = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1, **kw).start()
    assert s.ready.wait(60) and s.state == "ready", s.error

    async def go() -> Finished:
        handle = s.submit(Job(prompt=prompt, max_tokens=n, sampling=sampling or SamplingParams(temperature=0.0),
                              stop=stop or []))
        fin = None
        async for ev in handle.events():
            if isinstance(ev, Finished):
                fin = ev
        assert fin is not None and fin.reason in ("length", "stop"), fin
        return fin

    try:
        fin = asyncio.run(go())
        return fin.output, fin, s.status()["draft"]
    finally:
        s.stop()


@pytest.fixture(scope="module")
def plain(engine: Engine) -> list[int]:
    out, _, draft = generate(engine, PROMPT, N_NEW)
    assert draft["drafted"] == 0 and len(out) == N_NEW
    return out


@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_with_lookup_drafts_is_plain_decode(engine: Engine, plain: list[int], k: int) -> None:
    out, fin, draft = generate(engine, PROMPT, N_NEW, draft="lookup", draft_tokens=k)
    assert out == plain
    assert draft["steps"] > 0 and draft["drafted"] > 0  # the repeating prompt gave drafts
    assert fin.timings.draft_n == draft["drafted"] and fin.timings.draft_n_accepted == draft["accepted"]
    assert fin.timings.as_dict()["draft_n"] == draft["drafted"]


def test_a_lone_requests_verifications_are_decode_steps_of_the_step_log(engine: Engine) -> None:
    """One request drafting alone: each step that verified its drafts records it as decoded and verified (the
    step log, /status's batch counts), so its decode steps are counted whether or not they verify drafts."""
    s = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1, draft="lookup",
                  draft_tokens=3).start()
    try:
        assert s.ready.wait(60) and s.state == "ready", s.error

        job = Job(prompt=PROMPT, max_tokens=N_NEW, sampling=SamplingParams(temperature=0.0))

        async def go() -> None:
            async for _ in s.submit(job).events():
                pass

        asyncio.run(go())
        steps = [r for r in s.steps if r.decoded or r.prefilled]
        verified = [r for r in steps if r.verified]
        assert verified and all(r.verified == r.decoded == [job.id] for r in verified)
        status = s.status()
        assert len(verified) == status["draft"]["steps"] > 0
        assert status["batch"]["decode_steps"] == sum(1 for r in steps if r.decoded) >= len(verified)
        assert all(r.decoded for r in steps if not r.prefilled)  # every step after the prompt fed the request
    finally:
        s.stop()


class _Known:
    """A draft source that knows the greedy continuation: right (oracle) or always wrong (garbage)."""

    answer: list[int] = []
    wrong = False

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def propose(self, k: int) -> list[int]:
        done = len(self.tokens) - len(PROMPT)  # generated so far (the last one about to be fed)
        nxt = self.answer[done:done + k]
        return [(t + 1) % 512 for t in nxt] if self.wrong else nxt


@pytest.mark.parametrize("wrong", [False, True])
def test_an_oracle_draft_is_accepted_whole_and_garbage_never(engine: Engine, plain: list[int], wrong: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Known, "answer", plain)
    monkeypatch.setattr(_Known, "wrong", wrong)
    monkeypatch.setattr(scheduler_module, "LookupDrafter", _Known)
    k = 3
    out, fin, draft = generate(engine, PROMPT, N_NEW, draft="lookup", draft_tokens=k)
    assert out == plain
    if wrong:
        assert draft["drafted"] > 0 and draft["accepted"] == 0 and draft["tokens_per_verify"] == 1.0
    else:
        assert draft["accepted"] == draft["drafted"] > 0
        # the first token comes from the prompt; then each verification gives k + 1 (the last ones fewer)
        assert draft["steps"] <= -(-(N_NEW - 1) // (k + 1)) + 1 and draft["tokens_per_verify"] > k


def test_a_stop_string_inside_accepted_drafts_ends_the_output_there(engine: Engine, plain: list[int],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop string completed by a token in the middle of a verification's accepted drafts: the output ends
    as plain decoding's does (same tokens, same count), not with the rest of the step's tokens."""
    text = [engine.tokenizer.decode([t]) for t in plain]
    i = next(i for i in range(12, N_NEW - 8) if text[i].strip() and text[i] not in "".join(text[:i]))
    stop = [text[i]]
    want, want_fin, _ = generate(engine, PROMPT, N_NEW, stop=stop)
    assert want_fin.reason == "stop" and len(want) < N_NEW
    monkeypatch.setattr(_Known, "answer", plain)
    monkeypatch.setattr(_Known, "wrong", False)
    monkeypatch.setattr(scheduler_module, "LookupDrafter", _Known)
    got, fin, draft = generate(engine, PROMPT, N_NEW, stop=stop, draft="lookup", draft_tokens=4)
    assert draft["accepted"] > 0
    assert got == want and fin.completion_tokens == want_fin.completion_tokens and fin.stop_string == stop[0]


class _Fixed:
    """A draft source that always proposes one token (right or wrong by chance): sampled verification."""

    token = 0

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def propose(self, k: int) -> list[int]:
        return [self.token]


def test_sampled_tokens_at_drafted_positions_keep_plain_sampling_distribution(engine: Engine,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the scheduler, the second generated token (the first one a verification decides) of 240 seeded
    requests (temperature 0.3: the tiny random model's logits are flat) with a fixed draft, against 240
    without drafts: a two-sample chi-square test over the tokens seen at least 10 times in all (the rest
    pooled) stays below its critical value at significance 0.001 (measured: 11.0 at 11 degrees of freedom,
    critical 31.26)."""
    sampling = [SamplingParams(temperature=0.3, seed=s) for s in range(240)]
    prompt = [1] + [17, 23, 99, 5] * 3 + [42]

    def second_tokens(**kw) -> list[int]:  # type: ignore[no-untyped-def]
        s = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1, **kw).start()
        assert s.ready.wait(60)

        async def go() -> list[int]:
            out = []
            for p in sampling:
                fin = None
                # 3 tokens: the first from the prompt, the second decided by verifying the draft after it
                async for ev in s.submit(Job(prompt=prompt, max_tokens=3, sampling=p)).events():
                    fin = ev if isinstance(ev, Finished) else fin
                assert fin is not None and len(fin.output) == 3
                out.append(fin.output[1])
            return out

        try:
            return asyncio.run(go())
        finally:
            s.stop()

    plain = second_tokens()
    common = max(set(plain), key=plain.count)
    monkeypatch.setattr(_Fixed, "token", common)  # a draft the target often accepts, and often rejects
    monkeypatch.setattr(scheduler_module, "LookupDrafter", _Fixed)
    drafted = second_tokens(draft="lookup", draft_tokens=1)
    assert drafted != plain  # the verification drew from its own random stream
    cells = sorted(t for t in set(plain + drafted) if plain.count(t) + drafted.count(t) >= 10)
    a = [plain.count(t) for t in cells] + [sum(t not in cells for t in plain)]
    b = [drafted.count(t) for t in cells] + [sum(t not in cells for t in drafted)]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b, strict=True) if x + y)  # equal sample sizes
    dof = sum(1 for x, y in zip(a, b, strict=True) if x + y) - 1
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
                10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70, 16: 39.25}
    assert 1 <= dof <= 16, (dof, cells)
    assert chi2 < critical[dof], (chi2, dof, a, b)


def test_sampled_drafting_runs_and_counts(engine: Engine) -> None:
    out, fin, draft = generate(engine, PROMPT, N_NEW, SamplingParams(temperature=0.7, seed=5), draft="lookup")
    assert len(out) == N_NEW and fin.timings.draft_n == draft["drafted"]
    assert 0 <= draft["accepted"] <= draft["drafted"]


def test_bad_draft_settings_are_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="draft source 'medusa'"):
        Scheduler(lambda: engine, prefill_chunk=CHUNK, draft="medusa")
    with pytest.raises(ValueError, match="draft tokens 0: use 1 to 16"):
        Scheduler(lambda: engine, prefill_chunk=CHUNK, draft="lookup", draft_tokens=0)


def test_serve_reports_drafts_in_status_and_metrics(engine: Engine, model_path: Path) -> None:
    from ds4station.server.app import BackgroundServer, create_app

    scheduler = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1,
                          draft="lookup", draft_tokens=4)
    srv = BackgroundServer(create_app(scheduler, model_name="tiny", model_path=str(model_path), ctx=CTX)).start()
    try:
        assert srv.wait_ready(60)
        text = "the quick brown fox jumps over the lazy dog; " * 6
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 30, "temperature": 0,
            "thinking": False})
        assert r.status_code == 200, r.text
        draft = httpx.get(srv.url + "/status").json()["draft"]
        assert draft["source"] == "lookup" and draft["tokens"] == 4
        metrics = httpx.get(srv.url + "/metrics").text
        assert f"ds4_draft_tokens_total {float(draft['drafted'])}" in metrics
        assert f"ds4_draft_accepted_total {float(draft['accepted'])}" in metrics
        if draft["drafted"]:
            assert r.json()["timings"]["draft_n"] == draft["drafted"]
    finally:
        srv.stop()


def _together(engine, n: tuple[int, ...], *, prompt: list[int] = PROMPT, draft: str = "lookup",  # noqa: ANN001
              **kw) -> tuple[list[Finished], Scheduler]:
    """Requests of one prompt (the repeating one by default; n[i] tokens each) at once, greedy, drafted."""
    s = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=len(n), draft=draft,
                  **kw).start()
    assert s.ready.wait(60) and s.state == "ready", s.error

    async def all_of() -> list[Finished]:
        async def one(m: int) -> Finished:
            fin = None
            job = Job(prompt=prompt, max_tokens=m, sampling=SamplingParams(temperature=0.0))
            async for ev in s.submit(job).events():
                fin = ev if isinstance(ev, Finished) else fin
            assert fin is not None
            return fin

        return list(await asyncio.gather(*(one(m) for m in n)))

    try:
        return asyncio.run(all_of()), s
    finally:
        s.stop()


def test_requests_decoding_together_verify_their_drafts_in_one_step(engine: Engine) -> None:
    """Two requests decoding at once verify their drafts together (Engine.verify_batch: every row, drafts or
    not, in one step), each within the step's rows, and both outputs are plain decoding's."""
    alone = [generate(engine, PROMPT, n)[0] for n in (N_NEW, 20)]
    fins, s = _together(engine, (N_NEW, 20), draft_tokens=3)
    assert [f.output for f in fins] == alone
    # a step that fed both and verified drafts (one request's or both's) among them: one batched verification
    assert any(len(r.decoded) == 2 and r.verified for r in s.steps), list(s.steps)
    assert all(f.timings.draft_n > 0 for f in fins)
    assert all(len(r.decoded) <= 2 for r in s.steps)


class _NoBatchedVerify:
    """The engine without verify_batch (as a route of several stages is)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):  # noqa: ANN204
        if name == "verify_batch":
            raise AttributeError(name)
        return getattr(self._engine, name)


def test_without_a_batched_verification_requests_together_take_the_batched_step(engine: Engine) -> None:
    """Where the engine cannot verify several requests in one step, requests decoding together take the batched
    decode step without drafts (a verification of its own would read every weight for one request); the one left
    running drafts again; both outputs are plain decoding's."""
    alone = [generate(engine, PROMPT, n)[0] for n in (N_NEW, 10)]
    fins, s = _together(_NoBatchedVerify(engine), (N_NEW, 10), draft_tokens=3)
    assert [f.output for f in fins] == alone
    assert any(len(r.decoded) == 2 for r in s.steps)
    assert all(len(r.verified) <= 1 and len(r.decoded) == 1 for r in s.steps if r.verified)  # never together
    assert fins[1].timings.draft_n == 0 and fins[0].timings.draft_n > 0  # drafts only once alone
