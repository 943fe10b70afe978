"""GGML block formats in torch: dequantisation, quantisation and random valid blocks.

This module owns the byte layout of every tensor type a DS4 GGUF holds (F32, F16, BF16, Q8_0, Q2_K, Q4_K,
Q5_K, Q6_K, IQ2_XXS, MXFP4, plus I32). It is the reference the Triton kernels are tested against, so
`dequantize` reproduces gguf-py's numpy dequantisation bit for bit: the float32 operations happen in the
same order as there (e.g. `(d * sc) * q - dmin * m`), because a different association changes the last bit.

Layouts (little-endian, one block each; see llama.cpp ggml-common.h):
  Q8_0    34 B /  32: d f16 | qs int8[32]                       x = d * q
  Q2_K    84 B / 256: scales u8[16] (lo: sc, hi: m) | qs u8[64] (2 bits) | d f16 | dmin f16
                      x = (d * sc) * q - dmin * m, per 16-value sub-block
  Q4_K   144 B / 256: d f16 | dmin f16 | scales u8[12] (6-bit sc, m for 8 sub-blocks) | qs u8[128] (nibbles)
  Q5_K   176 B / 256: as Q4_K with qh u8[32] (fifth bit) before qs
  Q6_K   210 B / 256: ql u8[128] | qh u8[64] | scales int8[16] | d f16      x = (d * sc) * (q - 32)
  IQ2_XXS 66 B / 256: d f16 | 8 x (grid indices u8[4] | u32: four 7-bit sign indices, 4-bit scale s)
                      x = d * (0.5 + s) * 0.25 * grid[idx] * sign
  MXFP4   17 B /  32: e8m0 exponent u8 | qs u8[16] (e2m1 nibbles)     x = 2^(e-128) * kvalue (doubled e2m1)

`quantize` matches gguf.quants.quantize bit for bit where gguf-py has a quantiser (F16, BF16, Q8_0,
MXFP4) and is a plain round-to-nearest quantiser for Q2_K, Q4_K, Q6_K and IQ2_XXS (good enough for tests
and demo models, not for shipping weights). `random_blocks` builds random valid blocks of a chosen
magnitude on any device, fast enough for full-size benchmark models.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as _gguf_quants

QK_K = 256
FP16_MAX = 65504.0

# IQ2_XXS tables, taken from gguf-py so they are the very values its dequantiser uses.
# GRID: 256 points of 8 magnitudes in {8, 25, 43}. KSIGNS[i] = i with bit 7 set to the parity of i, so every
# 8-bit sign pattern has an even number of minus signs and 7 bits index it.
_gguf_quants.IQ2_XXS.init_grid()
IQ2XXS_GRID: torch.Tensor = torch.from_numpy(np.array(_gguf_quants.IQ2_XXS.grid, dtype=np.float32).reshape(256, 8))
IQ2XXS_KSIGNS: torch.Tensor = torch.from_numpy(np.frombuffer(_gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8).copy())
# [128, 8] of +1/-1: the sign of element k under sign index i (bit k of KSIGNS[i] set means negative).
_SIGN_BITS = (IQ2XXS_KSIGNS.view(128, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
IQ2XXS_SIGNS: torch.Tensor = 1.0 - 2.0 * _SIGN_BITS.float()
# e2m1 values doubled, indexed by the 4-bit code (the factor 2 is taken out of the e8m0 scale).
MXFP4_VALUES: torch.Tensor = torch.tensor(_gguf_quants.MXFP4.kvalues, dtype=torch.int8)

# Types `dequantize` handles; I32 is returned as int32, everything else as float32.
SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.MXFP4, Q.I32)
_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

_device_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    """A module constant on `device`, copied there once."""
    key = (name, device)
    if key not in _device_tables:
        _device_tables[key] = globals()[name].to(device)
    return _device_tables[key]


def _u8(values: Sequence[int], device: torch.device, shape: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def block_size(qtype: Q) -> int:
    """Values per block of `qtype` (1 for the plain float and integer types)."""
    return GGML_QUANT_SIZES[Q(qtype)][0]


def type_size(qtype: Q) -> int:
    """Bytes per block of `qtype`."""
    return GGML_QUANT_SIZES[Q(qtype)][1]


def row_bytes(qtype: Q, n: int) -> int:
    """Bytes that `n` consecutive values of `qtype` occupy; `n` must be a whole number of blocks."""
    bs, ts = GGML_QUANT_SIZES[Q(qtype)]
    if n % bs:
        raise ValueError(f"{Q(qtype).name} stores values in blocks of {bs}; a row of {n} values is not a whole "
                         f"number of blocks (pad or pick another type)")
    return n // bs * ts


def _check_type(qtype: Q) -> Q:
    qtype = Q(qtype)
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise NotImplementedError(f"no torch dequantiser for {qtype.name}; supported: {names}")
    return qtype


def _as_bytes(data: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Flat uint8 view of `data`, zero-copy for contiguous numpy arrays and memmaps."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise ValueError(f"raw block data must be uint8, got numpy {data.dtype}")
        data = np.ascontiguousarray(data).reshape(-1)
        with warnings.catch_warnings():
            # Read-only memmaps: torch warns that writes would be undefined; we only ever read them.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)
    if data.dtype != torch.uint8:
        raise ValueError(f"raw block data must be uint8, got torch {data.dtype}")
    return data.reshape(-1)


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret flat bytes as `dtype`, copying only if the start is misaligned for it."""
    try:
        return raw.view(dtype)
    except RuntimeError:
        return raw.clone().view(dtype)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 holding an fp16 -> [..., 1] float32 (exact)."""
    return b.contiguous().view(torch.float16).float()


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., 1] float32 -> [..., 2] uint8 of the round-to-nearest-even fp16."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


# ---------------------------------------------------------------------------------------------- dequantise
# Each takes [n_blocks, type_size] uint8 and returns [n_blocks, block_size] float32.

def _dq_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].view(torch.int8).float() * d


def _dq_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    # value e = h*128 + j*32 + l sits in bits 2j..2j+1 of qs[h*32 + l]
    q = (qs.reshape(n, 2, 1, 32) >> _u8((0, 2, 4, 6), b.device, (1, 1, 4, 1))) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into 6-bit scales and mins, [n, 8] uint8 each.

    Bytes 0-3 hold sc[0..3] in their low 6 bits, bytes 4-7 m[0..3]; sc[4..7] and m[4..7] keep their low
    nibbles in bytes 8-11 (sc low, m high) and their top 2 bits in the top 2 bits of bytes 0-3 / 4-7.
    """
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_pack_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of `_k_scale_min`: [n, 8] uint8 values < 64 -> [n, 12] uint8."""
    lo_sc, hi_sc, lo_m, hi_m = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    return torch.cat([lo_sc | ((hi_sc >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_sc & 0xF) | ((hi_m & 0xF) << 4)],
                     dim=-1)


def _dq_k_common(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).reshape(n, 8, 1)
    ml = (dmin * mn.float()).reshape(n, 8, 1)
    return (dl * q.float() - ml).reshape(n, QK_K)


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] uint8 -> [n, 8, 32]: sub-block 2c is the low nibbles of bytes 32c..32c+31, 2c+1 the high."""
    n = qs.shape[0]
    q = (qs.reshape(n, 4, 1, 32) >> _u8((0, 4), qs.device, (1, 1, 2, 1))) & 0xF
    return q.reshape(n, 8, 32)


