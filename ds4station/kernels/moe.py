"""Fused MoE decode over the selected experts, and its torch reference.

For each token t and each of its S selected experts e (weight w):
    g = gate[e] @ x_t, u = up[e] @ x_t        (quantised rows, fp32 sums)
    g = min(g, clamp), u = clamp(u, -clamp, clamp)   (DS4 routed experts; no clamp when clamp is None)
    h = silu(g) * u * w                         (routing weight applied BEFORE down, as the model does)
    y_t += down[e] @ h                          (fp32)
Two paths, chosen by `int_dot` (default: dispatch.use_int_dot, i.e. CUDA):
- fp32 math, two launches: `_moe_gate_up_kernel` (one program per (token, slot) and block of F rows, gate
  and up rows decoded side by side so x is read once) writes h [T, S, F] in fp32, in the transposed layout
  the down kernel reads; `_moe_down_kernel` (one program per token and block of D rows) loops over the S
  experts and writes each output element once (no atomics, so the sum order is fixed: reproducible);
- integer dot (dp4a), four launches: quantise x (act_quant.py), `_moe_gate_up_i8_kernel`, quantise h,
  `_moe_down_i8_kernel`. Measured 1.8x faster than fp32 math on the H200; the int8 activations (per 32
  values) cost ~1e-2 relative error, as llama.cpp's q8_1 activations do. For IQ2_XXS, Q2_K and Q4_K.
For many tokens use moe_prefill.py (tokens grouped by expert, tl.dot). `rows_matvec` runs the same row dot
over one dense IQ2_XXS / Q2_K / Q4_K weight (the decode matvec of such projections).

Supported weight types: IQ2_XXS, Q2_K, Q4_K or Q8_0 for gate/up and for down, independently (the q2 file:
IQ2_XXS / Q2_K; the q2-q4 and q4 files: Q4_K experts; some conversions: Q8_0). Q8_0 has no integer-dot path
yet: a layer with Q8_0 experts runs the fp32-math kernels.
Stacked expert weights have a leading expert dim: gate/up [E, F, D], down [E, D, F].
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import dequantize_act, quantize_act, quantize_act_ref
from ds4station.kernels.iq2_xxs import (
    PackedIQ2XXS,
    _iq2_xxs_dot,
    _iq2_xxs_dot_i8,
    dequantize_iq2_xxs,
    grid_codes,
    grid_words,
    transpose_groups,
)
from ds4station.kernels.pdl import enter, pdl
from ds4station.kernels.q2_k import PackedQ2K, _q2_k_dot, _q2_k_dot_i8, dequantize_q2_k
from ds4station.kernels.q4_k import PackedQ4K, _q4_k_dot, _q4_k_dot_i8, dequantize_q4_k
from ds4station.kernels.q8_0 import PackedQ8_0, _q8_0_dot, dequantize_q8_0

PackedExperts = PackedIQ2XXS | PackedQ2K | PackedQ4K | PackedQ8_0
_QT_CODE = {"iq2_xxs": 0, "q2_k": 1, "q4_k": 2, "q8_0": 3}
# weights per packed unit = the transposed activation's row count
_UNIT = {"iq2_xxs": 32, "q2_k": 16, "q4_k": 8, "q8_0": 4}
# weights per lane (one packed unit) of the integer-dot kernels
_I8_UNIT = {"iq2_xxs": 32, "q2_k": 16, "q4_k": 32}


def _expert(w: PackedExperts, e: int) -> PackedExperts:
    return type(w)(*(getattr(w, f.name)[e] for f in dataclasses.fields(w)))


def _dequantize(w: PackedExperts) -> torch.Tensor:
    if isinstance(w, PackedQ4K):
        return dequantize_q4_k(w)
    if isinstance(w, PackedQ8_0):
        return dequantize_q8_0(w)
    return dequantize_iq2_xxs(w) if isinstance(w, PackedIQ2XXS) else dequantize_q2_k(w)


def matvec_ref(w: PackedExperts, x: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """W @ x in fp32; with act_quant, as the integer-dot kernels compute it: x quantised per 32 (act_quant.py),
    except Q2_K's min term, which uses the exact x."""
    if not act_quant:
        return _dequantize(w) @ x
    if isinstance(w, PackedQ8_0):
        raise ValueError(f"{w.qtype} experts have no integer-dot path (act_quant)")
    xq, xs, _ = quantize_act_ref(x.unsqueeze(0), w.qtype)
    xd = dequantize_act(xq, xs, w.qtype)[0]
    if isinstance(w, PackedIQ2XXS):
        return dequantize_iq2_xxs(w) @ xd
    if isinstance(w, PackedQ4K):
        mins = dequantize_q4_k(PackedQ4K(torch.zeros_like(w.qs), w.sc, w.mn, w.dm))  # -dmin * mn per weight
        return (dequantize_q4_k(w) - mins) @ xd + mins @ x
    mins = dequantize_q2_k(PackedQ2K(torch.zeros_like(w.qs), w.sc, w.dm))  # -dmin * m per weight
    return (dequantize_q2_k(w) - mins) @ xd + mins @ x


