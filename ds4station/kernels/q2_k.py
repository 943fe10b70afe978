"""Q2_K weights (DS4's routed down experts): repack, the decode row dots (moe.rows_matvec runs them), torch reference.

GGUF block (256 weights, 84 bytes): scales[16] (low nibble = scale, high nibble = min of each 16 weights),
qs[64] (2-bit quants), fp16 d, fp16 dmin. Weight e of the block, with e = h*128 + s*32 + l (h half, s shift
slot, l in 0..31): q = (qs[h*32 + l] >> 2s) & 3, and value = d * (sc & 15) * q - dmin * (sc >> 4) with
sc = scales[e // 16].

`repack_q2_k` stores what the kernel wants: the 2-bit codes re-packed so that each byte holds FOUR
CONSECUTIVE weights (weight 4j + i at bits 2i of byte j), so one int32 word is 16 consecutive weights that
share one scale/min byte; qs uint8 [.., N, K/4] (read as int32 words), scales uint8 [.., N, K/16] (byte w
belongs to word w), dm fp16 [.., N, K/256, 2] (d, dmin). The bytes per weight are unchanged (2.625 bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ds4station.kernels.act_quant import _dp4a
from ds4station.kernels.iq2_xxs import _dm_f32, _uint_f32
from ds4station.kernels.packed import PackedRows, raw_rows

QK_K = 256
BLOCK_BYTES_Q2_K = 84


@dataclass(frozen=True)
class PackedQ2K(PackedRows):
    """Repacked Q2_K weight: qs uint8 [*lead, N, K/4] (4 consecutive weights per byte), sc uint8 [*lead, N, K/16],
    dm fp16 [*lead, N, K/128] ((d, dmin) per 256 weights)."""

    qs: torch.Tensor
    sc: torch.Tensor
    dm: torch.Tensor

    qtype = "q2_k"
    WEIGHTS_PER_QS = 4


def _codes_ggml_order(qs: torch.Tensor) -> torch.Tensor:
    """2-bit codes of GGUF Q2_K quant bytes [..., nb, 64] in weight order: [..., nb, 256] uint8."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).reshape(4, 1)
    lead = qs.shape[:-1]
    # byte h*32 + l holds weights h*128 + 32 s + l at bits 2s
    return ((qs.reshape(*lead, 2, 1, 32) >> shifts) & 3).reshape(*lead, 256)