def _dq_q4_k(b: torch.Tensor) -> torch.Tensor:
    return _dq_k_common(b, _nibbles_32(b[:, 16:144]))


def _dq_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles_32(b[:, 48:176])
    # the fifth bit of sub-block j, value l is bit j of qh[l]
    qh = (b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    return _dq_k_common(b, ql | (qh << 4))


def _dq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * scales.view(torch.int8).float()).reshape(n, 16, 1)
    # low nibbles: value e = h*128 + k*64 + l (l < 64) in nibble k of ql[h*64 + l]
    lo = ((ql.reshape(n, 2, 1, 64) >> _u8((0, 4), b.device, (1, 1, 2, 1))) & 0xF).reshape(n, 8, 32)
    # high 2 bits: value e = h*128 + j*32 + l (l < 32) in bits 2j..2j+1 of qh[h*32 + l]
    hi = ((qh.reshape(n, 2, 1, 32) >> _u8((0, 2, 4, 6), b.device, (1, 1, 4, 1))) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.int16) - 32
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _iq2xxs_words(qs: torch.Tensor) -> torch.Tensor:
    """[n, 8, 4] uint8 little-endian -> [n, 8] int64 (the u32 that holds sign indices and the scale)."""
    w = qs.to(torch.int64)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def _dq_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, :2])
    sub = b[:, 2:].reshape(n, 8, 8)
    word = _iq2xxs_words(sub[..., 4:])
    db = (d * ((word >> 28).float() + 0.5) * 0.25).reshape(n, 8, 1, 1)
    sign_idx = (word.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21], device=b.device)) & 0x7F
    signs = _table("IQ2XXS_SIGNS", b.device)[sign_idx]  # [n, 8, 4, 8]
    grid = _table("IQ2XXS_GRID", b.device)[sub[..., :4].long()]  # [n, 8, 4, 8]
    return (db * grid * signs).reshape(n, QK_K)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """e8m0 exponent byte -> 2^(e - 128) as float32 (half the OCP scale, matching the doubled kvalues).

    Built from bits like ggml: e < 2 gives the subnormals 2^-129 and 2^-128.
    """
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _dq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _e8m0_half(b[:, :1])
    # values 0..15 are the low nibbles of qs[0..15], values 16..31 the high nibbles
    codes = (b[:, 1:].reshape(n, 1, 16) >> _u8((0, 4), b.device, (1, 2, 1))) & 0xF
    vals = _table("MXFP4_VALUES", b.device)[codes.long()].float().reshape(n, 32)
    return d * vals


