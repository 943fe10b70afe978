"""The per-row finishing steps of attention and indexer rows in one launch: RMSNorm, RoPE, Hadamard rotation
and the model's FP8 / FP4 quantisation round trips, optionally written straight into a KV ring.

DeepSeek-V4 finishes every query, key and compressed row with some of these steps, in this order:
- attention queries: per-head RMSNorm (no weight) -> RoPE;
- the shared K=V row: RMSNorm (weight) -> RoPE -> FP8 e4m3 round trip on the non-RoPE dims -> KV ring;
- indexer queries: RoPE -> Hadamard -> FP4 e2m1 round trip;
- compressed rows (kernels/compressor.py pools them, then calls the same `finish_row`): RMSNorm (weight)
  -> RoPE at the block's first position -> the layer's round trip (FP8 for attention rows, Hadamard + FP4
  for indexer keys).
Torch does each of these as 5-25 small launches (the round trips alone are ~15); here a row is one program.

`finish_rows(x, pos, heads, ...)`: x [T * heads, D] fp32 rows, pos [T] int64 (one position per token).
Returns the finished rows [T * heads, D] fp32, or, with `ring=`, writes row t into ring[pos[t] % len(ring)]
(heads must be 1) and returns the ring; with `slots=` [T] too, ring is a pool [S, R, D] of rings (one per
KV slot, engine/kv.py's KVPool) and row t goes into ring[slots[t], pos[t] % R] (a batched decode step: each
token of its own sequence). Semantics equal engine/model.py's `rms_norm`, `Rope`, `hadamard`,
`fp8_e4m3_roundtrip` and `fp4_e2m1_roundtrip` (`finish_rows_ref` composes exactly those); the kernel rounds
e4m3 / e2m1 itself with exact integer and float arithmetic (no fp8 hardware needed: Vega20 has none), and
the Hadamard transform uses the reference's butterfly order, so results agree to fp32 rounding of the norm
and rotation. Scales are powers of two computed from the float's bits (2^ceil(log2 a)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.pdl import enter, pdl

Tensor = torch.Tensor
RT_NONE, RT_FP8, RT_FP4 = 0, 1, 2
_RT = {None: RT_NONE, "fp8": RT_FP8, "fp4": RT_FP4}


# ---------------------------------------------------------------------------------------------------------
# Torch reference (the model's own functions).


def finish_rows_ref(x: Tensor, pos: Tensor, heads: int, *, norm: bool = False, weight: Tensor | None = None,
                    eps: float = 1e-6, inv_freq: Tensor | None = None, inverse: bool = False,
                    hadamard: bool = False, rt: str | None = None, nope: int = 0,
                    ring: Tensor | None = None, slots: Tensor | None = None) -> Tensor:
    from ds4station.kernels.reference import fp4_e2m1_roundtrip, fp8_e4m3_roundtrip
    from ds4station.kernels.reference import hadamard as hadamard_ref

    from .norm import rms_norm_ref, rope_ref

    _check(x, pos, heads, weight, inv_freq, hadamard, rt, nope, ring, slots)
    y = x.float()
    if norm:
        y = rms_norm_ref(y, weight, eps)
    if inv_freq is not None:
        y = rope_ref(y, pos, inv_freq, heads, inverse)
    if hadamard:
        y = hadamard_ref(y)
    if rt == "fp8":
        y = torch.cat((fp8_e4m3_roundtrip(y[:, :nope]), y[:, nope:]), dim=-1)
    elif rt == "fp4":
        y = fp4_e2m1_roundtrip(y)
    if ring is None:
        return y
    if slots is None:
        ring[pos % ring.shape[0]] = y.to(ring.dtype)
    else:
        ring[slots, pos % ring.shape[1]] = y.to(ring.dtype)
    return ring


def _check(x: Tensor, pos: Tensor, heads: int, weight: Tensor | None, inv_freq: Tensor | None, hadamard: bool,
           rt: str | None, nope: int, ring: Tensor | None, slots: Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] != pos.numel() * heads:
        raise ValueError(f"x must be [T * heads, D] = [{pos.numel()} * {heads}, D], got {tuple(x.shape)}")
    d = x.shape[1]
    if weight is not None and weight.numel() != d:
        raise ValueError(f"norm weight has {weight.numel()} elements, rows have {d}")
    if inv_freq is not None and 2 * inv_freq.numel() > d:
        raise ValueError(f"RoPE over {2 * inv_freq.numel()} dims does not fit rows of {d}")
    if hadamard and d & (d - 1):
        raise ValueError(f"Hadamard size {d} is not a power of two")
    if rt not in _RT:
        raise ValueError(f"unknown round trip {rt!r}; have fp8, fp4 or None")
    if rt == "fp8" and (nope % 64 or not 0 <= nope <= d):
        raise ValueError(f"FP8 round trip over the first {nope} dims: must be a multiple of 64 within {d}")
    if rt == "fp4" and d % 32:
        raise ValueError(f"FP4 round trip needs rows of a multiple of 32, got {d}")
    if ring is not None and (heads != 1 or ring.dim() != (2 if slots is None else 3) or ring.shape[-1] != d):
        raise ValueError(f"ring writes take one row per token of width {d} (a pool of rings [S, R, D] with slots); "
                         f"got heads={heads}, ring {tuple(ring.shape)}")
    if slots is not None and (ring is None or slots.shape != pos.shape):
        raise ValueError(f"slots [T] name each token's ring in a pool: slots {tuple(slots.shape)}, pos "
                         f"{tuple(pos.shape)}, ring {None if ring is None else tuple(ring.shape)}")


# ---------------------------------------------------------------------------------------------------------
# Building blocks (also used by kernels/compressor.py).


@triton.jit
def _pow2_ceil(a):
    """2^ceil(log2(a)) for positive normal fp32 a, exactly, from the bits."""
    bits = a.to(tl.int32, bitcast=True)
    up = ((bits >> 23) + 1) << 23
    return tl.where((bits & 0x7FFFFF) == 0, a, up.to(tl.float32, bitcast=True))


@triton.jit
def _round_e4m3(v):
    """v (|v| <= 448) rounded to the nearest FP8 e4m3 value, ties to even: 3 mantissa bits down to the
    smallest normal 2^-6, then subnormal steps of 2^-9. Adding and removing 2^20 x the step rounds to a
    multiple of the step in fp32 (round-to-nearest-even) without any fp8 instruction."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    magic = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
    q = (a + magic) - magic
    return tl.where(v < 0, -q, q)


