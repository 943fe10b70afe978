"""Fused routed-expert FFN for a batch of tokens (prefill): tokens grouped by expert, dequantised weight tiles
fed to tl.dot (fp16 operands, fp32 accumulation), same math as moe.py's decode path.

Schedule (`_schedule`, torch ops on the device, no host synchronisation, so it can sit in a CUDA graph):
the T x S (token, slot) pairs are sorted by expert; each expert's run of rows is cut into BLOCK_M-row
tiles; the tile list has a fixed upper-bound length and unused tiles exit at once.
Kernels: `_moe_prefill_gate_up_kernel` (per tile and block of F: gate and up dots on the gathered token
rows, clamp, SiLU, routing weight -> h in sorted order, fp16), `_moe_prefill_down_kernel` (per tile and block
of D: h @ down^T, written per (token, slot)); the S slot rows of a token are then summed in a fixed order (no
atomics: reproducible). Supported: gate/up and down IQ2_XXS, Q2_K, Q4_K or Q8_0.

At ~50 rows per expert (a 2,048-token chunk) the cost is the weight tiles' decode, not the dots. Q2_K (the
down) decodes from a lookup table in fp16 (`tile_table`: per 4 weights one gather of the byte's 4 codes, then
packed fp16 multiply-adds), 16% faster than its fp32 bit-trick decode on the H100; IQ2_XXS (gate + up) keeps
the fp32 decode from grid words, which measured faster than the same table decode (docs/PERFORMANCE.md,
twenty-eighth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.iq2_xxs import _iq2_xxs_tile, grid_words
from ds4station.kernels.moe import _QT_CODE, PackedExperts, _ptrs, check_experts
from ds4station.kernels.pdl import enter, pdl
from ds4station.kernels.q2_k import _q2_k_tile16, code_halves
from ds4station.kernels.q4_k import _q4_k_tile
from ds4station.kernels.q8_0 import _q8_0_tile


def _schedule(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(order, tile_expert, tile_start, tile_end): slots sorted by expert, and each tile's expert and row span
    in that order. The tile count is an upper bound known without reading ids on the host."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    # rows per expert by a scatter-add: torch.bincount reads the ids' min and max on the host (two waits for the
    # GPU in every layer of a prefill chunk, so the host could never run ahead of it)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end_cum = torch.cumsum(tiles, 0)
    n_tiles = triton.cdiv(n, block_m) + min(n_experts, n)
    t = torch.arange(n_tiles, device=ids.device)
    expert = torch.searchsorted(tile_end_cum, t, right=True).clamp(max=n_experts - 1)
    local = t - (tile_end_cum[expert] - tiles[expert])
    valid = t < tile_end_cum[-1]
    start = torch.where(valid, starts[expert] + local * block_m, 0)
    end = torch.where(valid, torch.minimum(start + block_m, starts[expert] + counts[expert]), 0)
    return order, expert.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


def tile_table(qtype: str, device: torch.device) -> torch.Tensor:
    """The lookup table a weight type's prefill tile reads: IQ2_XXS the grid words (int64 [256]), Q2_K its byte
    codes (code_halves, fp16 [1024]); the other types read none (the grid words stand in)."""
    return code_halves(device) if qtype == "q2_k" else grid_words(device)


@triton.jit
def _dequant_tile(QT: tl.constexpr, p0, p1, p2, p3, grid_ptr, rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    if QT == 0:
        w = _iq2_xxs_tile(p0, p1, grid_ptr, rows, n_mask, k0, K, BLOCK_K)
    elif QT == 1:
        w = _q2_k_tile16(p0, p1, p2, grid_ptr, rows, n_mask, k0, K, BLOCK_K)
    elif QT == 2:
        w = _q4_k_tile(p0, p1, p2, p3, rows, n_mask, k0, K, BLOCK_K)
    else:
        w = _q8_0_tile(p0, p1, rows, n_mask, k0, K, BLOCK_K)
    return w.to(tl.float16)


@triton.jit
def _rows_tile(ptr, rows, stride, m_mask, k0, K, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of the gathered activation rows as fp16 [rows, BLOCK_K]."""
    kk = k0 + tl.arange(0, BLOCK_K)
    t = tl.load(ptr + rows[:, None] * stride + kk[None, :], mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
    return t.to(tl.float16)


@triton.jit
def _moe_prefill_gate_up_kernel(
    x_ptr, order_ptr, t_exp_ptr, t_start_ptr, t_end_ptr, wts_ptr, h_ptr, grid_ptr,
    g0, g1, g2, g3, u0, u1, u2, u3,
    F, D, stride_xt, clamp,
    S: tl.constexpr, QT: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    tile = tl.program_id(0)
    start = tl.load(t_start_ptr + tile)
    end = tl.load(t_end_ptr + tile)
    if start >= end:
        return
    e = tl.load(t_exp_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    slot = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
    tok = (slot // S).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    rows = e * F + offs_n.to(tl.int64)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        xt = _rows_tile(x_ptr, tok, stride_xt, m_mask, k0, D, BLOCK_K)
        wg = _dequant_tile(QT, g0, g1, g2, g3, grid_ptr, rows, n_mask, k0, D, BLOCK_K)
        acc_g = tl.dot(xt, tl.trans(wg), acc_g)
        wu = _dequant_tile(QT, u0, u1, u2, u3, grid_ptr, rows, n_mask, k0, D, BLOCK_K)
        acc_u = tl.dot(xt, tl.trans(wu), acc_u)
    if CLAMP:
        acc_g = tl.minimum(acc_g, clamp)
        acc_u = tl.minimum(tl.maximum(acc_u, -clamp), clamp)
    wt = tl.load(wts_ptr + slot, mask=m_mask, other=0.0).to(tl.float32)
    h = acc_g * tl.sigmoid(acc_g) * acc_u * wt[:, None]
    tl.store(h_ptr + offs_m.to(tl.int64)[:, None] * F + offs_n[None, :], h, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_prefill_down_kernel(
    h_ptr, order_ptr, t_exp_ptr, t_start_ptr, t_end_ptr, y_ptr, grid_ptr,
    d0, d1, d2, d3,
    F, D,
    QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    tile = tl.program_id(0)
    start = tl.load(t_start_ptr + tile)
    end = tl.load(t_end_ptr + tile)
    if start >= end:
        return
    e = tl.load(t_exp_ptr + tile).to(tl.int64)
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    slot = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    rows = e * D + offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        ht = _rows_tile(h_ptr, offs_m.to(tl.int64), F, m_mask, k0, F, BLOCK_K)
        w = _dequant_tile(QT, d0, d1, d2, d3, grid_ptr, rows, n_mask, k0, F, BLOCK_K)
        acc = tl.dot(ht, tl.trans(w), acc)
    tl.store(y_ptr + slot[:, None] * D + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def moe_prefill(
    x: torch.Tensor,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    ids: torch.Tensor,
    weights: torch.Tensor,
    clamp: float | None = 10.0,
    tiles: dispatch.MatmulTiles | None = None,
) -> torch.Tensor:
    """Triton routed-expert FFN for many tokens: x [T, D], ids / weights [T, S] -> y [T, D] fp32."""
    check_experts(x, gate, up, down, ids, weights)
    t_count, d_model = x.shape
    n_experts, d_ff, n_slots = gate.qs.shape[0], gate.n, ids.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = tiles or dispatch.moe_prefill_tiles(t_count * n_slots, dispatch.launch_backend(x))
    order, t_exp, t_start, t_end = _schedule(ids, n_experts, tiles.block_m)
    weights = weights.reshape(-1).float().contiguous()
    # fp16: what the down dot reads it as (the same rounding, at half the bytes)
    h = torch.empty((t_count * n_slots, d_ff), device=x.device, dtype=torch.float16)
    opts = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    _moe_prefill_gate_up_kernel[(t_exp.numel(), triton.cdiv(d_ff, tiles.block_n))](
        x, order, t_exp, t_start, t_end, weights, h, tile_table(gate.qtype, x.device), *_ptrs(gate, words=False),
        *_ptrs(up, words=False),
        d_ff, d_model, x.stride(0), float(clamp or 0.0),
        S=n_slots, QT=_QT_CODE[gate.qtype], CLAMP=clamp is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **opts, **pdl(x))
    y_slots = torch.empty((t_count * n_slots, d_model), device=x.device, dtype=torch.float32)
    _moe_prefill_down_kernel[(t_exp.numel(), triton.cdiv(d_model, tiles.block_n))](
        h, order, t_exp, t_start, t_end, y_slots, tile_table(down.qtype, x.device), *_ptrs(down, words=False),
        d_ff, d_model,
        QT=_QT_CODE[down.qtype], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **opts, **pdl(h))
    return y_slots.view(t_count, n_slots, d_model).sum(1)