_DEQUANT: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _dq_q8_0, Q.Q2_K: _dq_q2_k, Q.Q4_K: _dq_q4_k, Q.Q5_K: _dq_q5_k, Q.Q6_K: _dq_q6_k,
    Q.IQ2_XXS: _dq_iq2_xxs, Q.MXFP4: _dq_mxfp4,
}


def dequantize(data: torch.Tensor | np.ndarray, qtype: Q, shape: Sequence[int]) -> torch.Tensor:
    """Raw GGUF bytes of one tensor -> float32 tensor of torch-order `shape` (innermost dimension last).

    `data` is uint8 (torch, on any device, or numpy/memmap, taken zero-copy). I32 comes back as int32.
    The result never aliases `data`, so writing to it can not touch a memory-mapped file.
    """
    qtype = _check_type(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("dequantize needs a shape with at least one dimension")
    raw = _as_bytes(data)
    expected = math.prod(shape[:-1]) * row_bytes(qtype, shape[-1])
    if raw.numel() != expected:
        raise ValueError(f"{qtype.name} tensor of shape {list(shape)} takes {expected} bytes, but {raw.numel()} "
                         f"were given (truncated file or wrong shape/type?)")
    if qtype == Q.F32:
        return _view(raw, torch.float32).clone().reshape(shape)
    if qtype == Q.I32:
        return _view(raw, torch.int32).clone().reshape(shape)
    if qtype == Q.F16:
        return _view(raw, torch.float16).float().reshape(shape)
    if qtype == Q.BF16:
        # bf16 is the top half of an fp32; shifting the bits keeps NaN payloads exactly as gguf-py does
        return (_view(raw, torch.int16).to(torch.int32) << 16).view(torch.float32).reshape(shape)
    return _DEQUANT[qtype](raw.reshape(-1, type_size(qtype))).reshape(shape)


# ------------------------------------------------------------------------------------------------ quantise
# Each takes [n_blocks, block_size] float32 and returns [n_blocks, type_size] uint8.

def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, written as gguf-py's np_roundf so every intermediate is exact."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    # CUDA turns division by a Python scalar into multiplication by its reciprocal; dividing by a tensor
    # keeps the correctly rounded quotient the parity with gguf-py needs.
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def _safe_inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _q_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = _div(x.abs().amax(dim=-1, keepdim=True), 127.0)
    qs = _roundf(x * _safe_inv(d))
    return torch.cat([_f16_bytes(d), qs.to(torch.int8).view(torch.uint8)], dim=-1)


def _q_mxfp4(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    amax = x.abs().amax(dim=-1, keepdim=True)
    # gguf-py takes floor(log2) of a float32 log2, which rounds up to the next integer just below powers of
    # two; a float64 log2 rounded to float32 reproduces that, where an exact exponent (frexp) would not.
    # Blocks below 2^-125 would wrap around in gguf-py's uint8 cast; they get the smallest scale instead.
    log2 = torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)).double()).float().floor()
    e = torch.where(amax > 0, log2 - 2 + 127, torch.zeros_like(amax)).clamp(0, 255).to(torch.uint8)
    d = _e8m0_half(e)
    vals = _table("MXFP4_VALUES", x.device).float()
    codes = (d.view(n, 1, 1) * vals - x.view(n, 32, 1)).abs().argmin(dim=-1).to(torch.uint8)  # first of ties
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return torch.cat([e, qs], dim=-1)


