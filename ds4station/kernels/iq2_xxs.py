"""IQ2_XXS weights (DS4's routed gate/up experts): repack, decode matvec, torch reference.

GGUF block (256 weights, 66 bytes): fp16 d, then 8 groups of 32 weights, each two little-endian uint32:
  w0 = four 8-bit indices into a 256-entry grid of 8 magnitudes (each 0x08, 0x19 or 0x2b),
  w1 = four 7-bit sign indices (bits 0-27; the 8th sign bit is the parity of the 7) + a 4-bit scale s.
Weight = d * (0.5 + s) / 4 * grid[idx][e] * (-1 if sign bit e).

`repack_iq2_xxs` stores what the kernel wants: the 64 quant bytes of each block as 16 int32 words, so rows
are 16-byte aligned (int32 [.., N, K/16], read as one int64 per 32 weights), and d as fp16 [.., N, K/256].
The kernels read a grid entry as two words of 4 magnitude bytes (not 8 byte gathers) and handle the signs
as a 7-bit field with computed parity (fp32 path: flip the float's sign bit; integer path: byte permutes
of a nibble-code grid, one dp4a per 4 weights). Tiles are 2-D [rows, 32-groups], one lane per group (see _iq2_xxs_dot).
Kernels: `_iq2_xxs_dot` (fp32 math), `_iq2_xxs_dot_i8` (dp4a, act_quant.py activations; the signed bytes by
byte permutes from a nibble-code grid table, `grid_codes`, gathered from shared memory), `_iq2_xxs_tile`
(dequantised fp32 tile for prefill tl.dot, from `grid_words`). moe.rows_matvec runs the decode matvec of a
dense IQ2_XXS weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import triton
import triton.language as tl

from ds4station.kernels.act_quant import _dp4a, _popc, _prmt
from ds4station.kernels.packed import PackedRows, raw_rows

QK_K = 256
BLOCK_BYTES_IQ2_XXS = 66


@dataclass(frozen=True)
class PackedIQ2XXS(PackedRows):
    """Repacked IQ2_XXS weight: qs int32 [*lead, N, K/16] (2 words per 32 weights), d fp16 [*lead, N, K/256]."""

    qs: torch.Tensor
    d: torch.Tensor

    qtype = "iq2_xxs"
    WEIGHTS_PER_QS = 16


@lru_cache(maxsize=1)
def _grid_np() -> np.ndarray:
    """[256, 8] float32 grid magnitudes, from gguf-py's decoding of ggml's iq2xxs_grid."""
    from gguf.quants import IQ2_XXS

    IQ2_XXS.init_grid()
    return np.asarray(IQ2_XXS.grid, dtype=np.float32).reshape(256, 8)


@lru_cache(maxsize=8)
def grid_words(device: torch.device) -> torch.Tensor:
    """int64 [256]: grid entry i as one word, magnitude e in byte e (so one load fetches all 8)."""
    g = _grid_np().astype(np.int64)
    words = np.zeros(256, dtype=np.int64)
    for e in range(8):
        words |= g[:, e] << (8 * e)
    return torch.from_numpy(words).to(device)


# The grid's three magnitudes as bytes, and negated, for the byte-permute decode: selector nibble c picks
# magnitude c (0: 8, 1: 25, 2: 43), c + 4 the negated one.
MAGS = tl.constexpr(0x002B1908)
NEG_MAGS = tl.constexpr(0x00D5E7F8)  # -8, -25, -43 as int8


@lru_cache(maxsize=8)
def grid_codes(device: torch.device) -> torch.Tensor:
    """int32 [256]: grid entry i as 8 nibbles, nibble e = the code (0, 1, 2) of magnitude e (8, 25, 43).
    1 KB against grid_words' 2 KB (the integer-dot kernel stages it in shared memory)."""
    codes = np.searchsorted(np.array([8.0, 25.0, 43.0], dtype=np.float32), _grid_np()).astype(np.int64)
    words = np.zeros(256, dtype=np.int64)
    for e in range(8):
        words |= codes[:, e] << (4 * e)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(device)


