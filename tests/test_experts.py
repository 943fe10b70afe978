"""Streamed routed experts (engine/experts.py) on the kernel stage: slots hold exactly the resident packed
experts, generation bit-exact against resident experts (torch fallbacks, and the Triton kernels in the
interpreter), LRU eviction with the running layer pinned, hash-layer prefetch, statistics that add up, and the
refused too-small cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine
from ds4station.engine.experts import ExpertCache, ExpertCacheTooSmall, min_cache_bytes, too_small_message
from ds4station.engine.gpu import GpuStage
from ds4station.engine.model import OFF
from ds4station.engine.weights import load_tensors, tensor_view
from ds4station.kernels import dispatch, ops
from ds4station.kernels.moe_prefill import moe_prefill
from ds4station.model.config import FLASH
from ds4station.model.gguf import GGUFFile
from ds4station.model.layout import model_tensors
from ds4station.model.sizes import format_size

CTX, CHUNK = 96, 16
PROMPT = [(11 * i + 2) % 500 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    return GGUFFile.open(make_model(tmp_path_factory.mktemp("experts") / "tiny-q2.gguf", seed=3))


def _cache(gguf: GGUFFile, layers: range, capacity: int | None = None, prefetch: bool = False) -> ExpertCache:
    tensors = load_tensors(gguf, layers, embed=False, output=False)
    cap = min_cache_bytes(tensors, layers) if capacity is None else capacity
    return ExpertCache(gguf.config, tensors, layers, cap, prefetch=prefetch)


def _ids(*experts: int) -> torch.Tensor:
    return torch.tensor([list(experts)])


def _fields(p: object) -> list[torch.Tensor]:
    return [getattr(p, f.name) for f in dataclasses.fields(p)]


def test_slots_hold_exactly_the_resident_packed_experts(gguf: GGUFFile) -> None:
    cache = _cache(gguf, range(3, 5))
    n = gguf.config.n_experts
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for layer in (3, 4):
        slots = cache.slots(layer, order.view(2, -1))
        assert slots.shape == (2, n // 2) and len(set(slots.flatten().tolist())) == n
        for part, role, pool in zip(("gate", "up", "down"), ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                                    cache.parts(), strict=True):
            q = tensor_view(gguf, f"blk.{layer}.{role}.weight")
            full = ops.repack(q.data.view(q.shape[0], q.shape[1], -1), q.qtype.name, q.shape[-1])
            for e, s in zip(order.tolist(), slots.flatten().tolist(), strict=True):
                for a, b in zip(_fields(pool), _fields(full), strict=True):
                    assert torch.equal(a[s], b[e]), (layer, part, e)


@pytest.fixture(scope="module")
def gguf_q4(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    return GGUFFile.open(make_model(tmp_path_factory.mktemp("experts4") / "tiny-q4.gguf", seed=3, quant="q4"))


@pytest.mark.parametrize("experts", ["q2", "q4"])
def test_streaming_generation_matches_resident_exactly(gguf: GGUFFile, gguf_q4: GGUFFile, experts: str) -> None:
    """Resident and streamed experts give the same logits bit for bit, for the q2 file's IQ2_XXS / Q2_K
    experts and for Q4_K ones (the q4 file)."""
    gguf = gguf_q4 if experts == "q4" else gguf
    path = gguf.path
    resident = Engine.load(path, ctx=CTX, device="cpu", chunk=CHUNK, compute="kernels")
    need = min_cache_bytes(load_tensors(gguf), range(gguf.config.n_layers))
    streamed = Engine.load(path, CTX, device="cpu", expert_cache=need, chunk=CHUNK, activation_bits=32)
    try:
        assert streamed.world == 1 and streamed.procs == {}  # one stage, in this process
        assert streamed.stage_stats()[0]["compute"] == "kernels"  # the kernel stage streams, on the CPU too
        a, b = resident.new_session(), streamed.new_session()
        la, lb = a.extend(PROMPT), b.extend(PROMPT)
        for _ in range(5):
            assert torch.equal(la, lb)
            t = int(la.argmax())
            la, lb = a.extend([t]), b.extend([t])
        assert torch.equal(la, lb)
        stats = streamed.stage_stats()[0]["expert_cache"]
        # six layers through one layer's worth of slots: experts come and go, and the numbers add up
        assert stats["slots"] == gguf.config.n_experts and stats["evictions"] > 0 and stats["prefetched"] > 0
        assert stats["hits"] + stats["misses"] == stats["lookups"]
        assert stats["bytes_read"] == stats["misses"] * stats["slot_bytes"]
        assert stats["device_bytes"] >= stats["slots"] * stats["slot_bytes"]
    finally:
        streamed.close()
        resident.close()


@pytest.mark.skipif(not dispatch.interpreting(), reason="on a GPU test_gpu_stage's cuda cases run the kernels")
def test_streaming_through_the_kernels_in_the_interpreter_equals_resident(gguf: GGUFFile) -> None:
    """The GPU code path, run by the Triton interpreter: a slice with a hash-routed ratio-4 + indexer layer
    and a biased ratio-16 layer streams its experts (the fused MoE decode kernels read the pool through the
    slot table) and gives exactly the resident logits; the grouped prefill kernels read slots exactly too."""
    cfg, layers = gguf.config, range(2, 4)
    tokens = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(9))
    tensors = load_tensors(gguf, layers)
    cache = ExpertCache(cfg, tensors, layers, min_cache_bytes(tensors, layers) + 3 * 55296)
    got, want = [], []
    with dispatch.interpreted_kernels():
        for out, experts in ((want, None), (got, cache)):
            stage = GpuStage(cfg, tensors, layers, device="cpu", round_trips=OFF, int_dot=False, experts=experts)
            kv = stage.new_cache(64, chunk=8)
            out += [stage.prefill(tokens[:6], kv, logits=True), stage.decode(int(tokens[6]), kv, logits=True)]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        s = cache.stats
        assert s.misses > 0 and s.hits + s.misses == s.lookups and s.bytes_read == s.misses * cache.slot_bytes
        x = torch.randn(5, cfg.dim, generator=torch.Generator().manual_seed(2))
        ids = torch.randint(0, cfg.n_experts, (5, cfg.n_experts_used), generator=torch.Generator().manual_seed(3))
        wts = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4))
        resident = [ops.repack(q.data.view(q.shape[0], q.shape[1], -1), q.qtype.name, q.shape[-1])
                    for q in (tensors[f"blk.3.{r}.weight"] for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))]
        assert torch.equal(moe_prefill(x, *cache.parts(), cache.slots(3, ids), wts),
                           moe_prefill(x, *resident, ids, wts))


def test_lru_evicts_oldest_unpinned_and_never_the_running_layer(gguf: GGUFFile) -> None:
    cache = _cache(gguf, range(3, 5))  # exactly 8 slots, no prefetch
    n = gguf.config.n_experts
    cache.slots(3, _ids(0, 1, 2))
    assert cache.stats.misses == 3 and cache.stats.lookups == 3
    cache.slots(4, torch.arange(n).view(1, -1))  # every expert of layer 4: layer 3's are evicted, none pinned
    assert set(cache.slot_of) == {(4, e) for e in range(n)}
    assert cache.stats.evictions == 3
    cache.slots(4, _ids(7, 2))  # hits refresh the LRU order
    assert cache.stats.hits == 2
    slot = cache.slots(3, _ids(5))  # evicts the least recently selected unpinned expert: (4, 0)
    assert (4, 0) not in cache.slot_of and (3, 5) in cache.slot_of and (4, 7) in cache.slot_of
    assert cache.pinned == {(3, 5)} and int(slot) == cache.slot_of[(3, 5)]
    s = cache.stats
    assert s.hits + s.misses == s.lookups == 3 + n + 2 + 1
    assert s.bytes_read == s.misses * cache.slot_bytes


def test_prefetch_loads_the_hash_layers_experts_ahead(gguf: GGUFFile) -> None:
    cfg = gguf.config
    assert cfg.is_hash_layer(1) and cfg.is_hash_layer(0)
    cache = _cache(gguf, range(0, 2), capacity=2 * min_cache_bytes(load_tensors(gguf), range(0, 2)), prefetch=True)
    tokens = torch.tensor([5, 9, 100])
    ahead = {layer: sorted(set(tensor_view(gguf, f"blk.{layer}.ffn_gate_tid2eid.weight").dequantize()[tokens]
                               .flatten().tolist())) for layer in (0, 1)}
    cache.prefetch(tokens)
    assert cache.stats.prefetched == cache.stats.misses == sum(len(v) for v in ahead.values())
    for layer in (0, 1):
        hits = cache.stats.hits
        cache.slots(layer, torch.tensor([ahead[layer]]))
        assert cache.stats.hits == hits + len(ahead[layer])  # the layer found everything in place
    assert cache.stats.hits + cache.stats.misses == cache.stats.lookups
    cache.prefetch(tokens)  # all there already: nothing read
    assert cache.stats.prefetched == sum(len(v) for v in ahead.values())


def test_prefetch_never_evicts_the_running_layers_experts(gguf: GGUFFile) -> None:
    n = gguf.config.n_experts
    cache = _cache(gguf, range(0, 2), prefetch=True)  # exactly one layer's table
    cache.slots(0, torch.arange(n).view(1, -1))  # all 8 slots pinned by layer 0
    cache.prefetch(torch.tensor([5, 9, 100]))
    assert cache.stats.prefetched == 0
    assert set(cache.slot_of) == {(0, e) for e in range(n)}


def test_dry_selections_read_and_count_nothing(gguf: GGUFFile) -> None:
    cache = _cache(gguf, range(0, 2), prefetch=True)
    cache.dry = True
    slots = cache.slots(1, _ids(7, 3))
    cache.prefetch(torch.tensor([5, 9]))
    assert slots.tolist() == [[7 % cache.n_slots, 3 % cache.n_slots]]
    assert cache.stats.lookups == 0 and not cache.slot_of


def test_too_small_cache_is_refused_with_the_minimum(gguf: GGUFFile) -> None:
    layers = range(0, 6)
    tensors = load_tensors(gguf, layers, embed=False, output=False)
    need = min_cache_bytes(tensors, layers)
    per = sum(tensors[f"blk.0.{r}.weight"].nbytes for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert need == per  # all experts of one layer: gate + up + down
    with pytest.raises(ExpertCacheTooSmall, match=rf"8 experts x .* = {format_size(need)} \({need} bytes\)"):
        ExpertCache(gguf.config, tensors, layers, need - 1)
    assert ExpertCache(gguf.config, tensors, layers, need).n_slots == gguf.config.n_experts
    # what `generate --expert-cache` / `serve --expert-cache` meet first, before anything is loaded
    with pytest.raises(ExpertCacheTooSmall, match=rf"stage 0 .*minimum; give --expert-cache {format_size(need)}"):
        Engine.load(gguf.path, CTX, device="cpu", expert_cache="100KiB")


def test_minimum_for_the_real_q2_file_is_one_layers_256_experts() -> None:
    specs = {s.role: s for s in model_tensors(FLASH, "q2", range(3, 4), embed=False, output=False)}
    per = sum(specs[r].n_bytes for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) // FLASH.n_experts
    assert per == 7077888  # 6.75 MiB: IQ2_XXS gate and up, Q2_K down
    msg = too_small_message(1 << 30, FLASH.n_experts, per)
    assert "256 experts x 6912KiB = 1728MiB (1.69 GiB, 1811939328 bytes) is the minimum" in msg
    assert "--expert-cache 1728MiB" in msg


def test_a_streaming_server_reports_its_cache_in_status_and_metrics(gguf: GGUFFile) -> None:
    """`serve --expert-cache` as a client sees it: answers through the official SDK, the cache's counters in
    /status (which the control panel reads) and in /metrics, adding up."""
    import httpx
    import openai

    from ds4station.engine.scheduler import Scheduler
    from ds4station.server.app import BackgroundServer, create_app

    need = min_cache_bytes(load_tensors(gguf), range(gguf.config.n_layers))
    scheduler = Scheduler(lambda: Engine.load(gguf.path, 1024, device="cpu", expert_cache=need, chunk=CHUNK),
                          sessions=1, ctx=1024)
    srv = BackgroundServer(create_app(scheduler, model_name="tiny", model_path=str(gguf.path), ctx=1024)).start()
    try:
        assert srv.wait_ready(60)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        cache = httpx.get(srv.url + "/status").json()["expert_cache"]
        assert cache["capacity_bytes"] == need and cache["misses"] > 0
        assert cache["hits"] + cache["misses"] == cache["lookups"] and cache["stream_s"] > 0
        metrics = {line.split()[0]: float(line.split()[1]) for line in httpx.get(srv.url + "/metrics").text.splitlines()
                   if line.startswith("ds4_expert_cache")}
        assert metrics["ds4_expert_cache_hits_total"] + metrics["ds4_expert_cache_misses_total"] == \
            metrics["ds4_expert_cache_lookups_total"] >= cache["lookups"]
        assert metrics["ds4_expert_cache_read_bytes_total"] == metrics["ds4_expert_cache_misses_total"] * 55296
        assert metrics["ds4_expert_cache_capacity_bytes"] == need
    finally:
        srv.stop()


def test_a_streaming_stage_across_expert_types_is_refused_and_split_it_streams(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The q2-q4 layout (tiny: layer 5's experts Q4_K, the others IQ2_XXS / Q2_K): one streaming stage over
    both forms is refused before anything starts, naming the layer to split at; split there, both stages
    stream (two stages on one device) and give the resident tokens."""
    from ds4station.model.route import RouteError

    path = make_model(tmp_path / "tiny-q2-q4.gguf", seed=3, quant="q2-q4")
    g = GGUFFile.open(path)
    need = min_cache_bytes(load_tensors(g), range(g.config.n_layers))
    with pytest.raises(RouteError, match="split the stage at layer 5"):
        Engine.load(path, CTX, device="cpu", expert_cache=need, chunk=CHUNK)
    route = f"cpu=embed,0-4,cache={need}; cpu=5,output,cache={need}"
    with Engine.load(path, CTX, route, chunk=CHUNK, activation_bits=32) as split, \
            Engine.load(path, CTX, device="cpu", chunk=CHUNK, compute="kernels") as resident:
        a, b = split.new_session(), resident.new_session()
        la, lb = a.extend(PROMPT), b.extend(PROMPT)
        for _ in range(3):
            assert int(la.argmax()) == int(lb.argmax())
            t = int(lb.argmax())
            la, lb = a.extend([t]), b.extend([t])
        assert all(s["expert_cache"]["misses"] > 0 for s in split.stage_stats())
