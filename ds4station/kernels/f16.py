"""F16 weights in decode: y = x @ W^T for 1-8 activation rows in one launch, fp32 math, fp32 output.

DS4 keeps a few small projections in F16 (the compressors' kv / gate, the indexer's q_b and proj, the MoE
router's ffn_gate_inp). In decode torch runs them as x.half() @ W.T then .float(): a cast, a cuBLAS gemv
(with a split-K reduce) and a cast, 3-4 launches per call. `f16_matvec` is one:

- `f16_matvec(x, w, out=None) -> y`: x [M, K] fp32 or fp16 (1 <= M <= 8, any row stride, unit last stride),
  w [N, K] fp16 (any row stride, unit last stride), y [M, N] fp32 with y[m, n] = sum_k x[m, k] * w[n, k],
  every product and sum in fp32 (x is NOT rounded to fp16). `out` may be any fp32 [M, N] view with a unit
  last stride, e.g. a column slice of a wider buffer (row stride != N); only its [M, N] elements are written.
- `_f16_matvec_kernel`: grid (cdiv(N, BLOCK_N),), each program owns BLOCK_N output rows and walks K in
  BLOCK_K steps, reading a [BLOCK_N, BLOCK_K] fp16 weight tile per step (vectorised along K, each weight
  read once from HBM, evict-first) and the M activation chunks. One row (M = 1, the common case) accumulates
  element-wise in a [BLOCK_N, BLOCK_K] fp32 tile and reduces once at the end (no cross-lane reduction
  inside the loop); more rows reduce each step into a [BLOCK_N, M] accumulator. Masks cover K % BLOCK_K
  and N % BLOCK_N tails.

- `_f16_matmul_kernel` (`f16_matmul_triton`): the few-row form on CUDA (dispatch.f16_route: from 3 to 5 rows
  by size), one 16-row activation tile as the A operand of fp16 tensor-core dots and the weight tile, loaded
  straight into the dot, as B; x is split into two fp16 parts (hi = fp16(x), lo = fp16(x - hi)) and both are
  dotted, so x keeps ~22 bits (the products and sums are fp32, as in the matvec; |x| must stay below fp16's
  65,504, as in every tl.dot matmul here). K split across programs as the Q8_0 matmul splits it (kernels/splitk.py).

Launchers never read back to the host, so they can be captured in a CUDA graph. `f16_matvec` picks Triton
for a GPU tensor (or a CPU tensor inside `dispatch.interpreted_kernels()`) and the torch reference
otherwise, and `dispatch.f16_route` the kernel; `f16_matvec_triton` / `f16_matmul_triton` also run CPU
tensors under TRITON_INTERPRET. Tiles: `dispatch.f16_matvec_tiles`, `dispatch.f16_matmul_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.pdl import enter, pdl
from ds4station.kernels.splitk import split_buffers, split_k_range, store_split_k

Tensor = torch.Tensor

MAX_ROWS = 8


# ---------------------------------------------------------------------------------------------------------
# Torch reference.


def f16_matvec_ref(x: Tensor, w: Tensor) -> Tensor:
    """Torch reference of `f16_matvec`: fp32 x @ fp32 W^T."""
    return x.float() @ w.float().T


# ---------------------------------------------------------------------------------------------------------
# Kernel.


@triton.jit
def _f16_matvec_kernel(
    x_ptr, w_ptr, y_ptr,
    N, K,
    stride_xm, stride_wn, stride_ym,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """y [M, N] = x [M, K] @ W^T for a few rows. The first K step's weights are loaded before the grid-dependency
    wait (pdl.py: weights are no kernel's output), so with PDL their reads overlap the previous kernel's tail."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1] row starts
    offs_k = tl.arange(0, BLOCK_K)
    wt = _f16_weights(w_rows, n_mask, offs_k, K)
    enter(PDL)
    if M == 1:
        # element-wise fp32 partial sums, one reduction after the loop
        acc2 = wt * tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + offs_k
            wt = _f16_weights(w_rows, n_mask, kk, K)
            acc2 += wt * tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_n, tl.sum(acc2, axis=1), mask=n_mask)
    else:
        cols = tl.arange(0, M_PAD)
        acc = _f16_rows_step(tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32), wt, x_ptr, stride_xm, offs_k, K, M)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + offs_k
            acc = _f16_rows_step(acc, _f16_weights(w_rows, n_mask, kk, K), x_ptr, stride_xm, kk, K, M)
        y_ptrs = y_ptr + cols[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc, mask=n_mask[:, None] & (cols[None, :] < M))


