"""Footprint numbers against DS4-MODEL.md and against each other."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ds4station.model.config import FLASH, TINY
from ds4station.model.footprint import (
    FootprintSettings,
    activation_bytes_per_token,
    indexer_scratch_bytes,
    kept_bytes,
    kv_bytes,
    kv_bytes_per_token,
    mtp_bytes,
    named_shape,
    shape_from_specs,
    stage_footprint,
)
from ds4station.model.layout import model_tensors
from ds4station.model.sizes import format_size, parse_size
from ds4station.planner.devices import parse_gpu_spec
from ds4station.planner.presets import load_preset
from ds4station.planner.propose import _Planner

GiB, MiB = 1 << 30, 1 << 20


def test_kv_bytes_per_token_matches_the_doc() -> None:
    # DS4-MODEL.md: 21 ratio-4 layers x (512 + 128) + 20 ratio-128 layers x 16 = 13,760 bytes/token at f32
    assert kv_bytes_per_token(FLASH, range(43), "f32") == 13760
    assert kv_bytes_per_token(FLASH, range(43), "f16") == 6880
    assert kv_bytes_per_token(FLASH, range(2), "f32") == 0  # window-only layers do not grow


@pytest.mark.parametrize("dtype, per_token", [("f32", 13760), ("f16", 6880)])
def test_kv_bytes_grow_by_the_per_token_figure(dtype: str, per_token: int) -> None:
    n = 128 * 1000
    assert kv_bytes(FLASH, range(43), 2 * n, dtype) - kv_bytes(FLASH, range(43), n, dtype) == n * per_token
    # "1M tokens of context is ~13 GiB at f32": 13.44 GiB that grow with ctx plus ~0.1 GiB of rings
    if dtype == "f32":
        assert 13.4 < kv_bytes(FLASH, range(43), 1 << 20, dtype) / GiB < 13.6


@pytest.mark.parametrize("cfg", [FLASH, TINY], ids=["flash", "tiny"])
def test_kv_bytes_equal_the_engine_allocation(cfg) -> None:  # type: ignore[no-untyped-def]
    """The formula is what KVCache allocates, tensor by tensor (on torch's meta device: no memory)."""
    torch = pytest.importorskip("torch")
    kv = pytest.importorskip("ds4station.engine.kv")
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    for ctx, chunk, rollback, dtype in [(4096, 256, 0, "f32"), (1 << 20, 512, 1024, "f16"), (32768, 64, 0, "bf16"),
                                        (1000, 7, 300, "f32")]:
        ctx = min(ctx, cfg.context_length)
        for layers in (range(cfg.n_layers), range(2, 5)):
            cache = kv.KVCache(cfg, layers, ctx, dtype=dtypes[dtype], chunk=chunk, rollback=rollback, device="meta")
            assert kv_bytes(cfg, layers, ctx, dtype, chunk=chunk, rollback=rollback) == cache.nbytes()
    small = kv.KVCache(TINY, range(TINY.n_layers), 300, chunk=16)  # a real allocation too
    assert small.nbytes() == kv_bytes(TINY, range(TINY.n_layers), 300, "f32", chunk=16)


def test_named_shape_matches_the_q2_file() -> None:
    m = named_shape("flash-q2")
    assert len(m.specs) == 1328
    assert m.total_bytes / GiB == pytest.approx(80.76, abs=0.01)
    # one q2 expert (gate+up+down) is 6.75 MiB; a layer's table is 256 of them
    assert m.expert_bytes[10] == 256 * 6.75 * MiB == m.min_expert_cache(range(43))
    # ~9.5 GB of weights read per decoded token
    assert (sum(m.decode_read_bytes) + m.output_bytes) / 1e9 == pytest.approx(9.5, rel=0.03)
    with pytest.raises(ValueError, match="unknown shape 'flash-q9'"):
        named_shape("flash-q9")


def test_shape_from_a_spec_list_equals_the_named_shape() -> None:
    m = shape_from_specs("file", TINY, model_tensors(TINY, "q2"))
    n = named_shape("tiny-q2")
    assert (m.non_expert_bytes, m.expert_bytes, m.embed_bytes, m.output_bytes) == (
        n.non_expert_bytes, n.expert_bytes, n.embed_bytes, n.output_bytes)


def test_stage_footprint_parts() -> None:
    m = named_shape("flash-q2")
    fs = FootprintSettings(prefill_chunk=512, kv_dtype="f32", sessions=1, rollback=0, runtime_overhead=768 * MiB)
    layers = range(8, 15)
    res = stage_footprint(m, layers, 32768, fs)
    streamed = stage_footprint(m, layers, 32768, fs, expert_cache_bytes=2 * GiB)
    specs = model_tensors(FLASH, "q2", layers, embed=False, output=False)
    assert res.weights_bytes == sum(kept_bytes(s) for s in specs) > sum(s.n_bytes for s in specs)
    assert res.weights_bytes - streamed.weights_bytes == 7 * 1728 * MiB
    slot = 6912 * 1024  # one expert: 6.75 MiB
    staging = 2 * 8 * slot  # two staging buffers of 8 experts on the device
    pool = (2 * GiB // slot) * slot + 7 * 256 * 8  # whole slots + the slot table (int64 per layer and expert)
    assert streamed.predicted_bytes == streamed.weights_bytes + streamed.kv_bytes + streamed.scratch_bytes + \
        768 * MiB + pool + staging
    assert streamed.host_staging_bytes == staging
    on_cpu = stage_footprint(m, layers, 32768, fs, expert_cache_bytes=2 * GiB, device_kind="cpu")
    assert on_cpu.expert_cache_bytes == pool and on_cpu.host_staging_bytes == 0
    two = stage_footprint(m, layers, 32768, dataclasses.replace(fs, sessions=2, rollback=1024))
    assert two.kv_bytes == 2 * kv_bytes(FLASH, layers, 32768, "f32", chunk=512, rollback=1024)
    head = stage_footprint(m, layers, 32768, fs, embed=True, output=True)
    assert head.weights_bytes - res.weights_bytes == m.embed_bytes + m.output_bytes
    # the indexer's selection scratch: [chunk, k + step] int64, step bounded by the engine's 256 MiB block
    assert indexer_scratch_bytes(FLASH, 1 << 20, 512) == 8 * 512 * (512 + (256 << 20) // (8 * 512) - 512) + \
        16 * 512 * 512
    assert indexer_scratch_bytes(FLASH, 4096, 512) == 8 * 512 * (512 + 1024) + 16 * 512 * 512
    # 128K: a two-stage selection's candidates (bounded by 8,192 per query) with ids and valid flags
    assert indexer_scratch_bytes(FLASH, 131072, 2048) == 8 * 2048 * (512 + (256 << 20) // (8 * 2048) - 512) + \
        8 * 2048 * 8192 + 9 * 2048 * 512
    heavier = stage_footprint(m, layers, 32768, dataclasses.replace(fs, activation_factor=3.0))
    assert heavier.scratch_bytes - res.scratch_bytes == 2 * activation_bytes_per_token(FLASH) * 512
    long = stage_footprint(m, layers, 1 << 20, fs)
    assert long.scratch_bytes - res.scratch_bytes == indexer_scratch_bytes(FLASH, 1 << 20, 512) - \
        indexer_scratch_bytes(FLASH, 32768, 512)


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_planner_fast_path_equals_stage_footprint(mtp: bool) -> None:
    """The planner's O(1) prediction equals stage_footprint, also with the MTP layer beside the head (plan
    --draft mtp: the first device holds the embedding, the head and the layer)."""
    m = named_shape("flash-q2")
    settings = load_preset("context")
    settings = dataclasses.replace(settings, footprint=dataclasses.replace(settings.footprint, mtp=mtp))
    devices = parse_gpu_spec("32GiB,16GiBx2,cpu", 64 * GiB)
    p = _Planner(m, devices, settings, None)
    rng = random.Random(7)
    for _ in range(40):
        a = rng.randrange(43)
        b = rng.randrange(a + 1, 44)
        ctx = rng.choice([4096, 32768, 500_000, 1 << 20])
        cache = rng.choice([0, 2 * GiB])
        j = rng.randrange(4)
        want = stage_footprint(m, range(a, b), ctx, settings.footprint, embed=j == 0, output=j == 0,
                               expert_cache_bytes=p.cache_for(j, cache), device_kind=devices[j].kind).predicted_bytes
        assert p.predicted(j, a, b, ctx, cache) == want
    if mtp:  # what the layer adds to the first device (the same at any context: a window-only layer)
        plain = dataclasses.replace(settings.footprint, mtp=False)
        extra = stage_footprint(m, range(0, 9), 65536, settings.footprint, embed=True, output=True).predicted_bytes \
            - stage_footprint(m, range(0, 9), 65536, plain, embed=True, output=True).predicted_bytes
        assert extra == mtp_bytes(m.cfg, m.mtp_specs, 65536, plain.prefill_chunk, plain.sessions) > GiB


def test_sizes() -> None:
    assert parse_size("16GiB") == 16 * GiB and parse_size("1.5 GiB") == 3 * GiB // 2
    assert parse_size("16G") == 16 * GiB and parse_size("2GB") == 2 * 10**9 and parse_size(1024) == 1024
    assert format_size(2 * GiB) == "2GiB" and format_size(1728 * MiB) == "1728MiB"
    with pytest.raises(ValueError, match="not a size"):
        parse_size("16 gigs")
