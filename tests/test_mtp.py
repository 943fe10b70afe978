"""The MTP (next-token prediction) layer as a draft source (issue 21, item 2): its tensor layout (ds4's names
and shapes), `make-model --mtp` and an MTP-only GGUF read back and validated (a missing or malformed tensor
refused by name), the layer on the kernel stage against the reference, drafts from the incremental per-session
state (catch-up, truncation, rewind) against drafts computed from scratch over the whole sequence, and the
scheduler's `--draft mtp` decode: greedy output identical to plain decode, drafts counted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_draft import generate as _generate  # the scheduler's greedy decode of one prompt, with its draft stats

from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine
from ds4station.engine.gpu import GpuStage
from ds4station.engine.model import OFF, DS4Model
from ds4station.engine.scheduler import Scheduler
from ds4station.engine.weights import load_tensors, tensor_view, write_gguf
from ds4station.kernels.quants import QTensor
from ds4station.model.config import FLASH
from ds4station.model.footprint import mtp_bytes
from ds4station.model.gguf import GGUFError, GGUFFile
from ds4station.model.layout import MTP_PREFIX, TensorSpec, model_tensors, mtp_tensors

CTX, CHUNK = 1024, 64
# ds4.c's mtp_weights_bind: every tensor it requires of an MTP file, in its order
DS4_MTP = """hc_head_base hc_head_fn hc_head_scale e_proj h_proj enorm hnorm norm hc_attn_fn hc_attn_scale hc_attn_base
attn_norm attn_q_a attn_q_a_norm attn_q_b attn_kv attn_kv_a_norm attn_sinks attn_output_a attn_output_b hc_ffn_fn
hc_ffn_scale hc_ffn_base ffn_norm ffn_gate_inp exp_probs_b ffn_gate_exps ffn_up_exps ffn_down_exps ffn_gate_shexp
ffn_up_shexp ffn_down_shexp""".split()


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf", preset="tiny", seed=3, mtp=True)


@pytest.fixture(scope="module")
def engine(mtp_model: Path) -> Iterator[Engine]:
    with Engine.load(mtp_model, CTX, device="cpu", chunk=CHUNK, sessions=2, mtp="model") as e:
        yield e


# ---- the layout and the files -------------------------------------------------------------------------------
def test_the_mtp_layout_is_ds4s() -> None:
    specs = {s.name: s for s in mtp_tensors(FLASH, "q2")}
    names = [MTP_PREFIX + r + (".bias" if r == "exp_probs_b" else ".weight") for r in DS4_MTP]
    assert sorted(specs) == sorted(names)
    d, hc = FLASH.dim, FLASH.hc_mult
    # mtp_weights_validate_layout's shapes (ggml order) and types
    want = {"e_proj": ((d, d), Q.Q8_0), "h_proj": ((d, d), Q.Q8_0), "enorm": ((d,), Q.F32), "norm": ((d,), Q.F32),
            "hc_head_fn": ((d * hc, hc), Q.F16), "hc_head_scale": ((1,), Q.F32), "hc_head_base": ((hc,), Q.F32),
            "hc_attn_fn": ((d * hc, 2 * hc + hc * hc), Q.F16), "attn_q_a": ((d, 1024), Q.Q8_0),
            "attn_kv": ((d, 512), Q.Q8_0), "attn_output_a": ((512 * 8, 8 * 1024), Q.Q8_0),
            "ffn_gate_exps": ((d, 2048, 256), Q.IQ2_XXS), "ffn_down_exps": ((2048, d, 256), Q.Q2_K),
            "ffn_down_shexp": ((2048, d), Q.Q8_0), "exp_probs_b": ((256,), Q.F32)}
    for role, (shape, qtype) in want.items():
        s = specs[MTP_PREFIX + role + (".bias" if role == "exp_probs_b" else ".weight")]
        assert (s.shape, s.qtype, s.role) == (shape, qtype, role)
    # a window-only block routed by its scores: no compressor, no indexer, no hash table
    assert not any("compressor" in n or "indexer" in n or "tid2eid" in n for n in specs)


def test_make_model_mtp_writes_the_layer_and_the_file_validates(mtp_model: Path, tmp_path: Path) -> None:
    f = GGUFFile.open(mtp_model)
    assert f.has_mtp and len(f.mtp_specs()) == 32
    plain = GGUFFile.open(make_model(tmp_path / "plain.gguf", preset="tiny", seed=3))
    assert not plain.has_mtp
    # the model's weights are those of the same seed without the layer
    for s in plain.tensor_specs():
        assert torch.equal(tensor_view(f, s.name).data, tensor_view(plain, s.name).data), s.name
    out = subprocess.run([sys.executable, "-m", "ds4station.cli", "make-model", "--preset", "tiny", "--mtp",
                          "--out", str(tmp_path / "cli.gguf")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "and the MTP layer" in out.stdout, out.stderr


def _write(path: Path, specs: list[TensorSpec], src: GGUFFile) -> Path:
    tensors = {}
    for s in specs:  # the source's bytes, or for a malformed tensor zeros of its own shape and type
        same = src.specs.get(s.name) == s
        tensors[s.name] = tensor_view(src, s.name) if same else QTensor(torch.zeros(s.n_bytes, dtype=torch.uint8),
                                                                        s.qtype, s.torch_shape)
    return write_gguf(path, src.config, tensors, specs=specs)


def test_a_missing_or_malformed_mtp_tensor_is_refused_by_name(mtp_model: Path, tmp_path: Path) -> None:
    src = GGUFFile.open(mtp_model)
    cfg = src.config
    full = model_tensors(cfg, "q2", mtp=True)
    name = MTP_PREFIX + "attn_q_b.weight"
    with pytest.raises(GGUFError, match=f"missing the MTP layer's tensor.*{name}"):
        GGUFFile.open(_write(tmp_path / "missing.gguf", [s for s in full if s.name != name], src))
    bad = [TensorSpec(s.name, (s.shape[0], s.shape[1] + 32), s.qtype, None) if s.name == name else s for s in full]
    with pytest.raises(GGUFError, match=f"tensor {name} has shape"):
        GGUFFile.open(_write(tmp_path / "shape.gguf", bad, src))
    norm = MTP_PREFIX + "hnorm.weight"
    f16 = [TensorSpec(s.name, s.shape, Q.F16, None) if s.name == norm else s for s in full]
    with pytest.raises(GGUFError, match=f"tensor {norm} has type F16"):
        GGUFFile.open(_write(tmp_path / "type.gguf", f16, src))
    # the layer's own GGUF (the published MTP file's form): validated against the model it goes with
    alone = _write(tmp_path / "mtp-only.gguf", mtp_tensors(cfg, "q2"), src)
    assert len(GGUFFile.open_mtp(alone, cfg).mtp_specs()) == 32
    with pytest.raises(GGUFError, match="missing tensor"):
        GGUFFile.open(alone)  # not a model
    with pytest.raises(GGUFError, match="has shape .* for this model"):
        GGUFFile.open_mtp(alone, FLASH)  # the layer of another shape
    with pytest.raises(GGUFError, match="missing the MTP layer's tensor"):
        GGUFFile.open_mtp(_write(tmp_path / "mtp-short.gguf", [s for s in mtp_tensors(cfg, "q2")
                                                                 if s.name != name], src), cfg)


def test_engine_and_serve_refuse_a_missing_mtp_layer(mtp_model: Path, tmp_path: Path) -> None:
    plain = make_model(tmp_path / "plain.gguf", preset="tiny", seed=3)
    with pytest.raises(GGUFError, match="has no MTP layer"):
        Engine.load(plain, 256, device="cpu", mtp="model", warm=False)
    out = subprocess.run([sys.executable, "-m", "ds4station.cli", "serve", "--model", str(plain), "--draft", "mtp",
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "has no MTP layer" in out.stderr
    out = subprocess.run([sys.executable, "-m", "ds4station.cli", "serve", "--model", str(plain), "--mtp",
                          str(mtp_model), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "add --draft mtp" in out.stderr
    # the layer from its own file beside a model without one
    alone = _write(tmp_path / "mtp-only.gguf", mtp_tensors(GGUFFile.open(mtp_model).config, "q2"),
                   GGUFFile.open(mtp_model))
    with Engine.load(plain, 256, device="cpu", mtp=alone) as e, Engine.load(mtp_model, 256, device="cpu",
                                                                             mtp="model") as ref:
        a, b = e.new_session(), ref.new_session()
        prompt = list(range(3, 60))
        a.extend(prompt)
        b.extend(prompt)
        assert a.draft(9, 3) == b.draft(9, 3)


ROUTES = {"head on the last stage": ("cpu=embed,0-2; cpu=3-5,output", 1),
          "head on stage 0": ("cpu=embed,0-2,output; cpu=3-5", 0)}


@pytest.mark.parametrize("route", ROUTES)
def test_mtp_drafts_through_worker_processes(engine: Engine, mtp_model: Path, route: str) -> None:
    """On a pipeline the MTP layer runs beside the head: on the last stage (with its own copy of the token
    embedding; drafts come back to rank 0, OP_DRAFT), or on stage 0 when it applies the head to what the last
    stage sends back (then every prefill piece's last states come back too, FLAG_TAIL, for the layer's ring).
    Either way the drafts equal the one-stage engine's, after a prefill of several pieces and after a
    verification's rejected drafts were truncated away on every stage."""
    text, at_stage = ROUTES[route]
    gen = torch.Generator().manual_seed(8)
    seq = torch.randint(2, 500, (180,), generator=gen).tolist()
    with Engine.load(mtp_model, CTX, text, activation_bits=32, chunk=CHUNK, mtp="model") as pipe:
        stats = pipe.stage_stats()
        assert stats[at_stage]["mtp_bytes"] > 0 and stats[1 - at_stage]["mtp_bytes"] == 0
        a, b = pipe.new_session(), engine.new_session()
        try:
            for s in (a, b):
                s.extend(seq[:150])
            for at in (150, 160):
                for s in (a, b):
                    if len(s.tokens) < at:
                        s.extend(seq[len(s.tokens):at])
                da, db = a.draft(seq[at], 3), b.draft(seq[at], 3)
                assert da == db and len(da) == 3
                for s, d in ((a, da), (b, db)):
                    s.verify([seq[at], *d])
                    assert s.truncate(at + 1)
        finally:
            a.close()
            b.close()