@triton.jit
def _f16_weights(w_rows, n_mask, kk, K):
    """The weights [BLOCK_N, BLOCK_K] of one K step as fp32 (zero past K)."""
    return tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _f16_rows_step(acc, wt, x_ptr, stride_xm, kk, K, M: tl.constexpr):
    """acc [BLOCK_N, M_PAD] plus one K step (weights wt at columns kk) of each of the M activation rows."""
    cols = tl.arange(0, acc.shape[1])
    for m in tl.static_range(M):
        xv = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        part = tl.sum(wt * xv[None, :], axis=1)  # [BLOCK_N]
        acc += tl.where(cols[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def _f16_matmul_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One BLOCK_M x BLOCK_N output tile per program_id(0); program axis 1 is the K slice (kernels/splitk.py).
    enter(PDL)
    k_lo, k_hi = split_k_range(K, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        x_hi = x.to(tl.float16)
        x_lo = (x - x_hi.to(tl.float32)).to(tl.float16)
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K] fp16
        acc = tl.dot(x_hi, tl.trans(w), acc)
        acc = tl.dot(x_lo, tl.trans(w), acc)
    y_off = offs_m[:, None] * stride_ym + offs_n[None, :]
    p_off = offs_m[:, None] * N + offs_n[None, :]
    store_split_k(acc, y_ptr, part_ptr, cnt_ptr, y_off, p_off, m_mask[:, None] & n_mask[None, :], M, N, SPLIT_K)


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def _check(x: Tensor, w: Tensor, out: Tensor | None, max_rows: int = MAX_ROWS) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if w.dim() != 2:
        raise ValueError(f"w must be [N, K], got shape {tuple(w.shape)}")
    if w.dtype != torch.float16:
        raise ValueError(f"w must be fp16, got {w.dtype}")
    if x.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"x must be fp32 or fp16, got {x.dtype}")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x [{m}, {k}] does not match w [{n}, {w.shape[1]}]: K differs")
    if not 1 <= m <= max_rows:
        raise ValueError(f"f16_matvec takes 1-{max_rows} activation rows, got {m}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w is on {w.device}")
    if out is not None:
        if out.shape != (m, n) or out.dtype != torch.float32:
            raise ValueError(f"out must be fp32 [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
        if n > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have a unit last stride, got strides {out.stride()}")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x is on {x.device}")


def f16_matvec(x: Tensor, w: Tensor, out: Tensor | None = None) -> Tensor:
    """y [M, N] fp32 = x [M, K] (fp32/fp16, M <= 8) @ w [N, K]^T (fp16), fp32 math: Triton on a GPU tensor,
    the torch reference on CPU. Written into `out` (fp32 [M, N], any row stride) when given."""
    if dispatch.use_triton(x):
        if dispatch.f16_route(w.shape[0], w.shape[1], x.shape[0], dispatch.launch_backend(x)) == "matmul":
            return f16_matmul_triton(x, w, out=out)
        return f16_matvec_triton(x, w, out=out)
    _check(x, w, out)
    y = f16_matvec_ref(x, w)
    if out is None:
        return y
    out.copy_(y)
    return out


def _prepare(x: Tensor, w: Tensor, out: Tensor | None, who: str, max_rows: int) -> tuple[Tensor, Tensor]:
    """A Triton launcher's checks: (x with a unit last stride, out or a new fp32 [M, N])."""
    if not x.is_cuda and not dispatch.interpreting():
        raise ValueError(f"{who} needs GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    _check(x, w, out, max_rows)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if w.shape[1] > 1 and w.stride(1) != 1:
        raise ValueError(f"w must have a unit last stride, got strides {w.stride()}")
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), device=x.device, dtype=torch.float32)
    return x, out


def f16_matvec_triton(x: Tensor, w: Tensor, out: Tensor | None = None,
                      tiles: dispatch.F16Tiles | None = None) -> Tensor:
    """The Triton launcher of `f16_matvec` (GPU tensors, or CPU tensors under TRITON_INTERPRET): one launch,
    grid (cdiv(N, block_n),)."""
    x, out = _prepare(x, w, out, "f16_matvec_triton", MAX_ROWS)
    m, k = x.shape
    n = w.shape[0]
    if n == 0:
        return out
    tiles = tiles or dispatch.f16_matvec_tiles(n, k, m, dispatch.launch_backend(x))
    _f16_matvec_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, w, out, n, k, x.stride(0), w.stride(0), out.stride(0),
        M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x),
    )
    return out


def f16_matmul_triton(x: Tensor, w: Tensor, out: Tensor | None = None,
                      tiles: dispatch.MatmulTiles | None = None) -> Tensor:
    """The few-row tensor-core form of `f16_matvec` (same arguments and result; 1-16 rows), grid (cdiv(N,
    block_n), split_k)."""
    x, out = _prepare(x, w, out, "f16_matmul_triton", 16)
    m, k = x.shape
    n = w.shape[0]
    if n == 0:
        return out
    tiles = tiles or dispatch.f16_matmul_tiles(n, k, m)
    if tiles.block_m < m:
        raise ValueError(f"block_m {tiles.block_m} does not hold the {m} rows")
    split = max(1, min(tiles.split_k, triton.cdiv(k, tiles.block_k)))  # at least one K step per slice
    n_tiles = triton.cdiv(n, tiles.block_n)
    part, counters = split_buffers(out, split, n_tiles)
    _f16_matmul_kernel[(n_tiles, split)](
        x, w, out, part, counters, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_K=split > 1,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x),
    )
    return out