@triton.jit
def _round_e2m1(v):
    """v (|v| <= 6) rounded to FP4 e2m1 {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code (as the reference)."""
    a = tl.abs(v)
    q = tl.where(a > 5.0, 6.0, tl.where(a >= 3.5, 4.0, tl.where(a > 2.5, 3.0, tl.where(
        a >= 1.75, 2.0, tl.where(a > 1.25, 1.5, tl.where(a >= 0.75, 1.0, tl.where(a > 0.25, 0.5, 0.0)))))))
    return tl.where(v < 0, -q, q)


@triton.jit
def _fp8_round_trip(x, NOPE: tl.constexpr, BLOCK_D: tl.constexpr):
    """FP8 e4m3 round trip of x [BLOCK_D] in blocks of 64 over its first NOPE elements (scale: power of two
    >= amax / 448, amax floored at 1e-4); the rest passes through."""
    xb = tl.reshape(x, (BLOCK_D // 64, 64))
    amax = tl.maximum(tl.max(tl.abs(xb), axis=1), 1e-4)
    scale = _pow2_ceil(amax / 448.0)
    v = tl.minimum(tl.maximum(xb / scale[:, None], -448.0), 448.0)
    q = _round_e4m3(v) * scale[:, None]
    blk = tl.arange(0, BLOCK_D // 64)
    return tl.reshape(tl.where((blk < NOPE // 64)[:, None], q, xb), (BLOCK_D,))


@triton.jit
def _fp4_round_trip(x, BLOCK_D: tl.constexpr):
    """FP4 e2m1 round trip of x [BLOCK_D] in blocks of 32 (scale: power of two >= amax / 6)."""
    xb = tl.reshape(x, (BLOCK_D // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(xb), axis=1), 6 * 1.1754943508222875e-38)
    scale = _pow2_ceil(amax / 6.0)
    v = tl.minimum(tl.maximum(xb / scale[:, None], -6.0), 6.0)
    return tl.reshape(_round_e2m1(v) * scale[:, None], (BLOCK_D,))


@triton.jit
def _hadamard(x, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr):
    """Orthonormal Walsh-Hadamard transform of x [BLOCK_D] (a power of two), by the reference's butterflies:
    stage h pairs elements i and i + h within groups of 2h into (a + b, a - b)."""
    for s in tl.static_range(LOG_D):
        y = tl.permute(tl.reshape(x, (BLOCK_D >> (s + 1), 2, 1 << s)), (0, 2, 1))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (BLOCK_D,))
    return x * (1.0 / tl.sqrt(BLOCK_D * 1.0))


@triton.jit
def _rope_row(x, p, f_ptr, sign, D, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Interleaved RoPE of the last 2 * HALF of the D valid elements of x [BLOCK_D] at position p (float)."""
    pairs = tl.reshape(x, (BLOCK_D // 2, 2))
    a, b = tl.split(pairs)
    i = tl.arange(0, BLOCK_D // 2) - (D // 2 - HALF)  # frequency index of each pair (tail pairs: 0..HALF-1)
    rot = (i >= 0) & (i < HALF)
    ang = p * tl.load(f_ptr + i, mask=rot, other=0.0)
    c = tl.cos(ang)
    s = tl.sin(ang) * sign
    ra = tl.where(rot, a * c - b * s, a)
    rb = tl.where(rot, a * s + b * c, b)
    return tl.reshape(tl.join(ra, rb), (BLOCK_D,))


@triton.jit
def finish_row(x, offs, D, p, w_ptr, eps, f_ptr, sign,
               NORM: tl.constexpr, HAS_W: tl.constexpr, HALF: tl.constexpr, HADAMARD: tl.constexpr,
               RT: tl.constexpr, NOPE: tl.constexpr, BLOCK_D: tl.constexpr, LOG_D: tl.constexpr):
    """RMSNorm (weight) -> RoPE at p -> Hadamard -> FP8 / FP4 round trip of x [BLOCK_D] (zero beyond D)."""
    mask = offs < D
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * r
        if HAS_W:
            x = x * tl.load(w_ptr + offs, mask=mask, other=0.0)
    if HALF > 0:
        x = _rope_row(x, p, f_ptr, sign, D, HALF, BLOCK_D)
    if HADAMARD:
        x = _hadamard(x, BLOCK_D, LOG_D)
    if RT == 1:
        x = _fp8_round_trip(x, NOPE, BLOCK_D)
    elif RT == 2:
        x = _fp4_round_trip(x, BLOCK_D)
    return x


# ---------------------------------------------------------------------------------------------------------
# Kernel and launcher.


@triton.jit
def _finish_rows_kernel(x_ptr, pos_ptr, slot_ptr, w_ptr, f_ptr, y_ptr, D, heads, stride_x, stride_y, stride_slot,
                        ring_len, eps, sign,
                        NORM: tl.constexpr, HAS_W: tl.constexpr, HALF: tl.constexpr, HADAMARD: tl.constexpr,
                        RT: tl.constexpr, NOPE: tl.constexpr, RING: tl.constexpr, SLOTS: tl.constexpr,
                        BLOCK_D: tl.constexpr, LOG_D: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    pos = tl.load(pos_ptr + row // heads)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = finish_row(x, offs, D, pos.to(tl.float32), w_ptr, eps, f_ptr, sign, NORM, HAS_W, HALF, HADAMARD, RT, NOPE,
                   BLOCK_D, LOG_D)
    dst = pos % ring_len if RING else row
    if SLOTS:  # this token's ring in the pool
        y_ptr += tl.load(slot_ptr + row // heads).to(tl.int64) * stride_slot
    tl.store(y_ptr + dst * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def finish_rows(x: Tensor, pos: Tensor, heads: int, **kw) -> Tensor:
    """See the module docstring: Triton on a GPU tensor, the torch reference on CPU."""
    return finish_rows_triton(x, pos, heads, **kw) if dispatch.use_triton(x) else finish_rows_ref(x, pos, heads, **kw)


def finish_rows_triton(x: Tensor, pos: Tensor, heads: int, *, norm: bool = False, weight: Tensor | None = None,
                       eps: float = 1e-6, inv_freq: Tensor | None = None, inverse: bool = False,
                       hadamard: bool = False, rt: str | None = None, nope: int = 0,
                       ring: Tensor | None = None, slots: Tensor | None = None) -> Tensor:
    _check(x, pos, heads, weight, inv_freq, hadamard, rt, nope, ring, slots)
    if x.stride(-1) != 1:
        x = x.contiguous()
    d = x.shape[1]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device) if ring is None else ring
    tiles = dispatch.row_tiles(d, dispatch.launch_backend(x))
    block = max(64 if rt == "fp8" else 32 if rt == "fp4" else 2, tiles.block)  # == d for the Hadamard
    f = inv_freq if inv_freq is not None else x
    _finish_rows_kernel[(x.shape[0],)](
        x, pos, slots if slots is not None else pos, weight if weight is not None else x, f, y, d, heads,
        x.stride(0), y.stride(-2), y.stride(0) if slots is not None else 0,
        ring.shape[-2] if ring is not None else 1, float(eps), -1.0 if inverse else 1.0,
        NORM=norm, HAS_W=weight is not None, HALF=0 if inv_freq is None else inv_freq.numel(),
        HADAMARD=hadamard, RT=_RT[rt], NOPE=nope, RING=ring is not None, SLOTS=slots is not None, BLOCK_D=block,
        LOG_D=block.bit_length() - 1, num_warps=tiles.num_warps, **pdl(x))
    return y
