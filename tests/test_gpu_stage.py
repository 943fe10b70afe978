"""The fast stage (engine/gpu.py) against the reference model, on CPU: same logits for chunked prefill and
static-shape decode. On a GPU the same test runs the Triton kernels and the CUDA-graph decode."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from ds4station.engine import gpu
from ds4station.engine.demo import make_model
from ds4station.engine.gpu import GpuStage
from ds4station.engine.model import OFF, DS4Model, RoundTrips
from ds4station.engine.weights import load_tensors
from ds4station.kernels import dispatch, pdl
from ds4station.model.gguf import GGUFFile

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    return GGUFFile.open(make_model(tmp_path_factory.mktemp("g") / "tiny.gguf", seed=11))


@pytest.fixture(scope="module", params=[OFF, RoundTrips()], ids=["exact", "round-trips"])
def reference(tiny: GGUFFile, request: pytest.FixtureRequest) -> tuple[torch.Tensor, torch.Tensor, RoundTrips]:
    """Full-sequence reference logits over a prompt longer than the window, several compressor blocks and
    the indexer top-k."""
    cfg = tiny.config
    tokens = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(5))
    model = DS4Model(cfg, {n: q.dequantize() for n, q in load_tensors(tiny).items()}, round_trips=request.param)
    return tokens, model.head(model.prefill(tokens, model.new_cache(100, chunk=100))), request.param


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = (a.float().cpu() - b.float().cpu()).abs().max().item() / b.abs().max().item()
    assert err < tol, f"max error {err:.2e} relative to the largest logit"


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_and_decode_match_reference(tiny: GGUFFile, reference, device: str) -> None:
    tokens, want, rt = reference
    stage = GpuStage(tiny.config, load_tensors(tiny), device=device, round_trips=rt, int_dot=False)
    cache = stage.new_cache(256, chunk=32)
    # Without the round trips the CPU path differs from the reference by summation order only. With them,
    # those 1e-6 differences can move an FP8 / FP4 value across a rounding boundary (an FP4 step is 1/4 to
    # 1/2 of a block's scale), which then changes an indexer choice: bounded, but not at fp32 rounding.
    # On a GPU weights and activations of F16 tensors are fp16.
    # Measured on the H200 (docs/PERFORMANCE.md): exact mode 1-2e-3; with the round trips 0.11 (CPU stage under
    # torch 2.11) to 0.23 (GPU) when such a flip changes a block choice, so that case only bounds the damage.
    tol = 2e-5 if device == "cpu" and rt == OFF else 2e-2 if rt == OFF else 0.3
    _close(stage.prefill(tokens[:90], cache, logits=True), want[89], tol)
    for j in range(90, 100):
        _close(stage.decode(int(tokens[j]), cache, logits=True), want[j], tol)
    assert cache.length == 100


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_match_reference(tiny: GGUFFile, device: str) -> None:
    """Greedy generation (exact numerics) gives the reference model's tokens; on CUDA through graph decode."""
    cfg = tiny.config
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    ref = DS4Model(cfg, {n: q.dequantize() for n, q in load_tensors(tiny).items()}, round_trips=OFF)
    rc = ref.new_cache(64, chunk=64)
    want = [int(ref.prefill(prompt, rc, logits=True).argmax())]
    for _ in range(11):
        want.append(int(ref.decode(want[-1], rc, logits=True).argmax()))
    stage = GpuStage(cfg, load_tensors(tiny), device=device, round_trips=OFF, int_dot=False)
    cache = stage.new_cache(64, chunk=64)
    got = [int(stage.prefill(prompt, cache, logits=True).argmax())]
    for _ in range(11):
        got.append(int(stage.decode(got[-1], cache, logits=True).argmax()))  # read before the buffer is reused
    assert got == want


def test_eager_decode_equals_prefill_path(tiny: GGUFFile, reference) -> None:
    """Decode's static-shape path (bucketed reads, masked block writes) == one-token prefill chunks."""
    tokens, _, rt = reference
    stage = GpuStage(tiny.config, load_tensors(tiny), device="cpu", round_trips=rt)
    a, b = stage.new_cache(256, chunk=8), stage.new_cache(256, chunk=8)
    stage.prefill(tokens[:29], a)
    stage.prefill(tokens[:29], b)
    for j in range(29, 37):  # crosses ratio-4 and ratio-16 block ends (32) and the window
        la = stage.decode(int(tokens[j]), a, logits=True, graph=False)
        lb = stage.prefill(tokens[j:j + 1], b, logits=True)
        assert torch.allclose(la, lb, rtol=0, atol=1e-5 * lb.abs().max().item())
    for i in stage.layers:
        if a[i].comp is not None:
            close = torch.isclose(a[i].comp[:9], b[i].comp[:9], rtol=0, atol=1e-5)
            # Decode and prefill attend by different code (summation order), so the rows agree to fp32
            # rounding; with the round trips such a difference can also move one FP8 value across a rounding
            # boundary (one e4m3 step).
            assert close.all() if rt == OFF else close.float().mean() > 0.99, (i, close.float().mean())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["full", "middle"])
