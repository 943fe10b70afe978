"""The compressor update in one launch: write a position's projections into the frontier ring, and pool each
block that closes into its compressed row (gated softmax pooling -> RMSNorm -> RoPE -> round trip).

What it computes is engine/model.py's `Compressor.__call__` after the two projections (kv = x Wkv^T and
score = x Wgate^T, which stay in the matvec / matmul kernels): the frontier rings `fkv`, `fsc` [Rf, W] hold
each position's kv and score + ape[pos % r] (W = coff * d; coff = 2 for the overlapping ratio-4 compressors,
whose block i pools block i-1's entries on channels [:d] and its own on channels [d:]). A closed block b
pools, per channel, softmax over its coff * r entries of score, weighted sum of kv (positions < 0 weigh
nothing), then kernels/rows.py's `finish_row`: RMSNorm with the compressor's weight, RoPE at position b * r,
and the layer's round trip (FP8 on the non-RoPE dims for attention rows, Hadamard + FP4 for indexer keys).
The result goes to rows[b].

- `compress_decode(kv, sc, ape, pos, fkv, fsc, rows, ...)`: one token at device position pos[0]: writes the
  frontier slot, and pools block pos // r only if pos closes it, decided on the device (the pooling loop has
  zero trips otherwise), so a decode step needs no host branch and can be replayed from a CUDA graph. With
  `slots=` [T], a batched decode step: T tokens, each of its own sequence, whose frontiers and rows are pools
  [S, ...] (engine/kv.py's KVPool): token t updates slot slots[t] at pos[t], one program per token.
- `compress_blocks(fkv, fsc, rows, b0, n, ...)`: prefill: pools blocks b0 .. b0 + n - 1 from a frontier that
  already holds their positions, one program per block.
- `compress_rows(fkv, fsc, rows, pos, ...)`: a static-shape step of several positions pos [T] (device), whose
  projections the frontier already holds: each position pools the block it closes, decided on the device
  (one program per position), so a short prefill can be replayed from a CUDA graph too; with `slots=` [T]
  the frontiers and rows are pools and position t is slot slots[t]'s (a static step of one sequence of a
  pool passes its slot for every row).
Each is one launch with one program per pooled block; `compress_*_ref` run the model's torch code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.pdl import enter, pdl
from ds4station.kernels.rows import _RT, finish_row

Tensor = torch.Tensor


@dataclass(frozen=True)
class Finish:
    """How a compressor finishes its pooled rows."""

    norm: Tensor  # [d] RMSNorm weight
    eps: float
    inv_freq: Tensor  # RoPE frequencies (the compressed-layer YaRN ones)
    rt: str | None = None  # "fp8" (attention rows), "fp4" (indexer keys, after a Hadamard) or None
    nope: int = 0  # dims the FP8 round trip covers
    hadamard: bool = False


# ---------------------------------------------------------------------------------------------------------
# Torch reference (the model's code, on the same frontier layout).


def _pool_ref(fkv: Tensor, fsc: Tensor, rows: Tensor, blocks: Tensor, ratio: int, fin: Finish) -> None:
    from .reference import frontier_read
    from .rows import finish_rows_ref

    d = rows.shape[1]
    coff = fkv.shape[1] // d
    src = blocks[:, None] * ratio - (coff - 1) * ratio + torch.arange(coff * ratio, device=fkv.device)
    kv_s, sc_s = frontier_read(fkv, fsc, src)
    if coff == 2:
        kv_s = torch.cat((kv_s[:, :ratio, :d], kv_s[:, ratio:, d:]), dim=1)
        sc_s = torch.cat((sc_s[:, :ratio, :d], sc_s[:, ratio:, d:]), dim=1)
    pooled = (sc_s.softmax(dim=1) * kv_s).sum(1)
    out = finish_rows_ref(pooled, blocks * ratio, 1, norm=True, weight=fin.norm, eps=fin.eps, inv_freq=fin.inv_freq,
                          hadamard=fin.hadamard, rt=fin.rt, nope=fin.nope)
    rows[blocks] = out.to(rows.dtype)


def compress_decode_ref(kv: Tensor, sc: Tensor, ape: Tensor, pos: Tensor, fkv: Tensor, fsc: Tensor, rows: Tensor,
                        ratio: int, fin: Finish, slots: Tensor | None = None) -> None:
    if slots is not None:
        for t, s in enumerate(slots.tolist()):
            compress_decode_ref(kv[t:t + 1], sc[t:t + 1], ape, pos[t:t + 1], fkv[s], fsc[s], rows[s], ratio, fin)
        return
    p = int(pos[0])
    slot = p % fkv.shape[0]
    fkv[slot] = kv[0].float()
    fsc[slot] = sc[0].float() + ape[p % ratio]
    if (p + 1) % ratio == 0:
        _pool_ref(fkv, fsc, rows, torch.tensor([p // ratio], device=fkv.device), ratio, fin)


def compress_blocks_ref(fkv: Tensor, fsc: Tensor, rows: Tensor, b0: int, n: int, ratio: int, fin: Finish) -> None:
    if n > 0:
        _pool_ref(fkv, fsc, rows, torch.arange(b0, b0 + n, device=fkv.device), ratio, fin)


def compress_rows_ref(fkv: Tensor, fsc: Tensor, rows: Tensor, pos: Tensor, ratio: int, fin: Finish,
                      slots: Tensor | None = None) -> None:
    if slots is not None:
        for t, s in enumerate(slots.tolist()):
            compress_rows_ref(fkv[s], fsc[s], rows[s], pos[t:t + 1], ratio, fin)
        return
    closing = pos[(pos + 1) % ratio == 0]
    if closing.numel():
        _pool_ref(fkv, fsc, rows, closing // ratio, ratio, fin)


# ---------------------------------------------------------------------------------------------------------
# Kernel.


@triton.jit(do_not_specialize=["b0"])  # the first block pooled: a position, not a shape
def _compress_kernel(kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, fkv_ptr, fsc_ptr, rows_ptr, w_ptr, f_ptr,
                     b0, Rf, W, d, eps, stride_kv, stride_sf, stride_sr,
                     R: tl.constexpr, COFF: tl.constexpr, MODE: tl.constexpr, HALF: tl.constexpr,
                     HADAMARD: tl.constexpr, RT: tl.constexpr, NOPE: tl.constexpr, BLOCK_D: tl.constexpr,
                     LOG_D: tl.constexpr, BLOCK_J: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    # MODE 0: pool blocks b0 + program id; 1: write position pos[t] (t = program id, its projections in row t
    # of kv / sc) into the frontier, then pool the block it closes, if it does; 2: pool the block position
    # pos[program id] closes, if it does. SLOTS (modes 1, 2): program t's frontier and rows are slot slots[t] of
    # pools.
    enter(PDL)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < d
    if SLOTS:
        slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)
        fkv_ptr += slot * stride_sf
        fsc_ptr += slot * stride_sf
        rows_ptr += slot * stride_sr
    if MODE != 0:
        pos = tl.load(pos_ptr + tl.program_id(0)).to(tl.int64)
        if MODE == 1:
            kv_ptr += tl.program_id(0).to(tl.int64) * stride_kv
            sc_ptr += tl.program_id(0).to(tl.int64) * stride_kv
            slot = pos % Rf
            for c in tl.static_range(COFF):
                kv_w = tl.load(kv_ptr + c * d + offs, mask=dmask, other=0.0).to(tl.float32)
                sc_w = tl.load(sc_ptr + c * d + offs, mask=dmask, other=0.0).to(tl.float32)
                sc_w += tl.load(ape_ptr + (pos % R) * W + c * d + offs, mask=dmask, other=0.0)
                tl.store(fkv_ptr + slot * W + c * d + offs, kv_w, mask=dmask)
                tl.store(fsc_ptr + slot * W + c * d + offs, sc_w, mask=dmask)
            tl.debug_barrier()  # the pooling below reads the slot just written (same program)
        closing = (pos + 1) % R == 0
        smask = dmask & (((tl.zeros((BLOCK_D,), tl.int64) + pos + 1) % R) == 0)
        b = pos // R
        n_entries = tl.where(closing, COFF * R, 0)
    else:
        smask = dmask
        b = (b0 + tl.program_id(0)).to(tl.int64)
        n_entries = COFF * R
    # Online softmax over the block's entries, per channel (m starts finite: leading entries may all be -inf).
    m = tl.full((BLOCK_D,), -1e30, tl.float32)
    den = tl.zeros((BLOCK_D,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j0 in range(0, n_entries, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        src = b * R - (COFF - 1) * R + j
        valid = (src >= 0) & (j < COFF * R)
        slot_j = tl.where(valid, src, 0) % Rf
        ch = tl.where((j >= R) & (COFF == 2), d, 0)
        ptr = slot_j[:, None] * W + ch[:, None] + offs[None, :]
        mask = valid[:, None] & dmask[None, :]
        kv = tl.load(fkv_ptr + ptr, mask=mask, other=0.0)
        sc = tl.load(fsc_ptr + ptr, mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[None, :])
        den = den * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        m = m_new
    pooled = tl.where(dmask & (den > 0), acc / tl.where(den > 0, den, 1.0), 0.0)
    y = finish_row(pooled, offs, d, (b * R).to(tl.float32), w_ptr, eps, f_ptr, 1.0, True, True, HALF, HADAMARD, RT,
                   NOPE, BLOCK_D, LOG_D)
    tl.store(rows_ptr + b * d + offs, y.to(rows_ptr.dtype.element_ty), mask=smask)


def _check(fkv: Tensor, fsc: Tensor, rows: Tensor, ratio: int, fin: Finish) -> tuple[int, int]:
    d = rows.shape[1]
    W = fkv.shape[1]
    if W % d or W // d not in (1, 2) or fsc.shape != fkv.shape:
        raise ValueError(f"frontier {tuple(fkv.shape)} / {tuple(fsc.shape)} does not hold 1 or 2 x {d} channels")
    if (W // d == 2) != (ratio == 4):
        raise ValueError(f"ratio {ratio} with {W // d} x {d} frontier channels: overlapping (2x) means ratio 4")
    if fkv.shape[0] < (W // d) * ratio:
        raise ValueError(f"frontier ring of {fkv.shape[0]} rows cannot hold a block of {(W // d) * ratio}")
    if fkv.dtype != torch.float32 or fsc.dtype != torch.float32 or not (fkv.is_contiguous() and fsc.is_contiguous()):
        raise ValueError("frontier rings are contiguous float32")
    if not rows.is_contiguous() or fin.norm.numel() != d:
        raise ValueError(f"rows must be contiguous [n, {d}] with a norm weight of {d}")
    return d, W // d


def _launch(grid: int, kv: Tensor, sc: Tensor, ape: Tensor, pos: Tensor, fkv: Tensor, fsc: Tensor, rows: Tensor,
            b0: int, ratio: int, fin: Finish, mode: int, slots: Tensor | None = None) -> None:
    pooled = slots is not None
    if pooled and (fkv.dim() != 3 or rows.dim() != 3 or not (fkv.shape[0] == fsc.shape[0] == rows.shape[0])):
        raise ValueError(f"slots index pools of frontiers [S, Rf, W] and rows [S, n, d], got {tuple(fkv.shape)}, "
                         f"{tuple(rows.shape)}")
    d, coff = _check(fkv[0] if pooled else fkv, fsc[0] if pooled else fsc, rows[0] if pooled else rows, ratio, fin)
    if pooled and not (fkv.is_contiguous() and fsc.is_contiguous() and rows.is_contiguous()):
        raise ValueError("pools of frontiers and rows are contiguous")
    block = max(64 if fin.rt == "fp8" else 32, triton.next_power_of_2(d))
    if fin.hadamard and block != d:
        raise ValueError(f"the Hadamard rotation needs a power-of-two row, got {d}")
    tiles = dispatch.compressor_tiles(d, coff * ratio, dispatch.launch_backend(fkv))
    _compress_kernel[(grid,)](
        kv, sc, ape, pos, slots if pooled else pos, fkv, fsc, rows, fin.norm, fin.inv_freq, b0, fkv.shape[-2],
        fkv.shape[-1], d, float(fin.eps), kv.stride(0), fkv.stride(0) if pooled else 0, rows.stride(0) if pooled else 0,
        R=ratio, COFF=coff, MODE=mode, HALF=fin.inv_freq.numel(), HADAMARD=fin.hadamard, RT=_RT[fin.rt],
        NOPE=fin.nope, BLOCK_D=block, LOG_D=block.bit_length() - 1, BLOCK_J=tiles.block_j, SLOTS=pooled,
        num_warps=tiles.num_warps, **pdl(kv))


def compress_decode_triton(kv: Tensor, sc: Tensor, ape: Tensor, pos: Tensor, fkv: Tensor, fsc: Tensor, rows: Tensor,
                           ratio: int, fin: Finish, slots: Tensor | None = None) -> None:
    """kv, sc [T, W] (rows of a projection output; unit stride within the row, the same row stride), ape [r, W]
    fp32, pos [T]; T = 1 without slots, else slots [T] into pools fkv, fsc [S, Rf, W] and rows [S, n, d]."""
    W = fkv.shape[-1]
    T = kv.shape[0]
    if kv.shape[-1] != W or sc.shape[-1] != W or kv.stride(-1) != 1 or sc.stride(-1) != 1 or sc.shape[0] != T \
            or (T > 1 and sc.stride(0) != kv.stride(0)):
        raise ValueError(f"projections must be unit-stride rows of {W} with one row stride")
    if tuple(ape.shape) != (ratio, W) or not ape.is_contiguous() or ape.dtype != torch.float32:
        raise ValueError(f"ape must be contiguous float32 [{ratio}, {W}], got {tuple(ape.shape)}")
    if pos.shape != (T,) or (slots is None and T != 1) or (slots is not None and slots.shape != (T,)):
        raise ValueError(f"{T} token(s) need pos [{T}] and, for more than one, slots [{T}]")
    _launch(T, kv, sc, ape, pos, fkv, fsc, rows, 0, ratio, fin, mode=1, slots=slots)


def compress_blocks_triton(fkv: Tensor, fsc: Tensor, rows: Tensor, b0: int, n: int, ratio: int, fin: Finish) -> None:
    if n > 0:
        _launch(n, fkv, fsc, fkv, fkv, fkv, fsc, rows, b0, ratio, fin, mode=0)


def compress_rows_triton(fkv: Tensor, fsc: Tensor, rows: Tensor, pos: Tensor, ratio: int, fin: Finish,
                         slots: Tensor | None = None) -> None:
    if pos.dim() != 1 or not pos.is_contiguous():
        raise ValueError(f"pos must be a contiguous [T] tensor, got {tuple(pos.shape)}")
    if slots is not None and slots.shape != pos.shape:
        raise ValueError(f"slots {tuple(slots.shape)} must name one slot per position {tuple(pos.shape)}")
    _launch(pos.numel(), fkv, fsc, fkv, pos, fkv, fsc, rows, 0, ratio, fin, mode=2, slots=slots)


def compress_decode(kv: Tensor, sc: Tensor, ape: Tensor, pos: Tensor, fkv: Tensor, fsc: Tensor, rows: Tensor,
                    ratio: int, fin: Finish, slots: Tensor | None = None) -> None:
    """Triton on a GPU tensor, the torch reference on CPU (which reads pos back to the host)."""
    f = compress_decode_triton if dispatch.use_triton(fkv) else compress_decode_ref
    f(kv, sc, ape, pos, fkv, fsc, rows, ratio, fin, slots)


def compress_blocks(fkv: Tensor, fsc: Tensor, rows: Tensor, b0: int, n: int, ratio: int, fin: Finish) -> None:
    f = compress_blocks_triton if dispatch.use_triton(fkv) else compress_blocks_ref
    f(fkv, fsc, rows, b0, n, ratio, fin)


def compress_rows(fkv: Tensor, fsc: Tensor, rows: Tensor, pos: Tensor, ratio: int, fin: Finish,
                  slots: Tensor | None = None) -> None:
    f = compress_rows_triton if dispatch.use_triton(fkv) else compress_rows_ref
    f(fkv, fsc, rows, pos, ratio, fin, slots)
