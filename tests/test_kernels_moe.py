"""Fused MoE decode (ds4station/kernels/moe.py): the Triton gate+up / down launches and the torch reference
against an independent float64 computation from gguf-py's dequantisation of the raw expert blocks, with
the routed clamp, SiLU and routing weight applied before down; also the ops-level CPU dispatch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from numerics import rel_err

from ds4station.kernels import dispatch, ops
from ds4station.kernels.iq2_xxs import repack_iq2_xxs
from ds4station.kernels.moe import moe_decode, moe_decode_ref
from ds4station.kernels.moe_prefill import moe_prefill
from ds4station.kernels.q2_k import repack_q2_k
from ds4station.kernels.quants import random_blocks, row_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def raw_experts(qtype: Q, e: int, n: int, k: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return random_blocks(qtype, e * n * k, g, scale).view(e, n, row_bytes(qtype, k))


def oracle(raw: torch.Tensor, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), qtype))).double()


@pytest.mark.parametrize(("tokens", "slots", "clamp", "dtype"), [(1, 3, 10.0, torch.float32),
                                                                  (2, 2, None, torch.float16)])
def test_moe_decode_matches_float64(tokens: int, slots: int, clamp: float | None, dtype: torch.dtype) -> None:
    n_exp, d_model, d_ff = 5, 256, 256
    # scale chosen so some gate/up values pass the clamp of 10: the clamp must act to be tested
    gate_raw = raw_experts(Q.IQ2_XXS, n_exp, d_ff, d_model, seed=1, scale=0.6)
    up_raw = raw_experts(Q.IQ2_XXS, n_exp, d_ff, d_model, seed=2, scale=0.6)
    down_raw = raw_experts(Q.Q2_K, n_exp, d_model, d_ff, seed=3, scale=0.05)
    gen = torch.Generator().manual_seed(tokens * 10 + slots)
    x = torch.randn(tokens, d_model, generator=gen)
    ids = torch.stack([torch.randperm(n_exp, generator=gen)[:slots] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, slots, generator=gen) + 0.1

    gate_f, up_f, down_f = oracle(gate_raw, Q.IQ2_XXS), oracle(up_raw, Q.IQ2_XXS), oracle(down_raw, Q.Q2_K)
    want = torch.zeros(tokens, d_model, dtype=torch.float64)
    clamped = 0
    xd = x.to(dtype).double()
    for t in range(tokens):
        for s in range(slots):
            e = int(ids[t, s])
            g, u = gate_f[e] @ xd[t], up_f[e] @ xd[t]
            if clamp is not None:
                clamped += int((g > clamp).sum() + (u.abs() > clamp).sum())
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            want[t] += down_f[e] @ (torch.nn.functional.silu(g) * u * float(weights[t, s]))
    if clamp is not None:
        assert clamped > 0

    gate = repack_iq2_xxs(gate_raw.to(DEVICE), d_model)
    up = repack_iq2_xxs(up_raw.to(DEVICE), d_model)
    down = repack_q2_k(down_raw.to(DEVICE), d_ff)
    xs, ids_d, w_d = x.to(DEVICE, dtype), ids.to(DEVICE), weights.to(DEVICE)
    out = torch.full((tokens, d_model), float("nan"), device=DEVICE)
    moe_decode(xs, gate, up, down, ids_d, w_d, clamp=clamp, out=out, int_dot=False)
    assert rel_err(out, want) < 1e-5
    assert rel_err(moe_decode_ref(xs, gate, up, down, ids_d, w_d, clamp=clamp), want) < 1e-5
    # ops.moe takes the device's default path: integer dot on CUDA and on the CPU where built (its own numerics)
    int_dot = ops.moe_int_dot(xs, gate, down)
    via_ops = ops.moe(xs, gate, up, down, ids_d, w_d, clamp=clamp)
    assert rel_err(via_ops, moe_decode_ref(xs, gate, up, down, ids_d, w_d, clamp=clamp, act_quant=int_dot)) < 1e-5


def test_int_dot_numerics() -> None:
    """The integer-dot path (int8 activations per 32, exact int32 sums): its torch reference stays within the
    activation rounding of the exact result; on a GPU the dp4a kernels match that reference."""
    n_exp, d_model, d_ff, tokens, slots = 4, 512, 256, 2, 2
    gate = repack_iq2_xxs(raw_experts(Q.IQ2_XXS, n_exp, d_ff, d_model, seed=11, scale=0.3), d_model)
    up = repack_iq2_xxs(raw_experts(Q.IQ2_XXS, n_exp, d_ff, d_model, seed=12, scale=0.3), d_model)
    down = repack_q2_k(raw_experts(Q.Q2_K, n_exp, d_model, d_ff, seed=13, scale=0.05), d_ff)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, d_model, generator=gen)
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    weights = torch.rand(tokens, slots, generator=gen) + 0.1
    exact = moe_decode_ref(x, gate, up, down, ids, weights)
    quant = moe_decode_ref(x, gate, up, down, ids, weights, act_quant=True)
    assert 1e-5 < rel_err(quant, exact) < 3e-2
    # the integer-dot kernels (dp4a on CUDA, the same integer sums in the interpreter)
    dev = [t.to(DEVICE) for t in (x, ids, weights)]
    packed = [dataclasses.replace(w, **{f.name: getattr(w, f.name).to(DEVICE) for f in dataclasses.fields(w)})
              for w in (gate, up, down)]
    tiles = dispatch.moe_tiles("iq2_xxs", "q2_k", d_model, d_ff, tokens * slots, dispatch.launch_backend(dev[0]))
    out = torch.full((tokens, d_model), float("nan"), device=DEVICE)
    moe_decode(dev[0], *packed, dev[1], dev[2], out=out, int_dot=True, tiles=tiles)
    assert rel_err(out, quant) < 1e-5
    # a padded static step: the tokens after `last` are skipped and come out zero, the real ones unchanged
    last = torch.zeros(1, dtype=torch.long, device=DEVICE)
    out = moe_decode(dev[0], *packed, dev[1], dev[2], int_dot=True, tiles=tiles, last=last)
    assert rel_err(out[:1], quant[:1]) < 1e-5 and not out[1:].any()


@pytest.mark.parametrize("moe", [moe_decode, moe_prefill], ids=["decode", "prefill"])
def test_moe_rejects_mismatched_experts(moe) -> None:
    gate = repack_iq2_xxs(raw_experts(Q.IQ2_XXS, 2, 256, 256, seed=0, scale=0.1), 256)
    down = repack_q2_k(raw_experts(Q.Q2_K, 2, 512, 256, seed=0, scale=0.1), 256)
    fit = repack_q2_k(raw_experts(Q.Q2_K, 2, 256, 256, seed=0, scale=0.1), 256)
    x = torch.zeros(1, 256)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit"):
        moe(x, gate, gate, down, ids, torch.ones(1, 2))
    with pytest.raises(ValueError, match="must both be"):
        moe(x, gate, gate, fit, ids, torch.ones(1, 3))
    with pytest.raises(TypeError, match="same quant type"):
        moe(x, gate, fit, fit, ids, torch.ones(1, 2))


def test_moe_tiles_cover_the_real_shape() -> None:
    for backend in ("cuda", "hip64", "hip32"):
        t = dispatch.moe_tiles("iq2_xxs", "q2_k", 4096, 2048, 6, backend)
        assert 2048 % t.gate_up.block_n == 0 and 4096 % t.down.block_n == 0
        assert t.gate_up.block_k % 256 == 0 and t.down.block_k % 256 == 0
    # the integer-dot gate + up gathers its grid codes from shared memory only across >= 2 warps
    assert dispatch.moe_tiles("iq2_xxs", "q2_k", 4096, 2048, 6, "cuda").gate_up.num_warps >= 2


@pytest.mark.parametrize(("tokens", "slots", "clamp"), [(7, 2, 10.0), (3, 3, None), (30, 2, 10.0)])
def test_moe_prefill_matches_float64(tokens: int, slots: int, clamp: float | None) -> None:
    """Prefill path: tokens grouped by expert into 16-row tiles (several tokens share an expert, some experts
    get none; at 30 tokens every used expert gets more rows than a tile), fp16 dots on decoded tiles (IQ2_XXS
    from grid words, Q2_K from its fp16 code table); against float64 from gguf-py's dequantisation."""
    n_exp, d_model, d_ff = 4, 256, 256
    gate_raw = raw_experts(Q.IQ2_XXS, n_exp, d_ff, d_model, seed=21, scale=0.6)
    up_raw = raw_experts(Q.IQ2_XXS, n_exp, d_ff, d_model, seed=22, scale=0.6)
    down_raw = raw_experts(Q.Q2_K, n_exp, d_model, d_ff, seed=23, scale=0.05)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, d_model, generator=gen)
    ids = torch.stack([torch.randperm(n_exp - 1, generator=gen)[:slots] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, slots, generator=gen) + 0.1
    gate_f, up_f, down_f = oracle(gate_raw, Q.IQ2_XXS), oracle(up_raw, Q.IQ2_XXS), oracle(down_raw, Q.Q2_K)
    want = torch.zeros(tokens, d_model, dtype=torch.float64)
    for t in range(tokens):
        for s in range(slots):
            e = int(ids[t, s])
            g, u = gate_f[e] @ x[t].double(), up_f[e] @ x[t].double()
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            want[t] += down_f[e] @ (torch.nn.functional.silu(g) * u * float(weights[t, s]))
    packed = [repack_iq2_xxs(gate_raw.to(DEVICE), d_model), repack_iq2_xxs(up_raw.to(DEVICE), d_model),
              repack_q2_k(down_raw.to(DEVICE), d_ff)]
    tiles = dispatch.MatmulTiles(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=1)
    got = moe_prefill(x.to(DEVICE), *packed, ids.to(DEVICE), weights.to(DEVICE), clamp=clamp, tiles=tiles)
    assert rel_err(got, want) < 3e-3  # fp16 dot operands (x, dequantised weights, h), fp32 sums


def test_prefill_schedule_covers_every_row_once() -> None:
    from ds4station.kernels.moe_prefill import _schedule

    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [3, 1], [3, 0]], dtype=torch.int32)  # expert 2 unused
    order, t_exp, t_start, t_end = _schedule(ids, n_experts=4, block_m=2)
    flat = ids.reshape(-1)
    seen = []
    for e, s, t in zip(t_exp.tolist(), t_start.tolist(), t_end.tolist(), strict=True):
        assert t - s <= 2
        for pos in range(s, t):
            assert int(flat[order[pos]]) == e
            seen.append(pos)
    assert sorted(seen) == list(range(flat.numel()))  # 3 + 2 + 3 tiles used, the rest empty
    assert t_exp.numel() >= 8


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_prefill_schedule_tiles_each_experts_rows_and_waits_for_nothing(device: str) -> None:
    """Random routings of a prefill chunk (some experts unused, some heavy): each expert's rows, in token order,
    are cut into tiles of at most block_m rows in expert order; on a GPU the schedule is queued without one wait
    for the device (torch's sync debug mode raises on any), so the host runs ahead of a prefill's layers."""
    from ds4station.kernels.moe_prefill import _schedule

    gen = torch.Generator().manual_seed(5)
    for tokens, slots, n_experts, block_m in ((37, 6, 16, 4), (300, 6, 256, 16), (5, 2, 64, 8)):
        ids = torch.randint(0, n_experts // 2, (tokens, slots), generator=gen, dtype=torch.int32).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            order, t_exp, t_start, t_end = _schedule(ids, n_experts, block_m)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        flat = ids.reshape(-1).cpu()
        order, t_exp, t_start, t_end = (t.cpu() for t in (order, t_exp, t_start, t_end))
        want = []  # (expert, its rows in token order) tile by tile
        for e in range(n_experts):
            rows = torch.nonzero(flat == e).flatten().tolist()
            want += [(e, rows[i:i + block_m]) for i in range(0, len(rows), block_m)]
        used = [(int(e), order[s:t].tolist()) for e, s, t in zip(t_exp, t_start, t_end, strict=True) if t > s]
        assert used == want


_REPACK = {Q.IQ2_XXS: repack_iq2_xxs, Q.Q2_K: repack_q2_k}


def _repack(raw: torch.Tensor, qtype: Q, k: int):  # type: ignore[no-untyped-def]
    from ds4station.kernels.q4_k import repack_q4_k
    from ds4station.kernels.q8_0 import repack_q8_0

    return ({Q.Q4_K: repack_q4_k, Q.Q8_0: repack_q8_0} | _REPACK)[qtype](raw.to(DEVICE), k)


def _expected(x, gate_f, up_f, down_f, ids, weights, clamp):  # type: ignore[no-untyped-def]
    want = torch.zeros(x.shape[0], down_f.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            g, u = gate_f[e] @ x[t].double(), up_f[e] @ x[t].double()
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            want[t] += down_f[e] @ (torch.nn.functional.silu(g) * u * float(weights[t, s]))
    return want


@pytest.mark.parametrize(("gate_type", "down_type"), [(Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q2_K), (Q.IQ2_XXS, Q.Q4_K),
                                                      (Q.Q8_0, Q.Q8_0), (Q.IQ2_XXS, Q.Q8_0)],
                         ids=["q4_k/q4_k", "q4_k/q2_k", "iq2_xxs/q4_k", "q8_0/q8_0", "iq2_xxs/q8_0"])
def test_q4_k_and_q8_0_experts_in_the_decode_and_prefill_kernels(gate_type: Q, down_type: Q) -> None:
    """Q4_K routed experts (the q2-q4 and q4 files) and Q8_0 ones (some conversions) through both fused MoE
    paths, mixed with the 2-bit types, against float64 from gguf-py's dequantisation of the raw blocks. Q4_K
    has integer-dot kernels too (the CUDA default): they match the torch reference of the integer-dot
    numerics, which stays within the int8 activations' rounding of the exact result; Q8_0 has none, so an
    integer-dot request takes the fp32 kernels."""
    int_dot_types = dispatch.MOE_INT_DOT_QTYPES
    quantised = gate_type.name.lower() in int_dot_types and down_type.name.lower() in int_dot_types
    n_exp, d_model, d_ff, clamp = 5, 256, 512, 10.0
    gate_raw = raw_experts(gate_type, n_exp, d_ff, d_model, seed=31, scale=0.6)
    up_raw = raw_experts(gate_type, n_exp, d_ff, d_model, seed=32, scale=0.6)
    down_raw = raw_experts(down_type, n_exp, d_model, d_ff, seed=33, scale=0.05)
    gen = torch.Generator().manual_seed(4)
    gate_f, up_f, down_f = oracle(gate_raw, gate_type), oracle(up_raw, gate_type), oracle(down_raw, down_type)
    packed = [_repack(gate_raw, gate_type, d_model), _repack(up_raw, gate_type, d_model),
              _repack(down_raw, down_type, d_ff)]
    for tokens, slots in ((2, 3), (9, 2)):  # decode rows, then a prefill's grouped tiles
        x = torch.randn(tokens, d_model, generator=gen)
        ids = torch.stack([torch.randperm(n_exp, generator=gen)[:slots] for _ in range(tokens)]).to(torch.int32)
        weights = torch.rand(tokens, slots, generator=gen) + 0.1
        want = _expected(x, gate_f, up_f, down_f, ids, weights, clamp)
        args = (x.to(DEVICE), *packed, ids.to(DEVICE), weights.to(DEVICE))
        if tokens <= 8:
            assert rel_err(moe_decode(*args, clamp=clamp, int_dot=False), want) < 1e-5
            assert rel_err(moe_decode_ref(*args, clamp=clamp), want) < 1e-5
            if quantised:
                quant = moe_decode_ref(*args, clamp=clamp, act_quant=True)
                assert 1e-5 < rel_err(quant, want) < 3e-2
                assert rel_err(moe_decode(*args, clamp=clamp, int_dot=True), quant) < 1e-5
            else:
                assert rel_err(moe_decode(*args, clamp=clamp, int_dot=True), want) < 1e-5
        assert rel_err(moe_prefill(*args, clamp=clamp), want) < 3e-3
