"""The MoE router in one launch: sqrt-softplus scores, biased top-k or hash lookup, weight normalisation.

Owns the Triton version of engine/model.py's `MoE.route` (and GpuStage._moe's routing lines), applied to
the gate matvec's logits (the matvec itself is a Q8_0 / F16 linear and stays in the linear kernels):

- `router_triton(logits, bias, tid2eid, tokens, k, norm, scale) -> (ids [T, k] int64, weights [T, k] fp32)`
  one launch (`_router_kernel`, grid (T,)), one program per token with the whole row of E logits in
  registers (E = 256 for DS4): p = sqrt(softplus(logits)); on hash layers ids = tid2eid[tokens], else the
  top-k of p + bias (the bias steers selection only) in descending score order, ties to the LOWER expert
  index (k rounds of max + lowest-index argmax); weights = p[ids], divided by their sum when `norm`, times
  `scale`.

Outputs have shapes fixed by the inputs and nothing is read back to the host, so the launcher can be captured
in a CUDA graph. `router` picks Triton for GPU tensors and the torch reference for CPU tensors, like
kernels/norm.py; `router_triton` also takes CPU tensors under TRITON_INTERPRET.

Tile choice: `router_tiles` (to move into dispatch.py with the other tables).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.pdl import enter, pdl

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Tiles (belongs in dispatch.py).


# ---------------------------------------------------------------------------------------------------------
# Torch reference.


def router_ref(logits: Tensor, bias: Tensor | None, tid2eid: Tensor | None, tokens: Tensor | None, k: int,
               norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """MoE.route of engine/model.py from the gate logits [T, E], with ties in the biased scores going to the
    lower expert index (a stable descending sort; torch.topk leaves tie order unspecified)."""
    p = torch.sqrt(F.softplus(logits.float()))  # [T, E]
    if tid2eid is not None:
        if tokens is None:
            raise ValueError("hash routing needs the token ids")
        ids = tid2eid[tokens].long()
    else:
        s = p if bias is None else p + bias.float()
        ids = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    wts = p.gather(1, ids)
    if norm:
        wts = wts / wts.sum(-1, keepdim=True)
    return ids, wts * scale


# ---------------------------------------------------------------------------------------------------------
# Kernel.


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, tid2eid_ptr, tokens_ptr, ids_ptr, wts_ptr, E, stride_lt, stride_tid,
                   scale, K: tl.constexpr, K_P: tl.constexpr, BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HASH: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    e_ok = offs < E
    x = tl.load(logits_ptr + t * stride_lt + offs, mask=e_ok, other=0.0).to(tl.float32)
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)). log1p via log(u) * v / (u - 1) with u = 1 + v keeps full
    # relative precision for small v (a plain log(1 + v) loses it, and for very negative logits softplus(x)
    # ~ exp(x) is exactly that small v); u == 1 means v is below fp32 resolution and log1p(v) = v.
    v = tl.exp(-tl.abs(x))
    u = 1.0 + v
    exact = u == 1.0
    log1p_v = tl.where(exact, v, tl.log(u) * (v / tl.where(exact, 1.0, u - 1.0)))
    p = tl.sqrt(tl.maximum(x, 0.0) + log1p_v)

    offs_k = tl.arange(0, K_P)
    k_ok = offs_k < K
    if HASH:
        tok = tl.load(tokens_ptr + t).to(tl.int64)
        ids = tl.load(tid2eid_ptr + tok * stride_tid + offs_k, mask=k_ok, other=0).to(tl.int32)
    else:
        s = p
        if HAS_BIAS:
            s = s + tl.load(bias_ptr + offs, mask=e_ok, other=0.0).to(tl.float32)
        s = tl.where(e_ok, s, float("-inf"))
        ids = tl.zeros([K_P], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(s, axis=0)
            # the lowest index holding the maximum: ties go to the lower expert, as the reference's stable sort
            idx = tl.min(tl.where(s == best, offs, BLOCK_E), axis=0)
            ids = tl.where(offs_k == j, idx, ids)
            s = tl.where(offs == idx, float("-inf"), s)
    # weights = p[ids]: a [K_P, BLOCK_E] match against the row in registers (no second read of the logits).
    hit = (ids[:, None] == offs[None, :]) & k_ok[:, None]
    w = tl.sum(tl.where(hit, p[None, :], 0.0), axis=1)
    if NORM:
        w = w / tl.sum(w, axis=0)
    tl.store(ids_ptr + t * K + offs_k, ids.to(tl.int64), mask=k_ok)
    tl.store(wts_ptr + t * K + offs_k, w * scale, mask=k_ok)


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def router(logits: Tensor, bias: Tensor | None, tid2eid: Tensor | None, tokens: Tensor | None, k: int,
           norm: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Route tokens from gate logits [T, E]: Triton on a GPU tensor, the torch reference on CPU."""
    if dispatch.use_triton(logits):
        return router_triton(logits, bias, tid2eid, tokens, k, norm, scale)
    return router_ref(logits, bias, tid2eid, tokens, k, norm, scale)


def router_triton(logits: Tensor, bias: Tensor | None, tid2eid: Tensor | None, tokens: Tensor | None, k: int,
                  norm: bool, scale: float, *, out: tuple[Tensor, Tensor] | None = None,
                  tiles: dispatch.RouterTiles | None = None) -> tuple[Tensor, Tensor]:
    """The Triton launcher of `router`: logits [T, E] (any float dtype, math in fp32), bias [E] or None,
    tid2eid [vocab, k] (int32/int64) with tokens [T] on hash layers (then bias is ignored) -> ids [T, k]
    int64 and weights [T, k] fp32, written into `out` when given. One launch, grid (T,)."""
    if not logits.is_cuda and not dispatch.interpreting():
        raise ValueError("router_triton needs GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"k must be in 1..{E} (the number of experts), got {k}")
    if tid2eid is not None:
        if tokens is None or tokens.shape != (T,):
            got = None if tokens is None else tuple(tokens.shape)
            raise ValueError(f"hash routing needs tokens [T={T}], got {got}")
        if tid2eid.dim() != 2 or tid2eid.shape[1] != k:
            raise ValueError(f"tid2eid must be [vocab, k={k}], got {tuple(tid2eid.shape)}")
        if tid2eid.stride(1) != 1:
            tid2eid = tid2eid.contiguous()
    elif bias is not None and bias.shape != (E,):
        raise ValueError(f"bias must be [E={E}], got {tuple(bias.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
        wts = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    else:
        ids, wts = out
        if ids.shape != (T, k) or ids.dtype != torch.int64 or wts.shape != (T, k) or wts.dtype != torch.float32:
            raise ValueError(f"out must be (int64 [T, k], fp32 [T, k]) = [{T}, {k}]")
        if not (ids.is_contiguous() and wts.is_contiguous()):
            raise ValueError("out tensors must be contiguous")
    if T == 0:
        return ids, wts
    tiles = tiles or dispatch.router_tiles(E, dispatch.launch_backend(logits))
    hashed = tid2eid is not None
    _router_kernel[(T,)](
        logits, bias if bias is not None and not hashed else logits, tid2eid if hashed else ids,
        tokens if hashed else ids, ids, wts, E, logits.stride(0), tid2eid.stride(0) if hashed else 0, float(scale),
        K=k, K_P=triton.next_power_of_2(k), BLOCK_E=tiles.block_e, HAS_BIAS=bias is not None and not hashed,
        HASH=hashed, NORM=bool(norm), num_warps=tiles.num_warps, **pdl(logits))
    return ids, wts
