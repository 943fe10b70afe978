"""The reference model's own invariants: one forward over a prompt == chunked prefill == token-by-token
decoding, layer slices chained == the whole model, KV sizes == the formula, rollback == recomputation.

The TINY shape keeps Flash's layer pattern: window 8, ratio-4 layers with an indexer choosing 3 blocks,
ratio-16 layers; 64 tokens exceed the window, produce 16 ratio-4 and 4 ratio-16 blocks and make the top-k
a real choice.

The strict comparisons (1e-5) run with the quantisation round trips off: with them on, the last-bit
differences between matmuls of different shapes (one prompt vs chunks) can flip an FP8/FP4 rounding, which
is a legitimate, bounded difference; one test checks that path at a looser tolerance.
"""

from __future__ import annotations

import pytest
import torch

from ds4station.engine.kv import KVCache, KVPool, dtype_name, pooled_caches
from ds4station.engine.model import OFF, DS4Model, random_weights
from ds4station.kernels.reference import HyperConnection, sink_attention, sinkhorn
from ds4station.model.config import TINY
from ds4station.model.footprint import kv_bytes

N = 64


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=11)


@pytest.fixture(scope="module")
def model(weights):
    return DS4Model(TINY, weights, round_trips=OFF)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, TINY.vocab_size, (N,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def full(model, tokens):
    return forward(model, tokens)


def forward(model: DS4Model, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """Logits of every position: prefill (in pieces of cache.chunk) and the head over the whole state."""
    if cache is None:
        cache = model.new_cache(len(tokens), chunk=len(tokens))
    return model.head(model.prefill(tokens, cache))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_full_forward_is_finite_and_nontrivial(full):
    assert full.shape == (N, TINY.vocab_size)
    assert torch.isfinite(full).all()
    assert full.std() > 0.1
    assert full.argmax(-1).unique().numel() > 1


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_matches_full_forward(model, tokens, full, chunk):
    cache = model.new_cache(N + 8, chunk=chunk)
    got = forward(model, tokens, cache)
    assert cache.length == N
    assert rel(got, full) < 1e-5


def test_decode_matches_full_forward(model, tokens, full):
    cache = model.new_cache(N, chunk=8)
    first = forward(model, tokens[:20], cache)
    steps = [model.decode(int(tokens[i]), cache, logits=True)[None] for i in range(20, N)]
    got = torch.cat([first, *steps])
    assert rel(got, full) < 1e-5


def test_decode_with_round_trips_matches_full_forward(weights, tokens):
    model = DS4Model(TINY, weights)  # FP8 KV and indexer FP4 on, as in the real model
    full = forward(model, tokens)
    cache = model.new_cache(N, chunk=8)
    first = forward(model, tokens[:40], cache)
    got = torch.cat([first, *(model.decode(int(tokens[i]), cache, logits=True)[None] for i in range(40, N))])
    assert rel(got, full) < 1e-3
    assert (got.argmax(-1) == full.argmax(-1)).all()
    assert rel(full, forward(DS4Model(TINY, weights, round_trips=OFF), tokens)) > 1e-3  # they do act


def test_layer_slices_chain_to_the_full_model(weights, tokens, full):
    cut = 3
    head_stage = {k: v for k, v in weights.items() if k.startswith(("token_embd", "blk.0.", "blk.1.", "blk.2."))}
    stage0 = DS4Model(TINY, head_stage, range(0, cut), embed=True, output=False, round_trips=OFF)
    stage1 = DS4Model(TINY, weights, range(cut, TINY.n_layers), embed=False, output=True, round_trips=OFF)
    c0, c1 = stage0.new_cache(N, chunk=32), stage1.new_cache(N, chunk=32)
    assert set(c0.layers) == {0, 1, 2} and set(c1.layers) == {3, 4, 5}
    outs = []
    for s in range(0, N, 32):
        t = tokens[s: s + 32]
        outs.append(stage1.head(stage1.prefill(t, c1, stage0.prefill(t, c0))))
    assert rel(torch.cat(outs), full) < 1e-5


def test_missing_weights_are_named(weights):
    partial = {k: v for k, v in weights.items() if k != "blk.4.attn_compressor_ape.weight"}
    with pytest.raises(KeyError, match="attn_compressor_ape"):
        DS4Model(TINY, partial)


def test_truncate_then_extend_equals_recomputation(model, tokens, full):
    cache = model.new_cache(N, chunk=8, rollback=12)
    forward(model, tokens[:40], cache)
    assert cache.max_rollback == 12
    assert not cache.truncate(40 - 13)  # further back than the rings hold
    assert cache.length == 40
    assert cache.truncate(29)  # back into a ratio-16 block and across ratio-4 blocks
    got = forward(model, tokens[29:N], cache)
    assert rel(got, full[29:]) < 1e-5


def test_truncate_is_bounded_by_the_furthest_write(model, tokens, full):
    """Ring slots are reused by position: the rows of a rolled-back turn overwrote what earlier positions
    need, so a second truncate is bounded by the furthest position ever written, not the current length."""
    cache = model.new_cache(N, chunk=8, rollback=12)
    forward(model, tokens[:40], cache)
    assert cache.truncate(29)
    forward(model, tokens[29:33], cache)
    assert not cache.truncate(22)  # 33 - 22 <= 12, but position 35 took the ring slot of 15, which 22 reads
    assert cache.length == 33 and cache.written == 40
    assert cache.truncate(28)
    got = forward(model, tokens[28:N], cache)
    assert rel(got, full[28:]) < 1e-5
    cache.reset()
    assert cache.length == cache.written == 0


@pytest.mark.parametrize("layers", [range(0, 6), range(0, 2), range(2, 5), range(5, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_bytes_formula_matches_allocation(layers, dtype):
    cache = KVCache(TINY, layers, ctx=1000, dtype=dtype, chunk=64, rollback=100)
    assert cache.nbytes() == kv_bytes(TINY, layers, 1000, dtype_name(dtype), chunk=64, rollback=100)
    assert set(cache.layers) == set(layers)


def test_a_pool_holds_each_sessions_kv_as_slots_of_one_allocation():
    """KVPool: every session's stepped tensors are slot s of one [sessions, ...] tensor per layer and field (what
    the batched decode kernels index by slot); each cache is as large as a cache of its own (the one KV formula)
    and writes only its own slot; the checkpoint stays per session."""
    a, b, c = pooled_caches(TINY, None, 3, 96, chunk=16, rollback=8)
    pool = a.pool
    alone = KVCache(TINY, None, 96, chunk=16, rollback=8)
    assert alone.pool is not pool and alone.pool.sessions == 1 and alone.slot == 0  # a pool of its own
    for i in range(TINY.n_layers):
        shared, mine = pool.layers[i], b[i]
        assert shared.raw.shape == (3, *alone[i].raw.shape)
        assert mine.raw.data_ptr() == shared.raw[1].data_ptr()
        if alone[i].comp is not None:
            assert mine.comp.data_ptr() == shared.comp[1].data_ptr()
            assert mine.comp_frontier.kv.data_ptr() == shared.comp_frontier.kv[1].data_ptr()
        if alone[i].index_keys is not None:
            assert mine.index_keys.data_ptr() == shared.index_keys[1].data_ptr()
            assert mine.index_frontier.score.data_ptr() == shared.index_frontier.score[1].data_ptr()
        assert mine.saved_raw is not None and shared.saved_raw is None
    assert a.nbytes() == b.nbytes() == alone.nbytes() == kv_bytes(TINY, None, 96, "f32", chunk=16, rollback=8)
    b[0].raw.fill_(1.0)
    assert a[0].raw.abs().sum() == 0 and c[0].raw.abs().sum() == 0 and pool.layers[0].raw[1].eq(1).all()
    assert [x.slot for x in (a, b, c)] == [0, 1, 2] and b.pool is pool and c.pool is pool
    with pytest.raises(ValueError, match="at least one session"):
        KVPool(TINY, None, 0, 96)


def test_kv_bytes_per_token_of_flash_matches_ds4_figure():
    from ds4station.model.config import FLASH
    from ds4station.model.footprint import kv_bytes_per_token

    # DS4-MODEL.md: 13,760 bytes per token of context at f32 over all 43 layers.
    assert kv_bytes_per_token(FLASH, range(FLASH.n_layers)) == 13760
    grow = kv_bytes(FLASH, None, 2 * 65536) - kv_bytes(FLASH, None, 65536)
    assert grow == 13760 * 65536


def test_context_overflow_is_refused(model, tokens):
    cache = model.new_cache(10, chunk=8)
    with pytest.raises(ValueError, match="context full"):
        forward(model, tokens[:12], cache)


def test_sink_attention_equals_softmax_with_an_extra_sink_column():
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(5, 4, 16, generator=gen), torch.randn(9, 16, generator=gen)
    allowed = torch.rand(5, 9, generator=gen) > 0.3
    allowed[:, 0] = True
    sinks = torch.randn(4, generator=gen)
    z = torch.einsum("thd,nd->thn", q, keys) * 0.25
    z = z.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.cat((z, sinks[None, :, None].expand(5, 4, 1)), -1).softmax(-1)[..., :-1]
    torch.testing.assert_close(sink_attention(q, keys, allowed, sinks, 0.25), p @ keys)


def test_sinkhorn_is_near_doubly_stochastic_and_hc_post_mixes_columns():
    logits = 3 * torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(4))
    c = sinkhorn(logits, 20, 1e-6)
    torch.testing.assert_close(c.sum(-2), torch.ones(2, 4), atol=1e-5, rtol=0)  # columns exact (last step)
    torch.testing.assert_close(c.sum(-1), torch.ones(2, 4), atol=1e-3, rtol=0)
    # hc_post: X'[k] = post[k] * out + sum_j comb[j, k] X[j]
    X, out, post = torch.randn(2, 4, 8), torch.randn(2, 8), torch.rand(2, 4)
    want = torch.stack([post[:, k, None] * out + sum(c[:, j, k, None] * X[:, j] for j in range(4))
                        for k in range(4)], 1)
    torch.testing.assert_close(HyperConnection.post(out, X, post, c), want)


def test_indexer_keeps_top_k_visible_blocks_and_breaks_ties_towards_earlier_ones(weights):
    cfg = TINY
    w = dict(weights)
    w["blk.2.indexer.proj.weight"] = torch.zeros_like(w["blk.2.indexer.proj.weight"])  # every score is 0
    indexer = DS4Model(cfg, w, range(2, 3), embed=False, output=False).blocks[0].attn.indexer
    cache = KVCache(cfg, range(2, 3), ctx=64, chunk=40)
    gen = torch.Generator().manual_seed(0)
    xn, qr = torch.randn(40, cfg.dim, generator=gen), torch.randn(40, cfg.q_lora_rank, generator=gen)
    allowed = indexer(xn, qr, torch.arange(40), cache[2])  # [40, 10 blocks]
    for s in range(40):
        visible = (s + 1) // 4
        want = [i < min(visible, cfg.index_topk) for i in range(10)]
        assert allowed[s].tolist() == want, s

    # with real scores: each query keeps exactly min(k, visible) blocks, all of them visible
    indexer = DS4Model(cfg, weights, range(2, 3), embed=False, output=False).blocks[0].attn.indexer
    allowed = indexer(xn, qr, torch.arange(40), KVCache(cfg, range(2, 3), ctx=64, chunk=40)[2])
    for s in range(40):
        visible = (s + 1) // 4
        assert int(allowed[s].sum()) == min(visible, cfg.index_topk)
        assert not allowed[s, visible:].any()
    assert len({tuple(r.nonzero().flatten().tolist()) for r in allowed[-8:]}) > 1  # a real, varying choice