def _scale_codes(scale: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split per-sub-block scales [n, S] >= 0 into an fp16 block scale [n, 1] and integer codes 0..top."""
    d = (scale.amax(dim=-1, keepdim=True) / top).half().float()
    codes = (scale * _safe_inv(d)).round().clamp(0, top)
    return d, codes


def _q_q2_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    xb = x.reshape(n, 16, 16)
    lo = xb.amin(dim=-1).clamp(max=0)
    d, sc = _scale_codes((xb.amax(dim=-1) - lo) / 3, 15)
    dmin, m = _scale_codes(-lo, 15)
    step = (d * sc).unsqueeze(-1)
    q = ((xb + (dmin * m).unsqueeze(-1)) * _safe_inv(step)).round().clamp(0, 3).to(torch.uint8)
    q = q.reshape(n, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    scales = sc.to(torch.uint8) | (m.to(torch.uint8) << 4)
    return torch.cat([scales, qs.reshape(n, 64), _f16_bytes(d), _f16_bytes(dmin)], dim=-1)


def _q_q4_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    xb = x.reshape(n, 8, 32)
    lo = xb.amin(dim=-1).clamp(max=0)
    d, sc = _scale_codes((xb.amax(dim=-1) - lo) / 15, 63)
    dmin, m = _scale_codes(-lo, 63)
    step = (d * sc).unsqueeze(-1)
    q = ((xb + (dmin * m).unsqueeze(-1)) * _safe_inv(step)).round().clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    scales = _k_pack_scale_min(sc.to(torch.uint8), m.to(torch.uint8))
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), scales, qs], dim=-1)


def _q_q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    xb = x.reshape(n, 16, 16)
    # map the largest-magnitude value of each sub-block to -32, the one level without a positive twin
    peak = torch.gather(xb, -1, xb.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    sub_scale = peak / -32
    d = (sub_scale.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    sc = (sub_scale * _safe_inv(d)).round().clamp(-128, 127)
    step = (d * sc).unsqueeze(-1)
    u = ((xb * _safe_inv(step)).round().clamp(-32, 31) + 32).to(torch.uint8).reshape(n, 2, 2, 64)
    ql = (u[:, :, 0] & 0xF) | ((u[:, :, 1] & 0xF) << 4)
    hi = (u.reshape(n, 2, 4, 32) >> 4)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16_bytes(d)], dim=-1)


def _q_iq2_xxs(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid points per group of 8 |x| under a least-squares sub-block scale, then 4-bit scales."""
    n = x.shape[0]
    xs = x.reshape(n, 8, 4, 8)
    a = xs.abs()
    grid = _table("IQ2XXS_GRID", x.device)  # [256, 8]
    # ||a - db*g||^2 = ||a||^2 + db (db ||g||^2 - 2 <a, g>), so the nearest point minimises
    # [a, db] . [-2 g, ||g||^2]: one [groups, 9] x [9, 256] product per trial scale.
    lhs = torch.cat([a, torch.empty_like(a[..., :1])], dim=-1)  # [n, 8, 4, 9]; last column: the trial db
    rhs = torch.cat([-2 * grid.T, (grid * grid).sum(dim=-1).view(1, 256)])  # [9, 256]

    def nearest(db: torch.Tensor) -> torch.Tensor:
        lhs[..., 8] = db.view(n, 8, 1)
        return (lhs.view(-1, 9) @ rhs).view(n, 8, 4, 256).argmin(dim=-1)  # [n, 8, 4]

    # Trial scales map the sub-block's largest |x| onto 43/0.83 (where Gaussian data lands), 21.5 and 8 (flat
    # data: most grid points are small); for each, refit the scale to the chosen points by least squares,
    # db = <a, g> / <g, g> with error ||a||^2 - <a, g> db, and keep the trial that fits best.
    amax = a.amax(dim=(2, 3))  # [n, 8]
    a2 = (a * a).sum(dim=(2, 3))
    best_db, best_err = torch.zeros_like(amax), torch.full_like(amax, float("inf"))
    for ratio in (0.83 / 43, 1 / 21.5, 1 / 8):
        g = grid[nearest(amax * ratio)]  # [n, 8, 4, 8]
        ag = (a * g).sum(dim=(2, 3))
        db = ag * _safe_inv((g * g).sum(dim=(2, 3)))
        err = a2 - ag * db
        better = err < best_err
        best_db, best_err = torch.where(better, db, best_db), torch.where(better, err, best_err)
    # the largest sub-scale code (s = 15: 3.875 d) takes the largest fitted scale
    d = (best_db.amax(dim=-1, keepdim=True) / 3.875).half().float()
    s = (best_db * _safe_inv(d * 0.25) - 0.5).round().clamp(0, 15)
    idx = nearest(d * (s + 0.5) * 0.25).to(torch.uint8)  # under the scale exactly as the dequantiser computes it

    # signs must have even parity per group of 8; when they do not, flip the smallest |x|, which costs least
    neg = xs < 0
    odd = (neg.sum(dim=-1, keepdim=True) % 2) == 1
    smallest = torch.nn.functional.one_hot(a.argmin(dim=-1), 8).bool()
    neg = neg ^ (smallest & odd)
    bits = neg[..., :7].to(torch.int64) << torch.arange(7, device=x.device)
    sign_idx = bits.sum(dim=-1)  # [n, 8, 4], 7 bits each; bit 7 is implied by the parity
    word = (sign_idx << torch.tensor([0, 7, 14, 21], device=x.device)).sum(dim=-1) | (s.to(torch.int64) << 28)
    word_bytes = ((word.unsqueeze(-1) >> torch.tensor([0, 8, 16, 24], device=x.device)) & 0xFF).to(torch.uint8)
    sub = torch.cat([idx, word_bytes], dim=-1).reshape(n, 64)
    return torch.cat([_f16_bytes(d), sub], dim=-1)


_QUANT: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q_q8_0, Q.MXFP4: _q_mxfp4, Q.Q2_K: _q_q2_k, Q.Q4_K: _q_q4_k, Q.Q6_K: _q_q6_k, Q.IQ2_XXS: _q_iq2_xxs,
}
# Rows per call of the block quantisers, to bound the memory of their [n, 32, 16] / [n, 32, 256] temporaries.
_QUANT_CHUNK = 1024


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 bytes like ggml_compute_fp32_to_bf16: NaNs made quiet, round to nearest even."""
    n = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(nan, (n & 0xFFFF0000) | (64 << 16), n)
    n = (n + (0x7FFF + ((n >> 16) & 1))) >> 16
    return torch.stack([n & 0xFF, (n >> 8) & 0xFF], dim=-1).to(torch.uint8)


def quantize(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Float tensor -> raw GGUF bytes, shape [*x.shape[:-1], row_bytes]; x is converted to float32 first.

    The last dimension must be a whole number of blocks. Supported: F32, F16, BF16, Q8_0, MXFP4 (bit-exact
    with gguf-py) and Q2_K, Q4_K, Q6_K, IQ2_XXS (round-to-nearest).
    """
    qtype = Q(qtype)
    if qtype not in _FLOAT_TYPES and qtype not in _QUANT:
        names = ", ".join(t.name for t in (*_FLOAT_TYPES, *_QUANT))
        raise NotImplementedError(f"no quantiser for {qtype.name}; supported: {names}")
    if x.dim() == 0:
        raise ValueError("quantize needs a tensor with at least one dimension")
    out_shape = (*x.shape[:-1], row_bytes(qtype, x.shape[-1]))
    x = x.detach().to(torch.float32).contiguous()
    if qtype == Q.F32:
        return x.view(torch.uint8).reshape(out_shape).clone()
    if qtype == Q.F16:
        return x.to(torch.float16).view(torch.uint8).reshape(out_shape)
    if qtype == Q.BF16:
        return _bf16_bytes(x).reshape(out_shape)
    blocks = x.reshape(-1, block_size(qtype))
    fn = _QUANT[qtype]
    parts = [fn(blocks[i:i + _QUANT_CHUNK]) for i in range(0, blocks.shape[0], _QUANT_CHUNK)]
    return torch.cat(parts).reshape(out_shape) if parts else torch.empty(out_shape, dtype=torch.uint8)