def repack_iq2_xxs(raw: torch.Tensor, k: int) -> PackedIQ2XXS:
    """Split raw GGUF IQ2_XXS bytes (uint8 [..., N, K/256*66] or flat) of rows of length `k`."""
    blocks = raw_rows(raw, k, "IQ2_XXS", QK_K, BLOCK_BYTES_IQ2_XXS)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(*lead, nb)
    qs = blocks[..., 2:].contiguous().view(torch.int32).reshape(*lead, k // 16)
    return PackedIQ2XXS(qs=qs, d=d)


@lru_cache(maxsize=8)
def _signed_grid(device: torch.device) -> torch.Tensor:
    """fp32 [256 * 128, 8]: row g * 128 + s is grid entry g with the signs of 7-bit field s (the 8th sign is
    the field's parity, as the format defines), so dequantising is one gather per 8 weights."""
    s7 = torch.arange(128)
    parity = s7.clone()
    for sh in (4, 2, 1):
        parity = parity ^ (parity >> sh)
    sign8 = s7 | ((parity & 1) << 7)
    neg = ((sign8.unsqueeze(-1) >> torch.arange(8)) & 1).bool()  # [128, 8]
    mags = torch.from_numpy(_grid_np())  # [256, 8]
    return torch.where(neg[None], -mags[:, None], mags[:, None]).reshape(256 * 128, 8).to(device)


def dequantize_iq2_xxs(w: PackedIQ2XXS) -> torch.Tensor:
    """fp32 [*lead, N, K] values of a repacked IQ2_XXS weight (torch, any device)."""
    words = w.qs.to(torch.int64) & 0xFFFFFFFF
    words = words.unflatten(-1, (-1, 2))  # [..., K/32, 2]
    w0, w1 = words[..., 0], words[..., 1]
    dev = w.qs.device
    idx = (w0.unsqueeze(-1) >> torch.tensor([0, 8, 16, 24], device=dev)) & 255  # [..., K/32, 4]
    s7 = (w1.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=dev)) & 127
    signed = _signed_grid(dev)[idx * 128 + s7]  # [..., K/32, 4, 8]
    scale = w.d.float().repeat_interleave(8, dim=-1) * (0.5 + ((w1 >> 28) & 15).float()) * 0.25  # [..., K/32]
    return (signed * scale[..., None, None]).flatten(-3)


