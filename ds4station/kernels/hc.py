"""Fused hyper-connection (mHC) kernels: hc_pre, hc_post and the output head's pre, with torch references.

Owns the Triton versions of engine/model.py's `HyperConnection.pre` / `.post` and the first half of
`DS4Model.head` (DS4-MODEL.md "Forward pass" items 1, 2, 5). In torch each hc_pre is ~60 tiny launches
(matvec, rsqrt, sigmoids, a 20-round Sinkhorn on a 4x4 matrix, the weighted stream sum); here it is two:

- `hc_pre_triton(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm) -> (xn [T, dim], quantised forms,
  post [T, C], comb [T, C, C])`, hc_pre and the RMSNorm that always follows it (DS4's attn_norm / ffn_norm):
  launch 1 (`_hc_mix_partial_kernel`, grid (T, nblk)): split-K partial matvec fn @ flatten(X[t]) over one K
  chunk plus that chunk's sum of squares -> partials [T, nblk, M + 1] (slot M holds the sum of squares);
  launch 2 (`_hc_finalize_kernel`, grid (T, 2)): both programs reduce the partials and scale by
  rsqrt(mean + rms_eps); one takes the pre sigmoids, x = sum_j pre[j] * X[j] over the whole row, its RMSNorm
  and the quantised forms the norm's integer-dot consumers read; the other the post sigmoids and the Sinkhorn
  on the C x C comb logits in registers. In a static step hc_post computes launch 1 (`mix=`).
- `hc_post_triton(out, X, post, comb) -> X'`: X'[k] = post[k] * out + sum_j comb[j, k] * X[j], one launch
  (`_hc_post_kernel`, grid (T, dim blocks)); may write in place over X (`out_X=X`): each program reads all C
  streams of its dim block before it writes them.
- `hc_head_pre_triton(X, fn, scale, base, rms_eps, hc_eps, norm) -> (RMSNorm(h) [T, dim], quantised forms)`:
  the output head's weighted stream sum (sigmoid weights, no Sinkhorn) and output_norm, the same two launches.

Every buffer has a shape fixed by the input shapes (no host sync, no data-dependent allocation), so the
launchers can be captured in a CUDA graph. Math is fp32 throughout (fn may be fp16/bf16 in memory; it is
widened on load). `hc_pre` / `hc_post` / `hc_head_pre` pick Triton for GPU tensors and the torch reference
for CPU tensors, like kernels/norm.py; the `*_triton` launchers also take CPU tensors under TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import quant_buffers, quant_flags, quant_tile
from ds4station.kernels.norm import rms_norm_ref
from ds4station.kernels.pdl import enter, pdl

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Torch references (kernels/reference.py's functions on fp32 copies of the inputs).


def hc_pre_ref(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
               sinkhorn_iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """HyperConnection.pre of kernels/reference.py on fp32 copies of the inputs."""
    from ds4station.kernels.reference import hc_mix, sinkhorn

    C = X.shape[1]
    Xf = X.float()
    mix = hc_mix(Xf, fn.float(), rms_eps)
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(mix[:, :C] * scale[0] + base[:C]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, C:2 * C] * scale[1] + base[C:2 * C])
    comb = (mix[:, 2 * C:] * scale[2] + base[2 * C:]).unflatten(-1, (C, C))
    comb = sinkhorn(comb, sinkhorn_iters, hc_eps)
    return (pre.unsqueeze(-1) * Xf).sum(1), post, comb


def hc_post_ref(out: Tensor, X: Tensor, post: Tensor, comb: Tensor, extra: Tensor | None = None,
                last: Tensor | None = None) -> Tensor:
    """HyperConnection.post of kernels/reference.py (of out + extra, when given; with `last`, rows after it read
    row last's out and extra, as hc_post_triton's do)."""
    from ds4station.kernels.reference import HyperConnection

    out = out.float() if extra is None else out.float() + extra.float()
    if last is not None:
        out = out[torch.arange(out.shape[0], device=out.device).clamp(max=last.view(()))]
    return HyperConnection.post(out, X.float(), post.float(), comb.float())


def hc_head_pre_ref(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float) -> Tensor:
    """DS4Model.head up to (not including) the output RMSNorm."""
    from ds4station.kernels.reference import hc_mix

    Xf = X.float()
    mix = hc_mix(Xf, fn.float(), rms_eps)
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * Xf).sum(1)


# ---------------------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _hc_mix_partial_kernel(x_ptr, fn_ptr, part_ptr, K, M, CHUNK, stride_xt, stride_fn,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """part[t, b, :M] = fn[:, chunk b] @ Xf[t, chunk b]; part[t, b, M] = sum(Xf[t, chunk b]^2)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    nblk = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_K], dtype=tl.float32)
    k0 = b * CHUNK
    for s in range(0, CHUNK, BLOCK_K):
        k = k0 + s + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + offs_m[:, None] * stride_fn + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        ssq += x * x
    # The sum of squares rides in slot M of the same row, so one store writes the whole partial.
    vals = tl.where(offs_m == M, tl.sum(ssq, axis=0), acc)
    tl.store(part_ptr + (t * nblk + b) * (M + 1) + offs_m, vals, mask=offs_m <= M)


