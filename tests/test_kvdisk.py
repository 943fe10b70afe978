"""Disk KV checkpoints (engine/kvdisk.py, serve --kv-disk-dir) on the tiny model, CPU: a restored session
continues bit for bit as the saved one; the byte formula is what is saved; corrupt, truncated, foreign and
incomplete entries are ignored with a log line and removed, never loaded; the directory stays within its budget
(least recently used first); the scheduler restores an evicted conversation, also after a restart, and reports
it in /status and /metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine
from ds4station.engine.kvdisk import DiskKV, DiskSettings, entry_key, stage_file
from ds4station.engine.sampler import SamplingParams
from ds4station.engine.scheduler import Finished, Job, Scheduler
from ds4station.model.footprint import state_bytes

CTX, CHUNK = 1024, 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("kvdisk") / "tiny-q2.gguf", preset="tiny", seed=0, quant="q2")


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    with Engine.load(model_path, CTX, device="cpu", chunk=CHUNK, sessions=3, rollback=64) as e:
        yield e


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


def greedy_steps(session, first: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    out, logits = [], [first]
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits.append(session.extend([out[-1]]))
    return out, logits


def _disk(engine: Engine, root: Path, budget: int = 1 << 30, **kw) -> DiskKV:
    return DiskKV(root, budget, engine.state_identity(), entry_bytes=engine.state_bytes, **kw)


@pytest.mark.parametrize("n", [1, 3, 50, 301])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_saved_state_is_what_the_byte_formula_counts(engine: Engine, n: int, dtype: torch.dtype) -> None:
    from ds4station.engine.kv import KVCache, dtype_name

    cache = KVCache(engine.cfg, None, CTX, dtype=dtype, chunk=CHUNK)
    cache.advance(n)
    assert sum(t.nbytes for _, t in cache.state()) == state_bytes(engine.cfg, None, n, dtype_name(dtype))
    assert cache.saved_at == n  # state() took the checkpoint it saves


@pytest.mark.parametrize("n", [37, 301, 640])
def test_a_restored_session_continues_bit_for_bit(engine: Engine, tmp_path: Path, n: int) -> None:
    """Saved at n positions (not a multiple of any ratio for 37 and 301), restored into a fresh slot: every
    following step's logits are identical to those of the session that was saved, and the restored session
    can rewind to its checkpoint like the original."""
    prompt = tokens(n, seed=n)
    a = engine.new_session()
    first = a.extend(prompt)
    assert a.save_state(tmp_path / "e")
    want_tokens, want = greedy_steps(a, first, 12)
    a.close()
    b = engine.new_session()
    assert b.load_state(tmp_path / "e", prompt) and b.tokens == prompt
    got = [b.extend([t]) for t in want_tokens]
    assert all(torch.equal(g, w) for g, w in zip(got, want[1:], strict=True))
    for t in range(3 * CHUNK):  # beyond the rings' slack: the restored checkpoint brings it back
        b.extend([5 + t % 7])
    assert b.rewind(n) == n
    assert torch.equal(b.extend([want_tokens[0]]), want[1])
    b.close()


def test_a_restored_session_goes_back_before_its_end_only_through_its_checkpoint(engine: Engine,
                                                                                tmp_path: Path) -> None:
    """Restored at n, a prompt that shares d <= CHECKPOINT_MARGIN fewer tokens goes back to n - d from the
    checkpoint's rows (a truncate would read ring rows the restore did not write: they hold a slot's older
    data): the steps from there equal those of the saved session rolled back in place, bit for bit."""
    n = 300
    prompt = tokens(n + 20, seed=11)
    a = engine.new_session()
    a.extend(prompt[:n])
    assert a.save_state(tmp_path / "e")
    a.close()
    for d in (1, 2, 7, 16):
        stale = engine.new_session()  # the slot the restore reuses holds another sequence's rows
        stale.extend(tokens(n + 40, seed=d))
        stale.close()
        b = engine.new_session()
        assert b.load_state(tmp_path / "e", prompt[:n])
        assert not b.truncate(n - d)
        assert b.rewind(n - d) == n - d
        b.close()  # (a slot of its own for the comparison: a and b must not share one)
        b2 = engine.new_session()
        assert b2.load_state(tmp_path / "e", prompt[:n]) and b2.rewind(n - d) == n - d
        same = engine.new_session()  # the saved session's own prefill, rolled back in place
        same.extend(prompt[:n])
        assert same.truncate(n - d)
        assert torch.equal(b2.extend(prompt[n - d:n + 5]), same.extend(prompt[n - d:n + 5]))
        same.close()
        b2.close()
    b = engine.new_session()
    assert b.load_state(tmp_path / "e", prompt[:n]) and b.rewind(n - 17) == -1  # beyond the margin
    b.close()


def test_corrupt_truncated_and_missing_files_are_refused_with_a_log_line(engine: Engine, tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    prompt = tokens(200, seed=3)
    a = engine.new_session()
    a.extend(prompt)
    assert a.save_state(tmp_path / "e")
    a.close()
    path = stage_file(tmp_path / "e", 0)
    good = path.read_bytes()

    def refused(data: bytes | None, why: str) -> None:
        if data is None:
            path.unlink()
        else:
            path.write_bytes(data)
        capfd.readouterr()
        s = engine.new_session()
        assert not s.load_state(tmp_path / "e", prompt) and s.tokens == []
        assert why in capfd.readouterr().err
        path.write_bytes(good)

    flipped = bytearray(good)
    flipped[-100] ^= 0x40
    refused(bytes(flipped), "checksum mismatch")
    refused(good[: len(good) - 1000], "truncated")
    refused(good[:20], "truncated header")
    refused(b"GGUF" + good[4:], "not a ds4station KV state file")
    refused(None, "No such file")
    s = engine.new_session()
    assert not s.load_state(tmp_path / "e", prompt[:-1])  # the file holds 200 positions, not 199
    assert "positions is 200, expected 199" in capfd.readouterr().err
    s = engine.new_session()
    assert s.load_state(tmp_path / "e", prompt)  # the good file still loads
    s.close()


def _du(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def test_the_directory_stays_within_its_budget_least_recently_used_first(engine: Engine, tmp_path: Path) -> None:
    one = engine.state_bytes(300) + 12 * 300 + (1 << 16)  # an entry's allowance (kvdisk.meta_bytes)
    disk = _disk(engine, tmp_path, budget=2 * one + 1000, min_tokens=100)
    prompts = [tokens(300, seed=s) for s in range(4)]
    for p in prompts[:2]:
        s = engine.new_session()
        s.extend(p)
        assert disk.save(p, s.save_state)
        s.close()
    entry, n = disk.match(prompts[0] + [1, 2], 302)
    assert entry.tokens == prompts[0] and n == 300
    assert disk.match(prompts[0], 299)[1] == 299  # a retry: through the checkpoint's margin
    assert disk.match(prompts[0][:290] + [1] * 10, 299)[1] == 290  # the last tokens rendered otherwise
    assert disk.match(prompts[0][:280] + [1] * 20, 299) is None  # beyond the margin
    s = engine.new_session()  # restoring the first makes the second the least recently used
    assert disk.restore(entry, s.load_state)
    s.close()
    for p in prompts[2:]:
        s = engine.new_session()
        s.extend(p)
        assert disk.save(p, s.save_state)
        s.close()
        assert _du(tmp_path) <= disk.budget and disk.used_bytes <= disk.budget
    assert {e.key for e in disk.entries.values()} == {entry_key(prompts[3]), entry_key(prompts[2])}
    assert disk.match(prompts[1], 300) is None and disk.saves == 4 and disk.hits == 1
    short = tokens(50)
    assert not disk.save(short, lambda d: pytest.fail("a prompt under min_tokens is not saved"))
    huge = DiskKV(tmp_path / "small", 1000, disk.identity, entry_bytes=engine.state_bytes, min_tokens=1)
    assert not huge.save(prompts[0], lambda d: pytest.fail("an entry over the whole budget is not written"))


def test_a_scan_keeps_valid_entries_and_removes_incomplete_and_corrupt_ones(engine: Engine, tmp_path: Path,
                                                                          capfd: pytest.CaptureFixture[str]) -> None:
    disk = _disk(engine, tmp_path, min_tokens=10)
    kept, other = tokens(120, seed=1), tokens(130, seed=2)
    for p in (kept, other):
        s = engine.new_session()
        s.extend(p)
        assert disk.save(p, s.save_state)
        s.close()
    meta = tmp_path / entry_key(other) / "meta.json"  # another model's entry: kept, counted, never matched
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "identity": {**data["identity"], "model": "0:other"}}))
    (tmp_path / ("ab" * 16)).mkdir()  # a save that never finished: no meta.json
    bad = tmp_path / ("cd" * 16)
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("the user's own file")
    capfd.readouterr()
    again = _disk(engine, tmp_path, min_tokens=10)  # a restart
    err = capfd.readouterr().err
    assert "incomplete" in err and "unreadable meta.json" in err
    assert not (tmp_path / ("ab" * 16)).exists() and not bad.exists() and (tmp_path / "notes.txt").exists()
    assert list(again.entries) == [entry_key(kept)] and list(again.foreign) == [entry_key(other)]
    assert again.match(other, 200) is None and again.match(kept, 200) is not None
    assert again.used_bytes == sum(json.loads((tmp_path / k / "meta.json").read_text())["bytes"]
                                   for k in (entry_key(kept), entry_key(other)))
    # a corrupt stage file is found when it is restored: the entry goes, with a log line
    path = stage_file(tmp_path / entry_key(kept), 0)
    path.write_bytes(path.read_bytes()[:-10])
    s = engine.new_session()
    assert not again.restore(again.entries[entry_key(kept)], s.load_state)
    assert "truncated" in capfd.readouterr().err
    assert not (tmp_path / entry_key(kept)).exists() and not again.entries and again.failures == 1


# ---- through the scheduler --------------------------------------------------------------------------------
def run(scheduler: Scheduler, prompt: list[int], n: int = 8) -> tuple[list[int], Finished]:
    async def go() -> tuple[list[int], Finished]:
        handle = scheduler.submit(Job(prompt=prompt, max_tokens=n, sampling=SamplingParams(temperature=0.0)))
        fin = None
        async for ev in handle.events():
            if isinstance(ev, Finished):
                fin = ev
        assert fin is not None and fin.reason in ("length", "stop"), fin
        return fin.output, fin

    return asyncio.run(go())


def _scheduler(engine: Engine, root: Path, **kw) -> Scheduler:
    s = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1,
                  kv_disk=DiskSettings(str(root), 1 << 30, min_tokens=256, min_gain=64), **kw).start()
    assert s.ready.wait(60) and s.state == "ready", s.error
    return s


def test_an_evicted_conversation_comes_back_from_the_disk_also_after_a_restart(engine: Engine,
                                                                             tmp_path: Path) -> None:
    conversation, other = tokens(400, seed=7), tokens(300, seed=8)
    turn2 = conversation + tokens(30, seed=9)
    plain = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1).start()
    assert plain.ready.wait(60)
    want, _ = run(plain, turn2)
    plain.stop()
    s = _scheduler(engine, tmp_path)
    try:
        run(s, conversation)
        run(s, other)  # one session: the conversation's live KV is gone
        got, fin = run(s, turn2)
        assert got == want
        assert fin.reuse is not None and fin.reuse.outcome == "disk", fin.reuse
        assert fin.timings.cache_n == len(conversation) and fin.timings.prompt_n == 30
        disk = s.status()["sessions"]["disk"]  # turn 2 is only 30 tokens beyond the saved turn 1: not saved
        assert disk["hits"] == 1 and disk["saves"] == 2 and disk["entries"] == 2 and disk["failures"] == 0
        turn3 = turn2 + tokens(300, seed=10)
        run(s, turn3)  # 330 beyond turn 1 (>= min_tokens): saved
        assert s.status()["sessions"]["disk"]["saves"] == 3
    finally:
        s.stop()
    s = _scheduler(engine, tmp_path)  # a restart: the directory is read again
    try:
        got, fin = run(s, turn3 + [3, 4, 5])
        assert fin.reuse.outcome == "disk" and fin.timings.cache_n == len(turn3)
        got, fin = run(s, other + [6])
        assert fin.reuse.outcome == "disk" and fin.timings.cache_n == len(other)
        assert s.status()["sessions"]["disk"]["hits"] == 2
    finally:
        s.stop()


def test_serve_flags_status_and_metrics(engine: Engine, model_path: Path, tmp_path: Path) -> None:
    from ds4station.commands.serve import add_arguments, disk_settings
    from ds4station.server.app import BackgroundServer, create_app

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert disk_settings(p.parse_args([])) is None
    got = disk_settings(p.parse_args(["--kv-disk-dir", str(tmp_path / "d"), "--kv-disk-budget", "2GiB",
                                      "--kv-disk-min", "2K"]))
    assert got == DiskSettings(str(tmp_path / "d"), 2 << 30, 2048) and (tmp_path / "d").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot write there"):
        disk_settings(p.parse_args(["--kv-disk-dir", str(tmp_path / "file" / "sub")]))
    with pytest.raises(ValueError, match="must be positive"):
        disk_settings(p.parse_args(["--kv-disk-dir", str(tmp_path / "d"), "--kv-disk-budget", "0"]))
    scheduler = Scheduler(lambda: engine, ctx=CTX, prefill_chunk=CHUNK, owns_engine=False, sessions=1,
                          kv_disk=DiskSettings(str(tmp_path / "d"), 1 << 30, min_tokens=256, min_gain=64))
    srv = BackgroundServer(create_app(scheduler, model_name="tiny", model_path=str(model_path), ctx=CTX)).start()
    try:
        assert srv.wait_ready(60)
        text = " ".join(f"word{i}" for i in range(110))
        for content in (text, "something else entirely " * 25, text):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, "thinking": False})
            assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        disk = httpx.get(srv.url + "/status").json()["sessions"]["disk"]
        assert disk["hits"] == 1 and disk["saves"] == 2 and disk["used_bytes"] <= disk["budget_bytes"]
        metrics = httpx.get(srv.url + "/metrics").text
        assert "ds4_kv_disk_hits_total 1.0" in metrics and "ds4_kv_disk_saves_total 2.0" in metrics
        assert "ds4_kv_disk_entries 2.0" in metrics
    finally:
        srv.stop()


def test_common_prefix_at_every_kind_of_boundary() -> None:
    from ds4station.engine.kvdisk import common_prefix

    base = tokens(5000, seed=1)
    for cut in (0, 1, 1023, 1024, 1025, 2048, 4999):
        other = base[:cut] + [base[cut] + 1] + base[cut + 1:] if cut < 5000 else list(base)
        assert common_prefix(base, other) == cut
    assert common_prefix(base, base[:3000]) == 3000 and common_prefix(base[:2048], base) == 2048
    assert common_prefix([], base) == 0 and common_prefix(base, base) == 5000
    assert common_prefix(tuple(base), base[:10] + [0]) == 10  # (tokens are 5..499)
