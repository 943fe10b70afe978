"""Decode attention with sinks over the raw window and the compressed rows, split-K (flash-decoding).

Owns the Triton version of engine/model.py's `sink_attention` for ONE query token as the decode step of
`Attention.__call__` / GpuStage._attend uses it: shared-KV MQA (the keys are also the values), all H heads
against the same keys, the window keys and the compressed rows as one virtual key list:

    keys = [kw[0..Nw) ; compressed rows]    compressed rows = kc[0..Nc)  or, indexed, kc[ids[0..k)]
    z[h, n] = scale * q[h] . keys[n]  (-inf where the key's mask is 0)
    out[h] = sum_n p[h, n] keys[n],   p = exp(z - m) / (sum_n exp(z - m) + exp(sink[h] - m)),
                                      m = max(max_n z, sink[h])

- `attention_decode_triton(q, kw, mask_w, kc, mask_c, sinks, scale, ids=None) -> out [H, D] fp32`, two launches:
  launch 1 (`_attn_split_kernel`, grid (S, cdiv(H, BLOCK_H))): each program takes one block of BLOCK_N keys
  and BLOCK_H heads and writes that block's max m, sum l = sum exp(z - m) and unnormalised output
  acc = sum exp(z - m) * key to partials [S, H] / [S, H, D] (S = cdiv(Nw + Nc, BLOCK_N) key blocks, so a
  long compressed list spreads over many programs); launch 2 (`_attn_combine_kernel`, grid (H, D blocks))
  rescales the partials to the global max (the sink included) and divides by the total.
  Masked keys are never loaded (indexed layers pad `ids` with arbitrary, possibly out-of-range, entries).

Math is fp32; keys may be fp32 or fp16 in memory (window and compressed independently). Every buffer has a
shape fixed by the input shapes and nothing is read back to the host, so the launcher can be captured in a
CUDA graph. `attention_decode` picks Triton for GPU tensors and the torch reference for CPU tensors, like
kernels/norm.py; `attention_decode_triton` also takes CPU tensors under TRITON_INTERPRET.

Tile choice: `attention_tiles` (to move into dispatch.py with the other tables).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Tiles (belongs in dispatch.py).


# ---------------------------------------------------------------------------------------------------------
# Torch reference.


def attention_decode_ref(q: Tensor, kw: Tensor, mask_w: Tensor, kc: Tensor | None, mask_c: Tensor | None,
                         sinks: Tensor, scale: float, ids: Tensor | None = None) -> Tensor:
    """engine/model.py's sink_attention for one query over [kw ; kc] (or [kw ; kc[ids]]) -> [H, D] fp32.
    Masked compressed entries are zeroed before the call: their ids may be out of range and their rows
    arbitrary, and sink_attention multiplies p = 0 by the key (0 * inf would be NaN)."""
    from ds4station.engine.model import sink_attention

    keys, allowed = kw.float(), mask_w.bool()
    if kc is not None:
        mc = mask_c.bool()
        if ids is not None:
            rows = kc[torch.where(mc, ids.long(), 0)].float()
        else:
            rows = kc.float()
        keys = torch.cat((keys, torch.where(mc[:, None], rows, 0.0)))
        allowed = torch.cat((allowed, mc))
    return sink_attention(q.float()[None], keys, allowed[None], sinks.float(), scale)[0]


# ---------------------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _attn_split_kernel(q_ptr, kw_ptr, mw_ptr, kc_ptr, mc_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr,
                       H, D, NW, NC, stride_q, stride_kw, stride_kc, scale,
                       INDEXED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Partials of key block `split` for heads [hb * BLOCK_H, ...): m, l [S, H] and acc [S, H, D]."""
    split = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    n = split * BLOCK_N + tl.arange(0, BLOCK_N)
    # The block's keys: window entries n < NW, compressed entries c = n - NW < NC; one load per source with
    # complementary masks (masked-off lanes issue no memory access), so a block may straddle the two.
    in_w = n < NW
    c = n - NW
    in_c = (n >= NW) & (c < NC)
    ok_w = in_w & (tl.load(mw_ptr + n, mask=in_w, other=0) != 0)
    ok_c = in_c & (tl.load(mc_ptr + c, mask=in_c, other=0) != 0)
    if INDEXED:
        row_c = tl.load(ids_ptr + c, mask=ok_c, other=0).to(tl.int64)
    else:
        row_c = c.to(tl.int64)
    base_w = kw_ptr + n.to(tl.int64) * stride_kw
    base_c = kc_ptr + row_c * stride_kc
    ok = ok_w | ok_c
    offs_d = tl.arange(0, BLOCK_D)

    # Pass 1: logits z [BLOCK_H, BLOCK_N] over D in steps.
    z = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        d_ok = d < D
        qd = tl.load(q_ptr + offs_h[:, None] * stride_q + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)
        k = tl.load(base_w[:, None] + d[None, :], mask=ok_w[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        k += tl.load(base_c[:, None] + d[None, :], mask=ok_c[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        z += tl.sum(qd[:, None, :] * k[None, :, :], axis=2)
    z = tl.where(ok[None, :], z * scale, float("-inf"))
    m = tl.max(z, axis=1)  # [BLOCK_H]; -inf when every key of the block is masked
    e = tl.exp(z - tl.where(m == float("-inf"), 0.0, m)[:, None])  # exp(-inf) = 0 on masked keys
    part = split * H + offs_h
    tl.store(m_ptr + part, m, mask=h_ok)
    tl.store(l_ptr + part, tl.sum(e, axis=1), mask=h_ok)

    # Pass 2: acc [BLOCK_H, D] = e @ keys, over D in steps (the keys come back from L1/L2).
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        d_ok = d < D
        k = tl.load(base_w[:, None] + d[None, :], mask=ok_w[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        k += tl.load(base_c[:, None] + d[None, :], mask=ok_c[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        o = tl.sum(e[:, :, None] * k[None, :, :], axis=1)
        tl.store(acc_ptr + part.to(tl.int64)[:, None] * D + d[None, :], o, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, S, H, D, stride_o,
                         BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr):
    """out[h, d-block] = sum_s exp(m_s - M) acc_s / (sum_s exp(m_s - M) l_s + exp(sink - M)),
    M = max(max_s m_s, sink): the sink is finite, so M is too even when every key is masked."""
    h = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = d < D
    offs_s = tl.arange(0, BLOCK_S)
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    big = sink
    for s0 in range(0, S, BLOCK_S):
        s = s0 + offs_s
        big = tl.maximum(big, tl.max(tl.load(m_ptr + s * H + h, mask=s < S, other=float("-inf")), axis=0))
    total = tl.exp(sink - big)
    acc = tl.zeros([BLOCK_DC], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + offs_s
        s_ok = s < S
        w = tl.exp(tl.load(m_ptr + s * H + h, mask=s_ok, other=float("-inf")) - big)  # 0 for empty blocks
        total += tl.sum(w * tl.load(l_ptr + s * H + h, mask=s_ok, other=0.0), axis=0)
        a = tl.load(acc_ptr + (s.to(tl.int64) * H + h)[:, None] * D + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    tl.store(out_ptr + h * stride_o + d, acc / total, mask=d_ok)


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def attention_decode(q: Tensor, kw: Tensor, mask_w: Tensor, kc: Tensor | None, mask_c: Tensor | None,
                     sinks: Tensor, scale: float, ids: Tensor | None = None) -> Tensor:
    """Decode sink attention of one query: Triton on a GPU tensor, the torch reference on CPU."""
    if dispatch.use_triton(q):
        return attention_decode_triton(q, kw, mask_w, kc, mask_c, sinks, scale, ids=ids)
    return attention_decode_ref(q, kw, mask_w, kc, mask_c, sinks, scale, ids=ids)


def _rows(t: Tensor, name: str, d: int) -> Tensor:
    if t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name} must be [rows, D={d}], got {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"{name} must be fp32 or fp16 (the interpreter mishandles bf16), got {t.dtype}")
    return t if t.stride(1) == 1 else t.contiguous()


def _mask(t: Tensor, n: int, name: str) -> Tensor:
    if t.shape != (n,):
        raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
    return t if t.is_contiguous() else t.contiguous()


def attention_decode_triton(q: Tensor, kw: Tensor, mask_w: Tensor, kc: Tensor | None, mask_c: Tensor | None,
                            sinks: Tensor, scale: float, ids: Tensor | None = None, *, out: Tensor | None = None,
                            tiles: dispatch.AttentionTiles | None = None) -> Tensor:
    """The Triton launcher of `attention_decode`, two launches.

    q [H, D]; window keys kw [Nw, D] with mask_w [Nw] (bool or int, nonzero = attend); compressed keys
    kc [Nc, D] with mask_c [Nc], or, with ids [k] (int32/int64), the compressed table kc [R, D] of which rows
    ids are attended under mask_c [k] (masked ids are never dereferenced); kc None = window only. sinks [H],
    scale the logit scale (D^-0.5). -> out [H, D] fp32 (written into `out` when given)."""
    if not q.is_cuda and not dispatch.interpreting():
        raise ValueError("attention_decode_triton needs GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if q.dim() != 2:
        raise ValueError(f"q must be [H, D] (one query token), got {tuple(q.shape)}")
    H, D = q.shape
    q = q if q.stride(1) == 1 else q.contiguous()
    kw = _rows(kw, "kw", D)
    nw = kw.shape[0]
    mask_w = _mask(mask_w, nw, "mask_w")
    if sinks.shape != (H,):
        raise ValueError(f"sinks must be [H={H}], got {tuple(sinks.shape)}")
    sinks = sinks.float().contiguous()
    if kc is None:
        nc, kc, mask_c, idx = 0, kw, mask_w, mask_w  # stand-ins; NC = 0 masks every compressed access
    else:
        kc = _rows(kc, "kc", D)
        if mask_c is None:
            raise ValueError("compressed keys need mask_c")
        if ids is not None:
            if ids.dim() != 1:
                raise ValueError(f"ids must be [k], got {tuple(ids.shape)}")
            nc, idx = ids.shape[0], ids.contiguous()
        else:
            nc, idx = kc.shape[0], mask_w
        mask_c = _mask(mask_c, nc, "mask_c")
    if out is None:
        out = torch.empty(H, D, dtype=torch.float32, device=q.device)
    elif out.shape != (H, D) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be fp32 [H={H}, D={D}] with unit stride on D")
    tiles = tiles or dispatch.attention_tiles(H, D, nw + nc, dispatch.launch_backend(q))
    # At least one split, so an empty key list still writes out (all zeros: only the sink in the softmax).
    n_split = max(1, triton.cdiv(nw + nc, tiles.block_n))
    m = torch.empty(n_split, H, dtype=torch.float32, device=q.device)
    lsum = torch.empty(n_split, H, dtype=torch.float32, device=q.device)
    acc = torch.empty(n_split, H, D, dtype=torch.float32, device=q.device)
    _attn_split_kernel[(n_split, triton.cdiv(H, tiles.block_h))](
        q, kw, mask_w, kc, mask_c, idx, m, lsum, acc, H, D, nw, nc, q.stride(0), kw.stride(0), kc.stride(0),
        float(scale), INDEXED=ids is not None, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
        BLOCK_D=tiles.block_d, num_warps=tiles.num_warps)
    _attn_combine_kernel[(H, triton.cdiv(D, tiles.block_dc))](
        m, lsum, acc, sinks, out, n_split, H, D, out.stride(0),
        BLOCK_S=tiles.block_s, BLOCK_DC=tiles.block_dc, num_warps=tiles.num_warps_c)
    return out