def repack_q2_k(raw: torch.Tensor, k: int) -> PackedQ2K:
    """Repack raw GGUF Q2_K bytes (uint8 [..., N, K/256*84] or flat) of rows of length `k`."""
    blocks = raw_rows(raw, k, "Q2_K", QK_K, BLOCK_BYTES_Q2_K)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    sc = blocks[..., :16].reshape(*lead, k // 16).contiguous()
    codes = _codes_ggml_order(blocks[..., 16:80]).reshape(*lead, k // 4, 4)
    qs = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    dm = blocks[..., 80:84].contiguous().view(torch.float16).reshape(*lead, nb * 2)
    return PackedQ2K(qs=qs.contiguous(), sc=sc, dm=dm)


def dequantize_q2_k(w: PackedQ2K) -> torch.Tensor:
    """fp32 [*lead, N, K] values of a repacked Q2_K weight (torch, any device)."""
    lead = w.qs.shape[:-1]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=w.qs.device)
    q = ((w.qs.unsqueeze(-1) >> shifts) & 3).reshape(*lead, w.k // 16, 16).float()
    dm = w.dm.float().reshape(*lead, w.k // QK_K, 2).repeat_interleave(16, dim=-2)  # [.., K/16, 2]: 16 per block
    dl = dm[..., 0] * (w.sc & 15).float()
    ml = dm[..., 1] * (w.sc >> 4).float()
    return (dl.unsqueeze(-1) * q - ml.unsqueeze(-1)).reshape(*lead, w.k)


def q2_k_matvec_ref(x: torch.Tensor, w: PackedQ2K, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of the Q2_K decode matvec (moe.rows_matvec; fp32 math)."""
    return (x.float() @ dequantize_q2_k(w).T).to(out_dtype or x.dtype)


@triton.jit
def _q2_k_words(qs_ptr, sc_ptr, dm_ptr, rows, n_mask, ww, w_mask, K):
    """The decode dots' loads of words ww of rows: [rows, words] int32 code words, their scale / min bytes (as
    int32) and the (d, dmin) of their 256-weight blocks in fp32."""
    W = K // 16
    wmask = n_mask[:, None] & w_mask[None, :]
    word = tl.load(qs_ptr + rows[:, None] * W + ww[None, :], mask=wmask, other=0, eviction_policy="evict_first")
    sc = tl.load(sc_ptr + rows[:, None] * W + ww[None, :], mask=wmask, other=0,
                 eviction_policy="evict_first").to(tl.int32)
    dmw = tl.load(dm_ptr + rows[:, None] * (K // 256) + (ww // 16)[None, :], mask=wmask, other=0,
                  eviction_policy="evict_first")
    d, dmin = _dm_f32(dmw)
    return word, sc, d, dmin


@triton.jit
def _q2_k_dot(qs_ptr, sc_ptr, dm_ptr, rows, n_mask, xt_ptr, K, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """[BLOCK_N] fp32 dot products of weight rows `rows` (int64) with one activation row.

    qs_ptr: int32 words of 16 consecutive 2-bit weights; sc_ptr: one scale/min byte per word; dm_ptr: int32
    (d, dmin) fp16 pairs per 256 weights. xt_ptr: the activation row TRANSPOSED as [16, K/16]
    (xt[i, w] = x[16 w + i]) so lanes walking consecutive words read consecutive x values. 2-D tiles
    [rows, words], one lane per word, as in _iq2_xxs_dot.
    """
    W = K // 16
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        ww = w0 + offs_w
        w_mask = ww < W
        word, sc, d, dmin = _q2_k_words(qs_ptr, sc_ptr, dm_ptr, rows, n_mask, ww, w_mask, K)
        qx = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        sx = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(16):
            q = _uint_f32((word >> (2 * i)) & 3)
            xv = tl.load(xt_ptr + i * W + ww, mask=w_mask, other=0.0).to(tl.float32)
            qx += q * xv[None, :]
            sx += xv
        acc += (d * (sc & 15).to(tl.float32)) * qx - (dmin * (sc >> 4).to(tl.float32)) * sx[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _q2_k_dot_i8(qs_ptr, sc_ptr, dm_ptr, rows, n_mask, xq_ptr, xs_ptr, xsum_ptr, K,
                 BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Integer-dot form of _q2_k_dot: activation quantised by act_quant ("q2_k" layout: int32 [4, K/16], word i
    of 16-group w holds x[16 w + 4 b + i] in byte b, matching (word >> 2i) & 0x03030303 of the weights);
    the min term uses the exact fp32 sums of 16 activations."""
    W = K // 16
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        ww = w0 + offs_w
        w_mask = ww < W
        word, sc, d, dmin = _q2_k_words(qs_ptr, sc_ptr, dm_ptr, rows, n_mask, ww, w_mask, K)
        isum = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
        for i in tl.static_range(4):
            xv = tl.broadcast_to(tl.load(xq_ptr + i * W + ww, mask=w_mask, other=0)[None, :], (BLOCK_N, BLOCK_W))
            isum = _dp4a((word >> (2 * i)) & 0x03030303, xv, isum)
        xs = tl.load(xs_ptr + ww // 2, mask=w_mask, other=0.0)
        xsum = tl.load(xsum_ptr + ww, mask=w_mask, other=0.0)
        acc += (d * (sc & 15).to(tl.float32)) * (isum.to(tl.float32) * xs[None, :]) \
            - (dmin * (sc >> 4).to(tl.float32)) * xsum[None, :]
    return tl.sum(acc, axis=1)


@lru_cache(maxsize=8)
def code_halves(device: torch.device) -> torch.Tensor:
    """fp16 [256 * 4]: the four 2-bit codes of each byte value (code i at bits 2i) as fp16, for _q2_k_tile16."""
    b = torch.arange(256)
    return ((b.unsqueeze(-1) >> (2 * torch.arange(4))) & 3).reshape(-1).to(torch.float16).to(device)


@triton.jit
def _q2_k_tile16(qs_ptr, sc_ptr, dm_ptr, tab_ptr, rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """Dequantised [rows, BLOCK_K] fp16 tile (prefill tl.dot operand): qs_ptr the codes as bytes (4 weights
    each), sc_ptr scale bytes per 16 weights, dm_ptr int32 (d, dmin) per 256, tab_ptr code_halves. Per byte one
    8-byte gather of its 4 codes as fp16, per weight one fp16 multiply-add by the 16 weights' d * scale and
    dmin * min (rounded to fp16 first). BLOCK_K is a multiple of 16."""
    W = K // 16
    NW: tl.constexpr = BLOCK_K // 16
    BN: tl.constexpr = rows.shape[0]
    u = k0 // 16 + tl.arange(0, NW)
    mask = n_mask[:, None] & (u < W)[None, :]
    c4 = tl.arange(0, 4)
    byte = tl.load(qs_ptr + (rows[:, None] * (K // 4) + u[None, :] * 4)[:, :, None] + c4[None, None, :],
                   mask=mask[:, :, None], other=0).to(tl.int32)  # [rows, NW, 4]: the word's 4 bytes
    q = tl.load(tab_ptr + (byte * 4)[:, :, :, None] + c4[None, None, None, :])  # [rows, NW, 4, 4] fp16
    sc = tl.load(sc_ptr + rows[:, None] * W + u[None, :], mask=mask, other=0).to(tl.int32)
    dmw = tl.load(dm_ptr + rows[:, None] * (K // 256) + (u // 16)[None, :], mask=mask, other=0)
    d, dmin = _dm_f32(dmw)
    dl = (d * (sc & 15).to(tl.float32)).to(tl.float16)
    ml = (dmin * (sc >> 4).to(tl.float32)).to(tl.float16)
    # flattened before the multiply-add, and the factors broadcast to the flat tile: the 4-D product flattened
    # after it made Triton 3.6's dot-operand pass fail on sm_90 ("Illegal shared layout")
    dl = tl.reshape(tl.broadcast_to(dl[:, :, None], (BN, NW, 16)), (BN, BLOCK_K))
    ml = tl.reshape(tl.broadcast_to(ml[:, :, None], (BN, NW, 16)), (BN, BLOCK_K))
    return tl.reshape(q, (BN, BLOCK_K)) * dl - ml
