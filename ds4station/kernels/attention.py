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
from ds4station.kernels.act_quant import act16_tile, quant_buffers, quantize_act16
from ds4station.kernels.norm import rope_ref, rope_triton_
from ds4station.kernels.pdl import enter, pdl

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------------------
# Tiles (belongs in dispatch.py).


# ---------------------------------------------------------------------------------------------------------
# Torch reference.


def positional_masks(kw: Tensor, mask_w: Tensor | None, kc: Tensor | None, mask_c: Tensor | None,
                     pos: Tensor | None, window: int, ratio: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """The window keys and masks the kernel derives from the position (see attention_decode_triton):
    window > 0: kw is the raw ring and key n is position pos - window + 1 + n (masked below 0);
    ratio > 0: compressed row c is visible iff (c + 1) * ratio <= pos + 1."""
    if window:
        p = pos.reshape(-1)[0] - (window - 1) + torch.arange(window, device=kw.device)
        kw, mask_w = kw[p.clamp(min=0) % kw.shape[0]], p >= 0
    if ratio and kc is not None:
        mask_c = (torch.arange(kc.shape[0], device=kc.device) + 1) * ratio <= pos.reshape(-1)[0] + 1
    return kw, mask_w, mask_c


def attention_decode_ref(q: Tensor, kw: Tensor, mask_w: Tensor | None, kc: Tensor | None, mask_c: Tensor | None,
                         sinks: Tensor, scale: float, ids: Tensor | None = None, *, pos: Tensor | None = None,
                         window: int = 0, ratio: int = 0, slots: Tensor | None = None,
                         unrope: Tensor | None = None) -> Tensor:
    """engine/model.py's sink_attention for one query over [kw ; kc] (or [kw ; kc[ids]]) -> [H, D] fp32
    (q [T, H, D]: each query t as one, at pos[t] with ids[t] / mask_c[t] -> [T, H, D]; with slots [T], kw and
    kc are pools [S, ...] and query t reads slot slots[t]).
    Masked compressed entries are zeroed before the call: their ids may be out of range and their rows
    arbitrary, and sink_attention multiplies p = 0 by the key (0 * inf would be NaN)."""
    from ds4station.kernels.reference import sink_attention

    if unrope is not None:
        out = attention_decode_ref(q, kw, mask_w, kc, mask_c, sinks, scale, ids, pos=pos, window=window, ratio=ratio,
                                   slots=slots)
        T, H, D = (1, *out.shape) if out.dim() == 2 else out.shape
        return rope_ref(out.reshape(T * H, D), pos, unrope, H, inverse=True).view(out.shape)
    if q.dim() == 3:
        sl = [None] * q.shape[0] if slots is None else slots.tolist()
        return torch.stack([attention_decode_ref(
            q[t], kw if s is None else kw[s], mask_w, kc if s is None or kc is None else kc[s],
            mask_c if ids is None or mask_c is None else mask_c[t], sinks, scale,
            None if ids is None else ids[t], pos=pos[t:t + 1], window=window, ratio=ratio)
            for t, s in enumerate(sl)])

    kw, mask_w, mask_c = positional_masks(kw, mask_w, kc, mask_c, pos, window, ratio)

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
def _key_block(n, p, NW, NC, ring_len, kw_ptr, mw_ptr, kc_ptr, mc_ptr, ids_ptr, stride_kw, stride_kc,
               INDEXED: tl.constexpr, RING: tl.constexpr, RATIO: tl.constexpr):
    """Key entries n of the virtual list [window ; compressed] -> (row pointers into kw and kc, which of them
    are attended). Window: entries n < NW, read from kw directly under mask mw or, RING, from the raw ring at
    position p - (NW - 1) + n (masked below 0). Compressed: entries c = n - NW < NC, visible under mask mc or,
    RATIO, iff (c + 1) * RATIO <= p + 1; INDEXED rows are kc[ids[c]]. Masked ids are never dereferenced, and
    each key is loaded from exactly one source (complementary masks), so a block may straddle the two."""
    in_w = n < NW
    c = n - NW
    in_c = (n >= NW) & (c < NC)
    if RING:
        pn = p - (NW - 1) + n
        ok_w = in_w & (pn >= 0)
        row_w = tl.where(ok_w, pn, 0) % ring_len
    else:
        ok_w = in_w & (tl.load(mw_ptr + n, mask=in_w, other=0) != 0)
        row_w = n.to(tl.int64)
    if RATIO > 0:
        ok_c = in_c & ((c + 1) * RATIO <= p + 1)
    else:
        ok_c = in_c & (tl.load(mc_ptr + c, mask=in_c, other=0) != 0)
    if INDEXED:
        row_c = tl.load(ids_ptr + c, mask=ok_c, other=0).to(tl.int64)
    else:
        row_c = c.to(tl.int64)
    return kw_ptr + row_w * stride_kw, kc_ptr + row_c * stride_kc, ok_w, ok_c


@triton.jit
def _load_keys(base_w, base_c, ok_w, ok_c, d, d_ok):
    """[keys, dims] fp32 tile of the block's keys (window or compressed, whichever each entry is)."""
    k = tl.load(base_w[:, None] + d[None, :], mask=ok_w[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    return k + tl.load(base_c[:, None] + d[None, :], mask=ok_c[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _dot_operand(x, F16: tl.constexpr):
    """x as a tl.dot operand: fp16 (F16: half the bytes per tensor-core operand, fp32 accumulation) or fp32."""
    if F16:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _query_position(pos_ptr, NEEDED: tl.constexpr):
    if NEEDED:
        return tl.load(pos_ptr).to(tl.int64)
    return tl.zeros((), tl.int64)


@triton.jit
def _query(q_ptr, pos_ptr, mc_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr, kw_ptr, kc_ptr, slot_ptr, H, D, stride_qt,
           stride_it, stride_skw, stride_skc, SLOTS: tl.constexpr):
    """The pointers of query program_id(2) (several queries in one launch: a static step of a few positions,
    each with its own position, indexed rows and partials; S = the launch's key splits). SLOTS: each query
    of its own sequence (a batched decode step), its ring and compressed rows slot slots[t] of pools."""
    t = tl.program_id(2).to(tl.int64)
    part = t * tl.num_programs(0) * H
    if SLOTS:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kw_ptr += slot * stride_skw
        kc_ptr += slot * stride_skc
    return (q_ptr + t * stride_qt, pos_ptr + t, mc_ptr + t * stride_it, ids_ptr + t * stride_it, m_ptr + part,
            l_ptr + part, acc_ptr + part * D, kw_ptr, kc_ptr)


@triton.jit
def _attn_split_kernel(q_ptr, kw_ptr, mw_ptr, kc_ptr, mc_ptr, ids_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, slot_ptr,
                       H, D, NW, NC, ring_len, stride_q, stride_kw, stride_kc, stride_qt, stride_it, stride_skw,
                       stride_skc, scale,
                       INDEXED: tl.constexpr, RING: tl.constexpr, RATIO: tl.constexpr, SLOTS: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Partials of key block `split` for heads [hb * BLOCK_H, ...) of query program_id(2): m, l [T, S, H] and
    acc [T, S, H, D]."""
    enter(PDL)
    split = tl.program_id(0)
    hb = tl.program_id(1)
    q_ptr, pos_ptr, mc_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr, kw_ptr, kc_ptr = _query(
        q_ptr, pos_ptr, mc_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr, kw_ptr, kc_ptr, slot_ptr, H, D, stride_qt, stride_it,
        stride_skw, stride_skc, SLOTS)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    n = split * BLOCK_N + tl.arange(0, BLOCK_N)
    p = _query_position(pos_ptr, RING or RATIO > 0)
    base_w, base_c, ok_w, ok_c = _key_block(n, p, NW, NC, ring_len, kw_ptr, mw_ptr, kc_ptr, mc_ptr, ids_ptr,
                                            stride_kw, stride_kc, INDEXED, RING, RATIO)
    ok = ok_w | ok_c
    offs_d = tl.arange(0, BLOCK_D)
    part = split * H + offs_h
    if tl.max(ok.to(tl.int32), axis=0) == 0:  # no visible key: only m = -inf, which tells the combine to skip
        tl.store(m_ptr + part, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok)
    else:
        # Pass 1: logits z [BLOCK_H, BLOCK_N] over D in steps.
        z = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            d_ok = d < D
            qd = tl.load(q_ptr + offs_h[:, None] * stride_q + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                         other=0.0).to(tl.float32)
            k = _load_keys(base_w, base_c, ok_w, ok_c, d, d_ok)
            z += tl.sum(qd[:, None, :] * k[None, :, :], axis=2)
        z = tl.where(ok[None, :], z * scale, float("-inf"))
        m = tl.max(z, axis=1)  # [BLOCK_H], finite: the block has a visible key
        e = tl.exp(z - m[:, None])  # exp(-inf) = 0 on masked keys
        tl.store(m_ptr + part, m, mask=h_ok)
        tl.store(l_ptr + part, tl.sum(e, axis=1), mask=h_ok)

        # Pass 2: acc [BLOCK_H, D] = e @ keys, over D in steps (the keys come back from L1/L2).
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            d_ok = d < D
            k = _load_keys(base_w, base_c, ok_w, ok_c, d, d_ok)
            o = tl.sum(e[:, :, None] * k[None, :, :], axis=1)
            tl.store(acc_ptr + part.to(tl.int64)[:, None] * D + d[None, :], o, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_split_dot_kernel(q_ptr, kw_ptr, mw_ptr, kc_ptr, mc_ptr, ids_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, slot_ptr,
                           H, D, NW, NC, ring_len, stride_q, stride_kw, stride_kc, stride_qt, stride_it, stride_skw,
                           stride_skc, scale,
                           INDEXED: tl.constexpr, RING: tl.constexpr, RATIO: tl.constexpr, SLOTS: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, F16: tl.constexpr = False,
                           PDL: tl.constexpr = False):
    """The split step on the matrix units: grid (key blocks, value-dim blocks); every program takes ALL heads
    (MQA: one key load serves them all), computes the logits z [BLOCK_H, BLOCK_N] = q . keys^T over the whole
    head dim with tl.dot, and writes acc for its BLOCK_DV slice of the output dims (programs of value block 0
    also write m and l). Same partials as `_attn_split_kernel`. F16: fp16 dot operands (as the prefill
    kernel's), else fp32 at PRECISION."""
    enter(PDL)
    split = tl.program_id(0)
    dv = tl.program_id(1)
    q_ptr, pos_ptr, mc_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr, kw_ptr, kc_ptr = _query(
        q_ptr, pos_ptr, mc_ptr, ids_ptr, m_ptr, l_ptr, acc_ptr, kw_ptr, kc_ptr, slot_ptr, H, D, stride_qt, stride_it,
        stride_skw, stride_skc, SLOTS)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    n = split * BLOCK_N + tl.arange(0, BLOCK_N)
    p = _query_position(pos_ptr, RING or RATIO > 0)
    base_w, base_c, ok_w, ok_c = _key_block(n, p, NW, NC, ring_len, kw_ptr, mw_ptr, kc_ptr, mc_ptr, ids_ptr,
                                            stride_kw, stride_kc, INDEXED, RING, RATIO)
    ok = ok_w | ok_c
    part = split * H + offs_h
    if tl.max(ok.to(tl.int32), axis=0) == 0:  # no visible key: only m = -inf, which tells the combine to skip
        if dv == 0:
            tl.store(m_ptr + part, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=h_ok)
    else:
        z = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_K):  # BLOCK_K >= D: the whole head dim in one load and one dot
            d = d0 + tl.arange(0, BLOCK_K)
            d_ok = d < D
            qd = tl.load(q_ptr + offs_h[:, None] * stride_q + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                         other=0.0).to(tl.float32)
            z = tl.dot(_dot_operand(qd, F16), tl.trans(_dot_operand(_load_keys(base_w, base_c, ok_w, ok_c, d, d_ok),
                                                                    F16)), z, input_precision=PRECISION)
        z = tl.where(ok[None, :], z * scale, float("-inf"))
        m = tl.max(z, axis=1)
        e = tl.exp(z - m[:, None])  # m is finite: the block has a visible key
        if dv == 0:
            tl.store(m_ptr + part, m, mask=h_ok)
            tl.store(l_ptr + part, tl.sum(e, axis=1), mask=h_ok)
        d = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
        d_ok = d < D
        o = tl.dot(_dot_operand(e, F16), _dot_operand(_load_keys(base_w, base_c, ok_w, ok_c, d, d_ok), F16),
                   input_precision=PRECISION)
        tl.store(acc_ptr + part.to(tl.int64)[:, None] * D + d[None, :], o, mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, pos_ptr, f_ptr, hi_ptr, lo_ptr, xs_ptr, S, H, D,
                         stride_o, stride_ot, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr, HALF: tl.constexpr = 0,
                         ACT16: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t, h, d-block] = sum_s exp(m_s - M) acc_s / (sum_s exp(m_s - M) l_s + exp(sink - M)), for query
    t = program_id(2); M = max(max_s m_s, sink): the sink is finite, so M is too even when every key is masked.
    A split with m_s = -inf had no visible key and wrote neither l_s nor acc_s: they are not read.
    HALF > 0: the output's last 2 * HALF dims rotated back by the inverse interleaved RoPE at pos[t] (f_ptr:
    the HALF inverse frequencies), norm.rope_'s arithmetic on the same values, before the store.
    ACT16: the output rows [T, H * D] also stored quantised as act_quant.quantize_act16 lays them out (hi, lo,
    xs), for the output projection's integer-dot matvec (BLOCK_DC and D multiples of 32)."""
    enter(PDL)
    t = tl.program_id(2).to(tl.int64)
    m_ptr += t * S * H
    l_ptr += t * S * H
    acc_ptr += t * S * H * D
    out_ptr += t * stride_ot
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
        ms = tl.load(m_ptr + s * H + h, mask=s_ok, other=float("-inf"))
        s_ok = ms > float("-inf")  # the splits that saw a key
        w = tl.exp(ms - big)  # 0 for empty blocks
        total += tl.sum(w * tl.load(l_ptr + s * H + h, mask=s_ok, other=0.0), axis=0)
        a = tl.load(acc_ptr + (s.to(tl.int64) * H + h)[:, None] * D + d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    o = acc / total
    if HALF:  # pairs (2i, 2i + 1) of the rotated tail lie in one block (BLOCK_DC even, blocks aligned)
        a, b = tl.split(tl.reshape(o, (BLOCK_DC // 2, 2)))
        de = tl.program_id(1) * BLOCK_DC + 2 * tl.arange(0, BLOCK_DC // 2)  # the pair's even dim
        rot = (de >= D - 2 * HALF) & (de < D)
        ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + (de - (D - 2 * HALF)) // 2, mask=rot, other=0.0)
        c = tl.cos(ang)
        sn = tl.sin(ang) * -1.0
        o = tl.reshape(tl.join(tl.where(rot, a * c - b * sn, a), tl.where(rot, a * sn + b * c, b)), (BLOCK_DC,))
    tl.store(out_ptr + h * stride_o + d, o, mask=d_ok)
    if ACT16:  # row t from its own pointers, so the group bound can be this head's end (a ragged last block)
        act16_tile(tl.reshape(o, (BLOCK_DC // 32, 32)), 0, (h * D + tl.program_id(1) * BLOCK_DC) // 32,
                   (h + 1) * D // 32, hi_ptr + t * (H * D // 4), lo_ptr + t * (H * D // 4), xs_ptr + t * (H * D // 32))


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def attention_decode(q: Tensor, kw: Tensor, mask_w: Tensor | None, kc: Tensor | None, mask_c: Tensor | None,
                     sinks: Tensor, scale: float, ids: Tensor | None = None, **where: object) -> Tensor:
    """Decode sink attention of one query: Triton on a GPU tensor, the torch reference on CPU. `unrope`
    (inverse frequencies [HALF], with pos): the output's last 2 * HALF dims rotated back by the inverse
    interleaved RoPE at each query's position (DS4's attention output), in the same launch on a GPU. `act16`
    (GPU only, for the output projection's integer-dot matvec): -> (out, out's rows [T, H * D] quantised as
    act_quant.quantize_act16 gives them)."""
    if dispatch.use_triton(q):
        return attention_decode_triton(q, kw, mask_w, kc, mask_c, sinks, scale, ids=ids, **where)
    if where.pop("act16", False):
        raise ValueError("act16 is for the integer-dot kernels, which run on a GPU")
    return attention_decode_ref(q, kw, mask_w, kc, mask_c, sinks, scale, ids=ids, **where)


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


def attention_decode_triton(q: Tensor, kw: Tensor, mask_w: Tensor | None, kc: Tensor | None,
                            mask_c: Tensor | None, sinks: Tensor, scale: float, ids: Tensor | None = None, *,
                            pos: Tensor | None = None, window: int = 0, ratio: int = 0, out: Tensor | None = None,
                            tiles: dispatch.AttentionTiles | None = None, slots: Tensor | None = None,
                            unrope: Tensor | None = None, act16: bool = False):  # noqa: ANN201
    """The Triton launcher of `attention_decode`, two launches (-> out, or with act16 (out, (hi, lo, xs))).

    q [H, D], or [T, H, D] for T queries at once (a static step of several positions: each query its own
    position pos[t], indexed rows ids[t] under mask_c[t]; then the window must come from the ring and shared
    compressed rows from `ratio`; -> [T, H, D]); window keys kw [Nw, D] with mask_w [Nw] (bool or int,
    nonzero = attend); compressed keys
    kc [Nc, D] with mask_c [Nc], or, with ids [k] (int32/int64), the compressed table kc [R, D] of which rows
    ids are attended under mask_c [k] (masked ids are never dereferenced); kc None = window only. sinks [H],
    scale the logit scale (D^-0.5). -> out [H, D] fp32 (written into `out` when given).

    Masks from the query position pos [1] (device; the decode step needs no mask tensors then):
    window > 0 makes kw the raw ring [R, D] (row of position p at p % R) and attends positions
    pos - window + 1 .. pos that are >= 0 (mask_w ignored); ratio > 0 (shared compressed rows only) makes
    row c visible iff (c + 1) * ratio <= pos + 1 (mask_c ignored).

    slots [T] (a batched decode step, each query of its own sequence): kw and kc are pools [S, R, D] /
    [S, Nc, D] of rings and compressed rows (engine/kv.py's KVPool), query t reads slot slots[t]."""
    if not q.is_cuda and not dispatch.interpreting():
        raise ValueError("attention_decode_triton needs GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if q.dim() not in (2, 3):
        raise ValueError(f"q must be [H, D] (one query) or [T, H, D], got {tuple(q.shape)}")
    rows = q.dim() == 3
    T, (H, D) = (q.shape[0] if rows else 1), q.shape[-2:]
    q = q if q.stride(-1) == 1 else q.contiguous()
    pool_w = pool_c = None
    if slots is not None:
        if not rows or slots.shape != (T,) or kw.dim() != 3 or (kc is not None and kc.dim() != 3):
            raise ValueError(f"slots [T] index pools of keys [S, rows, D]: q {tuple(q.shape)}, slots "
                             f"{tuple(slots.shape)}, kw {tuple(kw.shape)}")
        if kw.stride(-1) != 1 or (kc is not None and kc.stride(-1) != 1):
            raise ValueError("pools of keys have unit stride on D")
        pool_w, kw = kw, kw[0]  # the kernels address slot 0's rows and step to the query's slot
        if kc is not None:
            pool_c, kc = kc, kc[0]
    kw = _rows(kw, "kw", D)
    if (window or ratio) and (pos is None or pos.numel() != T):
        raise ValueError(f"window / ratio masks need the query positions pos [{T}]")
    if rows and (not window or (kc is not None and ids is None and not ratio)):
        raise ValueError("several queries take their window from the ring and their compressed rows by ratio or ids")
    if ratio and ids is not None:
        raise ValueError("ratio masks are for shared compressed rows; indexed rows come with their mask")
    nw = window or kw.shape[0]
    mask_w = kw if window else _mask(mask_w, nw, "mask_w")
    if sinks.shape != (H,):
        raise ValueError(f"sinks must be [H={H}], got {tuple(sinks.shape)}")
    sinks = sinks.float().contiguous()
    if kc is None:
        nc, kc, mask_c, idx = 0, kw, mask_w, mask_w  # stand-ins; NC = 0 masks every compressed access
    else:
        kc = _rows(kc, "kc", D)
        if mask_c is None and not ratio:
            raise ValueError("compressed keys need mask_c (or ratio and pos)")
        if ids is not None:
            if ids.shape != ((T, ids.shape[-1]) if rows else (ids.shape[-1],)):
                raise ValueError(f"ids must be [{'T, ' if rows else ''}k], got {tuple(ids.shape)}")
            nc, idx = ids.shape[-1], ids.contiguous()
            if not ratio:
                mask_c = mask_c.contiguous()
                if mask_c.shape != ids.shape:
                    raise ValueError(f"mask_c must be {tuple(ids.shape)} like ids, got {tuple(mask_c.shape)}")
        else:
            nc, idx = kc.shape[0], mask_w
        if ratio:
            mask_c = kc
        elif ids is None:
            mask_c = _mask(mask_c, nc, "mask_c")
    shape = (T, H, D) if rows else (H, D)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    elif out.shape != shape or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 {list(shape)} with unit stride on D")
    tiles = tiles or dispatch.attention_tiles(H, D, nw + nc, dispatch.launch_backend(q))
    # At least one split, so an empty key list still writes out (all zeros: only the sink in the softmax).
    n_split = max(1, triton.cdiv(nw + nc, tiles.block_n))
    m = torch.empty(T, n_split, H, dtype=torch.float32, device=q.device)
    lsum = torch.empty(T, n_split, H, dtype=torch.float32, device=q.device)
    acc = torch.empty(T, n_split, H, D, dtype=torch.float32, device=q.device)
    stride_it = idx.stride(0) if rows and ids is not None else 0
    args = (q, kw, mask_w, kc, mask_c, idx, pos if pos is not None else q, m, lsum, acc,
            slots if slots is not None else q, H, D, nw, nc, kw.shape[0], q.stride(-2), kw.stride(0), kc.stride(0),
            q.stride(0) if rows else 0, stride_it, 0 if pool_w is None else pool_w.stride(0),
            0 if pool_c is None else pool_c.stride(0), float(scale))
    flags = {"INDEXED": ids is not None, "RING": window > 0, "RATIO": ratio, "SLOTS": slots is not None}
    if tiles.block_dv:  # matrix-unit form: all heads per program, grid over key blocks x value-dim blocks
        if tiles.block_h < H:
            raise ValueError(f"the tl.dot split kernel takes all {H} heads per program, tiles have {tiles.block_h}")
        _attn_split_dot_kernel[(n_split, triton.cdiv(D, tiles.block_dv), T)](
            *args, **flags, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_d,
            BLOCK_DV=tiles.block_dv, **dot_consts(tiles), num_warps=tiles.num_warps, **pdl(q))
    else:
        _attn_split_kernel[(n_split, triton.cdiv(H, tiles.block_h), T)](
            *args, **flags, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
            num_warps=tiles.num_warps, **pdl(q))
    half = 0 if unrope is None else unrope.numel()
    if half and (pos is None or pos.numel() != T or 2 * half > D):
        raise ValueError(f"unrope needs the {T} query positions and at most D / 2 = {D // 2} frequencies")
    fused = half and tiles.block_dc % 2 == 0
    f = unrope.float().contiguous() if half else sinks
    # the quantised rows in the combine launch when its blocks are whole 32-groups of one head (after the RoPE)
    quant = act16 and tiles.block_dc % 32 == 0 and D % 32 == 0 and (fused or not half)
    act = quant_buffers(T, H * D, "act16", q.device) if quant else (out, out, out)
    _attn_combine_kernel[(H, triton.cdiv(D, tiles.block_dc), T)](
        m, lsum, acc, sinks, out, pos if fused else sinks, f, *act, n_split, H, D, out.stride(-2),
        out.stride(0) if rows else 0, BLOCK_S=tiles.block_s, BLOCK_DC=tiles.block_dc, HALF=half if fused else 0,
        ACT16=quant, num_warps=tiles.num_warps_c, **pdl(m))
    if half and not fused:
        rope_triton_(out.view(T * H, D), pos, f, H, inverse=True)
    if not act16:
        return out
    return out, act if quant else quantize_act16(out.reshape(T, H * D))


# ---------------------------------------------------------------------------------------------------------
# Prefill: every query of a chunk over its own window and compressed rows, flash-attention style.


def attention_prefill_ref(q: Tensor, ring: Tensor, kc: Tensor | None, mask_c: Tensor | None, sinks: Tensor,
                          scale: float, ids: Tensor | None, pos: Tensor, window: int, ratio: int = 0) -> Tensor:
    """Each query t of q [T, H, D] as `attention_decode_ref` at position pos[t] (its window from the raw ring,
    its compressed rows: shared kc visible by `ratio`, or its own ids[t] under mask_c[t]) -> [T, H, D] fp32."""
    return torch.stack([
        attention_decode_ref(q[t], ring, None, kc, None if mask_c is None else mask_c[t], sinks, scale,
                             None if ids is None else ids[t], pos=pos[t:t + 1], window=window,
                             ratio=0 if ids is not None else ratio)
        for t in range(q.shape[0])])


@triton.jit(do_not_specialize=["NC", "stride_it"])  # the compressed rows seen grow with the position
def _attn_prefill_kernel(q_ptr, kw_ptr, kc_ptr, mc_ptr, ids_ptr, pos_ptr, sinks_ptr, out_ptr,
                         H, D, NW, NC, ring_len, stride_qt, stride_qh, stride_kw, stride_kc, stride_it,
                         stride_ot, stride_oh, scale,
                         INDEXED: tl.constexpr, RATIO: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
                         Q_ONCE: tl.constexpr = False, F16: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (T, value-dim blocks): one query, all heads, its NW window keys (ring slots of positions
    p - NW + 1 .. p) then its NC compressed rows, in BLOCK_N steps with an online softmax (base 2); the sink
    joins the denominator at the end. Masked keys are never loaded, and a key block with none visible to the
    query is skipped (the rows of a ratio layer past the query's position are not even visited). Q_ONCE
    (BLOCK_K >= D): the query's [heads, D] tile is loaded once, before the key loop (held for every block's
    scores), else once per BLOCK_K step of each block (AMD's register budget). F16: the dots' operands in fp16,
    else fp32 at PRECISION."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    dv = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    p = tl.load(pos_ptr + t).to(tl.int64)
    d_v = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_ok = d_v < D
    qk_scale = scale * _LOG2E  # the softmax in base 2
    q_row = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    if Q_ONCE:  # the whole query, once
        d_all = tl.arange(0, BLOCK_K)
        q_all = _dot_operand(tl.load(q_row + d_all[None, :], mask=h_ok[:, None] & (d_all < D)[None, :],
                                     other=0.0).to(tl.float32) * qk_scale, F16)
    n_end = NW + NC
    if RATIO > 0:
        n_end = NW + tl.minimum(NC, (p + 1) // RATIO)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(0, n_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        base_w, base_c, ok_w, ok_c = _key_block(n, p, NW, NC, ring_len, kw_ptr, kw_ptr, kc_ptr, mc_ptr + t * stride_it,
                                                ids_ptr + t * stride_it, stride_kw, stride_kc, INDEXED, True, RATIO)
        ok = ok_w | ok_c
        if tl.max(ok.to(tl.int32), axis=0) > 0:
            if Q_ONCE:
                keys = _load_keys(base_w, base_c, ok_w, ok_c, d_all, d_all < D)
                z = tl.dot(q_all, tl.trans(_dot_operand(keys, F16)), input_precision=PRECISION)
            else:
                z = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
                for d0 in range(0, D, BLOCK_K):
                    d = d0 + tl.arange(0, BLOCK_K)
                    d_ok = d < D
                    qd = tl.load(q_row + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                    keys = _load_keys(base_w, base_c, ok_w, ok_c, d, d_ok)
                    z = tl.dot(_dot_operand(qd * qk_scale, F16), tl.trans(_dot_operand(keys, F16)), z,
                               input_precision=PRECISION)
            z = tl.where(ok[None, :], z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            e = tl.exp2(z - m_safe[:, None])
            lsum = lsum * alpha + tl.sum(e, axis=1)
            v = _load_keys(base_w, base_c, ok_w, ok_c, d_v, dv_ok)
            acc = acc * alpha[:, None] + tl.dot(_dot_operand(e, F16), _dot_operand(v, F16), input_precision=PRECISION)
            m = m_new
    sink = tl.load(sinks_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * _LOG2E
    big = tl.maximum(m, sink)
    w = tl.exp2(m - big)  # 0 when every key was masked (m = -inf)
    total = lsum * w + tl.exp2(sink - big)
    out = acc * (w / total)[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + d_v[None, :], out,
             mask=h_ok[:, None] & dv_ok[None, :])


def dot_consts(tiles: dispatch.AttentionTiles) -> dict:
    """The tl.dot kernels' (split and prefill) dot constexprs for their tiles: precision "fp16" = fp16
    operands (PRECISION unused)."""
    f16 = tiles.precision == "fp16"
    return {"PRECISION": "ieee" if f16 else tiles.precision, "F16": f16}


def attention_prefill(q: Tensor, ring: Tensor, kc: Tensor | None, mask_c: Tensor | None, sinks: Tensor,
                      scale: float, ids: Tensor | None, pos: Tensor, window: int, ratio: int = 0) -> Tensor:
    if dispatch.use_triton(q):
        return attention_prefill_triton(q, ring, kc, mask_c, sinks, scale, ids, pos, window, ratio)
    return attention_prefill_ref(q, ring, kc, mask_c, sinks, scale, ids, pos, window, ratio)


def attention_prefill_triton(q: Tensor, ring: Tensor, kc: Tensor | None, mask_c: Tensor | None, sinks: Tensor,
                             scale: float, ids: Tensor | None, pos: Tensor, window: int, ratio: int = 0, *,
                             tiles: dispatch.AttentionTiles | None = None) -> Tensor:
    """Prefill sink attention of a chunk, one launch, no scratch beyond the output: q [T, H, D] at positions
    pos [T] (all already written into the raw ring [R, D], R >= window + T - 1); compressed rows either shared
    (kc [Nc, D], row c visible to query t iff (c + 1) * ratio <= pos[t] + 1) or indexed (kc the table, ids and
    mask_c [T, k]); kc None = window only. -> [T, H, D] fp32."""
    if q.dim() != 3 or pos.shape != (q.shape[0],):
        raise ValueError(f"q must be [T, H, D] with pos [T], got {tuple(q.shape)} and {tuple(pos.shape)}")
    T, H, D = q.shape
    ring = _rows(ring, "ring", D)
    if window <= 0 or ring.shape[0] < window:
        raise ValueError(f"window {window} must be in 1..{ring.shape[0]} (the ring's rows)")
    if ids is not None and (mask_c is None or ids.shape != mask_c.shape or ids.shape[0] != T or kc is None):
        raise ValueError("indexed rows need the table kc and ids / mask_c of shape [T, k]")
    if ids is None and kc is not None and ratio <= 0:
        raise ValueError("shared compressed rows need their ratio")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    tiles = tiles or dispatch.attention_prefill_tiles(H, D, dispatch.launch_backend(q), dispatch.shared_limit(q))
    if kc is None:
        nc, kc_, mc, idx, stride_it = 0, ring, ring, ring, 0
    elif ids is not None:
        kc_ = _rows(kc, "kc", D)
        idx, mc = ids.contiguous(), mask_c.contiguous()
        nc, stride_it = ids.shape[1], ids.stride(0)
    else:
        kc_ = _rows(kc, "kc", D)
        nc, mc, idx, stride_it = kc_.shape[0], ring, ring, 0
    _attn_prefill_kernel[(T, triton.cdiv(D, tiles.block_dv))](
        q, ring, kc_, mc, idx, pos, sinks.float().contiguous(), out, H, D, window, nc, ring.shape[0],
        q.stride(0), q.stride(1), ring.stride(0), kc_.stride(0), stride_it, out.stride(0), out.stride(1),
        float(scale), INDEXED=ids is not None, RATIO=ratio if ids is None else 0, BLOCK_H=tiles.block_h,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_d, BLOCK_DV=tiles.block_dv, Q_ONCE=tiles.block_d >= D,
        **dot_consts(tiles), num_warps=tiles.num_warps, **pdl(q))
    return out