def iq2_xxs_matvec_ref(x: torch.Tensor, w: PackedIQ2XXS, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of the IQ2_XXS decode matvec (moe.rows_matvec; fp32 math)."""
    return (x.float() @ dequantize_iq2_xxs(w).T).to(out_dtype or x.dtype)


@triton.jit
def _uint_f32(v):
    """Small non-negative int32 values (< 2^23) as fp32 without a conversion instruction: 2^23 + v has v in
    its low mantissa bits."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _dm_f32(dmw):
    """The two fp16 halves of int32 words (a K-quant block's d in the low half, dmin in the high) as fp32."""
    d = (dmw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((dmw >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d, dmin


@triton.jit
def _s8x4_f32(word):
    """The four int8 values of each int32 word as fp32, [..., 2, 2] (reshaped to [..., 4]: memory order), without a
    conversion instruction (I2F runs at a quarter of the FP32 rate on sm_80 / sm_90; in the Q8_0 kernels it
    was not the bound, docs/PERFORMANCE.md, seventeenth session): one XOR biases all four bytes to b + 128,
    each byte becomes 2^23 + b + 128 as in _uint_f32, minus
    2^23 + 128. Exact, so bit-identical to converting the bytes."""
    u = word ^ -2139062144  # 0x80808080 as int32
    f0 = (u & 255 | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    f1 = ((u >> 8) & 255 | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    f2 = ((u >> 16) & 255 | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    f3 = ((u >> 24) & 255 | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return tl.join(tl.join(f0, f2), tl.join(f1, f3))  # [..., j, i] = byte 2j + i


@triton.jit
def _s8x4_f16(word):
    """_s8x4_f32 in fp16 (the tl.dot tiles): 1024 + b + 128 built from its bits (0x6400 | byte), minus 1152."""
    u = word ^ -2139062144  # 0x80808080 as int32
    f0 = (u & 255 | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    f1 = ((u >> 8) & 255 | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    f2 = ((u >> 16) & 255 | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    f3 = ((u >> 24) & 255 | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    return tl.join(tl.join(f0, f2), tl.join(f1, f3))  # [..., j, i] = byte 2j + i


@triton.jit
def _signed_mag(word, sh: tl.constexpr, signs, e: tl.constexpr):
    """Magnitude byte `sh` of int32 `word` as fp32, negated where bit e of `signs` is set: no conversion or
    select instruction (_uint_f32; the sign applied by flipping the float's top bit)."""
    f = _uint_f32((word >> (8 * sh)) & 255)
    return (f.to(tl.int32, bitcast=True) ^ (((signs >> e) & 1) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _iq2_xxs_dot(qs_ptr, d_ptr, grid_ptr, rows, n_mask, xt_ptr, K, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """[BLOCK_N] fp32 dot products of weight rows `rows` (int64) with one activation row.

    qs_ptr: the packed words viewed as int64, one per 32-weight group (low word: 4 grid indices, high word:
    4 x 7 sign bits + 4-bit scale). grid_ptr: int64 [256], 8 magnitude bytes per entry. xt_ptr: the
    activation row TRANSPOSED as [32, K/32] (xt[c, g] = x[32 g + c]), so that the lanes of a warp, which walk
    consecutive groups g, read consecutive x values (one memory transaction) at every weight position c.
    Tiles are 2-D [rows, groups] throughout; each lane owns whole groups, so nothing crosses lanes until the
    final row sum (a 3-D [rows, groups, 8] tile cost ~190 shuffles and 28 layout conversions per chunk).
    """
    G = K // 32
    offs_g = tl.arange(0, BLOCK_G)
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        gg = g0 + offs_g
        g_mask = gg < G
        wmask = n_mask[:, None] & g_mask[None, :]
        q = tl.load(qs_ptr + rows[:, None] * G + gg[None, :], mask=wmask, other=0, eviction_policy="evict_first")
        w0 = q.to(tl.int32)  # low word (truncation)
        w1 = (q >> 32).to(tl.int32)
        db = tl.load(d_ptr + rows[:, None] * (K // 256) + (gg // 8)[None, :], mask=wmask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        scale = db * (0.5 + ((w1 >> 28) & 15).to(tl.float32)) * 0.25
        part = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
        for j in tl.static_range(4):
            idx = (w0 >> (8 * j)) & 255
            gw = tl.load(grid_ptr + idx)  # the grid entry's 8 magnitude bytes, one int64 gather
            lo = gw.to(tl.int32)  # magnitudes 0-3
            hi = (gw >> 32).to(tl.int32)  # magnitudes 4-7
            s7 = (w1 >> (7 * j)) & 127
            p = s7 ^ (s7 >> 4)
            p = p ^ (p >> 2)
            p = p ^ (p >> 1)
            sign8 = s7 | ((p & 1) << 7)  # the 8th sign is the parity of the 7 stored ones
            for e in tl.static_range(8):
                if e < 4:
                    f = _signed_mag(lo, e, sign8, e)
                else:
                    f = _signed_mag(hi, e - 4, sign8, e)
                xv = tl.load(xt_ptr + (j * 8 + e) * G + gg, mask=g_mask, other=0.0).to(tl.float32)
                part += f * xv[None, :]
        acc += part * scale
    return tl.sum(acc, axis=1)


@triton.jit
def _sign_selectors(s7):
    """The 8 signs of a 7-bit sign field (the 8th: the parity of the 7) at bit 2 of nibbles 0-7: OR'd into
    grid_codes' nibbles, the byte-permute selectors that pick each weight's signed magnitude. Computed, not
    looked up (a 128-entry table's second divergent lookup cost more than its instructions saved): three
    multiply-and-mask steps move bit e to 4 e + 2; each multiply adds shifted copies whose set bits never
    overlap, so no carry crosses a kept bit (bits above 7 of the first operand, popc's high bits, are
    dropped by the first mask)."""
    s = s7 + _popc(s7) * 128  # bit 7: the parity
    s = (s * 0x1001) & 0x000F000F  # bits 0-3 stay, bits 4-7 -> 16-19
    s = (s * 0x41) & 0x03030303  # pairs: bits 0-1, 8-9, 16-17, 24-25
    return (s * 0x24) & 0x44444444  # each pair's bits -> 4 e + 2


@triton.jit
def _iq2_xxs_dot_i8(qs_ptr, d_ptr, grid_ptr, rows, n_mask, xq_ptr, xs_ptr, K,
                    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """Integer-dot form of _iq2_xxs_dot: activation quantised by act_quant ("iq2_xxs" layout: int32 [8, K/32]
    words + fp32 scale per 32), two dp4a per 8 weights. The signed magnitude bytes of 8 weights come from two
    byte permutes of (8, 25, 43, -8, -25, -43), whose selectors are the grid entry's nibble codes (grid_ptr:
    grid_codes, 1 KB) OR'd with the signs moved into bit 2 of each nibble by arithmetic (_sign_selectors).
    The codes are looked up with `tl.gather` from the table held as a [256] tensor: across two or more warps
    Triton stages it in shared memory, so the divergent lookups are LDS instead of L1 loads of global memory
    (one warp would gather by shuffles, 8 per lookup: dispatch.moe_tiles gives this kernel >= 2 warps).
    Measured on the H200 (docs/PERFORMANCE.md, fifteenth session), gate + up of 6 of 256 Flash experts per
    token: 30.2 -> 18.3 us at 1 token, 103 -> 61 at 4, 190 -> 115 at 8, against the global-memory lookups at
    their best tiles (the kernel was L1-throughput bound, 85% at 4 tokens). Earlier, the nibble codes had
    beaten int64 grid words with multiplied sign masks and a 128-entry sign table (52.9 against 57-62 us).
    The four entries of a 32-group are looked up in one gather (one table store and two barriers per K step,
    not four and eight): 1% faster (twentieth session). Looking the sign words up from the same table (one
    gather of 8 per group, 25% fewer instructions in the sm_90 loop) was 2-12% slower: twice the shared-memory
    lookups, which bound this kernel, not its instruction count."""
    G = K // 32
    offs_g = tl.arange(0, BLOCK_G)
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    codes = tl.load(grid_ptr + tl.arange(0, 256))
    for g0 in range(0, G, BLOCK_G):
        gg = g0 + offs_g
        g_mask = gg < G
        wmask = n_mask[:, None] & g_mask[None, :]
        q = tl.load(qs_ptr + rows[:, None] * G + gg[None, :], mask=wmask, other=0, eviction_policy="evict_first")
        w0 = q.to(tl.int32)
        w1 = (q >> 32).to(tl.int32)
        db = tl.load(d_ptr + rows[:, None] * (K // 256) + (gg // 8)[None, :], mask=wmask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        xs = tl.load(xs_ptr + gg, mask=g_mask, other=0.0)
        scale = db * (0.5 + ((w1 >> 28) & 15).to(tl.float32)) * 0.25 * xs[None, :]
        isum = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
        mags = tl.full([BLOCK_N, BLOCK_G], MAGS, tl.int32)
        neg_mags = tl.full([BLOCK_N, BLOCK_G], NEG_MAGS, tl.int32)
        # the four grid entries' codes in one gather: [rows, groups, 2, 2] = entry 2 b + a at [.., a, b]
        idx = tl.join(tl.join(w0 & 255, (w0 >> 8) & 255), tl.join((w0 >> 16) & 255, (w0 >> 24) & 255))
        c01, c23 = tl.split(tl.reshape(tl.gather(codes, tl.reshape(idx, [BLOCK_N * BLOCK_G * 4]), 0),
                                       [BLOCK_N, BLOCK_G, 2, 2]))
        c0, c1 = tl.split(c01)
        c2, c3 = tl.split(c23)
        for j in tl.static_range(4):
            s7 = (w1 >> (7 * j)) & 127
            code = c0 if j == 0 else c1 if j == 1 else c2 if j == 2 else c3
            sel = _sign_selectors(s7) | code  # nibble e: code + 4 * sign
            lo = _prmt(mags, neg_mags, sel)
            hi = _prmt(mags, neg_mags, sel >> 16)
            xa = tl.broadcast_to(tl.load(xq_ptr + (2 * j) * G + gg, mask=g_mask, other=0)[None, :],
                                 (BLOCK_N, BLOCK_G))
            xb = tl.broadcast_to(tl.load(xq_ptr + (2 * j + 1) * G + gg, mask=g_mask, other=0)[None, :],
                                 (BLOCK_N, BLOCK_G))
            isum = _dp4a(lo, xa, isum)
            isum = _dp4a(hi, xb, isum)
        acc += isum.to(tl.float32) * scale
    return tl.sum(acc, axis=1)


@triton.jit
def _iq2_xxs_tile(qs_ptr, d_ptr, grid_ptr, rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """Dequantised [rows, BLOCK_K] fp32 tile of weights k0 .. k0 + BLOCK_K (prefill tl.dot operand).

    Decoded per unit of 8 weights (one grid entry): per unit one load of its 32-group's packed word, one
    load of the grid entry as an int64 (8 magnitude bytes) and one of the block scale; the 8 weights are 8
    [rows, units] tensors made with constant shifts of the entry's two int32 halves (the magnitude and sign
    by bit tricks, _signed_mag), joined into K order in registers. (Element-wise loads, 3 per weight, made
    the tile decode the bottleneck of the prefill MoE; a [rows, units, 8] tile with per-element shifts of
    the int64 entry, integer-to-float conversions and selects cost 1.5x this one on the H200:
    docs/PERFORMANCE.md, fifteenth session.) BLOCK_K is a multiple of 32."""
    G = K // 32
    u = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # unit index along the row
    g = u // 4
    j = u % 4
    mask = n_mask[:, None] & (g < G)[None, :]
    q = tl.load(qs_ptr + rows[:, None] * G + g[None, :], mask=mask, other=0)
    w0 = q.to(tl.int32)
    w1 = (q >> 32).to(tl.int32)
    gw = tl.load(grid_ptr + ((w0 >> (8 * j)[None, :]) & 255))  # [rows, units] int64: 8 magnitudes
    lo = gw.to(tl.int32)
    hi = (gw >> 32).to(tl.int32)
    s7 = (w1 >> (7 * j)[None, :]) & 127
    p = s7 ^ (s7 >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    signs = s7 | ((p & 1) << 7)
    db = tl.load(d_ptr + rows[:, None] * (K // 256) + (g // 8)[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = db * (0.5 + ((w1 >> 28) & 15).to(tl.float32)) * 0.25
    e0 = _signed_mag(lo, 0, signs, 0) * scale
    e1 = _signed_mag(lo, 1, signs, 1) * scale
    e2 = _signed_mag(lo, 2, signs, 2) * scale
    e3 = _signed_mag(lo, 3, signs, 3) * scale
    e4 = _signed_mag(hi, 0, signs, 4) * scale
    e5 = _signed_mag(hi, 1, signs, 5) * scale
    e6 = _signed_mag(hi, 2, signs, 6) * scale
    e7 = _signed_mag(hi, 3, signs, 7) * scale
    # [rows, units, a, b, c] = weight 4 a + 2 b + c of the unit (tl.join adds the minor axis)
    w = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(w, (rows.shape[0], BLOCK_K))


def transpose_groups(x: torch.Tensor, sub: int) -> torch.Tensor:
    """[M, K] -> [M, sub, K/sub] contiguous: the activation layout the 2-bit kernels read (see _iq2_xxs_dot)."""
    m, k = x.shape
    return x.reshape(m, k // sub, sub).transpose(1, 2).contiguous()
