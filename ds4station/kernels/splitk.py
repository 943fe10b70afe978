"""Split-K for the few-row and short-prefill matmuls (q8_0_matmul, f16_matmul): one launch, bit-stable.

Program axis 1 is the K slice: num_programs(1) slices of cdiv(K / BLOCK_K, slices) steps each (the last may be
shorter; `split_k_range`). Slice s writes its fp32 partial s of [slices, M, N] (part_ptr, contiguous), then
counts itself in the output tile's counter (cnt_ptr, one int32 per program_id(0), zero between launches); the
slice that counts last sums the partials in slice order, writes Y and zeroes the counter (`store_split_k`).
The fixed order keeps the result bit-stable from run to run; with one slice it is a plain store of Y.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import triton
import triton.language as tl


@triton.jit
def split_k_range(K, BLOCK_K: tl.constexpr):
    """[k_lo, k_hi) of this program's K slice (program axis 1), in whole BLOCK_K steps."""
    k_slice = tl.cdiv(tl.cdiv(K, BLOCK_K), tl.num_programs(1)) * BLOCK_K
    k_lo = tl.program_id(1) * k_slice
    return k_lo, tl.minimum(K, k_lo + k_slice)


@triton.jit
def store_split_k(acc, y_ptr, part_ptr, cnt_ptr, y_off, p_off, y_mask, M, N, SPLIT_K: tl.constexpr):
    """Write this program's fp32 tile `acc` to Y (y_off: its offsets in Y; p_off: in one [M, N] partial)."""
    if not SPLIT_K:  # (a constexpr: an unsplit launch compiles no counting, whatever cnt_ptr points at)
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        pid = tl.program_id(0)
        splits = tl.num_programs(1)
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * M * N + p_off, acc, mask=y_mask)
        tl.debug_barrier()  # every lane's partial is written before the count releases them
        if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu") == splits - 1:
            acc = tl.load(part_ptr + p_off, mask=y_mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                acc += tl.load(part_ptr + s * M * N + p_off, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next launch (and the next graph replay)


def split_buffers(y: torch.Tensor, split: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [split, M, N] fp32, counters) for a launch of `split` slices over n_tiles output tiles; with
    one slice both are `y` itself (the kernel never touches them)."""
    if split <= 1:
        return y, y
    return (torch.empty((split, *y.shape), device=y.device, dtype=torch.float32),
            split_counters(y.device, n_tiles))


# The tile counters, per device and lane: int32 zeros that every launch leaves zero again. Allocated outside any
# CUDA graph capture (a capture would own their memory), at first use or by `split_counters` ahead of capturing;
# enough for the largest matmul of the model (129,280 head rows in 64-row tiles). Launches that may run at the
# same time on two streams (the GPU stage's overlapped projections) count on different lanes (`counter_lane`).
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 14
_LANE: contextvars.ContextVar[int] = contextvars.ContextVar("split_k_lane", default=0)


@contextlib.contextmanager
def counter_lane(lane: int) -> Iterator[None]:
    """Split-K launches issued inside count on the device's counter array `lane` (0 outside): give each stream
    whose launches may overlap another's its own lane."""
    token = _LANE.set(lane)
    try:
        yield
    finally:
        _LANE.reset(token)


def split_counters(device: torch.device, n: int = 0, lane: int | None = None) -> torch.Tensor:
    """The device's split-K counters of `lane` (None: the current `counter_lane`), at least `n`. Call it once
    per lane before capturing graphs that hold a split-K matmul (the GPU stage does, at load); inside a capture
    a missing or short array is an error."""
    device = torch.device(device)
    key = (device, _LANE.get() if lane is None else lane)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters of lane {key[1]} must be allocated before CUDA graph capture "
                               "(call kernels.splitk.split_counters(device, lane=...) first)")
        have = _COUNTERS[key] = torch.zeros(max(n, _COUNTER_SLOTS), dtype=torch.int32, device=device)
    return have