@triton.jit
def _hc_finalize_kernel(part_ptr, x_ptr, scale_ptr, base_ptr, w_ptr, y_ptr, post_ptr, comb_ptr,
                        a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr,
                        NBLK, K, DIM, stride_xt, stride_xc, stride_yt, rms_eps, hc_eps, iters,
                        C: tl.constexpr, CP: tl.constexpr, NBLK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                        HEAD: tl.constexpr, QUANT: tl.constexpr = 0, LAYOUT: tl.constexpr = 0,
                        QUANT_B: tl.constexpr = 0, LAYOUT_B: tl.constexpr = 0, PDL: tl.constexpr = False):
    """hc_pre's second half and the RMSNorm after it, grid (T, 2) (HEAD: (T, 1)), BLOCK_D >= DIM. Both programs
    of a token reduce the partials they need: mix = sum of partials * rsqrt(mean(Xf^2) + rms_eps). Program 0:
    pre, the whole row y = pre . X, and y / rms(y) * w stored (norm._rms_norm_kernel's math, eps rms_eps), with
    QUANT / QUANT_B also quantised into a0-a2 / b0-b2 (act_quant.quant_tile). Program 1, beside it: post and the
    Sinkhorn of comb (so the Sinkhorn does not delay the row).
    HEAD: the output head's variant (M = C, pre only, one scale, no post / comb)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    if HEAD:
        M = C
    else:
        M = (2 + C) * C
    offs_b = tl.arange(0, NBLK_P)
    offs_c = tl.arange(0, CP)
    b_ok = offs_b < NBLK
    c_ok = offs_c < C
    rows = part_ptr + (t * NBLK + offs_b) * (M + 1)  # [NBLK_P] partial rows of this token

    ssq = tl.sum(tl.load(rows + M, mask=b_ok, other=0.0), axis=0)
    r = 1.0 / tl.sqrt(ssq / K + rms_eps)

    # Each group of mix entries is reduced straight from the partials in the shape it is used in ([C] or
    # [C, C]), which avoids moving values between register layouts.
    mix_pre = tl.sum(tl.load(rows[:, None] + offs_c[None, :], mask=b_ok[:, None] & c_ok[None, :], other=0.0),
                     axis=0) * r
    pre = tl.sigmoid(mix_pre * tl.load(scale_ptr) + tl.load(base_ptr + offs_c, mask=c_ok, other=0.0)) + hc_eps
    pre = tl.where(c_ok, pre, 0.0)

    if not HEAD and tl.program_id(1) == 1:
        mix_post = tl.sum(tl.load(rows[:, None] + C + offs_c[None, :], mask=b_ok[:, None] & c_ok[None, :],
                                  other=0.0), axis=0) * r
        post = 2.0 * tl.sigmoid(mix_post * tl.load(scale_ptr + 1)
                                + tl.load(base_ptr + C + offs_c, mask=c_ok, other=0.0))
        tl.store(post_ptr + t * C + offs_c, post, mask=c_ok)

        # comb logits [C(j), C(k)] at mix[2C + j*C + k].
        jk = offs_c[:, None] * C + offs_c[None, :]
        ok = c_ok[:, None] & c_ok[None, :]
        p3 = rows[:, None, None] + 2 * C + jk[None, :, :]
        mix_comb = tl.sum(tl.load(p3, mask=b_ok[:, None, None] & ok[None, :, :], other=0.0), axis=0) * r
        z = mix_comb * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * C + jk, mask=ok, other=0.0)
        # Sinkhorn exactly as model.sinkhorn: row softmax + eps, column-normalise, then iters-1 rounds of
        # (row, column) normalisation with + eps on each denominator. Padding (CP > C) is kept at zero.
        z = tl.where(ok, z, -1e30)  # finite, so padded rows give exp(0) (masked below), never inf - inf
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        e = tl.where(ok, e, 0.0)
        den = tl.sum(e, axis=1)
        den = tl.where(c_ok, den, 1.0)
        cm = tl.where(ok, e / den[:, None] + hc_eps, 0.0)
        cm = cm / (tl.sum(cm, axis=0)[None, :] + hc_eps)
        for _ in range(1, iters):
            cm = cm / (tl.sum(cm, axis=1)[:, None] + hc_eps)
            cm = cm / (tl.sum(cm, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * C * C + jk, cm, mask=ok)

    if tl.program_id(1) == 0:  # y = sum_j pre[j] * X[j] (zero past DIM), then the norm
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DIM
        xt = tl.load(x_ptr + t * stride_xt + offs_c[:, None] * stride_xc + d[None, :],
                     mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * xt, axis=0)
        y = y * (1.0 / tl.sqrt(tl.sum(y * y, axis=0) / DIM + rms_eps))
        y = y * tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + d, y, mask=d_ok)
        if QUANT:
            quant_tile(tl.reshape(y, (BLOCK_D // 32, 32)), t, 0, DIM // 32, a0_ptr, a1_ptr, a2_ptr, QUANT, LAYOUT)
        if QUANT_B:
            quant_tile(tl.reshape(y, (BLOCK_D // 32, 32)), t, 0, DIM // 32, b0_ptr, b1_ptr, b2_ptr, QUANT_B, LAYOUT_B)


@triton.jit
def _hc_post_kernel(o_ptr, e_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, part_ptr, last_ptr, DIM, M, stride_ot,
                    stride_et, stride_xt, stride_xc, stride_yt, stride_yc, stride_fn, C: tl.constexpr,
                    CP: tl.constexpr, BLOCK_D: tl.constexpr, EXTRA: tl.constexpr, MIX: tl.constexpr = False,
                    BLOCK_M: tl.constexpr = 1, LAST: tl.constexpr = False, PDL: tl.constexpr = False):
    """Y[t, k, d-block] = post[t, k] * out[t, d-block] + sum_j comb[t, j, k] * X[t, j, d-block], with EXTRA
    out + extra[t, d-block] in place of out (a sublayer's two parts summed here, not in a launch of their own).
    MIX: also the next hc_pre's mix partials of Y (what `_hc_mix_partial_kernel` computes, with K chunks of
    BLOCK_D): part[t, k * nd + d-block, :M] = fn[:, k * DIM + d-block] @ Y[t, k, d-block] and slot M the
    chunk's sum of squares, nd = cdiv(DIM, BLOCK_D).
    LAST: a padded static step (its rows after *last_ptr copies of row last): those rows read row last's out and
    extra, so they stay copies where the MoE kernels skipped them (their rows of out are zero)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    src = t
    if LAST:
        src = tl.minimum(t, tl.load(last_ptr))
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < DIM
    offs_c = tl.arange(0, CP)
    c_ok = offs_c < C
    o = tl.load(o_ptr + src * stride_ot + d, mask=d_ok, other=0.0).to(tl.float32)
    if EXTRA:
        o += tl.load(e_ptr + src * stride_et + d, mask=d_ok, other=0.0).to(tl.float32)
    xt = tl.load(x_ptr + t * stride_xt + offs_c[:, None] * stride_xc + d[None, :],
                 mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [CP(j), BLOCK_D]
    post = tl.load(post_ptr + t * C + offs_c, mask=c_ok, other=0.0)
    comb = tl.load(comb_ptr + t * C * C + offs_c[:, None] * C + offs_c[None, :],
                   mask=c_ok[:, None] & c_ok[None, :], other=0.0)  # [CP(j), CP(k)]
    mixed = tl.sum(comb[:, :, None] * xt[:, None, :], axis=0)  # [CP(k), BLOCK_D]
    y = post[:, None] * o[None, :] + mixed
    tl.store(y_ptr + t * stride_yt + offs_c[:, None] * stride_yc + d[None, :], y,
             mask=c_ok[:, None] & d_ok[None, :])
    if MIX:
        offs_m = tl.arange(0, BLOCK_M)
        nd = tl.num_programs(1)
        for k in tl.static_range(C):
            yk = tl.sum(tl.where(offs_c[:, None] == k, y, 0.0), axis=0)  # [BLOCK_D] (zero past DIM)
            w = tl.load(fn_ptr + offs_m[:, None] * stride_fn + k * DIM + d[None, :],
                        mask=(offs_m < M)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            vals = tl.where(offs_m == M, tl.sum(yk * yk, axis=0), tl.sum(w * yk[None, :], axis=1))
            tl.store(part_ptr + ((t * C + k) * nd + tl.program_id(1)) * (M + 1) + offs_m, vals, mask=offs_m <= M)


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def _check_device(t: Tensor) -> None:
    if not t.is_cuda and not dispatch.interpreting():
        raise ValueError("the hc Triton launchers need GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")


def _streams(X: Tensor) -> Tensor:
    """X [T, C, dim] with each token's C x dim block contiguous (flatten(X[t]) is then plain pointer math)."""
    if X.dim() != 3:
        raise ValueError(f"X must be [T, C, dim], got {tuple(X.shape)}")
    if X.stride(2) != 1 or X.stride(1) != X.shape[2]:
        X = X.contiguous()
    return X


def _mix_partials(X: Tensor, fn: Tensor, m: int, tiles: dispatch.HcTiles) -> Tensor:
    """Launch 1: partials [T, nblk, m + 1] of fn @ flatten(X[t]) and sum(flatten(X[t])^2)."""
    T, C, dim = X.shape
    k = C * dim
    if fn.shape != (m, k):
        raise ValueError(f"fn must be [{m}, {k}], got {tuple(fn.shape)}")
    if fn.stride(1) != 1:
        fn = fn.contiguous()
    if tiles.chunk_k % tiles.block_k:
        raise ValueError(f"chunk_k {tiles.chunk_k} must be a multiple of block_k {tiles.block_k}")
    nblk = triton.cdiv(k, tiles.chunk_k)
    part = torch.empty(T, nblk, m + 1, device=X.device, dtype=torch.float32)
    if T:
        _hc_mix_partial_kernel[(T, nblk)](
            X, fn, part, k, m, tiles.chunk_k, X.stride(0), fn.stride(0),
            BLOCK_M=triton.next_power_of_2(m + 1), BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, **pdl(X))
    return part


def hc_pre_triton(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                  sinkhorn_iters: int, norm: Tensor, *, quant: tuple[str, ...] = (),
                  tiles: dispatch.HcTiles | None = None,
                  part: Tensor | None = None) -> tuple[Tensor, list, Tensor, Tensor]:
    """HyperConnection.pre and the RMSNorm after it (weight `norm` [dim], eps rms_eps) in two launches. X [T, C,
    dim], fn [(2+C)*C, C*dim], scale [3], base [(2+C)*C] -> (xn [T, dim], per entry of `quant`
    (act_quant.QUANTS, at most two) xn's rows quantised so, post [T, C], comb [T, C, C]), fp32. `tiles`
    overrides hc_tiles (tests). `part`: the mix partials of X with fn, as the hc_post that made X computed them
    (hc_post_triton(mix=fn)): one launch."""
    _check_device(X)
    if sinkhorn_iters < 1:
        raise ValueError("sinkhorn_iters must be >= 1")
    X = _streams(X)
    T, C, dim = X.shape
    m = (2 + C) * C
    if scale.numel() < 3 or base.numel() != m:
        raise ValueError(f"scale must have 3 entries and base {m}, got {scale.numel()} and {base.numel()}")
    tiles = tiles or dispatch.hc_tiles(C * dim, m, dim, T, dispatch.launch_backend(X))
    if part is None:
        part = _mix_partials(X, fn, m, tiles)
    elif part.dim() != 3 or part.shape[0] != T or part.shape[2] != m + 1:
        raise ValueError(f"part must be the [T={T}, blocks, {m + 1}] mix partials, got {tuple(part.shape)}")
    post = torch.empty(T, C, device=X.device, dtype=torch.float32)
    comb = torch.empty(T, C, C, device=X.device, dtype=torch.float32)
    xn, acts = _finalize(part, X, scale, base, norm, post, comb, rms_eps, hc_eps, sinkhorn_iters, tiles, quant)
    return xn, acts, post, comb


def hc_head_pre_triton(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                       norm: Tensor, *, quant: tuple[str, ...] = (),
                       tiles: dispatch.HcTiles | None = None) -> tuple[Tensor, list]:
    """The output head's pre and output_norm (weight `norm`) in two launches: X [T, C, dim], fn [C, C*dim],
    scale [1], base [C] -> (RMSNorm(h) [T, dim], its quantised forms as hc_pre_triton's), where
    h = sum_j (sigmoid(mix[j] * scale + base[j]) + hc_eps) * X[j]."""
    _check_device(X)
    X = _streams(X)
    T, C, dim = X.shape
    if scale.numel() < 1 or base.numel() != C:
        raise ValueError(f"scale must have 1 entry and base {C}, got {scale.numel()} and {base.numel()}")
    tiles = tiles or dispatch.hc_tiles(C * dim, C, dim, T, dispatch.launch_backend(X))
    part = _mix_partials(X, fn, C, tiles)
    return _finalize(part, X, scale, base, norm, None, None, rms_eps, hc_eps, 1, tiles, quant)


def _finalize(part: Tensor, X: Tensor, scale: Tensor, base: Tensor, norm: Tensor, post: Tensor | None,
              comb: Tensor | None, rms_eps: float, hc_eps: float, iters: int, tiles: dispatch.HcTiles,
              quant: tuple[str, ...]) -> tuple[Tensor, list]:
    """Launch 2 (`_hc_finalize_kernel`; the head's form when post is None) -> (xn [T, dim] fp32, the quantised
    forms of it `quant` names, in order)."""
    T, C, dim = X.shape
    if len(quant) > 2:
        raise ValueError(f"hc_pre emits at most two quantised forms, got {quant}")
    if norm.shape != (dim,):
        raise ValueError(f"norm must be a [{dim}] weight, got {tuple(norm.shape)}")
    y = torch.empty(T, dim, device=X.device, dtype=torch.float32)
    acts = [quant_buffers(T, dim, q, X.device) for q in quant]
    a, b = (*acts, (y,) * 3, (y,) * 3)[:2]
    flags_b = quant_flags(quant[1] if len(quant) > 1 else None)
    head = post is None
    if T:
        nblk = part.shape[1]
        # post / comb pointers are unused under HEAD; y stands in for them.
        _hc_finalize_kernel[(T, 1 if head else 2)](
            part, X, scale.float().contiguous(), base.float().contiguous(), norm, y, y if head else post,
            y if head else comb, *a, *b, nblk, C * dim, dim, X.stride(0), X.stride(1), y.stride(0), float(rms_eps),
            float(hc_eps), int(iters), C=C, CP=triton.next_power_of_2(C), NBLK_P=triton.next_power_of_2(nblk),
            BLOCK_D=triton.next_power_of_2(dim), HEAD=head, **quant_flags(quant[0] if quant else None),
            QUANT_B=flags_b["QUANT"], LAYOUT_B=flags_b["LAYOUT"], num_warps=tiles.num_warps_n, **pdl(part))
    return y, acts


def hc_post_triton(out: Tensor, X: Tensor, post: Tensor, comb: Tensor, extra: Tensor | None = None, *,
                   out_X: Tensor | None = None, tiles: dispatch.HcTiles | None = None,
                   mix: Tensor | None = None, last: Tensor | None = None):  # noqa: ANN201
    """HyperConnection.post in one launch: out [T, dim] (plus `extra` [T, dim] when given), X [T, C, dim],
    post [T, C], comb [T, C, C] -> X' [T, C, dim] fp32. `out_X` is the destination (may be X itself: every
    program reads its whole [C, dim-block] of X before writing the same block). `mix` (the next hc_pre's fn
    [M, C * dim]): -> (X', X''s mix partials for hc_pre_triton(part=...)), in the same launch. `last` ([1] on
    the device: a padded static step's last real row): the rows after it take row last's out and extra."""
    _check_device(X)
    if X.dim() != 3:
        raise ValueError(f"X must be [T, C, dim], got {tuple(X.shape)}")
    T, C, dim = X.shape
    if out.shape != (T, dim) or post.shape != (T, C) or comb.shape != (T, C, C):
        raise ValueError(f"shapes do not match X [T={T}, C={C}, dim={dim}]: out {tuple(out.shape)}, "
                         f"post {tuple(post.shape)}, comb {tuple(comb.shape)}")
    if X.stride(2) != 1:
        X = X.contiguous()
    if out.stride(1) != 1:
        out = out.contiguous()
    if extra is not None:
        if extra.shape != out.shape:
            raise ValueError(f"extra {tuple(extra.shape)} must have out's shape {tuple(out.shape)}")
        if extra.stride(1) != 1:
            extra = extra.contiguous()
    post = post.float().contiguous()
    comb = comb.float().contiguous()
    y = torch.empty(T, C, dim, device=X.device, dtype=torch.float32) if out_X is None else out_X
    if y.shape != (T, C, dim) or y.dtype != torch.float32 or y.stride(2) != 1:
        raise ValueError("out_X must be an fp32 [T, C, dim] tensor with unit stride on dim")
    tiles = tiles or dispatch.hc_tiles(C * dim, (2 + C) * C, dim, T, dispatch.launch_backend(X))
    block_d, num_warps, part, m = tiles.block_d, tiles.num_warps_d, y, 0
    if mix is not None:
        m = mix.shape[0]
        if mix.shape != (m, C * dim) or mix.stride(1) != 1:
            raise ValueError(f"mix must be a unit-stride fn [M, {C * dim}], got {tuple(mix.shape)}")
        block_d, num_warps = tiles.block_dm, tiles.num_warps_m
        part = torch.empty(T, C * triton.cdiv(dim, block_d), m + 1, device=X.device, dtype=torch.float32)
    if T:
        _hc_post_kernel[(T, triton.cdiv(dim, block_d))](
            out, out if extra is None else extra, X, post, comb, y, y if mix is None else mix, part,
            y if last is None else last, dim, m, out.stride(0), 0 if extra is None else extra.stride(0), X.stride(0),
            X.stride(1), y.stride(0), y.stride(1), 0 if mix is None else mix.stride(0), C=C,
            CP=triton.next_power_of_2(C), BLOCK_D=block_d, EXTRA=extra is not None, MIX=mix is not None,
            BLOCK_M=triton.next_power_of_2(m + 1), LAST=last is not None, num_warps=num_warps, **pdl(out))
    return y if mix is None else (y, part)


# ---------------------------------------------------------------------------------------------------------
# Public ops: Triton on GPU tensors, the torch reference on CPU tensors.


def hc_pre(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
           sinkhorn_iters: int, norm: Tensor, quant: tuple[str | None, ...] = (),
           part: Tensor | None = None) -> tuple[Tensor, list, Tensor, Tensor]:
    """HyperConnection.pre and the RMSNorm after it (weight `norm`, eps rms_eps): X [T, C, dim] -> (xn [T, dim],
    per entry of `quant` xn's rows quantised in that form (act_quant.QUANTS; GPU only) or None where the entry is
    None, post [T, C], comb [T, C, C]); `part`: X's mix partials from the hc_post that made it (GPU), or None."""
    wanted = tuple(q for q in quant if q)
    if dispatch.use_triton(X):
        xn, acts, post, comb = hc_pre_triton(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm, quant=wanted,
                                             part=part)
    else:
        if wanted:
            raise ValueError("quantised rows are for the integer-dot kernels, which run on a GPU")
        x, post, comb = hc_pre_ref(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
        xn, acts = rms_norm_ref(x, norm, rms_eps), []
    it = iter(acts)
    return xn, [next(it) if q else None for q in quant], post, comb


def hc_post(out: Tensor, X: Tensor, post: Tensor, comb: Tensor, extra: Tensor | None = None,
            mix: Tensor | None = None, last: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """HyperConnection.post of out (+ extra: e.g. the routed and the shared experts' outputs) -> (X' [T, C, dim],
    with `mix` (the next hc_pre's fn) on a GPU X''s mix partials for it (hc_pre(part=...)), else None). `last`:
    a padded static step's last real row ([1] on the device); the padding rows take its out and extra."""
    if dispatch.use_triton(X):
        if mix is not None:
            return hc_post_triton(out, X, post, comb, extra, mix=mix, last=last)
        return hc_post_triton(out, X, post, comb, extra, last=last), None
    return hc_post_ref(out, X, post, comb, extra, last), None


def hc_head_pre(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float, norm: Tensor,
                quant: str | None = None) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """The output head's stream sum and output_norm (weight `norm`): X [T, C, dim] -> (RMSNorm(h) [T, dim], with
    `quant` (GPU only) its rows quantised so, else None)."""
    if dispatch.use_triton(X):
        xn, acts = hc_head_pre_triton(X, fn, scale, base, rms_eps, hc_eps, norm, quant=(quant,) if quant else ())
        return xn, acts[0] if quant else None
    if quant:
        raise ValueError("quantised rows are for the integer-dot kernels, which run on a GPU")
    return rms_norm_ref(hc_head_pre_ref(X, fn, scale, base, rms_eps, hc_eps), norm, rms_eps), None
