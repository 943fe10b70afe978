"""Activation quantisation for the integer-dot (dp4a) decode kernels, and the dp4a helper itself.

The 2-bit expert kernels spend most of their time turning weights into floats (~7.7 instructions per
weight in the fp32 path, see docs/PERFORMANCE.md). With the activation quantised to int8 per 32
values (scale = amax / 127, as llama.cpp's q8_1), four weights x four activations become one `dp4a`
(a 4-way int8 dot product with int32 accumulation, exact), and the weights stay packed bytes.

`quantize_act` writes the int8 values packed four to an int32 word, TRANSPOSED so that lanes walking
consecutive weight units read consecutive words, in the order each weight format needs:
- layout "iq2_xxs": word c of 32-group g holds x[32 g + 4 c + b] in byte b (natural order), stored at
  [c, g] of an int32 [8, K/32] array;
- layout "q2_k": word i of 16-group w holds x[16 w + 4 b + i] in byte b (matching the repacked Q2_K word
  whose byte b holds weights 16 w + 4 b + 0..3 at bits 2i), stored at [i, w] of an int32 [4, K/16] array;
- layout "q4_k": word c = 2 j + p of 32-group g holds x[32 g + 8 j + 2 b + p] in byte b (matching the
  repacked Q4_K word j of the group, whose byte b holds weights 8 j + 2 b and 8 j + 2 b + 1 in its low and
  high nibble: word & 0x0F0F0F0F pairs with c = 2 j, (word >> 4) & 0x0F0F0F0F with c = 2 j + 1), stored at
  [c, g] of an int32 [8, K/32] array.
Both also write the fp32 scale per 32 values [K/32] and the exact fp32 sum per 16 values [K/16] (Q2_K's
min term needs sum(x), which stays unquantised).

`_dp4a` (and `_prmt`, a byte permute, and `_popc`, a bit count) is NVIDIA PTX (sm_61+); the dispatcher only
selects integer-dot kernels on CUDA. The fp32 kernels remain the portable path and the reference. Under the
CPU interpreter, which cannot run inline assembly, `_dp4a` is the same sum in integer ops, so the tests still
check the integer kernels end to end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.pdl import enter, pdl

LAYOUTS = {"iq2_xxs": 0, "q2_k": 1, "q4_k": 2}


if dispatch.interpreting():
    # The CPU interpreter cannot run inline assembly: the same sum in plain integer ops, so the CPU tests run
    # every other part of the integer-dot kernels (layouts, sign masks, scales) bit for bit.
    @triton.jit
    def _dp4a(a, b, c):
        """c + sum of the four signed byte products of int32 words a and b."""
        acc = c
        for i in tl.static_range(4):
            acc += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return acc

    @triton.jit
    def _popc(a):
        """Number of set bits of int32 words a."""
        n = tl.zeros_like(a)
        for i in tl.static_range(32):
            n += (a >> i) & 1
        return n

    @triton.jit
    def _prmt(a, b, c):
        """Bytes of {b, a} picked by the 4 low nibbles of c (index 0-3: a's bytes, 4-7: b's); the sign-replicate
        mode (nibble bit 3) is not emulated: no caller sets it."""
        out = tl.zeros_like(c)
        for i in tl.static_range(4):
            n = (c >> (4 * i)) & 7
            byte = (tl.where(n < 4, a, b) >> ((n & 3) * 8)) & 255
            out |= byte << (8 * i)
        return out
else:
    @triton.jit
    def _popc(a):
        """Number of set bits of int32 words a (NVIDIA popc)."""
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [a], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _prmt(a, b, c):
        """Byte permute (NVIDIA prmt.b32): byte i of the result is byte (nibble i of c) of {b, a}."""
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _dp4a(a, b, c):
        """c + sum of the four signed byte products of int32 words a and b (NVIDIA dp4a)."""
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def act_tile(x, row, g0, G, xq_ptr, xs_ptr, xsum_ptr, LAYOUT: tl.constexpr):
    """Quantise x [BLOCK_G, 32] fp32, the 32-groups g0 .. g0 + BLOCK_G of activation row `row` (groups from G
    on are masked off), and store them as `quantize_act` lays them out (LAYOUT: LAYOUTS[layout]). Used by the
    quantiser's own kernel and by producers that emit the quantised row with their output (norm.rms_norm)."""
    BLOCK_G: tl.constexpr = x.shape[0]
    gg = g0 + tl.arange(0, BLOCK_G)
    g_mask = gg < G
    amax = tl.max(tl.abs(x), axis=1)
    scale = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    v = x * inv[:, None]
    q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)  # round half away from zero, |q| <= 127
    tl.store(xs_ptr + row * G + gg, scale, mask=g_mask)
    xsum = tl.sum(tl.reshape(x, (BLOCK_G, 2, 16)), axis=2)  # [BLOCK_G, 2]
    tl.store(xsum_ptr + row * (2 * G) + gg[:, None] * 2 + tl.arange(0, 2)[None, :], xsum, mask=g_mask[:, None])
    qb = q & 255
    if LAYOUT == 0:
        words = tl.sum(tl.reshape(qb, (BLOCK_G, 8, 4)) << (tl.arange(0, 4) * 8)[None, None, :], axis=2)
        tl.store(xq_ptr + row * (8 * G) + tl.arange(0, 8)[None, :] * G + gg[:, None], words, mask=g_mask[:, None])
    elif LAYOUT == 2:
        # [g, j, b, p] -> word c = 2 j + p holds byte b = x[32 g + 8 j + 2 b + p]
        q4 = tl.reshape(qb, (BLOCK_G, 4, 4, 2)) << (tl.arange(0, 4) * 8)[None, None, :, None]
        words = tl.reshape(tl.sum(q4, axis=2), (BLOCK_G, 8))
        tl.store(xq_ptr + row * (8 * G) + tl.arange(0, 8)[None, :] * G + gg[:, None], words, mask=g_mask[:, None])
    else:
        # [g, w_local, b, i] -> word (w = 2 g + w_local, i) holds byte b = x[16 w + 4 b + i]
        q4 = tl.reshape(qb, (BLOCK_G, 2, 4, 4)) << (tl.arange(0, 4) * 8)[None, None, :, None]
        words = tl.reshape(tl.sum(q4, axis=2), (BLOCK_G * 2, 4))  # rows: w = 2 g + w_local
        ww = g0 * 2 + tl.arange(0, BLOCK_G * 2)
        tl.store(xq_ptr + row * (8 * G) + tl.arange(0, 4)[None, :] * (2 * G) + ww[:, None], words,
                 mask=(ww < 2 * G)[:, None])


