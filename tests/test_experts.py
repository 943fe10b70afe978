"""Streamed routed experts (engine/experts.py): bit-exact against resident experts, LRU eviction with the
running layer pinned, prefetch, statistics that add up, and the refused too-small cache."""

from __future__ import annotations

import pytest
import torch

from ds4station.engine.demo import make_model
from ds4station.engine.engine import Engine
from ds4station.engine.experts import ExpertCache, ExpertCacheTooSmall, ExpertView, min_cache_bytes, too_small_message
from ds4station.engine.weights import load_tensors, tensor_view
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


def test_streamed_rows_equal_the_resident_dequantisation(gguf: GGUFFile) -> None:
    cache = _cache(gguf, range(3, 4))
    for part, role in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
        full = tensor_view(gguf, f"blk.3.{role}.weight").dequantize()
        view = cache.view(3, part)
        assert isinstance(view, ExpertView) and view.is_floating_point() and view.shape == tuple(full.shape)
        for e in range(gguf.config.n_experts):
            assert torch.equal(view[e], full[e])


def test_streaming_generation_matches_resident_exactly(gguf: GGUFFile) -> None:
    path = gguf.path
    resident = Engine.load(path, ctx=CTX, device="cpu", chunk=CHUNK)
    tensors = load_tensors(gguf)
    need = min_cache_bytes(tensors, range(gguf.config.n_layers))
    streamed = Engine.load(path, CTX, device="cpu", expert_cache=need, chunk=CHUNK, activation_bits=32)
    try:
        assert streamed.world == 1 and streamed.procs == {}  # one stage, in this process
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
    finally:
        streamed.close()


def test_lru_evicts_oldest_unpinned_and_never_the_running_layer(gguf: GGUFFile) -> None:
    cache = _cache(gguf, range(3, 5))  # exactly 8 slots, no prefetch
    n = gguf.config.n_experts
    cache.select(3, _ids(0, 1, 2))
    assert cache.stats.misses == 3 and cache.stats.lookups == 3
    cache.select(4, torch.arange(n).view(1, -1))  # every expert of layer 4: layer 3's are evicted, none pinned
    assert set(cache.slot_of) == {(4, e) for e in range(n)}
    assert cache.stats.evictions == 3
    cache.select(4, _ids(7, 2))  # hits refresh the LRU order
    assert cache.stats.hits == 2
    cache.select(3, _ids(5))  # evicts the least recently selected unpinned expert: (4, 0)
    assert (4, 0) not in cache.slot_of and (3, 5) in cache.slot_of and (4, 7) in cache.slot_of
    assert cache.pinned == {(3, 5)}
    s = cache.stats
    assert s.hits + s.misses == s.lookups == 3 + n + 2 + 1
    assert s.bytes_read == s.misses * cache.slot_bytes
    # get() hands out the pinned slot's expert; an expert used without select() is looked up on demand
    assert torch.equal(cache.get(3, 5, "down"), tensor_view(gguf, "blk.3.ffn_down_exps.weight").dequantize()[5])
    before = s.lookups
    cache.get(4, 0, "gate")
    assert s.lookups == before + 1 and (4, 0) in cache.slot_of


def test_prefetch_loads_a_hash_layers_experts_ahead(gguf: GGUFFile) -> None:
    cfg = gguf.config
    assert cfg.is_hash_layer(1)
    cache = _cache(gguf, range(0, 2), prefetch=True)
    tokens = torch.tensor([5, 9, 100])
    ahead = sorted(set(tensor_view(gguf, "blk.1.ffn_gate_tid2eid.weight").dequantize()[tokens].flatten().tolist()))
    cache.select(0, _ids(0), tokens)
    report = cache.report()  # waits for the prefetch
    assert report["prefetched"] == len(ahead)
    assert all((1, e) in cache.slot_of for e in ahead)
    hits = cache.stats.hits
    cache.select(1, torch.tensor([ahead]), tokens)
    assert cache.stats.hits == hits + len(ahead)  # layer 1 found everything in place
    assert cache.stats.hits + cache.stats.misses == cache.stats.lookups
    cache.close()


def test_prefetch_never_evicts_the_running_layers_experts(gguf: GGUFFile) -> None:
    n = gguf.config.n_experts
    cache = _cache(gguf, range(3, 5), prefetch=True)
    cache.select(4, _ids(1, 2))  # remembered as layer 4's last choice: what the prefetch will guess
    cache.select(3, torch.arange(n).view(1, -1))  # all 8 slots pinned by layer 3
    report = cache.report()
    assert report["prefetched"] == 0
    assert {(3, e) for e in range(n)} <= set(cache.slot_of)
    cache.close()


def test_too_small_cache_is_refused_with_the_minimum(gguf: GGUFFile) -> None:
    layers = range(0, 6)
    tensors = load_tensors(gguf, layers, embed=False, output=False)
    need = min_cache_bytes(tensors, layers)
    per = sum(tensors[f"blk.0.{r}.weight"].nbytes for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert need == per  # all experts of one layer: gate + up + down
    with pytest.raises(ExpertCacheTooSmall, match=rf"8 experts x .* = {format_size(need)} \({need} bytes\)"):
        ExpertCache(gguf.config, tensors, layers, need - 1)
    ExpertCache(gguf.config, tensors, layers, need).close()
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