def moe_decode_ref(
    x: torch.Tensor,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    ids: torch.Tensor,
    weights: torch.Tensor,
    clamp: float | None = 10.0,
    act_quant: bool = False,
) -> torch.Tensor:
    """Torch reference: x [T, D], ids/weights [T, S] -> y [T, D] fp32 (act_quant: the integer-dot numerics)."""
    y = torch.zeros(x.shape[0], down.n, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        xt = x[t].float()
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            g = matvec_ref(_expert(gate, e), xt, act_quant)
            u = matvec_ref(_expert(up, e), xt, act_quant)
            if clamp is not None:
                g = g.clamp(max=clamp)
                u = u.clamp(-clamp, clamp)
            h = torch.nn.functional.silu(g) * u * weights[t, s].float()
            y[t] += matvec_ref(_expert(down, e), h, act_quant)
    return y


@triton.jit
def _rows_dot(QT: tl.constexpr, p0, p1, p2, p3, grid_ptr, rows, n_mask, xt_ptr, K,
              BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """[BLOCK_N] fp32 dot products of quantised rows with one transposed activation row.

    QT 0: IQ2_XXS (p0 int64 words, p1 d; xt [32, K/32]); QT 1: Q2_K (p0 int32 words, p1 scales, p2 (d, dmin)
    pairs; xt [16, K/16]); QT 2: Q4_K (p0 int32 words, p1 scales, p2 mins, p3 (d, dmin) pairs; xt [8, K/8]);
    QT 3: Q8_0 (p0 int32 words of 4 weights, p1 d; xt [4, K/4]). BLOCK_U packed units per chunk."""
    if QT == 0:
        acc = _iq2_xxs_dot(p0, p1, grid_ptr, rows, n_mask, xt_ptr, K, BLOCK_N, BLOCK_U)
    elif QT == 1:
        acc = _q2_k_dot(p0, p1, p2, rows, n_mask, xt_ptr, K, BLOCK_N, BLOCK_U)
    elif QT == 2:
        acc = _q4_k_dot(p0, p1, p2, p3, rows, n_mask, xt_ptr, K, BLOCK_N, BLOCK_U)
    else:
        acc = _q8_0_dot(p0, p1, rows, n_mask, xt_ptr, K, BLOCK_N, BLOCK_U)
    return acc


@triton.jit
def _rows_matvec_kernel(xt_ptr, p0, p1, p2, p3, grid_ptr, y_ptr, N, K, stride_ym, QT: tl.constexpr, M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    for m in tl.static_range(M):  # extra activation rows re-read the weights from L2
        acc = _rows_dot(QT, p0, p1, p2, p3, grid_ptr, rows, n_mask, xt_ptr + m * K, K, BLOCK_N, BLOCK_U)
        tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def rows_matvec(x: torch.Tensor, w: PackedIQ2XXS | PackedQ2K | PackedQ4K, out: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, tiles: dispatch.MatvecTiles | None = None) -> torch.Tensor:
    """Decode y [M, N] = x [M, K] @ W^T for 1-8 activation rows of one IQ2_XXS, Q2_K or Q4_K weight (a dense
    projection, not an expert stack): the fused MoE kernels' row dot (`_rows_dot`, fp32 math), one program per
    `tiles.block_n` rows, the activation transposed to [M, unit, K / unit] as that dot reads it."""
    if isinstance(w, PackedQ8_0) or w.qs.dim() != 2 or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x {tuple(x.shape)} does not match a dense IQ2_XXS / Q2_K / Q4_K weight [{w.n}, {w.k}]")
    m = x.shape[0]
    if not 1 <= m <= 8:
        raise ValueError(f"{w.qtype} matvec takes 1-8 activation rows, got {m}")
    tiles = tiles or dispatch.matvec_tiles(w.qtype, w.n, w.k, m, dispatch.launch_backend(x))
    if out is None:
        out = torch.empty((m, w.n), device=x.device, dtype=out_dtype or x.dtype)
    unit = _UNIT[w.qtype]
    _rows_matvec_kernel[(triton.cdiv(w.n, tiles.block_n),)](
        transpose_groups(x, unit), *_ptrs(w), grid_words(x.device), out, w.n, w.k, out.stride(0),
        QT=_QT_CODE[w.qtype], M=m, BLOCK_N=tiles.block_n, BLOCK_U=tiles.block_k // unit,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x),
    )
    return out


@triton.jit
def _moe_gate_up_kernel(
    xt_ptr, ids_ptr, wts_ptr, ht_ptr, grid_ptr,
    g0, g1, g2, g3, u0, u1, u2, u3,
    F, D, clamp,
    S: tl.constexpr, QT: tl.constexpr, H_SUB: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    slot = tl.program_id(0)  # token * S + s
    pid_n = tl.program_id(1)
    t = slot // S
    e = tl.load(ids_ptr + slot).to(tl.int64)
    wt = tl.load(wts_ptr + slot).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    rows = e * F + offs_n.to(tl.int64)
    xt = xt_ptr + t.to(tl.int64) * D
    g = _rows_dot(QT, g0, g1, g2, g3, grid_ptr, rows, n_mask, xt, D, BLOCK_N, BLOCK_U)
    u = _rows_dot(QT, u0, u1, u2, u3, grid_ptr, rows, n_mask, xt, D, BLOCK_N, BLOCK_U)
    if CLAMP:
        g = tl.minimum(g, clamp)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    h = g * tl.sigmoid(g) * u * wt
    # h is written in the transposed layout the down kernel reads: [H_SUB, F / H_SUB] per slot
    h_off = (offs_n % H_SUB) * (F // H_SUB) + offs_n // H_SUB
    tl.store(ht_ptr + slot.to(tl.int64) * F + h_off, h, mask=n_mask)


@triton.jit
def _moe_down_kernel(
    ht_ptr, ids_ptr, y_ptr, grid_ptr,
    d0, d1, d2, d3,
    F, D, stride_yt,
    S: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(S):
        slot = t * S + s
        e = tl.load(ids_ptr + slot).to(tl.int64)
        rows = e * D + offs_n.to(tl.int64)
        acc += _rows_dot(QT, d0, d1, d2, d3, grid_ptr, rows, n_mask, ht_ptr + slot.to(tl.int64) * F, F,
                         BLOCK_N, BLOCK_U)
    tl.store(y_ptr + t * stride_yt + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _rows_dot_i8(QT: tl.constexpr, p0, p1, p2, p3, grid_ptr, rows, n_mask, xq_ptr, xs_ptr, xsum_ptr, K,
                 BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Integer-dot counterpart of _rows_dot over an act_quant-quantised activation row (BLOCK_U: lanes' units
    per chunk, _I8_UNIT weights each)."""
    if QT == 0:
        acc = _iq2_xxs_dot_i8(p0, p1, grid_ptr, rows, n_mask, xq_ptr, xs_ptr, K, BLOCK_N, BLOCK_U)
    elif QT == 1:
        acc = _q2_k_dot_i8(p0, p1, p2, rows, n_mask, xq_ptr, xs_ptr, xsum_ptr, K, BLOCK_N, BLOCK_U)
    else:
        acc = _q4_k_dot_i8(p0, p1, p2, p3, rows, n_mask, xq_ptr, xs_ptr, xsum_ptr, K, BLOCK_N, BLOCK_U)
    return acc


@triton.jit
def _moe_gate_up_i8_kernel(
    xq_ptr, xs_ptr, xsum_ptr, ids_ptr, wts_ptr, h_ptr, grid_ptr,
    g0, g1, g2, g3, u0, u1, u2, u3, last_ptr,
    F, D, clamp,
    S: tl.constexpr, QT: tl.constexpr, CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
    PADDED: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    t = (slot // S).to(tl.int64)
    if PADDED:  # tokens after the last real one (a padded static step): zero-trip dot loops, zero rows out
        D = tl.where(t <= tl.load(last_ptr), D, 0)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    wt = tl.load(wts_ptr + slot).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    rows = e * F + offs_n.to(tl.int64)
    xq, xs, xsum = xq_ptr + t * (D // 4), xs_ptr + t * (D // 32), xsum_ptr + t * (D // 16)
    g = _rows_dot_i8(QT, g0, g1, g2, g3, grid_ptr, rows, n_mask, xq, xs, xsum, D, BLOCK_N, BLOCK_U)
    u = _rows_dot_i8(QT, u0, u1, u2, u3, grid_ptr, rows, n_mask, xq, xs, xsum, D, BLOCK_N, BLOCK_U)
    if CLAMP:
        g = tl.minimum(g, clamp)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    tl.store(h_ptr + slot.to(tl.int64) * F + offs_n, g * tl.sigmoid(g) * u * wt, mask=n_mask)


@triton.jit
def _moe_down_i8_kernel(
    xq_ptr, xs_ptr, xsum_ptr, ids_ptr, y_ptr, grid_ptr,
    d0, d1, d2, d3, last_ptr,
    F, D, stride_yt,
    S: tl.constexpr, QT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
    PADDED: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    n_slots = S
    if PADDED:
        n_slots = tl.where(t <= tl.load(last_ptr), S, 0)
    for s in range(n_slots):
        slot = (t * S + s).to(tl.int64)
        e = tl.load(ids_ptr + slot).to(tl.int64)
        rows = e * D + offs_n.to(tl.int64)
        acc += _rows_dot_i8(QT, d0, d1, d2, d3, grid_ptr, rows, n_mask, xq_ptr + slot * (F // 4),
                            xs_ptr + slot * (F // 32), xsum_ptr + slot * (F // 16), F, BLOCK_N, BLOCK_U)
    tl.store(y_ptr + t * stride_yt + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def _ptrs(w: PackedExperts, words: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four kernel pointers of an expert stack (unused ones repeat one); `words`: Q2_K's, Q4_K's and Q8_0's
    quants as int32 words (the decode dot) rather than bytes (the prefill tile)."""
    if isinstance(w, PackedIQ2XXS):
        return w.qs.view(torch.int64), w.d, w.d, w.d
    if isinstance(w, PackedQ4K):
        return w.qs.view(torch.int32) if words else w.qs, w.sc, w.mn, w.dm.view(torch.int32)
    if isinstance(w, PackedQ8_0):
        return w.qs.view(torch.int32) if words else w.qs, w.d, w.d, w.d
    dm = w.dm.view(torch.int32)
    return w.qs.view(torch.int32) if words else w.qs, w.sc, dm, dm


def check_experts(x: torch.Tensor, gate: PackedExperts, up: PackedExperts, down: PackedExperts, ids: torch.Tensor,
                  weights: torch.Tensor) -> None:
    """Refuse experts whose types or shapes do not fit x [T, D] and routing ids / weights [T, S] (both MoE paths)."""
    if type(gate) is not type(up):
        raise TypeError("gate and up experts must have the same quant type")
    t_count, d_model = x.shape
    if gate.k != d_model or down.n != d_model or down.k != gate.n or up.n != gate.n:
        raise ValueError(f"expert shapes gate [{gate.n},{gate.k}] up [{up.n},{up.k}] down [{down.n},{down.k}] "
                         f"do not fit x of width {d_model}")
    if ids.shape != weights.shape or ids.shape[0] != t_count:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T={t_count}, S]")


def moe_decode(
    x: torch.Tensor,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    ids: torch.Tensor,
    weights: torch.Tensor,
    clamp: float | None = 10.0,
    out: torch.Tensor | None = None,
    tiles: dispatch.MoeTiles | None = None,
    int_dot: bool | None = None,
    last: torch.Tensor | None = None,
    xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton fused MoE for a few tokens: x [T, D], ids [T, S] (int32/int64), weights [T, S] -> y [T, D] fp32.

    int_dot (default: dispatch.use_int_dot for the device): quantise the activations per 32 to int8 and use
    dp4a (four launches: quantise x, gate+up, quantise h, down); otherwise the fp32-math kernels (two).
    `int_dot_layout` says which; `xq`: x already quantised in that layout (by its producer, norm.rms_norm).
    last: the index of the last real token, [1] int64 on the device (a short prefill padded to its static
    row class): the integer-dot kernels skip the tokens after it, whose rows come out zero.
    """
    check_experts(x, gate, up, down, ids, weights)
    t_count, d_model = x.shape
    d_ff, n_slots = gate.n, ids.shape[1]
    ids = ids.contiguous()
    weights = weights.contiguous()
    tiles = tiles or dispatch.moe_tiles(gate.qtype, down.qtype, d_model, d_ff, t_count * n_slots,
                                        dispatch.launch_backend(x))
    if int_dot_layout(x, gate, down, int_dot):
        return _moe_decode_i8(x, gate, up, down, ids, weights, clamp, out, tiles, last, xq)
    sub_in, sub_h = _UNIT[gate.qtype], _UNIT[down.qtype]
    ht = torch.empty((t_count, n_slots, d_ff), device=x.device, dtype=torch.float32)
    grid_tab = grid_words(x.device)
    gu = tiles.gate_up
    _moe_gate_up_kernel[(t_count * n_slots, triton.cdiv(d_ff, gu.block_n))](
        transpose_groups(x, sub_in), ids, weights, ht, grid_tab, *_ptrs(gate), *_ptrs(up),
        d_ff, d_model, float(clamp or 0.0),
        S=n_slots, QT=_QT_CODE[gate.qtype], H_SUB=sub_h, CLAMP=clamp is not None,
        BLOCK_N=gu.block_n, BLOCK_U=gu.block_k // sub_in, num_warps=gu.num_warps, num_stages=gu.num_stages, **pdl(x),
    )
    if out is None:
        out = torch.empty((t_count, d_model), device=x.device, dtype=torch.float32)
    dn = tiles.down
    _moe_down_kernel[(t_count, triton.cdiv(d_model, dn.block_n))](
        ht, ids, out, grid_tab, *_ptrs(down), d_ff, d_model, out.stride(0),
        S=n_slots, QT=_QT_CODE[down.qtype], BLOCK_N=dn.block_n, BLOCK_U=dn.block_k // sub_h,
        num_warps=dn.num_warps, num_stages=dn.num_stages, **pdl(ht),
    )
    return out


def int_dot_layout(x: torch.Tensor, gate: PackedExperts, down: PackedExperts, int_dot: bool | None) -> str | None:
    """The activation layout (act_quant.LAYOUTS) moe_decode quantises x in for its integer-dot kernels, or None
    when it runs the fp32 ones (int_dot None: dispatch.use_int_dot for the device)."""
    if int_dot is None:
        int_dot = dispatch.use_int_dot(dispatch.launch_backend(x))
    ok = int_dot and gate.qtype in dispatch.MOE_INT_DOT_QTYPES and down.qtype in dispatch.MOE_INT_DOT_QTYPES
    return gate.qtype if ok else None


def _moe_decode_i8(
    x: torch.Tensor,
    gate: PackedExperts,
    up: PackedExperts,
    down: PackedExperts,
    ids: torch.Tensor,
    weights: torch.Tensor,
    clamp: float | None,
    out: torch.Tensor | None,
    tiles: dispatch.MoeTiles,
    last: torch.Tensor | None = None,
    act: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    t_count, d_model = x.shape
    d_ff, n_slots = gate.n, ids.shape[1]
    grid_tab = grid_codes(x.device)
    xq, xs, xsum = quantize_act(x, gate.qtype) if act is None else act
    h = torch.empty((t_count * n_slots, d_ff), device=x.device, dtype=torch.float32)
    gu = tiles.gate_up
    _moe_gate_up_i8_kernel[(t_count * n_slots, triton.cdiv(d_ff, gu.block_n))](
        xq, xs, xsum, ids, weights, h, grid_tab, *_ptrs(gate), *_ptrs(up), ids if last is None else last,
        d_ff, d_model, float(clamp or 0.0),
        S=n_slots, QT=_QT_CODE[gate.qtype], CLAMP=clamp is not None, BLOCK_N=gu.block_n,
        BLOCK_U=gu.block_k // _I8_UNIT[gate.qtype], PADDED=last is not None, num_warps=gu.num_warps,
        num_stages=gu.num_stages, **pdl(xq),
    )
    hq, hs, hsum = quantize_act(h, down.qtype)
    if out is None:
        out = torch.empty((t_count, d_model), device=x.device, dtype=torch.float32)
    dn = tiles.down
    _moe_down_i8_kernel[(t_count, triton.cdiv(d_model, dn.block_n))](
        hq, hs, hsum, ids, out, grid_tab, *_ptrs(down), ids if last is None else last, d_ff, d_model,
        out.stride(0), S=n_slots, QT=_QT_CODE[down.qtype], BLOCK_N=dn.block_n,
        BLOCK_U=dn.block_k // _I8_UNIT[down.qtype], PADDED=last is not None, num_warps=dn.num_warps,
        num_stages=dn.num_stages, **pdl(hq),
    )
    return out