def test_short_prefill_as_a_static_step_equals_chunked_prefill(tiny: GGUFFile, device: str, form: str) -> None:
    """A short prompt as one static-shape step padded to its row class (a CUDA graph on a GPU; the same ops
    launched eagerly on a CPU) gives the chunked prefill's result and leaves the cache as the chunked prefill
    does: the turns after it, decode included, agree. Turns of 22 (class 24), 5 (8) and 30 (32) tokens: the
    padding runs past window, ratio-4 and ratio-16 block ends that the real rows do not reach."""
    cfg = tiny.config
    middle = form == "middle"
    layers = range(2, 5) if middle else None
    w = load_tensors(tiny, layers, embed=not middle, output=not middle)
    stage = GpuStage(cfg, w, layers, embed=not middle, output=not middle, device=device, round_trips=OFF,
                     int_dot=False)
    stage.graphs = device == "cuda"  # on a CPU: the static steps' ops launched eagerly (graphs off)
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, cfg.vocab_size, (70,), generator=gen).to(device)
    X = (torch.randn(70, cfg.hc_mult, cfg.dim, generator=gen) * 0.5).to(device) if middle else None
    a, b = stage.new_cache(128, chunk=32, rollback=16), stage.new_cache(128, chunk=32, rollback=16)
    # on a GPU the chunked prefill's attention rounds its dot operands to fp16, the static step's to TF32
    # (dispatch.attention_prefill_tiles / attention_tiles): 2.2e-3 on the H100 (docs/PERFORMANCE.md, 34th session)
    tol = 5e-3 if device == "cuda" else 1e-5
    cuts = [0, 22, 27, 57]
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        assert stage.short_rows(e - s, a) in (8, 24, 32)
        x = None if X is None else X[s:e]
        got = stage.prefill(tokens[s:e], a, x, logits=not middle, graph=True)
        want = stage.prefill(tokens[s:e], b, x, logits=not middle, graph=False)
        assert got.shape == want.shape
        _close(got, want, tol)
    assert a.length == b.length == 57 and a.written == 59 and b.written == 57  # 30 tokens padded to 32
    # the padding's rows took ring slots: a truncate back over them is refused (slack 32: 57 - 26 would do)
    assert not a.truncate(26) and a.length == 57 and 57 - 26 <= b.max_rollback
    for j in range(57, 62):  # decode on: over the KV the static steps wrote (blocks closing at 59 and 63)
        x = None if X is None else X[j:j + 1]
        _close(stage.decode(int(tokens[j]), a, x, logits=not middle), stage.decode(int(tokens[j]), b, x,
                                                                             logits=not middle), tol)
    for i in stage.layers:
        if a[i].comp is not None:
            n = 62 // cfg.ratio(i)  # the blocks real positions closed (padded ones wrote rows past them)
            assert torch.allclose(a[i].comp[:n].float(), b[i].comp[:n].float(), rtol=0, atol=tol * 10)


def test_short_rows_classes(tiny: GGUFFile) -> None:
    stage = GpuStage(tiny.config, load_tensors(tiny), device="cpu", round_trips=OFF)
    cache = stage.new_cache(100, chunk=16)
    assert [stage.short_rows(n, cache) for n in (1, 2, 3, 4, 5, 16, 17)] == [0, 2, 3, 4, 8, 16, 0]  # 17 > chunk
    cache.length = 90
    assert stage.short_rows(8, cache) == 8 and stage.short_rows(9, cache) == 0  # 90 + 16 > ctx
    assert stage.bucket(cache, 8) == 100  # the context caps the bucket


class _NoGraphs:
    """Stands in for a step graph where capture is unsupported (a driver or ROCm build without graphs)."""

    made = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        type(self).made += 1
        raise RuntimeError("operation not supported while the stream is capturing")