@triton.jit
def quant_tile(x, row, g0, G, q0_ptr, q1_ptr, q2_ptr, QUANT: tl.constexpr, LAYOUT: tl.constexpr):
    """x [BLOCK_G, 32] stored quantised as QUANT says: 1 `act16_tile` (q0, q1, q2 = hi, lo, scale), 2 `act_tile`
    in LAYOUT (xq, scale, sums)."""
    if QUANT == 1:
        act16_tile(x, row, g0, G, q0_ptr, q1_ptr, q2_ptr)
    else:
        act_tile(x, row, g0, G, q0_ptr, q1_ptr, q2_ptr, LAYOUT)


@triton.jit
def _quant_kernel(x_ptr, q0_ptr, q1_ptr, q2_ptr, K, stride_xm, QUANT: tl.constexpr, LAYOUT: tl.constexpr,
                  BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    """The quantiser's own launch: BLOCK_G groups of 32 values of row program_id(0) per program (see quant_tile)."""
    enter(PDL)
    row = tl.program_id(0)
    G = K // 32
    g0 = tl.program_id(1) * BLOCK_G
    gg = g0 + tl.arange(0, BLOCK_G)
    x = tl.load(x_ptr + row * stride_xm + gg[:, None] * 32 + tl.arange(0, 32)[None, :], mask=(gg < G)[:, None],
                other=0.0).to(tl.float32)  # [BLOCK_G, 32]
    quant_tile(x, row, g0, G, q0_ptr, q1_ptr, q2_ptr, QUANT, LAYOUT)


QUANTS = ("act16", *LAYOUTS)  # the quantised forms: quantize_act16's, and quantize_act's per layout


def quant_buffers(m: int, k: int, quant: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty outputs of m rows of k values quantised as `quant` (QUANTS): act16 (hi, lo int32 [m, k/4], scale
    fp32 [m, k/32]); a layout (xq int32 [m, k/4], scale fp32 [m, k/32], sums fp32 [m, k/16])."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if k % 32:
        raise ValueError(f"a quantised row has a multiple of 32 values, got {k}")
    words = torch.empty((m, k // 4), device=device, dtype=torch.int32)
    scale = torch.empty((m, k // 32), device=device, dtype=torch.float32)
    if quant == "act16":
        return words, torch.empty_like(words), scale
    return words, scale, torch.empty((m, k // 16), device=device, dtype=torch.float32)


def quant_flags(quant: str | None) -> dict:
    """The QUANT / LAYOUT constexprs of quant_tile for `quant` (None: QUANT 0, nothing quantised)."""
    return {"QUANT": 0 if quant is None else 1 if quant == "act16" else 2, "LAYOUT": LAYOUTS.get(quant, 0)}


def _quantize(x: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    out = quant_buffers(m, k, quant, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = dispatch.row_tiles(k // 32, dispatch.launch_backend(x))
    block_g = min(tiles.block, 32)
    _quant_kernel[(m, triton.cdiv(k // 32, block_g))](x, *out, k, x.stride(0), **quant_flags(quant), BLOCK_G=block_g,
                                                      num_warps=tiles.num_warps, **pdl(x))
    return out


def quantize_act(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq int32 [M, K/4] in `layout`'s transposed order, scales fp32 [M, K/32], sums fp32 [M, K/16])."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    return _quantize(x, layout)


def quantize_act_ref(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize_act` (same rounding rule)."""
    m, k = x.shape
    xf = x.float().reshape(m, k // 32, 32)
    amax = xf.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    v = xf * inv.unsqueeze(-1)
    q = (v + torch.where(v >= 0, 0.5, -0.5)).to(torch.int32).reshape(m, k)
    qb = (q & 255).to(torch.int64)
    shifts = torch.arange(4, device=x.device) * 8
    if layout == "iq2_xxs":
        words = (qb.reshape(m, k // 32, 8, 4) << shifts).sum(-1)  # [m, G, 8]
        xq = words.transpose(1, 2).reshape(m, k // 4)
    elif layout == "q4_k":
        words = (qb.reshape(m, k // 32, 4, 4, 2) << shifts.reshape(4, 1)).sum(-2).reshape(m, k // 32, 8)
        xq = words.transpose(1, 2).reshape(m, k // 4)
    else:
        words = (qb.reshape(m, k // 16, 4, 4) << shifts.reshape(4, 1)).sum(-2)  # [m, W, i]
        xq = words.transpose(1, 2).reshape(m, k // 4)
    xq = torch.where(xq >= 2**31, xq - 2**32, xq).to(torch.int32)
    return xq, amax / 127.0, x.float().reshape(m, k // 16, 16).sum(-1)


@triton.jit
def act16_tile(x, row, g0, G, hi_ptr, lo_ptr, xs_ptr):
    """Quantise x [BLOCK_G, 32] fp32, the 32-groups g0 .. g0 + BLOCK_G of activation row `row` (groups from G
    on are masked off), to two int8 digits per value and store them as `quantize_act16` lays them out. Used by
    the quantiser's own kernel and by producers that emit the quantised row with their output."""
    BLOCK_G: tl.constexpr = x.shape[0]
    gg = g0 + tl.arange(0, BLOCK_G)
    g_mask = gg < G
    amax = tl.max(tl.abs(x), axis=1)
    # 32639 = 127 * 256 + 127: the largest value whose two signed digits both fit int8
    inv = tl.where(amax > 0, 32639.0 / tl.maximum(amax, 1e-30), 0.0)
    v = x * inv[:, None]
    q = (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int32)
    lo = ((q + 128) & 255) - 128
    hi = (q - lo) >> 8
    tl.store(xs_ptr + row * G + gg, amax / 32639.0, mask=g_mask)
    shifts = (tl.arange(0, 4) * 8)[None, None, :]
    hw = tl.sum(tl.reshape(hi & 255, (BLOCK_G, 8, 4)) << shifts, axis=2)  # [BLOCK_G, 8] natural order
    lw = tl.sum(tl.reshape(lo & 255, (BLOCK_G, 8, 4)) << shifts, axis=2)
    w_off = row * (8 * G) + gg[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(hi_ptr + w_off, hw, mask=g_mask[:, None])
    tl.store(lo_ptr + w_off, lw, mask=g_mask[:, None])


def quantize_act16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (hi, lo int32 [M, K/4], scale fp32 [M, K/32]) with x ~ scale * (256 hi + lo) per 32 values:
    16-bit activations as two int8 digits, so a Q8_0 block's dot is two exact dp4a sums (KERNEL-NOTES.md:
    max relative error 2e-5). Words hold 4 consecutive values, in natural order."""
    return _quantize(x, "act16")


def dequantize_act16(hi: torch.Tensor, lo: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """fp32 [M, K] values the 16-bit integer kernels see."""
    def digits(w: torch.Tensor) -> torch.Tensor:
        b = (w.unsqueeze(-1).to(torch.int64) >> (torch.arange(4, device=w.device) * 8)) & 255
        return torch.where(b >= 128, b - 256, b).reshape(w.shape[0], -1).float()

    return (256 * digits(hi) + digits(lo)) * xs.repeat_interleave(32, dim=1)


def dequantize_act(xq: torch.Tensor, xs: torch.Tensor, layout: str) -> torch.Tensor:
    """fp32 [M, K] values the integer kernels see (for references and tests)."""
    m = xq.shape[0]
    k = xq.shape[1] * 4
    b = ((xq.unsqueeze(-1).to(torch.int64) >> (torch.arange(4, device=xq.device) * 8)) & 255)
    b = torch.where(b >= 128, b - 256, b).float()  # [m, K/4, 4] signed bytes
    if layout == "iq2_xxs":
        vals = b.reshape(m, 8, k // 32, 4).permute(0, 2, 1, 3).reshape(m, k)
    elif layout == "q4_k":  # [m, c = 2 j + p, g, b] -> x[32 g + 8 j + 2 b + p]
        vals = b.reshape(m, 4, 2, k // 32, 4).permute(0, 3, 1, 4, 2).reshape(m, k)
    else:
        vals = b.reshape(m, 4, k // 16, 4).permute(0, 2, 3, 1).reshape(m, k)  # [m, w, byte b, i]
    return vals * xs.repeat_interleave(32, dim=1)
