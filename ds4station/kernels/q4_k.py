"""Q4_K weights: repack, decode row dots, prefill tl.dot matmul, torch references.

GGUF block (256 weights, 144 bytes): fp16 d, fp16 dmin, scales[12] (6-bit scale and min of each of the 8
sub-blocks of 32, packed as engine/quants.py's `_k_scale_min` reads them), qs[128] (4-bit quants: sub-block 2c
is the low nibbles of bytes 32c..32c+31, 2c+1 their high nibbles). Weight value = d * sc * q - dmin * m.

`repack_q4_k` stores what the kernels want: the nibbles re-packed in weight order (weight 2j in the low nibble
of byte j, 2j + 1 in the high one), so an int32 word is 8 consecutive weights of one sub-block; the 6-bit
scales and mins unpacked to one byte each per sub-block; (d, dmin) per 256 weights. 0.578 bytes per weight
against the GGUF's 0.5625 (the unpacked scales).

- `_q4_k_dot`: the decode row dot (moe.rows_matvec for a dense weight, the fused MoE kernels for experts),
  1-8 activation rows; 2-D [rows, words] tiles with one lane per int32 word (8 weights) and the activation
  transposed to [8, K/8], as the 2-bit kernels do; fp32 math. (A first
  version decoded 3-D [rows, words, 8] tiles and reshaped them to [rows, K]: 0.7% of copy bandwidth on the
  H200, 1.3 ms for 4096x4096.)
- `q4_k_matmul(x, w)`: prefill, a dequantised [rows, BLOCK_K] tile (`_q4_k_tile`) as an fp16 tl.dot operand,
  fp32 accumulation.
- `_q4_k_dot_i8`: the integer-dot (dp4a) row dot of the fused MoE decode (CUDA), over an activation quantised
  per 32 by act_quant.py in its "q4_k" layout; one lane per 32-weight sub-block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import _dp4a
from ds4station.kernels.iq2_xxs import _dm_f32, _uint_f32
from ds4station.kernels.packed import PackedRows, raw_rows
from ds4station.kernels.pdl import enter, pdl

QK_K = 256
BLOCK_BYTES_Q4_K = 144


@dataclass(frozen=True)
class PackedQ4K(PackedRows):
    """Repacked Q4_K weight: qs uint8 [*lead, N, K/2] (two consecutive weights per byte), sc / mn uint8
    [*lead, N, K/32] (6-bit scale / min per sub-block), dm fp16 [*lead, N, K/128] ((d, dmin) per 256)."""

    qs: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    dm: torch.Tensor

    qtype = "q4_k"
    WEIGHTS_PER_QS = 2


def repack_q4_k(raw: torch.Tensor, k: int) -> PackedQ4K:
    """Repack raw GGUF Q4_K bytes (uint8 [..., N, K/256*144] or flat) of rows of length `k`."""
    from ds4station.kernels.quants import _k_scale_min, _nibbles_32

    blocks = raw_rows(raw, k, "Q4_K", QK_K, BLOCK_BYTES_Q4_K)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    blocks = blocks.reshape(-1, BLOCK_BYTES_Q4_K)
    dm = blocks[:, 0:4].contiguous().view(torch.float16).reshape(*lead, nb * 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    codes = _nibbles_32(blocks[:, 16:144]).reshape(-1, QK_K // 2, 2)  # weight order, pairs
    qs = (codes[..., 0] | (codes[..., 1] << 4)).reshape(*lead, k // 2)
    return PackedQ4K(qs=qs.contiguous(), sc=sc.reshape(*lead, k // 32).contiguous(),
                     mn=mn.reshape(*lead, k // 32).contiguous(), dm=dm.contiguous())


def dequantize_q4_k(w: PackedQ4K) -> torch.Tensor:
    """fp32 [*lead, N, K] values of a repacked Q4_K weight (torch, any device), as the GGUF dequantises."""
    lead = w.qs.shape[:-1]
    q = torch.stack((w.qs & 15, w.qs >> 4), dim=-1).reshape(*lead, w.k // 32, 32).float()
    dm = w.dm.float().reshape(*lead, w.k // QK_K, 1, 2)
    d, dmin = dm[..., 0], dm[..., 1]  # [.., K/256, 1]
    dl = (d * w.sc.reshape(*lead, w.k // QK_K, 8).float()).reshape(*lead, w.k // 32, 1)
    ml = (dmin * w.mn.reshape(*lead, w.k // QK_K, 8).float()).reshape(*lead, w.k // 32, 1)
    return (dl * q - ml).reshape(*lead, w.k)


def q4_k_matvec_ref(x: torch.Tensor, w: PackedQ4K, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return (x.float() @ dequantize_q4_k(w).T).to(out_dtype or x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _q4_k_tile(qs_ptr, sc_ptr, mn_ptr, dm_ptr, rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """Dequantised [rows, BLOCK_K] fp32 tile of weights k0 .. k0 + BLOCK_K (prefill tl.dot operand):
    qs_ptr bytes (two weights each), sc_ptr / mn_ptr bytes per 32 weights, dm_ptr int32 (d, dmin) per 256.
    The two nibbles of a byte are joined on a new last axis (tl.join keeps it inside a thread) and the
    sub-block factors broadcast per 32 in registers, so every weight load is a plain vector load."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    KB: tl.constexpr = BLOCK_K // 32
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = n_mask[:, None] & (kb < K // 2)[None, :]
    b = tl.load(qs_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=mask, other=0).to(tl.int32)
    q = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)  # weight order
    sb = k0 // 32 + tl.arange(0, KB)
    smask = n_mask[:, None] & (sb < K // 32)[None, :]
    sub = rows[:, None] * (K // 32) + sb[None, :]
    sc = tl.load(sc_ptr + sub, mask=smask, other=0).to(tl.float32)
    mn = tl.load(mn_ptr + sub, mask=smask, other=0).to(tl.float32)
    dmw = tl.load(dm_ptr + rows[:, None] * (K // 256) + (sb // 8)[None, :], mask=smask, other=0)
    d, dmin = _dm_f32(dmw)
    scale = tl.reshape(tl.broadcast_to((d * sc)[:, :, None], (BLOCK_N, KB, 32)), (BLOCK_N, BLOCK_K))
    shift = tl.reshape(tl.broadcast_to((dmin * mn)[:, :, None], (BLOCK_N, KB, 32)), (BLOCK_N, BLOCK_K))
    return q * scale - shift


@triton.jit
def _q4_k_dot(qs_ptr, sc_ptr, mn_ptr, dm_ptr, rows, n_mask, xt_ptr, K, BLOCK_N: tl.constexpr,
              BLOCK_U: tl.constexpr):
    """[BLOCK_N] fp32 dot products of weight rows `rows` (int64) with one activation row TRANSPOSED as
    [8, K/8] (xt[e, u] = x[8 u + e]), so the lanes, which walk consecutive int32 words u, read consecutive x
    at each nibble position e. 2-D [rows, words] tiles, one lane per word (as the 2-bit kernels): per word
    sum_e x_e (d sc q_e - dmin mn) = d sc sum_e q_e x_e - dmin mn sum_e x_e, the x sum shared by the rows."""
    U = K // 8
    offs_u = tl.arange(0, BLOCK_U)
    acc = tl.zeros([BLOCK_N, BLOCK_U], dtype=tl.float32)
    for u0 in range(0, U, BLOCK_U):
        uu = u0 + offs_u
        u_mask = uu < U
        wmask = n_mask[:, None] & u_mask[None, :]
        word = tl.load(qs_ptr + rows[:, None] * U + uu[None, :], mask=wmask, other=0, eviction_policy="evict_first")
        sub = rows[:, None] * (K // 32) + (uu // 4)[None, :]
        sc = tl.load(sc_ptr + sub, mask=wmask, other=0, eviction_policy="evict_first").to(tl.float32)
        mn = tl.load(mn_ptr + sub, mask=wmask, other=0, eviction_policy="evict_first").to(tl.float32)
        dmw = tl.load(dm_ptr + rows[:, None] * (K // 256) + (uu // 32)[None, :], mask=wmask, other=0,
                      eviction_policy="evict_first")
        d, dmin = _dm_f32(dmw)
        dot = tl.zeros([BLOCK_N, BLOCK_U], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_U], dtype=tl.float32)
        for e in tl.static_range(8):
            q = _uint_f32((word >> (4 * e)) & 15)  # no conversion instruction
            xv = tl.load(xt_ptr + e * U + uu, mask=u_mask, other=0.0).to(tl.float32)
            dot += q * xv[None, :]
            xsum += xv
        acc += d * sc * dot - dmin * mn * xsum[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _q4_k_dot_i8(qs_ptr, sc_ptr, mn_ptr, dm_ptr, rows, n_mask, xq_ptr, xs_ptr, xsum_ptr, K,
                 BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """Integer-dot form of _q4_k_dot: [BLOCK_N] fp32 dot products with an activation quantised per 32 by
    act_quant ("q4_k" layout: int32 [8, K/32] words, fp32 scale per 32, exact fp32 sums per 16). One lane per
    32-weight sub-block: its 4 words as 4 loads (one 16-byte load split in registers compiled to a layout
    conversion through shared memory on sm_90); per word two dp4a, of the low
    nibbles (weights 8 j + 2 b) and of the high ones (8 j + 2 b + 1) against the layout's words 2 j and 2 j + 1.
    Per sub-block: d sc xs isum - dmin mn sum(x), the sum exact (as the fp32 kernel's)."""
    G = K // 32
    offs_g = tl.arange(0, BLOCK_G)
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        gg = g0 + offs_g
        g_mask = gg < G
        wmask = n_mask[:, None] & g_mask[None, :]
        wp = qs_ptr + rows[:, None] * (K // 8) + (gg * 4)[None, :]
        w0 = tl.load(wp, mask=wmask, other=0, eviction_policy="evict_first")
        w1 = tl.load(wp + 1, mask=wmask, other=0, eviction_policy="evict_first")
        w2 = tl.load(wp + 2, mask=wmask, other=0, eviction_policy="evict_first")
        w3 = tl.load(wp + 3, mask=wmask, other=0, eviction_policy="evict_first")
        sub = rows[:, None] * G + gg[None, :]
        sc = tl.load(sc_ptr + sub, mask=wmask, other=0, eviction_policy="evict_first").to(tl.float32)
        mn = tl.load(mn_ptr + sub, mask=wmask, other=0, eviction_policy="evict_first").to(tl.float32)
        dmw = tl.load(dm_ptr + rows[:, None] * (K // 256) + (gg // 8)[None, :], mask=wmask, other=0,
                      eviction_policy="evict_first")
        d, dmin = _dm_f32(dmw)
        xs = tl.load(xs_ptr + gg, mask=g_mask, other=0.0)
        xsum = tl.load(xsum_ptr + 2 * gg, mask=g_mask, other=0.0) + tl.load(xsum_ptr + 2 * gg + 1, mask=g_mask,
                                                                            other=0.0)
        isum = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
        isum = _q4_k_word_dp4a(w0, 0, xq_ptr, gg, g_mask, G, isum)
        isum = _q4_k_word_dp4a(w1, 1, xq_ptr, gg, g_mask, G, isum)
        isum = _q4_k_word_dp4a(w2, 2, xq_ptr, gg, g_mask, G, isum)
        isum = _q4_k_word_dp4a(w3, 3, xq_ptr, gg, g_mask, G, isum)
        acc += (d * sc) * (isum.to(tl.float32) * xs[None, :]) - (dmin * mn) * xsum[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _q4_k_word_dp4a(word, j: tl.constexpr, xq_ptr, gg, g_mask, G, isum):
    """isum + the two dp4a of Q4_K word j of each sub-block (8 weights) with its activation words 2 j, 2 j + 1."""
    xa = tl.broadcast_to(tl.load(xq_ptr + (2 * j) * G + gg, mask=g_mask, other=0)[None, :], word.shape)
    xb = tl.broadcast_to(tl.load(xq_ptr + (2 * j + 1) * G + gg, mask=g_mask, other=0)[None, :], word.shape)
    isum = _dp4a(word & 0x0F0F0F0F, xa, isum)
    return _dp4a((word >> 4) & 0x0F0F0F0F, xb, isum)


@triton.jit
def _q4_k_matmul_kernel(x_ptr, qs_ptr, sc_ptr, mn_ptr, dm_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + kk[None, :],
                     mask=m_mask[:, None] & (kk < K)[None, :], other=0.0).to(tl.float16)
        w = _q4_k_tile(qs_ptr, sc_ptr, mn_ptr, dm_ptr, rows, n_mask, k0, K, BLOCK_K).to(tl.float16)
        acc = tl.dot(xt, tl.trans(w), acc)
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, w: PackedQ4K) -> None:
    if x.dim() != 2 or x.shape[1] != w.k or w.qs.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} does not match the Q4_K weight [{w.n}, {w.k}]")


def q4_k_matmul(x: torch.Tensor, w: PackedQ4K, out_dtype: torch.dtype | None = None,
                tiles: dispatch.MatmulTiles | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T for prefill (Triton launcher; fp16 tl.dot, fp32 accumulation)."""
    _check(x, w)
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    tiles = tiles or dispatch.matmul_tiles("q4_k", m, w.n, w.k, dispatch.launch_backend(x))
    y = torch.empty(m, w.n, device=x.device, dtype=out_dtype or x.dtype)
    _q4_k_matmul_kernel[(triton.cdiv(m, tiles.block_m), triton.cdiv(w.n, tiles.block_n))](
        x, w.qs, w.sc, w.mn, w.dm.view(torch.int32), y, m, w.n, w.k, x.stride(0), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **pdl(x))
    return y