def test_graph_capture_failure_with_dependent_launches_retries_in_stream_order(
        tiny: GGUFFile, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A capture that fails while kernels launch with PDL (a driver that cannot put dependent launches in a graph)
    is retried once with PDL off, keeping the graphs; a second failure falls back to eager launches."""
    stage = GpuStage(tiny.config, load_tensors(tiny), device="cpu", round_trips=OFF)
    monkeypatch.setattr(pdl, "ON", True)
    monkeypatch.setattr(pdl, "enabled", lambda device: pdl.ON)  # as on an sm_90 GPU
    tries: list[bool] = []

    def make() -> object:
        tries.append(pdl.ON)
        if pdl.ON:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "graph"

    with caplog.at_level(logging.WARNING, logger="ds4station.engine.gpu"):
        assert stage._graph(True, ("k",), make) == "graph"
    assert tries == [True, False] and not pdl.ON and stage.graphs
    assert "stream order" in caplog.records[0].message
    tries.clear()
    assert stage._graph(True, ("k",), make) == "graph" and tries == []  # kept
    monkeypatch.setattr(pdl, "ON", True)
    assert stage._graph(True, ("k2",), lambda: (_ for _ in ()).throw(RuntimeError("no graphs"))) is None
    assert not stage.graphs and not pdl.ON  # retried without PDL, failed again: eager from now on


def test_graph_capture_failure_falls_back_to_eager(tiny: GGUFFile, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A failed capture warns once and decode goes on with eager launches (the same logits, no retries);
    DS4STATION_CUDA_GRAPHS=0 never tries."""
    monkeypatch.setattr(gpu, "_StepGraph", _NoGraphs)
    monkeypatch.setattr(_NoGraphs, "made", 0)
    tokens = torch.randint(0, tiny.config.vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    stage = GpuStage(tiny.config, load_tensors(tiny), device="cpu", round_trips=OFF)
    assert stage.graphs
    a, b = stage.new_cache(64, chunk=16), stage.new_cache(64, chunk=16)
    stage.prefill(tokens[:20], a)
    stage.prefill(tokens[:20], b)
    eager = []
    with caplog.at_level(logging.WARNING, logger="ds4station.engine.gpu"):
        for j in range(20, 24):
            got = stage.decode(tokens[j], a, logits=True, graph=True).clone()
            eager.append(stage.decode(tokens[j], b, logits=True, graph=False))
            assert torch.equal(got, eager[-1])
    assert _NoGraphs.made == 1 and not stage.graphs
    assert [r.message for r in caplog.records if "capture failed" in r.message] == [caplog.records[0].message]
    assert "eager launches" in caplog.records[0].message and "RuntimeError" in caplog.records[0].message

    monkeypatch.setenv("DS4STATION_CUDA_GRAPHS", "0")
    off = GpuStage(tiny.config, load_tensors(tiny), device="cpu", round_trips=OFF)
    c = off.new_cache(64, chunk=16)
    off.prefill(tokens[:20], c)
    assert not off.graphs and torch.equal(off.decode(tokens[20], c, logits=True, graph=True), eager[0])
    assert _NoGraphs.made == 1


def test_missing_weight_is_named(tiny: GGUFFile) -> None:
    w = dict(load_tensors(tiny))
    del w["blk.3.attn_kv.weight"]
    with pytest.raises(KeyError, match="blk.3.attn_kv.weight"):
        GpuStage(tiny.config, w, device="cpu")


def test_decode_bytes_per_token_of_the_q2_file() -> None:
    """~9.5 GB of weights per decoded token (DS4-MODEL.md): all dense tensors, 6 of 256 routed experts."""
    from ds4station.engine.benchmark import decode_bytes_per_token
    from ds4station.model.config import FLASH
    from ds4station.model.layout import model_tensors

    specs = model_tensors(FLASH, "q2")
    n = decode_bytes_per_token(FLASH, specs)
    assert 9.4e9 < n < 9.7e9
    experts = sum(s.n_bytes for s in specs if s.is_routed_expert)
    dense = sum(s.n_bytes for s in specs if not s.is_routed_expert and s.role not in ("token_embd", "ffn_gate_tid2eid"))
    assert n == int(dense + experts * 6 / 256)


def test_bench_table_says_when_no_greedy_hash_was_taken() -> None:
    """The hash is of the decode after an empty prompt; a run without one says so instead of an empty hash."""
    from ds4station.engine.benchmark import BenchResult

    res = BenchResult("flash-q2", "H200", 1.0, 4000.0, 9_560_000_000, decode={2048: 127.3}, prefill={2048: 2333.3})
    assert res.table().splitlines()[-1] == ("greedy output hash: not taken (it is the decode after an empty "
                                            "prompt: add 0 to --prompts)")
    res.output_hash = "0ba43edf6bd78811"
    assert res.table().splitlines()[-1] == "greedy output hash 0ba43edf6bd78811 (the decode after an empty prompt)"
    assert "decode after 2048 tokens      127.3" in res.table()


def test_random_weights_do_not_depend_on_access_order() -> None:
    from ds4station.engine.gpu import RandomWeights
    from ds4station.model.config import TINY

    a, b = RandomWeights(TINY, device="cpu", seed=2), RandomWeights(TINY, device="cpu", seed=2)
    names = list(a)
    first = {n: a[n] for n in names}
    for n in reversed(names):
        x, y = first[n], b[n]
        assert torch.equal(getattr(x, "data", x), getattr(y, "data", y)), n
    assert not torch.equal(RandomWeights(TINY, device="cpu", seed=3)["blk.2.attn_q_b.weight"].data,
                           first["blk.2.attn_q_b.weight"].data)


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    """The tiny shape in the q4 recipe: Q4_K routed experts in every layer (as the q4-imatrix Flash file)."""
    return GGUFFile.open(make_model(tmp_path_factory.mktemp("g4") / "tiny-q4.gguf", seed=11, quant="q4"))


@pytest.mark.skipif(not dispatch.interpreting(), reason="on a GPU the cuda cases above run the same kernels")
@pytest.mark.parametrize("experts", ["q2", "q4"])
def test_kernel_path_end_to_end_in_the_interpreter(tiny: GGUFFile, tiny_q4: GGUFFile, experts: str) -> None:
    """The GPU code path itself, every Triton launch (Q8_0 matvec and tl.dot matmul, fused MoE decode and
    grouped prefill, hyper-connections, router, decode attention), run by the Triton interpreter on a slice
    with a hash-routed ratio-4 + indexer layer and a biased ratio-16 layer, against the reference slice; with
    the q2 file's IQ2_XXS / Q2_K experts and with Q4_K experts (the q4 file)."""
    tiny = tiny_q4 if experts == "q4" else tiny
    assert {tiny.specs[f"blk.2.ffn_{p}_exps.weight"].qtype.name for p in ("gate", "down")} == \
        ({"Q4_K"} if experts == "q4" else {"IQ2_XXS", "Q2_K"})
    cfg, layers = tiny.config, range(2, 4)
    tokens = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(9))
    ref = DS4Model(cfg, {n: q.dequantize() for n, q in load_tensors(tiny, layers).items()}, layers, round_trips=OFF)
    want = ref.head(ref.prefill(tokens, ref.new_cache(13, chunk=13)))
    stage = GpuStage(cfg, load_tensors(tiny, layers), layers, device="cpu", round_trips=OFF, int_dot=False)
    cache = stage.new_cache(64, chunk=12)
    short = stage.new_cache(64, chunk=16)
    stage.graphs = False  # the short prompt's static step (rows padded to 16), its ops launched eagerly
    with dispatch.interpreted_kernels():
        got = [stage.prefill(tokens[:12], cache, logits=True),
               stage.decode(int(tokens[12]), cache, logits=True, graph=False),
               stage.prefill(tokens[:12], short, logits=True, graph=True)]
    _close(got[0], want[11], 2e-2)  # prefill feeds fp16 into tl.dot
    _close(got[1], want[12], 1e-3)  # fp32 decode kernels, over KV the fp16 prefill wrote
    _close(got[2], want[11], 2e-2)
    assert short.written == 16 and cache.written == 13


@pytest.mark.parametrize("device", [d for d in DEVICES if d == "cuda" or dispatch.interpreting()])
def test_padding_rows_stay_copies_of_the_last_row(tiny: GGUFFile, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verification step is padded to its row class with copies of its last real row (same token, position
    and slot), which write that row's KV rows again: they must stay exact copies through every layer, or the
    last row's KV is whatever the padding wrote last (a race between programs on a GPU). The integer-dot MoE
    decode kernels skip the padding (zero rows out); hc_post gives it the last row's output. Kernel path (the
    interpreter on the CPU), two sequences' 3 + 2 rows in a step of 8: after every hc_post the padding equals
    row 4 bit for bit."""
    cfg, layers = tiny.config, range(2, 4)
    stage = GpuStage(cfg, load_tensors(tiny, layers), layers, device=device, round_trips=OFF, int_dot=True)
    stage.graphs = False  # the step's launches eagerly, so each hc_post can be looked at
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(14))
    states: list[torch.Tensor] = []
    real = gpu.hc_k.hc_post

    def hc_post(*a, **k):  # noqa: ANN002, ANN003, ANN202
        X, part = real(*a, **k)
        states.append(X.clone())
        return X, part

    pool = stage.new_caches(2, 64, chunk=16)
    with dispatch.interpreted_kernels() if device == "cpu" else contextlib.nullcontext():
        for b, c in enumerate(pool):
            stage.prefill(tokens[b, :9], c)
        monkeypatch.setattr(gpu.hc_k, "hc_post", hc_post)
        stage.verify_batch([tokens[0, 9:12].tolist(), tokens[1, 9:11].tolist()], pool, logits=False)
    assert len(states) == 2 * len(layers)
    for X in states:
        assert X.shape[0] == 8 and all(torch.equal(X[r], X[4]) for r in range(5, 8))


@pytest.mark.skipif(not dispatch.interpreting(), reason="the interpreter's case; on a GPU every decode test runs it")
def test_producers_quantise_for_their_integer_dot_consumers(tiny: GGUFFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a projection or the experts read their input quantised (the integer-dot kernels: Q8_0 at one or two
    rows, the routed experts), the launch that makes the input emits it quantised too: the RMSNorms (attention
    norm -> q_a + kv and FFN norm -> shared and routed experts, both in hc_pre's launch; q_a norm -> q_b; output
    norm -> head, in hc_head_pre's), the decode
    attention's combine (-> the grouped output a) and the shared expert's swiglu (-> its down). Interpreter, every
    integer-dot route forced on: the same logits, bit for bit, as when each consumer quantises its input itself,
    and of the 7 quantiser launches that takes only output b's is left (its input is a matvec's output)."""
    from ds4station.kernels import act_quant
    from ds4station.kernels import hc as hc_k

    cfg, layers = tiny.config, range(2, 3)
    real_route = dispatch.q8_0_route
    monkeypatch.setattr(dispatch, "q8_0_route", lambda n, k, m, backend, quantised=False: "int_dot" if m <= 2 else
                        real_route(n, k, m, backend, quantised))
    stage = GpuStage(cfg, load_tensors(tiny, layers), layers, device="cpu", round_trips=OFF, int_dot=True)
    stage.graphs = False
    tokens = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(12))
    quants: list[tuple] = []
    launched: list[str] = []
    real_norm, real_swiglu, real_attention, real_quantize = gpu._norm, gpu.swiglu, gpu.attention_decode, \
        act_quant._quantize
    real_hc_pre, real_head_pre = hc_k.hc_pre, hc_k.hc_head_pre

    def norm(x, weight, eps, *quant):  # noqa: ANN001, ANN202
        quants.append(quant)
        return real_norm(x, weight, eps, *quant)

    def hc_pre(*args, quant=(), part=None, keep=True):  # noqa: ANN001, ANN002, ANN202 (attention and FFN norms)
        quants.append(tuple(quant))
        return real_hc_pre(*args, quant if keep else [None] * len(quant), part)

    def head_pre(*args, keep=True):  # noqa: ANN001, ANN002, ANN202 (the output norm)
        quants.append(args[7:] or (None,))
        return real_head_pre(*args[:7], *(args[7:] if keep else ()))

    def quantize(x, quant):  # noqa: ANN001, ANN202
        launched.append(quant)
        return real_quantize(x, quant)

    monkeypatch.setattr(act_quant, "_quantize", quantize)
    got = []
    for fused in (True, False):
        if not fused:  # every consumer quantises its own input, as before
            monkeypatch.setattr(gpu, "_norm", lambda x, weight, eps, *quant: real_norm(x, weight, eps,
                                                                                     *[None] * len(quant)))
            monkeypatch.setattr(gpu, "swiglu", lambda gu, clamp, act16=False: (real_swiglu(gu, clamp), None)
                                if act16 else real_swiglu(gu, clamp))
            monkeypatch.setattr(gpu, "attention_decode", lambda *a, act16=False, **k: (real_attention(*a, **k), None)
                                if act16 else real_attention(*a, **k))
            monkeypatch.setattr(hc_k, "hc_pre", lambda *a: hc_pre(*a[:8], quant=a[8], part=a[9], keep=False))
            monkeypatch.setattr(hc_k, "hc_head_pre", lambda *a: head_pre(*a, keep=False))
        else:
            monkeypatch.setattr(gpu, "_norm", norm)
            monkeypatch.setattr(hc_k, "hc_pre", lambda *a: hc_pre(*a[:8], quant=a[8], part=a[9]))
            monkeypatch.setattr(hc_k, "hc_head_pre", head_pre)
        cache = stage.new_cache(64, chunk=32)
        stage.prefill(tokens[:18], cache)  # torch references
        quants.clear()
        launched.clear()
        with dispatch.interpreted_kernels():
            got.append(stage.decode(int(tokens[18]), cache, logits=True, graph=False))
        if fused:  # the decode step's: attention norm (in hc_pre), q_a norm, FFN norm (hc_pre), the output norm
            assert quants == [("act16",), ("act16",), ("act16", "iq2_xxs"), ("act16",)]
            assert [q for q in launched if q == "act16"] == ["act16"]  # output b's
        else:
            assert [q for q in launched if q == "act16"] == ["act16"] * 7
    assert torch.equal(got[0], got[1])


