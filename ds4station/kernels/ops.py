"""The kernels' public entry points: repack GGUF weights, quantised linear layers and the fused MoE.

Each op runs the Triton kernel for a GPU tensor and the family's torch reference for a CPU tensor
(dispatch.use_triton), so the engine calls one function on every device. Tile choices come from dispatch.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ds4station.kernels import cpu, dispatch
from ds4station.kernels.act_quant import quantize_act16
from ds4station.kernels.iq2_xxs import (
    PackedIQ2XXS,
    dequantize_iq2_xxs,
    repack_iq2_xxs,
)
from ds4station.kernels.moe import _expert, int_dot_layout, moe_decode, rows_matvec
from ds4station.kernels.moe_prefill import moe_prefill
from ds4station.kernels.norm import rms_norm, rope_
from ds4station.kernels.q2_k import PackedQ2K, dequantize_q2_k, repack_q2_k
from ds4station.kernels.q4_k import PackedQ4K, dequantize_q4_k, q4_k_matmul, repack_q4_k
from ds4station.kernels.q8_0 import (
    PackedQ8_0,
    dequantize_q8_0,
    q8_0_matmul,
    q8_0_matvec,
    q8_0_matvec_q16,
    repack_q8_0,
)
from ds4station.kernels.quants import row_bytes
from ds4station.kernels.reference import swiglu as swiglu_pair
from ds4station.model.footprint import CPU_DEQUANT_BYTES  # on the CPU: the fp32 copy of a block of rows

Packed = PackedQ8_0 | PackedIQ2XXS | PackedQ2K | PackedQ4K
__all__ = ["Packed", "dequantize", "linear", "moe", "repack", "rms_norm", "rope_"]

_REPACK = {"q8_0": repack_q8_0, "iq2_xxs": repack_iq2_xxs, "q2_k": repack_q2_k, "q4_k": repack_q4_k}
# A tensor larger than this is repacked in blocks of rows of at most this many raw bytes (see `repack`).
REPACK_BLOCK_BYTES = 64 << 20
# Largest activation row count the decode matvecs take; more rows go to the prefill path.
MAX_MATVEC_ROWS = 8
# Up to this many tokens the routed experts run on the decode kernels (one program per token and slot, each
# reading its expert once): a short prompt sends about one token to each expert, where the prefill kernel's
# 64-row tiles run nearly empty. H200, one Flash layer (docs/PERFORMANCE.md): 22 tokens 6.6 ms in moe_prefill, 0.9
# ms on the decode kernels; 256 tokens 14.7 against 10.6 ms; from 512 tokens the prefill kernel is faster.
MOE_DECODE_ROWS = 256
# On the CPU, up to this many activation rows run the native matvec (kernels/cpu.py, 8 rows a call), which reads
# each weight once per call; more take a dequantised block of rows and torch's matmul. Two cores
# (docs/scripts/cpu_matvec.py, docs/PERFORMANCE.md): even at 32 rows (q_b 29.2 against 43.7 ms, output b 28.1 /
# 29.7, an IQ2_XXS expert 7.6 / 7.6, a Q2_K one 6.7 / 8.0), the blocks ahead from 64 rows and by 2x at 256.
CPU_MATVEC_ROWS = 32


def _row_block(w: Packed, r0: int, r1: int) -> Packed:
    """Rows [r0, r1) of a repacked weight (every packed field is [*lead, N, ...])."""
    return type(w)(*(getattr(w, f.name)[..., r0:r1, :] for f in dataclasses.fields(w)))


def repack(raw: torch.Tensor, qtype: str, k: int, device: torch.device | str | None = None) -> Packed:
    """Repack raw GGUF bytes of `qtype` ("q8_0", "iq2_xxs", "q2_k", "q4_k") with rows of `k` values (raw
    [*lead, row bytes] or flat), on `device` (default: raw's). A large tensor goes through in blocks of rows
    of at most REPACK_BLOCK_BYTES, each moved to the device and repacked into the result's preallocated
    fields: the repack's elementwise temporaries (several times the raw size) and the raw copy on the device
    are bounded by the block, not by the tensor (a Flash layer's Q2_K experts are 672 MiB)."""
    try:
        fn = _REPACK[qtype.lower()]
    except KeyError:
        raise ValueError(f"no repack for quant type {qtype!r}; have {sorted(_REPACK)}") from None
    device = raw.device if device is None else torch.device(device)
    qt = Q[qtype.upper()]
    row = row_bytes(qt, k) if k % GGML_QUANT_SIZES[qt][0] == 0 else 0
    if raw.numel() <= REPACK_BLOCK_BYTES or not row or raw.numel() % row or (raw.dim() > 1 and raw.shape[-1] != row):
        return fn(raw.to(device), k)  # small, or not whole rows: the repack itself says what is wrong
    lead = raw.shape[:-1] if raw.dim() > 1 else (raw.numel() // row,)
    rows = raw.reshape(-1, row)
    step = max(1, REPACK_BLOCK_BYTES // row)
    out: Packed | None = None
    for r in range(0, rows.shape[0], step):
        part = fn(rows[r:r + step].to(device), k)
        if out is None:
            out = type(part)(*(torch.empty((rows.shape[0], *getattr(part, f.name).shape[1:]), device=device,
                                           dtype=getattr(part, f.name).dtype) for f in dataclasses.fields(part)))
        for f in dataclasses.fields(part):
            getattr(out, f.name)[r:r + step].copy_(getattr(part, f.name))
    assert out is not None
    return type(out)(*(getattr(out, f.name).view(*lead, *getattr(out, f.name).shape[1:])
                       for f in dataclasses.fields(out)))


def dequantize(w: Packed) -> torch.Tensor:
    """fp32 values of a repacked weight, [*lead, N, K]."""
    if isinstance(w, PackedQ8_0):
        return dequantize_q8_0(w)
    if isinstance(w, PackedIQ2XXS):
        return dequantize_iq2_xxs(w)
    if isinstance(w, PackedQ4K):
        return dequantize_q4_k(w)
    return dequantize_q2_k(w)


_scratch = threading.local()


def _dequant_scratch() -> torch.Tensor:
    """This thread's CPU_DEQUANT_BYTES of fp32 for the blocks `_cpu_linear` dequantises (allocated once: the planner
    counts it, model/footprint.CPU_DEQUANT_BYTES)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() * 4 != CPU_DEQUANT_BYTES:
        buf = _scratch.buf = torch.empty(CPU_DEQUANT_BYTES // 4, dtype=torch.float32)
    return buf


def _cpu_linear(x: torch.Tensor, w: Packed, groups: int, int8: bool = False) -> torch.Tensor:
    """`linear` on the CPU, fp32 [M, N]: up to CPU_MATVEC_ROWS rows the native matvec (kernels/cpu.py: each weight
    read once for all rows; `int8`: its integer dot, which `moe` asks for); more rows (prefill), blocks of rows
    dequantised to fp32 (CPU_DEQUANT_BYTES at a time, natively into a reused buffer where the library is built) and
    multiplied by torch's matmul. Without the native kernels, the torch references."""
    native = cpu.available()
    x = x.float()
    if native and x.shape[0] <= CPU_MATVEC_ROWS:
        return cpu.matvec(x, w, groups, int8=int8)
    per_group = w.n // groups
    rows = min(per_group, max(1, CPU_DEQUANT_BYTES // (4 * w.k)))  # the fp32 copy of one block of rows at a time
    out, r = [], 0
    while r < w.n:
        g, end = r // per_group, min(r + rows, (r // per_group + 1) * per_group)  # a block lies in one group
        block = _row_block(w, r, end)
        wf = cpu.dequantize(block, _dequant_scratch()) if native else dequantize(block)
        out.append(x[:, g * w.k:(g + 1) * w.k] @ wf.T)
        r = end
    return torch.cat(out, -1)


def linear_act16(x: torch.Tensor, w: Packed) -> bool:
    """Whether `linear` runs W over x's rows from their 16-bit quantisation (act_quant.quantize_act16): the
    integer-dot Q8_0 matvec, when its producer emits x quantised (norm.rms_norm(quant="act16"), swiglu, the decode
    attention) and passes it as `act`, saving the quantiser's launch (dispatch.q8_0_route(quantised=True))."""
    return isinstance(w, PackedQ8_0) and dispatch.use_triton(x) and \
        dispatch.q8_0_route(w.n, w.k, x.shape[0], dispatch.launch_backend(x), quantised=True) == "int_dot"


def linear(x: torch.Tensor, w: Packed, groups: int = 1, out_dtype: torch.dtype | None = None,
           act: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y = x @ W^T for x [M, groups*K] -> [M, N] (groups > 1: Q8_0 grouped projection, rows split evenly).

    GPU: M <= 8 runs the fused dequant matvec (Q8_0: dispatch.q8_0_route picks the integer-dot matvec, the fp32
    one or the split-K matmul, measured); more rows run the Q8_0 / Q4_K tl.dot matmul (the 2-bit types, which
    hold routed experts, are dequantised to fp16 and multiplied by torch here). CPU: `_cpu_linear`.
    `act`: x as quantize_act16 gives it, where `linear_act16` says the route reads that (else ignored).
    """
    m = x.shape[0]
    if groups != 1 and not isinstance(w, PackedQ8_0):
        raise ValueError("grouped linear is implemented for Q8_0 weights only")
    if not dispatch.use_triton(x):
        return _cpu_linear(x, w, groups).to(out_dtype or x.dtype)
    if isinstance(w, PackedQ8_0):
        route = dispatch.q8_0_route(w.n, w.k, m, dispatch.launch_backend(x), quantised=act is not None)
        if route == "int_dot":
            return q8_0_matvec_q16(quantize_act16(x) if act is None else act, w, groups=groups,
                                   out_dtype=out_dtype or x.dtype,
                                   tiles=dispatch.q8_0_int_dot_tiles(w.n, w.k, m, dispatch.tma_reads(x), w.n // groups))
        if route == "matvec":
            return q8_0_matvec(x, w, groups=groups, out_dtype=out_dtype)
        return q8_0_matmul(x, w, out_dtype=out_dtype, groups=groups)
    if m <= MAX_MATVEC_ROWS:
        return rows_matvec(x, w, out_dtype=out_dtype)
    if isinstance(w, PackedQ4K):
        return q4_k_matmul(x, w, out_dtype=out_dtype)
    return (x.half() @ dequantize(w).half().T).to(out_dtype or x.dtype)


def moe_act_layout(x: torch.Tensor, gate: PackedIQ2XXS | PackedQ2K | torch.Tensor,
                   down: PackedIQ2XXS | PackedQ2K | torch.Tensor, int_dot: bool | None = None) -> str | None:
    """The layout (act_quant.LAYOUTS) in which `moe` quantises x's rows for its integer-dot decode kernels, or
    None when it reads them as floats: its producer can emit them quantised (norm.rms_norm(quant=layout)) and
    pass them as `xq`."""
    if isinstance(gate, torch.Tensor) or not dispatch.use_triton(x) or x.shape[0] > MOE_DECODE_ROWS:
        return None
    return int_dot_layout(x, gate, down, int_dot)


def moe_int_dot(x: torch.Tensor, gate: PackedIQ2XXS | PackedQ2K | torch.Tensor,
                down: PackedIQ2XXS | PackedQ2K | torch.Tensor, int_dot: bool | None = None) -> bool:
    """Whether `moe` multiplies the experts by x's rows as integer dots (x quantised to int8 per 32 values: the
    numerics of moe.matvec_ref with act_quant) rather than in floats. GPU: the decode kernels' integer-dot path
    (moe_act_layout). CPU: up to CPU_MATVEC_ROWS tokens (a decode or verification step; every expert's rows then
    take the native matvec) with the native integer dot built for the experts' types, unless `int_dot` is False or,
    with `int_dot` None (the default), DS4STATION_CPU_INT8=0 asks for the fp32 matvecs (exact relations between
    decode and prefill, which the engine's tests check)."""
    if dispatch.use_triton(x):
        return moe_act_layout(x, gate, down, int_dot) is not None
    if int_dot is False or isinstance(gate, torch.Tensor) or x.shape[0] > CPU_MATVEC_ROWS or not cpu.available():
        return False
    if int_dot is None and os.environ.get("DS4STATION_CPU_INT8", "1") == "0":
        return False
    return cpu.int8_matvec(gate.qtype) and cpu.int8_matvec(down.qtype)


def moe(
    x: torch.Tensor,
    gate: PackedIQ2XXS | PackedQ2K | torch.Tensor,
    up: PackedIQ2XXS | PackedQ2K | torch.Tensor,
    down: PackedIQ2XXS | PackedQ2K | torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    clamp: float | None = 10.0,
    *,
    int_dot: bool | None = None,
    last: torch.Tensor | None = None,
    xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed-expert FFN for tokens x [T, D] with selected ids/weights [T, S]: y [T, D] fp32 (the one place
    that picks the MoE path). `xq`: x quantised in the layout `moe_act_layout` names (ignored elsewhere).

    GPU: up to MOE_DECODE_ROWS tokens run the decode kernels (integer dot on CUDA unless `int_dot` is False;
    `last`: see moe_decode), more the prefill kernels (tokens grouped by expert, tl.dot); no host
    synchronisation on either path. CPU: each used expert once over all of its tokens through `_cpu_linear` (the
    native matvec for a few tokens, its integer dot where `moe_int_dot` says so; a dequantised block and a matmul
    for many). Float experts (dense [E, N, K] tensors:
    files whose experts are F32 / F16 / BF16) take that per-expert path on every device, multiplied by torch."""
    dense = isinstance(gate, torch.Tensor)
    if dispatch.use_triton(x) and not dense:
        if x.shape[0] <= MOE_DECODE_ROWS:
            return moe_decode(x, gate, up, down, ids, weights, clamp, int_dot=int_dot, last=last, xq=xq)
        return moe_prefill(x, gate, up, down, ids, weights, clamp=clamp)
    int8 = moe_int_dot(x, gate, down, int_dot)
    y = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float32, device=x.device)  # [T, S, D]: the sum does not
    x = x.float()  # depend on the experts' order (numbers or cache slots), as on the GPU
    for e in ids.unique().tolist():  # each used expert once, over all of its tokens
        t, slot = torch.where(ids == e)
        if dense:
            g, u, d = (w[e].float() for w in (gate, up, down))
            h = swiglu_pair(x[t] @ g.T, x[t] @ u.T, clamp or 0.0) * weights[t, slot, None]
            y[t, slot] = h @ d.T
        else:
            h = swiglu_pair(_cpu_linear(x[t], _expert(gate, e), 1, int8),
                            _cpu_linear(x[t], _expert(up, e), 1, int8), clamp or 0.0)
            y[t, slot] = _cpu_linear(h * weights[t, slot, None], _expert(down, e), 1, int8)
    return y.sum(1)