# ------------------------------------------------------------------------------------------- random blocks

# Per type: (offset of the fp16 block scale d, offset of dmin or None, dmin / d). Random payloads tie every
# sub-block's min code to its scale code (m = sc) and set dmin = d * mean(q), so each sub-block is centred.
_SCALE_FIELDS: dict[Q, tuple[int, int | None, float]] = {
    Q.Q8_0: (0, None, 0.0), Q.Q2_K: (80, 82, 1.5), Q.Q4_K: (0, 2, 7.5), Q.Q5_K: (0, 2, 15.5),
    Q.Q6_K: (208, None, 0.0), Q.IQ2_XXS: (0, None, 0.0),
}
# Blocks dequantised to measure the magnitude of a random payload before the real scales are written.
_CALIBRATION_BLOCKS = 1024


def _random_bytes(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8, device=generator.device)


def _random_payload(qtype: Q, n: int, generator: torch.Generator) -> torch.Tensor:
    """[n, type_size] random bytes, valid for `qtype`, with sub-block scales kept away from zero."""
    raw = _random_bytes((n, type_size(qtype)), generator)
    dev = generator.device
    if qtype == Q.Q2_K:
        sc = torch.randint(1, 16, (n, 16), generator=generator, dtype=torch.uint8, device=dev)
        raw[:, :16] = sc | (sc << 4)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        sc = torch.randint(1, 64, (n, 8), generator=generator, dtype=torch.uint8, device=dev)
        raw[:, 4:16] = _k_pack_scale_min(sc, sc)
    return raw