@pytest.mark.skipif(not dispatch.interpreting(), reason="on a GPU the cuda case of the batched test runs them")
def test_batched_decode_kernels_in_the_interpreter(tiny: GGUFFile) -> None:
    """The batched decode step's own launches (ring writes, compressor updates, indexer scores and decode
    attention of several sequences in one launch each, every row reaching its sequence through its pool slot)
    run by the Triton interpreter: each row equals that sequence decoded alone by the same kernels, across a
    ratio-4 block end and with the indexer choosing among blocks."""
    cfg, layers = tiny.config, range(2, 4)
    stage = GpuStage(cfg, load_tensors(tiny, layers), layers, device="cpu", round_trips=OFF, int_dot=False)
    stage.graphs = False
    gen = torch.Generator().manual_seed(5)
    lengths = (13, 22, 27)
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=gen)
    pool = stage.new_caches(4, 64, chunk=32)
    batched = [pool[2], pool[0], pool[3]]
    alone = [stage.new_cache(64, chunk=32) for _ in lengths]
    for b, n in enumerate(lengths):  # the prompts through the torch references (fast), the steps in Triton
        for c in (batched[b], alone[b]):
            stage.prefill(tokens[b, :n], c)
    with dispatch.interpreted_kernels():
        for step in range(2):  # positions 23 and 27 close ratio-4 blocks
            ids = [int(tokens[b, n + step]) for b, n in enumerate(lengths)]
            got = stage.decode_batch(ids, batched, logits=True).clone()
            for b, c in enumerate(alone):
                _close(got[b], stage.decode(ids[b], c, logits=True, graph=False), 1e-4)
        # the static steps of one sequence reach slot 1 of the pool (untouched until now) as they reach a cache of
        # its own: a short prompt of 14 tokens padded to 16 rows across a block end, then a decode step
        own = stage.new_cache(64, chunk=32)
        for c in (pool[1], own):
            c.length = 20
        got = [stage.prefill(tokens[0, 20:34], pool[1], logits=True, graph=True),
               stage.decode(int(tokens[0, 34]), pool[1], logits=True, graph=False)]
        want = [stage.prefill(tokens[0, 20:34], own, logits=True, graph=True),
                stage.decode(int(tokens[0, 34]), own, logits=True, graph=False)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for a, b in zip(batched, alone, strict=True):
        assert torch.equal(a[2].raw, b[2].raw) and torch.equal(a[2].index_keys, b[2].index_keys)


@pytest.mark.parametrize("device", DEVICES)
def test_pipeline_stage_decode_equals_its_prefill_path(tiny: GGUFFile, device: str) -> None:
    """A middle slice (no embedding, no head) as a pipeline stage runs it: decode from an HC state (static
    shapes; a CUDA graph on a GPU) gives prefill's one-token result, the cache advancing the same way."""
    cfg, layers = tiny.config, range(2, 5)
    stage = GpuStage(cfg, load_tensors(tiny, layers, embed=False, output=False), layers, embed=False, output=False,
                     device=device, round_trips=OFF, int_dot=False)
    a, b = stage.new_cache(128, chunk=16), stage.new_cache(128, chunk=16)
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(30, cfg.hc_mult, cfg.dim, generator=gen).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (30,), generator=gen).to(device)
    for c in (a, b):
        stage.prefill(tokens[:16], c, X[:16])
        stage.prefill(tokens[16:24], c, X[16:24])
    for j in range(24, 30):  # crosses the ratio-4 block end at 27
        got = stage.decode(int(tokens[j]), a, X[j:j + 1]).clone()
        want = stage.prefill(tokens[j:j + 1], b, X[j:j + 1])
        tol = 2e-3 if device == "cuda" else 1e-5  # CUDA: TF32 attention in both paths, different kernels
        assert torch.allclose(got, want, rtol=0, atol=tol * want.abs().max().item())
    assert a.length == b.length == 30


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["full", "middle"])
def test_batched_decode_equals_one_sequence_at_a_time(tiny: GGUFFile, device: str, form: str) -> None:
    """One decode step of three sequences at different lengths (crossing compressor block ends and past the
    window, the indexer choosing blocks), slots 3, 0 and 2 of a pool of four, gives each sequence what its own
    decode step gives, and leaves every cache as its own steps do; on a GPU from the graph captured for
    (pool, batch size, bucket), which a different set of the pool's sessions then replays."""
    cfg = tiny.config
    middle = form == "middle"
    layers = range(1, 5) if middle else None
    stage = GpuStage(cfg, load_tensors(tiny, layers, embed=not middle, output=not middle), layers,
                     embed=not middle, output=not middle, device=device, round_trips=OFF, int_dot=False)
    gen = torch.Generator().manual_seed(4)
    lengths = (30, 57, 93)
    tokens = torch.randint(0, cfg.vocab_size, (3, 110), generator=gen)
    X = torch.randn(3, 110, cfg.hc_mult, cfg.dim, generator=gen).to(device) if middle else None
    pool = stage.new_caches(4, 256, chunk=64)
    batched = [pool[3], pool[0], pool[2]]
    alone = [stage.new_cache(256, chunk=64) for _ in lengths]
    for b, n in enumerate(lengths):
        for c in (batched[b], alone[b]):
            stage.prefill(tokens[b, :n], c, None if X is None else X[b, :n])
    tol = 2e-3 if device == "cuda" else 1e-5
    for step in range(12):
        pos = [n + step for n in lengths]
        ids = [int(tokens[b, p]) for b, p in enumerate(pos)]
        xs = None if X is None else torch.stack([X[b, p] for b, p in enumerate(pos)])
        got = stage.decode_batch(ids, batched, xs, logits=not middle).clone()
        for b, c in enumerate(alone):
            want = stage.decode(ids[b], c, None if xs is None else xs[b:b + 1], logits=not middle)
            ref = want.reshape(got[b].shape)
            assert torch.allclose(got[b], ref, rtol=0, atol=tol * ref.abs().max().item()), (step, b)
    assert [c.length for c in batched] == [c.length for c in alone] == [n + 12 for n in lengths]
    for a, b in zip(batched, alone, strict=True):  # the caches hold the same rows
        for x, y in ((a[4].raw, b[4].raw), (a[4].comp, b[4].comp)):
            assert torch.allclose(x, y, rtol=0, atol=tol * y.abs().max().item())
    if device == "cuda":
        assert [k[2] for k in stage._graphs if k[0] == "batch"] == [3]  # one graph: one size, one bucket
    # another set of the pool's sessions, of the same size: slot 1 (empty until now) in the place of slot 3
    stage.prefill(tokens[0, :30], pool[1], None if X is None else X[0, :30])
    again = stage.new_cache(256, chunk=64)
    stage.prefill(tokens[0, :30], again, None if X is None else X[0, :30])
    trio = [pool[1], pool[0], pool[2]]
    ids = [int(tokens[0, 30]), 7, 9]
    xs = None if X is None else torch.stack([X[0, 30], X[1, 0], X[2, 0]])
    got = stage.decode_batch(ids, trio, xs, logits=not middle).clone()
    want = stage.decode(ids[0], again, None if xs is None else xs[:1], logits=not middle).reshape(got[0].shape)
    assert torch.allclose(got[0], want, rtol=0, atol=tol * want.abs().max().item())
    # a decode step of slot 1 alone (its pool's static graph on a GPU) equals the cache of its own
    one = stage.decode(5, pool[1], None if X is None else X[0, 1:2], logits=not middle).clone()
    two = stage.decode(5, again, None if X is None else X[0, 1:2], logits=not middle)
    assert torch.allclose(one, two, rtol=0, atol=tol * two.abs().max().item())
    if device == "cuda":
        assert len([k for k in stage._graphs if k[0] == "batch"]) == 1  # the same graph replayed
        stage.drop_graphs(batched[1])
        assert not any(k[0] == "batch" for k in stage._graphs)
    with pytest.raises(ValueError, match="each sequence once"):
        stage.decode_batch(ids[:2], [batched[0], batched[0]], None if xs is None else xs[:2], logits=not middle)


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_on_the_device_give_the_host_tokens_results(tiny: GGUFFile, device: str) -> None:
    """Decode steps fed the previous step's argmax where it was computed (one sequence: its pool's static
    graph; three: the batched graph), never read on the host between steps, give bit for bit the logits of the
    same steps fed host ints, on two pools of the same stage."""
    cfg = tiny.config
    stage = GpuStage(cfg, load_tensors(tiny), device=device, round_trips=OFF)
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(5))
    host, dev = stage.new_caches(3, 128, chunk=64), stage.new_caches(3, 128, chunk=64)
    for caches in (host, dev):
        for b, c in enumerate(caches):
            stage.prefill(tokens[b, :20 + 7 * b], c)
    for rows in (1, 3):
        want = stage.decode_batch([int(t) for t in tokens[:rows, 40 - rows]], host[:rows], logits=True).clone()
        got = stage.decode_batch(tokens[:rows, 40 - rows].to(device), dev[:rows], logits=True).clone()
        for _ in range(4):
            assert torch.equal(got, want)
            picks = want.argmax(-1).tolist()
            want = stage.decode_batch(picks, host[:rows], logits=True).clone()
            got = stage.decode_batch(got.argmax(-1), dev[:rows], logits=True).clone()  # stays on the device
    assert [c.length for c in dev] == [c.length for c in host]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the second stream is a GPU's")
