"""Q8_0 weights: repack from GGUF blocks, decode matvec (optionally grouped), prefill matmul, torch references.

GGUF stores Q8_0 as 34-byte blocks (fp16 scale d, then 32 int8 quants), which leaves the quants 2-byte
aligned. `repack_q8_0` splits them once, at load, into a contiguous int8 [.., N, K] array (16-byte aligned
rows, so a thread loads 16 weights as one vector) and an fp16 [.., N, K/32] scale array; measured 1.4-1.7x
faster than reading the raw blocks (KERNEL-NOTES.md). Value of weight (n, k) = qs[n, k] * d[n, k // 32].

Kernels:
- `_q8_0_matvec_kernel`: y[m, n] = sum_k x[m, g(n), k] * W[n, k] for 1-8 activation rows, fp32 math.
  Grouped form: W's rows are split into G equal groups, and group g reads its own input row x[m, g]
  (DS4's attn_output_a: 8 groups of 1024 rows, one launch).
- `_q8_0_matvec_i8_kernel`: the same product from an activation quantised to two int8 digits per value
  (act_quant.quantize_act16), two dp4a per weight word, exact int32 block sums (CUDA; where
  dispatch.q8_0_route sends the decode's large projections and those whose producer quantises their input).
- `_q8_0_matvec_tma_kernel`: the same integer dot with the weights and scales read through Hopper's tensor
  memory accelerator (tensor descriptors; the copies run STAGES K steps ahead in shared memory), on the
  shapes where dispatch.q8_0_int_dot_tiles says it wins (q_b's many short rows, sm_90+).
- `_q8_0_matmul_kernel`: prefill, dequantises a weight tile to fp16 and feeds tl.dot (fp32 accumulate),
  optionally as Y^T = W X^T with the weight tile as the register operand (dispatch's w_as_a), and optionally
  split-K (dispatch's split_k: fp32 partials per K slice, summed in slice order by the slice that finishes
  last, in the same launch; short prefills and few-row steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import _dp4a, dequantize_act16
from ds4station.kernels.iq2_xxs import _s8x4_f16, _s8x4_f32
from ds4station.kernels.packed import PackedRows, raw_rows
from ds4station.kernels.pdl import enter, pdl
from ds4station.kernels.splitk import split_buffers, split_k_range, store_split_k

QK8_0 = 32
BLOCK_BYTES_Q8_0 = 34


@dataclass(frozen=True)
class PackedQ8_0(PackedRows):
    """Repacked Q8_0 weight: qs int8 [*lead, N, K], d fp16 [*lead, N, K/32] (lead = e.g. experts)."""

    qs: torch.Tensor
    d: torch.Tensor

    qtype = "q8_0"
    WEIGHTS_PER_QS = 1


def repack_q8_0(raw: torch.Tensor, k: int) -> PackedQ8_0:
    """Split raw GGUF Q8_0 bytes (uint8 [..., N, K/32*34] or flat) of rows of length `k` into PackedQ8_0.

    Runs on whatever device `raw` is on (on the GPU it is a few strided copies).
    """
    blocks = raw_rows(raw, k, "Q8_0", QK8_0, BLOCK_BYTES_Q8_0)
    lead, nb = blocks.shape[:-2], blocks.shape[-2]
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(*lead, nb)
    qs = blocks[..., 2:].contiguous().view(torch.int8).reshape(*lead, k)
    return PackedQ8_0(qs=qs, d=d)


def dequantize_q8_0(w: PackedQ8_0) -> torch.Tensor:
    """fp32 [*lead, N, K] values of a repacked Q8_0 weight."""
    vals = w.qs.float().unflatten(-1, (-1, QK8_0)) * w.d.float().unsqueeze(-1)
    return vals.flatten(-2)


def q8_0_matvec_ref(
    x: torch.Tensor, w: PackedQ8_0, groups: int = 1, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Torch reference of `q8_0_matvec` (fp32 math)."""
    out_dtype = out_dtype or x.dtype
    wf = dequantize_q8_0(w)  # [N, K]
    if groups == 1:
        return (x.float() @ wf.T).to(out_dtype)
    xg = x.float().reshape(x.shape[0], groups, w.k)  # [M, G, K]
    wg = wf.reshape(groups, w.n // groups, w.k)  # [G, N/G, K]
    return torch.einsum("mgk,gnk->mgn", xg, wg).reshape(x.shape[0], w.n).to(out_dtype)


@triton.jit
def _q8_0_matvec_kernel(
    x_ptr, qs_ptr, d_ptr, y_ptr,
    N, K, rows_per_group,
    stride_xm, stride_xg, stride_ym,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    enter(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    # All rows of a program are in one group (the launcher makes BLOCK_N divide rows_per_group).
    group = (pid * BLOCK_N) // rows_per_group
    KB: tl.constexpr = BLOCK_K // 32
    offs_b = tl.arange(0, KB)
    offs_e = tl.arange(0, 32)
    offs_w = tl.arange(0, 8)
    cols = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_b[:, None] * 32 + offs_e[None, :]  # [KB, 32]
        k_mask = kk < K
        # 3-D tile [rows, 32-blocks, 32]: the 32-axis stays inside a thread (16 bytes per load); a 4-D tile
        # made Triton spread it over lanes with shuffles. Read as int32 words, the bytes become floats by bits.
        wi = k0 // 4 + offs_b[:, None] * 8 + offs_w[None, :]  # [KB, 8] word index in the row
        wq = tl.load(qs_ptr + rows[:, None, None] * (K // 4) + wi[None, :, :],
                     mask=n_mask[:, None, None] & (wi < K // 4)[None, :, :], other=0, eviction_policy="evict_first")
        q = tl.reshape(_s8x4_f32(wq), (BLOCK_N, KB, 32))
        s_mask = n_mask[:, None] & ((k0 // 32 + offs_b) < K // 32)[None, :]
        s = tl.load(d_ptr + rows[:, None] * (K // 32) + (k0 // 32 + offs_b)[None, :], mask=s_mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        for m in tl.static_range(M):
            xv = tl.load(x_ptr + m * stride_xm + group * stride_xg + kk, mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(tl.sum(q * xv[None, :, :], axis=2) * s, axis=1)  # [BLOCK_N]
            acc += tl.where(cols[None, :] == m, part[:, None], 0.0)
    y_ptrs = y_ptr + cols[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & (cols[None, :] < M))


@triton.jit
def _q8_0_dot(qs_ptr, d_ptr, rows, n_mask, xt_ptr, K, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """[BLOCK_N] fp32 dot products of Q8_0 rows `rows` (int64; qs_ptr int32 words of 4 weights, d_ptr fp16
    per 32) with one activation row TRANSPOSED as [4, K/4] (xt[e, u] = x[4 u + e]): the fused MoE's layout,
    one lane per word as its 2-bit and Q4_K dots (Q8_0 routed experts of some conversions)."""
    U = K // 4
    offs_u = tl.arange(0, BLOCK_U)
    acc = tl.zeros([BLOCK_N, BLOCK_U], dtype=tl.float32)
    for u0 in range(0, U, BLOCK_U):
        uu = u0 + offs_u
        u_mask = uu < U
        wmask = n_mask[:, None] & u_mask[None, :]
        word = tl.load(qs_ptr + rows[:, None] * U + uu[None, :], mask=wmask, other=0, eviction_policy="evict_first")
        d = tl.load(d_ptr + rows[:, None] * (K // 32) + (uu // 8)[None, :], mask=wmask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dot = tl.zeros([BLOCK_N, BLOCK_U], dtype=tl.float32)
        for e in tl.static_range(4):
            q = ((word << (24 - 8 * e)) >> 24).to(tl.float32)  # signed byte e of the word
            xv = tl.load(xt_ptr + e * U + uu, mask=u_mask, other=0.0).to(tl.float32)
            dot += q * xv[None, :]
        acc += d * dot
    return tl.sum(acc, axis=1)


@triton.jit
def _q8_0_tile(qs_ptr, d_ptr, rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """Dequantised [rows, BLOCK_K] fp32 tile of Q8_0 weights k0 .. k0 + BLOCK_K (qs_ptr int8, d_ptr fp16 per
    32): the grouped MoE prefill's operand for Q8_0 experts."""
    BLOCK_N: tl.constexpr = rows.shape[0]
    KB: tl.constexpr = BLOCK_K // 32
    kk = k0 + tl.arange(0, BLOCK_K)
    q = tl.load(qs_ptr + rows[:, None] * K + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0)
    sb = k0 // 32 + tl.arange(0, KB)
    d = tl.load(d_ptr + rows[:, None] * (K // 32) + sb[None, :], mask=n_mask[:, None] & (sb < K // 32)[None, :],
                other=0.0).to(tl.float32)
    scale = tl.reshape(tl.broadcast_to(d[:, :, None], (BLOCK_N, KB, 32)), (BLOCK_N, BLOCK_K))
    return q.to(tl.float32) * scale


def q8_0_matvec(
    x: torch.Tensor,
    w: PackedQ8_0,
    groups: int = 1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: dispatch.MatvecTiles | None = None,
) -> torch.Tensor:
    """Triton y = x @ W^T for 1-8 activation rows: x [M, G*K] (fp16/fp32/bf16), returns [M, N].

    With groups = G > 1, output rows [g*N/G, (g+1)*N/G) read input x[:, g*K:(g+1)*K].
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, groups*K], got shape {tuple(x.shape)}")
    m = x.shape[0]
    n, k = w.n, w.k
    if not 1 <= m <= 8:
        raise ValueError(f"q8_0_matvec takes 1-8 activation rows, got {m}; use q8_0_matmul for more")
    if x.shape[1] != groups * k or n % groups:
        raise ValueError(f"x {tuple(x.shape)} does not match weight [{n}, {k}] in {groups} groups")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows_per_group = n // groups
    tiles = tiles or dispatch.matvec_tiles("q8_0", n, k, m, dispatch.launch_backend(x), rows_per_group)
    if groups > 1 and rows_per_group % tiles.block_n:
        raise ValueError(f"block_n {tiles.block_n} must divide the {rows_per_group} rows of a group")
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    grid = (triton.cdiv(n, tiles.block_n),)
    _q8_0_matvec_kernel[grid](
        x, w.qs.view(torch.int32), w.d, out, n, k, rows_per_group, x.stride(0), k, out.stride(0),
        M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x),
    )
    return out


@triton.jit
def _q8_0_matvec_i8_kernel(
    hi_ptr, lo_ptr, xs_ptr, qs_ptr, d_ptr, y_ptr,
    N, K, rows_per_group, stride_xm, stride_ym,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):
    """Integer-dot form of _q8_0_matvec_kernel: weights read as int32 words, activations as two int8 digits
    (act_quant.quantize_act16), two dp4a per weight word, exact int32 block sums. The first K step's weights
    are loaded before the grid-dependency wait (pdl.py: the weights are no kernel's output), so with PDL their
    reads overlap the previous kernel's tail."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    q, s = _q8_0_words(qs_ptr, d_ptr, rows, n_mask, 0, K, BLOCK_K)
    enter(PDL)
    group = (pid * BLOCK_N) // rows_per_group
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    acc = _q8_0_i8_step(acc, q, s, hi_ptr, lo_ptr, xs_ptr, group, 0, K, stride_xm, M, BLOCK_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        q, s = _q8_0_words(qs_ptr, d_ptr, rows, n_mask, k0, K, BLOCK_K)
        acc = _q8_0_i8_step(acc, q, s, hi_ptr, lo_ptr, xs_ptr, group, k0, K, stride_xm, M, BLOCK_K)
    cols = tl.arange(0, M_PAD)
    tl.store(y_ptr + cols[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=n_mask[:, None] & (cols[None, :] < M))


@triton.jit
def _q8_0_words(qs_ptr, d_ptr, rows, n_mask, k0, K, BLOCK_K: tl.constexpr):
    """One K step's weights of the integer-dot matvec: int32 words [BLOCK_N, BLOCK_K / 32, 8] and fp32 block
    scales [BLOCK_N, BLOCK_K / 32] (zero past K)."""
    KB: tl.constexpr = BLOCK_K // 32
    offs_b = tl.arange(0, KB)
    wi = k0 // 4 + offs_b[:, None] * 8 + tl.arange(0, 8)[None, :]  # [KB, 8] word index in the row
    q = tl.load(qs_ptr + rows[:, None, None] * (K // 4) + wi[None, :, :],
                mask=n_mask[:, None, None] & (wi < K // 4)[None, :, :], other=0, eviction_policy="evict_first")
    kb = k0 // 32 + offs_b
    s = tl.load(d_ptr + rows[:, None] * (K // 32) + kb[None, :], mask=n_mask[:, None] & (kb < K // 32)[None, :],
                other=0.0, eviction_policy="evict_first").to(tl.float32)
    return q, s


@triton.jit
def _q8_0_i8_step(acc, q, s, hi_ptr, lo_ptr, xs_ptr, group, k0, K, stride_xm, M: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, M_PAD] plus the K step at k0 of every activation row (weights q, s from _q8_0_words)."""
    KB: tl.constexpr = BLOCK_K // 32
    offs_b = tl.arange(0, KB)
    wi = k0 // 4 + offs_b[:, None] * 8 + tl.arange(0, 8)[None, :]
    k_mask = wi < K // 4
    kb = k0 // 32 + offs_b
    kb_mask = kb < K // 32
    cols = tl.arange(0, acc.shape[1])
    zero = tl.zeros(q.shape, dtype=tl.int32)
    for m in tl.static_range(M):
        xw = m * stride_xm + group * (K // 4) + wi
        hi = tl.broadcast_to(tl.load(hi_ptr + xw, mask=k_mask, other=0)[None, :, :], q.shape)
        lo = tl.broadcast_to(tl.load(lo_ptr + xw, mask=k_mask, other=0)[None, :, :], q.shape)
        xs = tl.load(xs_ptr + m * (stride_xm // 8) + group * (K // 32) + kb, mask=kb_mask, other=0.0)
        isum = tl.sum(_dp4a(q, hi, zero), axis=2) * 256 + tl.sum(_dp4a(q, lo, zero), axis=2)  # [BN, KB]
        part = tl.sum(isum.to(tl.float32) * s * xs[None, :], axis=1)
        acc += tl.where(cols[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def _q8_0_matvec_tma_kernel(
    hi_ptr, lo_ptr, xs_ptr, w_desc, d_desc, y_ptr,
    N, K, rows_per_group, stride_xm, stride_ym,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """_q8_0_matvec_i8_kernel with the weight words [N, K/4] and the fp16 scales [N, K/32] behind tensor
    descriptors (w_desc, d_desc: blocks [BLOCK_N, BLOCK_K/4] and [BLOCK_N, BLOCK_K/32]). A program walks its
    (row block, K step) pairs as one flat loop that Triton pipelines STAGES deep, so the bulk copies also run
    ahead across row blocks and no registers hold loads in flight; row blocks pid, pid + grid, ... (a
    persistent grid where the launcher caps it). K is a multiple of BLOCK_K; rows past N arrive as zeros."""
    enter(PDL)
    KB: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_steps = K // BLOCK_K
    mine = (tl.cdiv(N, BLOCK_N) - pid + grid - 1) // grid
    cols = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for it in tl.range(0, mine * k_steps, num_stages=STAGES):
        rb = pid + (it // k_steps) * grid
        ks = it % k_steps
        k0 = ks * BLOCK_K
        q = w_desc.load([rb * BLOCK_N, k0 // 4]).reshape(BLOCK_N, KB, 8)
        s = d_desc.load([rb * BLOCK_N, k0 // 32]).to(tl.float32)
        acc = _q8_0_i8_step(acc, q, s, hi_ptr, lo_ptr, xs_ptr, (rb * BLOCK_N) // rows_per_group, k0, K, stride_xm,
                            M, BLOCK_K)
        if ks == k_steps - 1:
            offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + cols[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                     mask=(offs_n < N)[:, None] & (cols[None, :] < M))
            acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)


def _launch_tma(act: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: PackedQ8_0, rows_per_group: int,
                out: torch.Tensor, tiles: dispatch.MatvecTiles) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    hi = act[0]
    n, k = w.n, w.k
    if k % tiles.block_k or tiles.block_k % 256 or w.qs.data_ptr() % 16 or w.d.data_ptr() % 16:
        raise ValueError(f"{tiles} cannot read the Q8_0 weight [{n}, {k}] through tensor descriptors (K a multiple "
                         "of block_k, itself of 256, and 16-byte aligned fields)")
    grid = triton.cdiv(n, tiles.block_n)
    if tiles.per_sm:
        grid = min(grid, tiles.per_sm * dispatch.multiprocessors(hi))
    _q8_0_matvec_tma_kernel[(grid,)](
        *act, TensorDescriptor.from_tensor(w.qs.view(torch.int32), [tiles.block_n, tiles.block_k // 4]),
        TensorDescriptor.from_tensor(w.d, [tiles.block_n, tiles.block_k // 32]), out, n, k, rows_per_group,
        hi.stride(0), out.stride(0), M=hi.shape[0], M_PAD=triton.next_power_of_2(hi.shape[0]),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, STAGES=tiles.num_stages, num_warps=tiles.num_warps, **pdl(hi),
    )


def q8_0_matvec_q16(
    act: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w: PackedQ8_0,
    groups: int = 1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    tiles: dispatch.MatvecTiles | None = None,
) -> torch.Tensor:
    """Integer-dot y = x @ W^T from an activation already quantised by act_quant.quantize_act16 (so the
    producer of x can emit it fused); act = (hi, lo, scale) for x [M, groups*K]. Returns [M, N]. Tiles with
    `tma` read the weights through tensor descriptors (`_q8_0_matvec_tma_kernel`, sm_90+)."""
    hi, lo, xs = act
    m = hi.shape[0]
    n, k = w.n, w.k
    if not 1 <= m <= 8 or hi.shape[1] * 4 != groups * k or n % groups:
        raise ValueError(f"activation [{m}, {hi.shape[1] * 4}] does not match weight [{n}, {k}] in {groups} groups")
    rows_per_group = n // groups
    tiles = tiles or dispatch.matvec_tiles("q8_0", n, k, m, dispatch.launch_backend(hi), rows_per_group)
    if groups > 1 and rows_per_group % tiles.block_n:
        raise ValueError(f"block_n {tiles.block_n} must divide the {rows_per_group} rows of a group")
    if out is None:
        out = torch.empty((m, n), device=hi.device, dtype=out_dtype)
    if tiles.tma:
        _launch_tma(act, w, rows_per_group, out, tiles)
        return out
    _q8_0_matvec_i8_kernel[(triton.cdiv(n, tiles.block_n),)](
        hi, lo, xs, w.qs.view(torch.int32), w.d, out, n, k, rows_per_group, hi.stride(0), out.stride(0),
        M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(hi),
    )
    return out


def q8_0_matvec_q16_ref(act: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: PackedQ8_0,
                        groups: int = 1) -> torch.Tensor:
    """Torch reference of q8_0_matvec_q16 (fp32 math on the dequantised 16-bit activation)."""
    return q8_0_matvec_ref(dequantize_act16(*act), w, groups=groups, out_dtype=torch.float32)


def q8_0_matmul_ref(x: torch.Tensor, w: PackedQ8_0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of `q8_0_matmul`: fp16-rounded operands as the kernel's dot sees them, fp32 sums."""
    wf = dequantize_q8_0(w).half().float()
    return (x.half().float() @ wf.T).to(out_dtype or x.dtype)


@triton.jit
def _q8_0_matmul_kernel(
    x_ptr, qs_ptr, d_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, rows_per_group,
    stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    W_AS_A: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr = False,
):
    # Grouped projection (rows_per_group < N): output rows [g * rows_per_group, (g + 1) * rows_per_group) read
    # x[:, g * K:(g + 1) * K]; a program's BLOCK_N rows lie in one group (the launcher checks BLOCK_N divides
    # rows_per_group).
    # Split-K (kernels/splitk.py): program axis 1 is the K slice; with one slice this is the plain matmul.
    enter(PDL)
    k_lo, k_hi = split_k_range(K, BLOCK_K)
    # Grouped program order: GROUP_M row-blocks share each weight column-block while it is in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 32)
    offs_w = tl.arange(0, BLOCK_K // 4)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_w = offs_n.to(tl.int64)
    rows_x = offs_m.to(tl.int64)
    x_ptr += ((pid_n * BLOCK_N) // rows_per_group).to(tl.int64) * K  # this program's group of x's columns
    if W_AS_A:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        kb_mask = (k0 // 32 + offs_kb) < K // 32
        # one scale per (row, 32 weights), broadcast over the 32 in registers rather than loaded per weight
        s = tl.load(d_ptr + rows_w[:, None] * (K // 32) + (k0 // 32 + offs_kb)[None, :],
                    mask=n_mask[:, None] & kb_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K/32]
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
        wq = tl.load(qs_ptr + rows_w[:, None] * (K // 4) + (k0 // 4 + offs_w)[None, :],
                     mask=n_mask[:, None] & ((k0 // 4 + offs_w) < K // 4)[None, :], other=0)
        w = tl.reshape(_s8x4_f16(wq), (BLOCK_N, BLOCK_K)) * s  # [BLOCK_N, BLOCK_K] fp16
        if W_AS_A:
            # Y^T = W X^T: the dequantised tile is the register operand A (Hopper's wgmma reads A from
            # registers, B from shared memory), so it never round-trips through shared memory.
            xt = tl.load(x_ptr + rows_x[None, :] * stride_xm + kk[:, None], mask=k_mask[:, None] & m_mask[None, :],
                         other=0.0).to(tl.float16)  # [BLOCK_K, BLOCK_M]
            acc = tl.dot(w, xt, acc)
        else:
            xt = tl.load(x_ptr + rows_x[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                         other=0.0).to(tl.float16)  # [BLOCK_M, BLOCK_K]
            acc = tl.dot(xt, tl.trans(w), acc)
    if W_AS_A:
        y_off = rows_x[None, :] * stride_ym + offs_n[:, None]
        p_off = rows_x[None, :] * N + offs_n[:, None]
        y_mask = n_mask[:, None] & m_mask[None, :]
    else:
        y_off = rows_x[:, None] * stride_ym + offs_n[None, :]
        p_off = rows_x[:, None] * N + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
    store_split_k(acc, y_ptr, part_ptr, cnt_ptr, y_off, p_off, y_mask, M, N, SPLIT_K)


def q8_0_matmul(
    x: torch.Tensor,
    w: PackedQ8_0,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    tiles: dispatch.MatmulTiles | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """Triton Y = X @ W^T for prefill: x [M, groups * K] -> [M, N]; fp16 tensor-core dots, fp32 accumulation.
    With groups = G > 1 (one launch), output rows [g*N/G, (g+1)*N/G) read x[:, g*K:(g+1)*K].

    With tiles.split_k = S > 1 the K loop runs in S slices (multiples of block_k) on separate programs, which
    write fp32 partials [S, M, N]; the last slice of each output tile to finish sums them in slice order and
    writes Y, in the same launch (no atomics on Y: bit-stable from run to run; kernels/splitk.py)."""
    if x.dim() != 2 or x.shape[1] != groups * w.k or w.n % groups:
        raise ValueError(f"x {tuple(x.shape)} does not match weight [{w.n}, {w.k}] in {groups} group(s)")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k, n = x.shape[0], w.k, w.n
    rows = n // groups
    if tiles is None:
        tiles = dispatch.matmul_tiles("q8_0", m, n, k, dispatch.launch_backend(x), rows if groups > 1 else None)
        if rows % tiles.block_n and groups > 1:  # no tile fits a group: one launch per group
            y = torch.cat([q8_0_matmul(x[:, g * k:(g + 1) * k], PackedQ8_0(w.qs[g * rows:(g + 1) * rows],
                                                                          w.d[g * rows:(g + 1) * rows]),
                                       out_dtype=out_dtype) for g in range(groups)], dim=1)
            return y if out is None else out.copy_(y)
    if groups > 1 and rows % tiles.block_n:
        raise ValueError(f"block_n {tiles.block_n} must divide the {rows} rows of a group")
    split = max(1, min(tiles.split_k, triton.cdiv(k, tiles.block_k)))  # at least one K step per slice
    y = out if out is not None else torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
    n_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    part, counters = split_buffers(y, split, n_tiles)
    _q8_0_matmul_kernel[(n_tiles, split)](
        x, w.qs.view(torch.int32), w.d, y, part, counters, m, n, k, n // groups, x.stride(0), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        W_AS_A=tiles.w_as_a, SPLIT_K=split > 1, num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl(x),
    )
    return y