def test_the_footprint_counts_what_the_mtp_layer_allocates(mtp_model: Path) -> None:
    """model/footprint.py's mtp_bytes against the kernel stage's allocation: every session's state exactly (at
    load, one per KV slot), the weights as held within 3% (as the plan's weights are checked)."""
    f = GGUFFile.open(mtp_model)
    ctx, chunk, sessions = 512, 64, 3
    with Engine.load(mtp_model, ctx, device="cpu", compute="kernels", sessions=sessions, chunk=chunk,
                     mtp="model", warm=False) as e:
        got = e.stage_stats()[0]["mtp_bytes"]
        state = e.runner.mtp.nbytes()
        assert state == mtp_bytes(f.config, [], ctx, chunk, sessions)
        want = mtp_bytes(f.config, f.mtp_specs(), ctx, chunk, sessions)
        assert abs(got - want) <= 0.03 * (want - state), (got, want)
        assert e.stage_stats()[0]["weights_held_bytes"] == e.runner.held_weight_bytes()  # without the layer


@pytest.mark.parametrize("route", ROUTES)
def test_batched_steps_keep_the_mtp_layers_ring(engine: Engine, mtp_model: Path, route: str) -> None:
    """Batched decode steps record every session's state for the MTP layer (on a pipeline's last stage, or on
    stage 0 from the states the head reads): drafts after them equal the one-stage engine's."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (70, 90)]
    with Engine.load(mtp_model, CTX, ROUTES[route][0], activation_bits=32, chunk=CHUNK, sessions=2,
                     mtp="model") as pipe:
        got, want = [], []
        for e, out in ((pipe, got), (engine, want)):
            ss = [e.new_session() for _ in prompts]
            try:
                for s, p in zip(ss, prompts, strict=True):
                    s.extend(p)
                for t in range(4):
                    e.decode_batch(ss, [100 + t, 200 + t])
                out += [s.draft(7, 3) for s in ss]
                out += e.draft_batch(ss, [7, 8], [3, 2])  # together: the same drafts as alone
                with pytest.raises(ValueError, match="each session once"):
                    e.draft_batch([ss[0], ss[0]], [7, 7], [1, 1])
            finally:
                for s in ss:
                    s.close()
        assert got == want
        assert got[2] == got[0] and len(got[3]) == 2  # session 0 alone and together


# ---- the layer's numerics --------------------------------------------------------------------------------------
def _mtp_stages(mtp_model: Path) -> tuple[DS4Model, GpuStage]:
    f = GGUFFile.open(mtp_model)
    views = load_tensors(f) | {s.name: tensor_view(f, s.name) for s in f.mtp_specs()}
    ref = DS4Model(f.config, {n: q.dequantize() for n, q in views.items()}, round_trips=OFF, mtp=True)
    return ref, GpuStage(f.config, views, device="cpu", round_trips=OFF, int_dot=False, mtp=True)


def test_the_kernel_stage_mtp_layer_matches_the_reference(mtp_model: Path) -> None:
    ref, fast = _mtp_stages(mtp_model)
    cfg = ref.cfg
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (70,), generator=gen)
    H = torch.randn(70, cfg.hc_mult, cfg.dim, generator=gen)
    a, b = ref.new_mtp_caches(1, 256, 128)[0], fast.new_mtp_caches(1, 256, 128)[0]
    for lo, hi in ((0, 40), (40, 69), (69, 70)):  # a catch-up, another, then one depth of a chain
        Xa, la = ref.mtp_step(H[lo:hi], tokens[lo:hi], a)
        Xb, lb = fast.mtp_step(H[lo:hi], tokens[lo:hi], b)
        assert torch.allclose(Xb, Xa, rtol=0, atol=1e-4 * Xa.abs().max().item())
        assert torch.allclose(lb, la, rtol=0, atol=1e-4 * la.abs().max().item())
    assert a.length == b.length == 70


def test_mtp_drafts_of_several_sequences_in_one_step_are_each_ones_own(mtp_model: Path) -> None:
    """GpuStage.mtp_draft of several sequences (their pairs in one static step, each row on its own slot of
    the pool, padded with copies of the last row; then one row per sequence per depth) drafts what the
    reference drafts for each sequence alone; a catch-up too long for the step runs eagerly first. Each
    sequence's cache then goes on as the reference's does."""
    ref, fast = _mtp_stages(mtp_model)
    cfg = ref.cfg
    gen = torch.Generator().manual_seed(5)
    H = torch.randn(3, 80, cfg.hc_mult, cfg.dim, generator=gen)
    tokens = torch.randint(2, cfg.vocab_size, (3, 80), generator=gen)
    for pairs, k in (((1, 1, 1), 1), ((1, 3, 5), 3), ((2, 30, 1), 2)):  # 3 rows; 9 padded to 16; 33 > 32 rows
        refs, fasts = ref.new_mtp_caches(3, 256, 128), fast.new_mtp_caches(3, 256, 128)
        for c in (*refs, *fasts):
            c.length = 10
        want = ref.mtp_draft([H[i, :n] for i, n in enumerate(pairs)], [tokens[i, :n] for i, n in enumerate(pairs)],
                             refs, k)
        got = fast.mtp_draft([H[i, :n] for i, n in enumerate(pairs)], [tokens[i, :n] for i, n in enumerate(pairs)],
                             fasts, k)
        assert got.shape == (3, k) and got.tolist() == want.tolist()
        assert [c.length for c in fasts] == [c.length for c in refs] == [10 + n + k - 1 for n in pairs]
        for c, n in zip((*refs, *fasts), pairs * 2, strict=True):  # the callers keep the pairs, not the chains
            c.length = 10 + n
        nxt = [(H[i, n:n + 2], tokens[i, n:n + 2]) for i, n in enumerate(pairs)]
        assert (fast.mtp_draft([h for h, _ in nxt], [t for _, t in nxt], fasts, 2).tolist() ==
                ref.mtp_draft([h for h, _ in nxt], [t for _, t in nxt], refs, 2).tolist())


@pytest.mark.parametrize("pairs", [1, 3, 5, 40])  # one row, a row class, padded to 8 rows, past the largest class
def test_the_kernel_stage_drafts_in_one_static_step_what_the_reference_drafts(mtp_model: Path, pairs: int) -> None:
    """GpuStage.mtp_draft (the pairs as one static step padded to a row class, then the chain's one-row steps:
    what its CUDA graph captures, run eagerly here) drafts the reference's tokens, at depths 1 and 3, on slots
    of one pool of MTP caches that go on from where the draft left them (the padded rows and the chain's rows
    are overwritten before they are read: the next draft agrees too)."""
    ref, fast = _mtp_stages(mtp_model)
    cfg = ref.cfg
    gen = torch.Generator().manual_seed(pairs)
    H = torch.randn(pairs + 60, cfg.hc_mult, cfg.dim, generator=gen)
    tokens = torch.randint(2, cfg.vocab_size, (pairs + 60,), generator=gen)
    refs, fasts = ref.new_mtp_caches(2, 256, 128), fast.new_mtp_caches(2, 256, 128)
    assert fasts[0].pool is fasts[1].pool and fasts[1].slot == 1
    for k in (1, 3):
        a, b = refs[k == 3], fasts[k == 3]  # slot 0, then slot 1 of the pool
        a.length = b.length = 20  # an earlier catch-up left the layer here (what lies before is never read)
        want = ref.mtp_draft([H[:pairs]], [tokens[:pairs]], [a], k)
        got = fast.mtp_draft([H[:pairs]], [tokens[:pairs]], [b], k)
        assert got.tolist() == want.tolist() and got.shape == (1, k)
        assert a.length == b.length == 20 + pairs + k - 1
        for c in (a, b):  # the caller keeps the pairs, not the chain
            c.length = 20 + pairs
        nxt = slice(pairs, pairs + 2)
        assert (fast.mtp_draft([H[nxt]], [tokens[nxt]], [b], 2).tolist() ==
                ref.mtp_draft([H[nxt]], [tokens[nxt]], [a], 2).tolist())
    with pytest.raises(ValueError, match="one state per token"):
        fast.mtp_draft([H[:2]], [tokens[:3]], [fasts[0]], 1)
    with pytest.raises(ValueError, match="each once"):
        fast.mtp_draft([H[:2], H[:2]], [tokens[:2], tokens[:2]], [fasts[0], fasts[0]], 1)
    assert fast.capture_mtp(fast.new_mtp_caches(1, 256, 128)[0], 3) == 0  # graphs are CUDA's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are a GPU's")
def test_mtp_draft_graphs_replay_the_eager_drafts(mtp_model: Path) -> None:
    """On CUDA, mtp_draft replays one graph per (row class, depth) over the slots of its pool: the same tokens as
    the same launches run eagerly, on either slot, for catch-ups of 1-9 pairs and depths 1-4; a (row class,
    depth) seen before replays its graph."""
    f = GGUFFile.open(mtp_model)
    views = load_tensors(f) | {s.name: tensor_view(f, s.name) for s in f.mtp_specs()}
    fast = GpuStage(f.config, views, device="cuda", round_trips=OFF, mtp=True)
    cfg = f.config
    gen = torch.Generator().manual_seed(2)
    H = (torch.randn(200, cfg.hc_mult, cfg.dim, generator=gen)).cuda()
    tokens = torch.randint(2, cfg.vocab_size, (200,), generator=gen)
    graphed, eager = fast.new_mtp_caches(2, 512, 128), fast.new_mtp_caches(2, 512, 128)
    assert fast.capture_mtp(graphed[0], 3) == 4 and graphed[0].length == 0  # ahead: 1-4 pairs, depth 3
    at = [0, 0]  # each slot's sequence: its pairs in order (what a position reads was written by the same pairs)
    for pairs, k, slot in ((1, 1, 0), (3, 2, 1), (4, 4, 0), (9, 3, 1), (2, 4, 0), (1, 1, 1)):
        g, e = graphed[slot], eager[slot]
        g.length = e.length = at[slot]
        span = slice(at[slot], at[slot] + pairs)
        got = fast.mtp_draft([H[span]], [tokens[span]], [g], k, graph=True)
        want = fast.mtp_draft([H[span]], [tokens[span]], [e], k, graph=False)
        assert got.tolist() == want.tolist()
        at[slot] += pairs
    # (rows, depth): (1-4, 3) captured ahead, (16, 3) and the others on first use, (1, 1) replayed the second time
    assert sum(key[0] == "mtp" for key in fast._graphs) == 9
    for pairs, k in (((2, 1), 3), ((1, 5), 2), ((4, 4), 2)):  # both slots in one step: 3, 6 (padded to 8), 8 rows
        for c in (*graphed, *eager):
            c.length = at[c.slot]
        spans = [slice(at[i], at[i] + n) for i, n in enumerate(pairs)]
        got = fast.mtp_draft([H[sp] for sp in spans], [tokens[sp] for sp in spans], graphed, k, graph=True)
        want = fast.mtp_draft([H[sp] for sp in spans], [tokens[sp] for sp in spans], eager, k, graph=False)
        assert got.shape == (2, k) and got.tolist() == want.tolist()
        at = [a + n for a, n in zip(at, pairs, strict=True)]
    assert sum(key[0] == "mtp" for key in fast._graphs) == 11  # (8 rows, 2 sequences, depth 2) replayed


def _scratch_drafts(engine: Engine, seq: list[int], token: int, k: int) -> list[int]:
    """The drafts after `seq` + `token`, computed from nothing: the model's last HC states of the whole
    sequence, the MTP layer over every pair (h_i, x_{i+1}), then the chain."""
    model = engine.runner.model
    cache = model.new_cache(CTX, chunk=len(seq) + 1)
    H = model.prefill(seq, cache)  # the HC states the head reads
    mcache = model.new_mtp_caches(1, CTX, len(seq) + 1)[0]
    model.mtp_step(H[:-1], torch.as_tensor(seq[1:]), mcache)
    out, h, t = [], H[-1:], token
    for _ in range(k):
        X, logits = model.mtp_step(h, torch.as_tensor([t]), mcache)
        t = int(logits[-1].argmax())
        out.append(t)
        h = X[-1:]
    return out


@pytest.fixture(scope="module")
def exact_engine(mtp_model: Path) -> Iterator[Engine]:
    """The engine without the FP8 KV / FP4 indexer round trips: two passes that group the rows differently then
    agree to fp32 rounding, where with them a ~1e-7 difference can cross one FP8 step of a KV row and move a logit
    by percents (seen: a draft 4% below the from-scratch maximum once the CPU matvecs rounded differently)."""
    with Engine.load(mtp_model, CTX, device="cpu", chunk=CHUNK, sessions=1, mtp="model", round_trips=OFF) as e:
        yield e


def test_drafts_from_the_incremental_state_equal_drafts_from_scratch(exact_engine: Engine) -> None:
    """The session's MTP state, caught up lazily after prefills, verifications, truncations and a rewind, gives
    the drafts a from-scratch pass over the sequence gives (the pairs older than one window are never read, so
    skipping them changes nothing)."""
    engine = exact_engine
    gen = torch.Generator().manual_seed(4)
    seq = torch.randint(2, 500, (300,), generator=gen).tolist()  # longer than the window
    s = engine.new_session()
    try:
        s.extend(seq[:200])
        s.checkpoint()
        for at, k in ((200, 3), (205, 4)):
            if len(s.tokens) < at:
                s.extend(seq[len(s.tokens):at])
            got = s.draft(seq[at], k)
            assert got == _scratch_drafts(engine, seq[:at], seq[at], k)
            rows = s.verify([seq[at], *got])  # the drafts go in, then are rejected: truncated back
            assert rows.shape[0] == k + 1 and s.truncate(at + 1)
        s.extend(seq[len(s.tokens):260])
        assert s.draft(seq[260], 2) == _scratch_drafts(engine, seq[:260], seq[260], 2)
        assert s.rewind(210) == 210  # within the rollback? else to the checkpoint
    except AssertionError:
        raise
    finally:
        s.close()
    t = engine.new_session()
    try:
        t.extend(seq[:250])
        t.checkpoint()
        t.extend(seq[250:300])
        kept = t.rewind(251)
        assert kept in (250, 251)
        assert t.draft(seq[kept], 3) == _scratch_drafts(engine, seq[:kept], seq[kept], 3)
    finally:
        t.close()


# ---- the scheduler's --draft mtp -----------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_mtp_drafts_is_plain_decode(engine: Engine, k: int) -> None:
    prompt = [1] + list(range(40, 200))
    plain, _, off = _generate(engine, prompt, 30)
    assert off["drafted"] == 0
    out, fin, draft = _generate(engine, prompt, 30, draft="mtp", draft_tokens=k)
    assert out == plain
    assert draft["source"] == "mtp" and draft["steps"] > 0 and draft["drafted"] >= draft["steps"]
    assert fin.timings.draft_n == draft["drafted"] and fin.timings.draft_n_accepted == draft["accepted"]


def test_requests_together_verify_mtp_drafts_in_one_kernel_step(mtp_model: Path) -> None:
    """On the kernel stage (CPU here), two requests with MTP drafts draft them in one step of the layer
    (Engine.draft_batch) and verify them together in one step (GpuStage.verify_batch, the layer's ring fed from
    that step's states): each output is plain decoding's."""
    from test_draft import _together

    prompt_a = [1] + list(range(40, 120))
    with Engine.load(mtp_model, CTX, device="cpu", compute="kernels", chunk=CHUNK, sessions=2, mtp="model") as e:
        alone = [_generate(e, prompt_a, n)[0] for n in (24, 12)]
        together, draft_batch = [], e.draft_batch

        def counted(sessions, tokens, ks):  # noqa: ANN001, ANN202 (the engine's own call, its sessions counted)
            together.append(len(sessions))
            return draft_batch(sessions, tokens, ks)

        e.draft_batch = counted
        fins, s = _together(e, (24, 12), draft_tokens=2, draft="mtp", prompt=prompt_a)
    assert [f.output for f in fins] == alone
    assert any(len(r.decoded) == 2 and sorted(r.verified) == sorted(r.decoded) for r in s.steps), list(s.steps)
    # the steps that verified both requests' drafts drafted them in one step of the MTP layer
    assert together.count(2) == sum(len(r.verified) == 2 for r in s.steps) > 0, (together, list(s.steps))


def test_draft_mtp_needs_an_engine_with_the_layer(tmp_path: Path) -> None:
    plain = make_model(tmp_path / "plain.gguf", preset="tiny", seed=3)
    with Engine.load(plain, 256, device="cpu") as e:
        s = Scheduler(lambda: e, ctx=256, prefill_chunk=CHUNK, owns_engine=False, draft="mtp").start()
        try:
            assert s.ready.wait(60)
            assert s.state == "failed" and "needs the model's MTP layer" in (s.error or "")
        finally:
            s.stop()


def test_serve_draft_mtp_over_http_gives_plain_decodings_answer(mtp_model: Path, tmp_path: Path) -> None:
    """The user's path: `ds4station serve --draft mtp` as its own process, the official openai client streaming
    a chat completion at temperature 0: the same text as `serve` without drafts, the drafts in the response's
    timings and in /status and /metrics. On the CPU: on a GPU a verification's rows run other kernels than a
    decode step's, whose rounding can flip this random model's near-tied greedy picks (an H100 run with other
    tests beside it did, thirty-fourth session)."""
    import socket

    import httpx
    import openai

    from ds4station.server.bench import wait_ready

    def answer(*flags: str) -> tuple[str, dict, str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        log = (tmp_path / f"serve{port}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "ds4station.cli", "serve", "--model", str(mtp_model),
                                 "--port", str(port), "--ctx", "1024", "--sessions", "1", "--device", "cpu", *flags],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(url, proc, 180)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
            stream = client.chat.completions.create(
                model="tiny-mtp", messages=[{"role": "user", "content": "Write a story about a station. " * 8}],
                max_tokens=40, temperature=0, stream=True, extra_body={"thinking": False})
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            return text, httpx.get(url + "/status").json()["draft"], httpx.get(url + "/metrics").text
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()

    plain, off, _ = answer()
    text, draft, metrics = answer("--draft", "mtp", "--draft-tokens", "3")
    assert off["source"] == "off" and plain
    assert text == plain
    assert draft["source"] == "mtp" and draft["tokens"] == 3 and draft["drafted"] > 0
    assert f"ds4_draft_tokens_total {float(draft['drafted'])}" in metrics
    out = (tmp_path / next(p.name for p in tmp_path.glob("serve*.log") if "MTP layer" in p.read_text())).read_text()
    assert "--draft mtp: the MTP layer (the model file) adds" in out


def test_break_even_acceptance() -> None:
    from ds4station.engine.draft_bench import break_even_acceptance

    assert break_even_acceptance(1.0, 3) == 0.0  # a verification as cheap as a decode step: any draft pays
    assert break_even_acceptance(2.0, 1) is None  # twice a decode step for at most two tokens: never pays
    assert abs(break_even_acceptance(1.5, 1) - 0.5) < 1e-9  # 1 + a = 1.5
    assert abs(break_even_acceptance(1.75, 2) - 0.5) < 1e-9  # 1 + a + a^2 = 1.75


def test_bench_draft_measures_oracle_and_mtp_drafts(mtp_model: Path) -> None:
    """`bench draft` on the tiny model with its MTP layer: the verifier's greedy output is plain decoding's (the
    CPU verification is exact), the oracle's drafts are all accepted, the MTP's counted; the table has a row per
    k."""
    from ds4station.engine import draft_bench

    res = draft_bench.run(str(mtp_model), mtp="model", ks=(1, 2), prompt=40, tokens=8, device="cpu",
                          log=lambda _m: None)
    assert [r.k for r in res.rows] == [1, 2] and res.decode_ms > 0
    for r in res.rows:
        assert r.greedy_plain == r.oracle_same == r.mtp_same == 8 and r.verify_ms > 0 and r.oracle_tps > 0
        assert 0.0 <= r.mtp_accepted <= 1.0 and r.mtp_per_verify >= 1.0 and r.mtp_draft_ms > 0
    table = res.table()
    assert "| 1 |" in table and "| 2 |" in table and "MTP layer: the model file" in table
    assert "| 8/8 |" in table and "differed" not in table


def test_bench_draft_command_prints_the_table_and_writes_json(mtp_model: Path, tmp_path: Path, capsys) -> None:
    """`ds4station bench draft --json FILE`: exit 0, the table on stdout and the same result as JSON."""
    import json

    from ds4station.cli import main

    out = tmp_path / "draft.json"
    assert main(["bench", "draft", "--model", str(mtp_model), "--k", "1", "--prompt-tokens", "24",
                 "--decode-tokens", "4", "--device", "cpu", "--json", str(out)]) == 0
    assert "| 1 |" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["k"] for r in res["rows"]] == [1] and res["rows"][0]["greedy_plain"] == 4