def test_overlapped_projections_give_the_one_stream_results(tiny: GGUFFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Static steps run the compressor / indexer projections, the KV writes with the indexer's selection (beside
    q_b) and the shared expert on a second stream: the same kernels on the same inputs, so a decode step (graph
    replay), a batched step of three sequences and a short prefill give bit-identical results to a stage that
    keeps one stream (DS4STATION_OVERLAP=0)."""
    cfg = tiny.config
    weights = load_tensors(tiny)
    monkeypatch.setenv("DS4STATION_OVERLAP", "0")
    one = GpuStage(cfg, weights, device="cuda")
    monkeypatch.delenv("DS4STATION_OVERLAP")
    two = GpuStage(cfg, weights, device="cuda")
    assert one.side is None and two.side is not None
    tokens = torch.randint(0, cfg.vocab_size, (3, 80), generator=torch.Generator().manual_seed(8))
    for a, b in zip(_every_step(one, tokens, 64), _every_step(two, tokens, 64), strict=True):
        assert torch.equal(a, b)


def _every_step(stage: GpuStage, tokens: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """Logits of each kind of step over three sequences of tokens [3, 80]: prefills (chunked, eager), decode
    steps, batched decode steps, a 5-token static step and a verification of two sequences' rows."""
    pool = stage.new_caches(3, 256, chunk=chunk)
    got = [stage.prefill(tokens[b, :40 + 9 * b], c, logits=True).clone() for b, c in enumerate(pool)]
    got += [stage.decode(int(tokens[0, 40 + j]), pool[0], logits=True).clone() for j in range(6)]
    for j in range(6):
        got.append(stage.decode_batch([int(tokens[b, 60 + j]) for b in range(3)], pool, logits=True).clone())
    got.append(stage.prefill(tokens[1, 70:75], pool[1], logits=True).clone())  # a 5-token static step
    got += stage.verify_batch([tokens[0, 70:73].tolist(), tokens[2, 70:72].tolist()], [pool[0], pool[2]])
    return got


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch is sm_90+")
def test_dependent_launches_give_the_serial_results(tiny: GGUFFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """With programmatic dependent launch (kernels/pdl.py) each kernel starts while the one before it finishes
    and waits for its results on the device: eager prefill chunks, decode graphs, batched graphs, a short
    prefill's static step and a verification of several sequences give bit-identical results to launches in
    plain stream order (DS4STATION_PDL=0)."""
    cfg = tiny.config
    weights = load_tensors(tiny)
    tokens = torch.randint(0, cfg.vocab_size, (3, 80), generator=torch.Generator().manual_seed(9))
    outs = []
    for on in (False, True):
        monkeypatch.setattr(pdl, "ON", on)
        outs.append(_every_step(GpuStage(cfg, weights, device="cuda"), tokens, 32))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static", [False, True], ids=["chunked", "static-step"])
def test_a_verification_gives_every_positions_logits(tiny: GGUFFile, reference, device: str, static: bool) -> None:
    """prefill(all_logits=True), a draft's verification, gives the reference's logits at each position: in
    prefill pieces, and as the static step of its row class (5 rows padded to 8, the head over every row: what
    a GPU replays from a graph), which gives what five decode steps give and can drop rejected drafts."""
    tokens, want, rt = reference
    stage = GpuStage(tiny.config, load_tensors(tiny), device=device, round_trips=rt, int_dot=False)
    if static:
        stage.graphs = device == "cuda"
    cache = stage.new_cache(256, chunk=32)
    stage.prefill(tokens[:90], cache)
    rows = stage.prefill(tokens[90:95], cache, logits=True, all_logits=True, graph=True if static else False)
    assert rows.shape == (5, tiny.config.vocab_size) and cache.length == 95
    _close(rows, want[90:95], 2e-5 if device == "cpu" and rt == OFF else 2e-2 if rt == OFF else 0.3)
    if static:
        alone = stage.new_cache(256, chunk=32)
        stage.prefill(tokens[:90], alone)
        steps = torch.stack([stage.decode(int(t), alone, logits=True).clone() for t in tokens[90:95]])
        # On a GPU the rows' projections take other kernels than one decode row's (the fp16 tensor-core matmul
        # past dispatch.q8_0_matvec_rows). Without the round trips the two agree to 2e-3; with them (FP8 KV rows,
        # the FP4 indexer: coarse steps that a small rounding difference can cross) they differed by 9.3e-2 of
        # the largest logit on the H200 (not traced further), so there the bound is the reference's. On the CPU
        # the two agree to ~1e-6 (the rows' and one row's torch ops round differently); with the round trips
        # such a difference crossed one FP8 step of a KV row at one torch thread (2.2e-4 of the largest logit).
        _close(rows, steps, (1e-5 if rt == OFF else 1e-2) if device == "cpu" else 2e-3 if rt == OFF else 0.3)
        assert cache.truncate(92) and cache.length == 92  # two drafts rejected: their rows dropped


def test_verify_batch_gives_each_sequence_what_its_own_prefill_gives(tiny: GGUFFile) -> None:
    """Several sessions' tokens (a token and its drafts each) in one static step (GpuStage.verify_batch): every
    row's logits equal that sequence's own prefill of the same tokens, across compressor blocks and the indexer,
    and the caches go on exactly as after their own prefills (the next decode step agrees)."""
    cfg = tiny.config
    stage = GpuStage(cfg, load_tensors(tiny), device="cpu", round_trips=OFF, int_dot=False)
    gen = torch.Generator().manual_seed(3)
    lengths = (37, 126, 70)  # the second's rows close a ratio-4 and a ratio-128 block
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    batch, alone = stage.new_caches(3, 512, chunk=64), stage.new_caches(3, 512, chunk=64)
    for p, a, b in zip(prompts, batch, alone, strict=True):
        stage.prefill(p, a)
        stage.prefill(p, b)
    rows = [[5, 6, 7, 8], [9, 10, 11], [12]]  # 8 rows: the class of 8, no padding; then 7 rows, padded
    for step in (rows, [[13, 14, 15], [16], [17, 18, 19]]):
        got = stage.verify_batch(step, batch)
        for i, (t, c) in enumerate(zip(step, alone, strict=True)):
            want = stage.prefill(t, c, logits=True, all_logits=True)
            _close(got[i], want, 1e-5)
    assert [c.length for c in batch] == [c.length for c in alone]
    for a, b in zip(batch, alone, strict=True):
        _close(stage.decode(3, a, logits=True), stage.decode(3, b, logits=True), 1e-5)
    assert stage.multi_rows([[1] * 20, [2] * 13], batch[:2]) == 0  # more rows than the largest class
    with pytest.raises(ValueError, match="do not make one verification step"):
        stage.verify_batch([[1] * 20, [2] * 13], batch[:2])
