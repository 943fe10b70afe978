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

Launchers never read back to the host, so they can be captured in a CUDA graph. `f16_matvec` picks Triton
for a GPU tensor (or a CPU tensor inside `dispatch.interpreted_kernels()`) and the torch reference
otherwise; `f16_matvec_triton` also runs CPU tensors under TRITON_INTERPRET. Tiles: `dispatch.f16_matvec_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch

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
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1] row starts
    offs_k = tl.arange(0, BLOCK_K)
    if M == 1:
        # element-wise fp32 partial sums, one reduction after the loop
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            wt = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            xv = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc2 += wt * xv[None, :]
        tl.store(y_ptr + offs_n, tl.sum(acc2, axis=1), mask=n_mask)
    else:
        cols = tl.arange(0, M_PAD)
        acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_mask = kk < K
            wt = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            for m in tl.static_range(M):
                xv = tl.load(x_ptr + m * stride_xm + kk, mask=k_mask, other=0.0).to(tl.float32)
                part = tl.sum(wt * xv[None, :], axis=1)  # [BLOCK_N]
                acc += tl.where(cols[None, :] == m, part[:, None], 0.0)
        y_ptrs = y_ptr + cols[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc, mask=n_mask[:, None] & (cols[None, :] < M))


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def _check(x: Tensor, w: Tensor, out: Tensor | None) -> None:
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
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"f16_matvec takes 1-{MAX_ROWS} activation rows, got {m}")
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
        return f16_matvec_triton(x, w, out=out)
    _check(x, w, out)
    y = f16_matvec_ref(x, w)
    if out is None:
        return y
    out.copy_(y)
    return out


def f16_matvec_triton(x: Tensor, w: Tensor, out: Tensor | None = None,
                      tiles: dispatch.F16Tiles | None = None) -> Tensor:
    """The Triton launcher of `f16_matvec` (GPU tensors, or CPU tensors under TRITON_INTERPRET): one launch,
    grid (cdiv(N, block_n),)."""
    if not x.is_cuda and not dispatch.interpreting():
        raise ValueError("f16_matvec_triton needs GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    _check(x, w, out)
    m, k = x.shape
    n = w.shape[0]
    if k > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if k > 1 and w.stride(1) != 1:
        raise ValueError(f"w must have a unit last stride, got strides {w.stride()}")
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=torch.float32)
    if n == 0:
        return out
    tiles = tiles or dispatch.f16_matvec_tiles(n, k, m, dispatch.launch_backend(x))
    _f16_matvec_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, w, out, n, k, x.stride(0), w.stride(0), out.stride(0),
        M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