def _write_scales(qtype: Q, raw: torch.Tensor, d: torch.Tensor) -> None:
    """Write the per-block scale `d` ([n, 1] float32 > 0) into the scale fields of `raw` in place."""
    if qtype == Q.MXFP4:
        raw[:, :1] = (torch.log2(d).round() + 128).clamp(2, 254).to(torch.uint8)
        return
    at, min_at, ratio = _SCALE_FIELDS[qtype]
    raw[:, at:at + 2] = _f16_bytes(d)
    if min_at is not None:
        raw[:, min_at:min_at + 2] = _f16_bytes(d * ratio)


def random_blocks(qtype: Q, n_elements: int, generator: torch.Generator, scale: float) -> torch.Tensor:
    """Random valid raw blocks (flat uint8 on the generator's device) for `n_elements` values of `qtype`.

    Dequantised, the values are finite with an RMS close to `scale` (block scales vary by up to 1.5x around
    it, as in real weights). Float types hold Gaussian values of std `scale`.
    """
    qtype = _check_type(qtype)
    if qtype == Q.I32:
        raise NotImplementedError("random_blocks makes weights; I32 tensors hold indices, not weights")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    n_blocks = row_bytes(qtype, n_elements) // type_size(qtype)
    dev = generator.device
    if qtype == Q.F16 and scale * 6 > FP16_MAX:
        raise ValueError(f"scale {scale} overflows F16 (max {FP16_MAX})")
    if qtype in _FLOAT_TYPES:
        return quantize(torch.randn(n_elements, generator=generator, device=dev) * scale, qtype)
    raw = _random_payload(qtype, n_blocks, generator)
    spread = torch.rand((n_blocks, 1), generator=generator, device=dev) + 0.5  # block scales in [0.5, 1.5)
    # Measure the RMS a unit block scale gives on a sample, then scale every block to the requested RMS.
    sample = raw[:_CALIBRATION_BLOCKS].clone()
    _write_scales(qtype, sample, spread[:_CALIBRATION_BLOCKS])
    rms = dequantize(sample, qtype, (sample.shape[0] * block_size(qtype),)).square().mean().sqrt().item()
    d = spread * (scale / rms)
    if qtype in _SCALE_FIELDS and d.max().item() * max(_SCALE_FIELDS[qtype][2], 1.0) > FP16_MAX:
        raise ValueError(f"scale {scale} needs block scales beyond the fp16 range of {qtype.name} (max {FP16_MAX})")
    _write_scales(qtype, raw, d)
    return raw.reshape(-1)


# ---------------------------------------------------------------------------------------------- QTensor

@dataclass(frozen=True)
class QTensor:
    """One tensor's raw GGUF bytes with its type and torch-order shape (innermost dimension last)."""

    data: torch.Tensor  # flat uint8; numpy arrays / memmaps are wrapped zero-copy
    qtype: Q
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", _check_type(self.qtype))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "data", _as_bytes(self.data))
        if not self.shape:
            raise ValueError("a GGUF tensor has at least one dimension")
        expected = math.prod(self.shape[:-1]) * row_bytes(self.qtype, self.shape[-1])
        if self.data.numel() != expected:
            raise ValueError(f"{self.qtype.name} tensor of shape {list(self.shape)} takes {expected} bytes, "
                             f"got {self.data.numel()}")

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.qtype, self.shape)
