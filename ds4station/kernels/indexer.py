"""Lightning indexer: per query, the top-k visible compressed blocks by weighted-ReLU score, on the GPU.

Owns the Triton version of the scoring and selection of engine/model.py's `Indexer.__call__` and
engine/gpu.py's `GpuStage._index`, from the index queries q [T, IH, Dq] (fp32; DS4: 64 x 128), the per-query
head weights w [T, IH] (fp32, already scaled), the compressed index keys `keys` [R, Dq] (the cache: fp32 or
fp16; rows [0, n_blocks) are used) and the query positions pos [T] (int64):

    score[t, i] = sum_h w[t, h] * relu(q[t, h] . keys[i])                        i < n_blocks
    visible[t, i] = (i + 1) * ratio <= pos[t] + 1
    ids[t] = the k = min(k, n_blocks) highest visible scores, ties to the LOWER block index (the
             reference's stable descending sort with the invisible blocks at -inf; invisible blocks fill the
             row, lowest index first, when fewer than k are visible), valid[t, j] = visible[t, ids[t, j]]

- `index_topk_triton(q, w, keys, n_blocks, pos, ratio, k) -> (ids [T, k] int64, valid [T, k] bool)`:
  `_indexer_kernel` (grid (cdiv(n, BLOCK_N), cdiv(T, BLOCK_T))) writes one int64 sort key per (t, i),
      key = (ordered(score) << 32) | (2^31 - 1 - i),   ordered(b) = b if b >= 0 else b ^ 0x7FFFFFFF
  on the fp32 bits b of the score, and INT32_MIN as the high half for an invisible
  block (below every score, -inf included). The key is unique per block and orders by score descending,
  then index ascending, so the k largest keys are exactly the stable sort's selection, and the ids come
  back from the low half. Two ways to select them:
  - up to `dispatch.select_max` keys (8,192 on CUDA) per program, in registers (`dispatch.select_plan`):
    `_select_kernel`, one program per query, finds the k-th largest key in 32 counting rounds (63 when
    scores tie at the cut, as the invisible blocks do while fewer than k are visible) and writes ids and
    valid flags itself (ascending block order); with more keys (up to select_max / k chunks: 512K tokens of
    context at k = 512), first one program per chunk of select_max / 2 or select_max keys keeps its k
    largest into a candidate buffer, then one program per query selects among those; past that (a decode
    step past 512K tokens: 64 chunks of 4,096 blocks at 1M), for up to dispatch.SELECT_MID_ROWS queries, a
    middle stage of the same programs keeps the k largest of each chunk of candidates first. The keys of a
    column block are scored into a [T, k + step] int64 scratch (<= SCRATCH_BYTES): all blocks at once for decode
    and prefill chunks at up to ~64K tokens of context, else column blocks of whole first-stage chunks
    each feeding the first stage (a 2,048-token chunk at 128K). A query or chunk that sees at most k blocks
    keeps its first k keys without counting (decode buckets positions to powers of two, so up to half the
    chunks lie past the position);
  - otherwise (more candidates than a program holds, a middle stage for a prefill piece, or a column block
    smaller than a chunk) column blocks of `step` blocks hold the running top k with torch.topk (score
    order): a 1M-token context has 262,144 blocks, and a [T = 2048, n] key matrix would be 4 GB.
  The order of the k entries is not part of the contract (attention sums over them).
  Per program (BLOCK_T queries x BLOCK_N keys, the keys loaded once): BLOCK_T = 1 puts the query's heads in
  the M rows of one tl.dot per BLOCK_H heads (or, with tiles.dot False, per-head fp32 FMA sums); BLOCK_T > 1
  loops over the heads with one [BLOCK_T, Dq] x [Dq, BLOCK_N] tl.dot each. The weighted ReLU sum is fp32.
  The dot operands are fp16 with fp32 accumulation (`fp16_dot`, the default): exact for DS4's indexer, whose
  q and keys went through the FP4 e2m1 round trip (power-of-two block scales, so every value is an fp16 and
  every product exact in fp32); fp16_dot=False dots in fp32 with input_precision="ieee" (never TF32).

Nothing is read back to the host (n_blocks, ratio, k and step are host ints; the shapes depend only on
them), so the launcher can be captured in a CUDA graph. `index_topk` picks Triton for GPU tensors and the
torch reference for CPU tensors, like kernels/norm.py; `index_topk_triton` also takes CPU tensors under
TRITON_INTERPRET. Tile choice: `dispatch.indexer_tiles`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.pdl import enter, pdl

Tensor = torch.Tensor

_LOW = 2147483647  # the low half of a sort key is _LOW - block index
SCRATCH_BYTES = 256 << 20  # bound on the [T, k + step] int64 key scratch of one column block (engine/gpu.py's)


# ---------------------------------------------------------------------------------------------------------
# Torch reference.


def _k_eff(k: int, n_blocks: int) -> int:
    """Selected entries per query: min(k, n_blocks), and one (all invalid) when there are no blocks yet."""
    return min(k, max(n_blocks, 1))


def index_topk_ref(q: Tensor, w: Tensor, keys: Tensor, n_blocks: int, pos: Tensor, ratio: int,
                   k: int, slots: Tensor | None = None, w_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """GpuStage._index's scoring and selection: scores in column blocks of bounded scratch, invisible blocks
    at -inf, a stable descending sort (ties to the lower block), the first min(k, n_blocks). With slots [T],
    keys is a pool [S, R, D] and query t scores the keys of slot slots[t]."""
    if slots is not None:
        parts = [index_topk_ref(q[t:t + 1], w[t:t + 1], keys[s], n_blocks, pos[t:t + 1], ratio, k, w_scale=w_scale)
                 for t, s in enumerate(slots.tolist())]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    T, IH = w.shape
    kk = _k_eff(k, n_blocks)
    if n_blocks == 0:
        z = torch.zeros(T, kk, dtype=torch.long, device=q.device)
        return z, z.bool()
    qf, wf = q.float(), w.float() * w_scale
    score = torch.empty(T, n_blocks, device=q.device)
    step = max(64, SCRATCH_BYTES // (4 * max(T, 1) * IH))
    for n0 in range(0, n_blocks, step):
        kb = keys[n0:min(n0 + step, n_blocks)].float()
        score[:, n0:n0 + kb.shape[0]] = torch.einsum("th,thn->tn", wf, torch.einsum("thd,nd->thn", qf, kb).relu())
    visible = (torch.arange(n_blocks, device=q.device)[None] + 1) * ratio <= pos[:, None] + 1
    masked = score.masked_fill(~visible, float("-inf"))
    top = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :kk]
    return top, visible.gather(1, top)


# ---------------------------------------------------------------------------------------------------------
# Kernel.


@triton.jit
def _sort_key(score, idx, vis):
    """int64 keys ordering by score descending, then block index ascending: the score's fp32 bits made
    monotone in the high half, INT32_MIN there for an invisible block (below any score); 2^31 - 1 - idx in
    the low half. A score is never -0.0 (which would sort below +0.0): the sums start at +0.0, and
    +0.0 + -0.0 = +0.0."""
    bits = score.to(tl.int32, bitcast=True)
    hi = tl.where(vis, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), -2147483648).to(tl.int64)
    return (hi << 32) | (2147483647 - idx)


@triton.jit
def _score_dot(qt, ktt, DOT_FP16: tl.constexpr):
    """q rows . keys in fp32 sums: fp16 operands (exact for FP4-round-tripped values) or fp32 ieee ones."""
    if DOT_FP16:
        s = tl.dot(qt.to(tl.float16), ktt, out_dtype=tl.float32)
    else:
        s = tl.dot(qt.to(tl.float32), ktt, input_precision="ieee", out_dtype=tl.float32)
    return s


# Position-dependent integers are not specialised on (Triton would compile a variant for every value that is
# 1 or divisible by 16: new compiles in the middle of serving); shapes and strides fixed by the model still are.
@triton.jit(do_not_specialize=["n0", "n1", "col0", "stride_ot"])
def _indexer_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, slot_ptr, out_ptr, T, IH, D, n0, n1, col0,
                    stride_qt, stride_qh, stride_wt, stride_k, stride_ot, stride_sk, ratio, w_scale,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    USE_DOT: tl.constexpr, DOT_FP16: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    """Sort keys of blocks [n0 + pid0 * BLOCK_N, ...) < n1 for queries [pid1 * BLOCK_T, ...) < T, written to
    out[t, col0 + (i - n0)]. A program whose first block is past every one of its queries' positions (the
    rest of a position bucket) writes the invisible keys without loading or scoring anything. SLOTS (one query
    per program): query t reads the keys of slot slots[t] of a pool (stride_sk apart)."""
    enter(PDL)
    offs_n = n0 + tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n1
    first = n0 + tl.program_id(0).to(tl.int64) * BLOCK_N
    if BLOCK_T == 1:
        t = tl.program_id(1).to(tl.int64)
        p = tl.load(pos_ptr + t).to(tl.int64)
        if SLOTS:
            k_ptr += tl.load(slot_ptr + t).to(tl.int64) * stride_sk
    else:
        offs_t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < T
        p = tl.max(tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.int64), axis=0)
    if (first + 1) * ratio > p + 1:
        none = _sort_key(tl.zeros([BLOCK_N], dtype=tl.float32), offs_n, offs_n < 0)
        if BLOCK_T == 1:
            tl.store(out_ptr + t * stride_ot + col0 + (offs_n - n0), none, mask=n_ok)
        else:
            tl.store(out_ptr + offs_t[:, None] * stride_ot + col0 + (offs_n[None, :] - n0), none[None, :],
                     mask=t_ok[:, None] & n_ok[None, :])
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kraw = tl.load(k_ptr + offs_n[:, None] * stride_k + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                   other=0.0)  # [BLOCK_N, BLOCK_D], loaded once for every head and query of the program
    if DOT_FP16:
        kt = kraw.to(tl.float16)
    else:
        kt = kraw.to(tl.float32)
    if BLOCK_T == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if USE_DOT:  # the query's heads are the M rows of the dot; padded heads have q = 0 and w = 0
            ktt = tl.trans(kt)
            for h0 in range(0, IH, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                h_ok = offs_h < IH
                qt = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                             mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
                s = _score_dot(qt, ktt, DOT_FP16)
                wv = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32) * w_scale
                acc += tl.sum(tl.maximum(s, 0.0) * wv[:, None], axis=0)
        else:  # per-head fp32 FMA reductions over the key row
            kf = kraw.to(tl.float32)
            for h in range(0, IH):
                qv = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
                s = tl.sum(kf * qv[None, :], axis=1)
                wh = tl.load(w_ptr + t * stride_wt + h).to(tl.float32) * w_scale
                acc += tl.maximum(s, 0.0) * wh
        vis = n_ok & ((offs_n + 1) * ratio <= p + 1)
        tl.store(out_ptr + t * stride_ot + col0 + (offs_n - n0), _sort_key(acc, offs_n, vis), mask=n_ok)
    else:
        ktt = tl.trans(kt)
        acc2 = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for h in range(0, IH):
            qt = tl.load(q_ptr + offs_t[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                         mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_D]
            s2 = _score_dot(qt, ktt, DOT_FP16)
            wv = tl.load(w_ptr + offs_t * stride_wt + h, mask=t_ok, other=0.0).to(tl.float32) * w_scale
            acc2 += tl.maximum(s2, 0.0) * wv[:, None]
        p2 = tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
        vis2 = n_ok[None, :] & ((offs_n[None, :] + 1) * ratio <= p2[:, None] + 1)
        tl.store(out_ptr + offs_t[:, None] * stride_ot + col0 + (offs_n[None, :] - n0),
                 _sort_key(acc2, offs_n[None, :], vis2), mask=t_ok[:, None] & n_ok[None, :])


@triton.jit
def _count(m):
    return tl.sum(m.to(tl.int32), axis=0)


_PAD_KEY = tl.constexpr(-(1 << 63) + (1 << 32) - 1)  # high half INT32_MIN, low half -1: below every real key


@triton.jit
def _top_keys(key, ok, Kc):
    """The mask of the Kc largest of the (unique) keys where ok, by block-wide counts on int32 halves."""
    hi = (key >> 32).to(tl.int32)
    lo = (key & 0xFFFFFFFF).to(tl.int32)
    # Setting bits of a two's-complement int32 raises it, from 0 up or from INT32_MIN up.
    top = tl.where(_count(ok & (hi >= 0)) >= Kc, 0, -2147483648)
    for b in range(30, -1, -1):
        cand = top | (1 << b)
        top = tl.where(_count(ok & (hi >= cand)) >= Kc, cand, top)
    tie = ok & (hi == top)
    need = Kc - _count(ok & (hi > top))  # >= 1 keys to take from the tie
    cut = tl.zeros((), dtype=tl.int32)
    if _count(tie) > need:
        for b in range(30, -1, -1):
            cand = cut | (1 << b)
            cut = tl.where(_count(tie & (lo >= cand)) >= need, cand, cut)
    return ok & ((hi > top) | (tie & (lo >= cut)))  # exactly Kc entries


@triton.jit(do_not_specialize=["stride_b", "col0", "n", "blk0", "stride_o", "K"])  # position-dependent
def _select_kernel(buf_ptr, stride_b, col0, n, blk0, pos_ptr, ratio, ids_ptr, valid_ptr, out_ptr, stride_o, K,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, KEYS_OUT: tl.constexpr, PDL: tl.constexpr = False):
    """Per query and chunk of CHUNK keys (grid (T, cdiv(n, CHUNK))): the min(K, keys in the chunk) largest of
    the sort keys at buf[t, col0 + c CHUNK ...] (blocks blk0 + c CHUNK ... in a first stage), held in
    registers. The keys are unique, so the selection is every key at or above the K-th largest, found by
    block-wide counts on int32 halves (`_top_keys`): the K-th largest high half (the ordered score; 32 rounds:
    sign, then bits 30..0), then, only when that score is tied across the cut, the r-th largest low half
    among the tied keys (31 more rounds; the low half is 2^31 - 1 - block >= 0). Writes ids [T, K] (ascending
    block order) and valid [T, K]; or, KEYS_OUT (the first stage of a two-stage selection), the selected keys
    themselves to out[t, c K ...], padded to K with _PAD_KEY. A query or chunk that sees at most Kc blocks
    keeps its first Kc keys without counting."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    n_here = tl.minimum(n - c * CHUNK, CHUNK)
    ok = offs < n_here
    key = tl.load(buf_ptr + t * stride_b + col0 + c * CHUNK + offs, mask=ok, other=0)
    Kc = tl.minimum(K, n_here)
    # The keys come in block order: a first-stage chunk holds blocks blk0 + c CHUNK ..., a one-stage
    # selection all blocks, and a second stage the first stage's picks chunk by chunk, each in block order
    # (padding last). The visible blocks come first, so when at most Kc are visible (block blk0 + c CHUNK + Kc
    # is past the position) the Kc largest keys are the first Kc: the visible blocks, then the invisible ones
    # (high half INT32_MIN) by ascending block, as their low halves fall (a second stage then sees only chunk
    # 0's picks, blocks 0 .. Kc - 1). No counting rounds: the 63 of the tie made the chunks past the position
    # the first stage's longest programs (decode buckets positions to powers of two: up to half the chunks
    # are past it).
    if (blk0 + c * CHUNK + Kc + 1) * ratio > tl.load(pos_ptr + t).to(tl.int64) + 1:
        sel = ok & (offs < Kc)
    else:
        sel = _top_keys(key, ok, Kc)
    slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    if KEYS_OUT:
        row = out_ptr + t * stride_o + c * K
        tl.store(row + slot, key, mask=sel)
        tl.store(row + offs, tl.full([BLOCK], _PAD_KEY, tl.int64), mask=(offs >= Kc) & (offs < K))
    else:
        lo = (key & 0xFFFFFFFF).to(tl.int32)
        ids = 2147483647 - lo.to(tl.int64)  # _LOW - block index
        valid = (ids + 1) * ratio <= tl.load(pos_ptr + t).to(tl.int64) + 1
        tl.store(ids_ptr + t * K + slot, ids, mask=sel)
        tl.store(valid_ptr + t * K + slot, valid, mask=sel)


# ---------------------------------------------------------------------------------------------------------
# Launchers.


def _column_step(t: int, k: int, n_blocks: int, block_n: int, step: int | None = None) -> int:
    """Blocks per column block of the selection: the given `step` or the most that keep the [t, k + step]
    int64 scratch within SCRATCH_BYTES (a multiple of block_n), at least k (the first column block alone
    fills the running top k) and at most n_blocks."""
    if step is None:
        step = SCRATCH_BYTES // (8 * max(t, 1)) - k
        step = step // block_n * block_n if step >= block_n else step
    return min(max(step, k), n_blocks)


def index_topk(q: Tensor, w: Tensor, keys: Tensor, n_blocks: int, pos: Tensor, ratio: int,
               k: int, *, fp16_dot: bool = True, slots: Tensor | None = None,
               w_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Top-min(k, n_blocks) visible index blocks per query: Triton on a GPU tensor, the torch reference on
    CPU. `fp16_dot`: see index_topk_triton (DS4 with the indexer's FP4 round trip: True, exact). `slots`:
    query t of its own sequence, keys a pool [S, R, D] (a batched decode step)."""
    if dispatch.use_triton(q):
        return index_topk_triton(q, w, keys, n_blocks, pos, ratio, k, fp16_dot=fp16_dot, slots=slots, w_scale=w_scale)
    return index_topk_ref(q, w, keys, n_blocks, pos, ratio, k, slots, w_scale)


def _select_first(buf: Tensor, col0: int, n: int, blk0: int, pos: Tensor, ratio: int, k: int, chunk: int,
                  tiles: dispatch.SelectTiles, cand: Tensor) -> None:
    """A reducing stage over the keys buf[:, col0:col0 + n] in block order, the first of them block (or
    candidate) blk0, a multiple of `chunk`: each chunk's k largest to cand[:, (blk0 / chunk + c) k ...]. The
    keys are blocks (the first stage) or a previous stage's candidates (a middle stage): those are in
    ascending block order too, so candidate i is block i or later, and a chunk whose first candidate past
    the position's visible blocks comes within its first k still holds at most k visible keys (the kernel's
    shortcut holds)."""
    out = cand[:, blk0 // chunk * k:]
    _select_kernel[(buf.shape[0], triton.cdiv(n, chunk))](
        buf, buf.stride(0), col0, n, blk0, pos, ratio, cand, cand, out, out.stride(0), k, CHUNK=chunk,
        BLOCK=tiles.block, KEYS_OUT=True, num_warps=tiles.num_warps, **pdl(buf))


def _select_last(buf: Tensor, col0: int, n: int, pos: Tensor, ratio: int, k: int,
                 tiles: dispatch.SelectTiles) -> tuple[Tensor, Tensor]:
    """The k largest of buf[:, col0:col0 + n] per row (all blocks, or a first stage's candidates) -> (ids,
    valid), one program per row."""
    T = buf.shape[0]
    ids = torch.empty(T, k, dtype=torch.int64, device=buf.device)
    valid = torch.empty(T, k, dtype=torch.bool, device=buf.device)
    _select_kernel[(T, 1)](buf, buf.stride(0), col0, n, 0, pos, ratio, ids, valid, ids, 0, k, CHUNK=tiles.block,
                           BLOCK=tiles.block, KEYS_OUT=False, num_warps=tiles.num_warps, **pdl(buf))
    return ids, valid


def index_topk_triton(q: Tensor, w: Tensor, keys: Tensor, n_blocks: int, pos: Tensor, ratio: int, k: int, *,
                      fp16_dot: bool = True, step: int | None = None, tiles: dispatch.IndexerTiles | None = None,
                      slots: Tensor | None = None, w_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """The Triton launcher of `index_topk`.

    q [T, IH, Dq] and w [T, IH] (any float dtype, fp32 math; each weight times `w_scale` as it is read: the
    fp32 product a multiplication of w before the call gives), keys [R >= n_blocks, Dq] fp32 or fp16 (only
    the first n_blocks rows are read), pos [T] integer -> ids [T, k'] int64 and valid [T, k'] bool with
    k' = min(k, max(n_blocks, 1)); n_blocks == 0 gives zeros (all invalid), as GpuStage._index. The entries
    come in ascending block order (one-program select) or score order (torch.topk over column blocks).
    `fp16_dot`: dot operands in fp16 (fp32 accumulation); exact only when q and keys hold fp16 values (DS4's
    FP4 round trip guarantees it); False: fp32 dots (input_precision="ieee"). `step`: blocks per column
    block of the selection (default: the largest that keeps the [T, k' + step] int64 scratch within
    SCRATCH_BYTES; at least k'). `slots` [T]: keys is a pool [S, R, Dq] and query t reads slot slots[t]."""
    if not q.is_cuda and not dispatch.interpreting():
        raise ValueError("index_topk_triton needs GPU tensors (or TRITON_INTERPRET=1 for CPU tensors)")
    if q.dim() != 3:
        raise ValueError(f"q must be [T, IH, Dq], got {tuple(q.shape)}")
    T, IH, D = q.shape
    if w.shape != (T, IH):
        raise ValueError(f"w must be [T={T}, IH={IH}], got {tuple(w.shape)}")
    if slots is not None:
        if keys.dim() != 3 or slots.shape != (T,):
            raise ValueError(f"slots [T={T}] index a pool of keys [S, R, Dq], got slots {tuple(slots.shape)}, keys "
                             f"{tuple(keys.shape)}")
        if keys.stride(2) != 1:
            raise ValueError("a pool of keys has unit stride on Dq")
    if keys.dim() != (2 if slots is None else 3) or keys.shape[-1] != D:
        raise ValueError(f"keys must be [R, Dq={D}], got {tuple(keys.shape)}")
    if keys.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"keys must be fp32 or fp16, got {keys.dtype}")
    if not 0 <= n_blocks <= keys.shape[-2]:
        raise ValueError(f"n_blocks must be in 0..{keys.shape[-2]} (the rows of keys), got {n_blocks}")
    if pos.shape != (T,):
        raise ValueError(f"pos must be [T={T}], got {tuple(pos.shape)}")
    if k < 1 or ratio < 1:
        raise ValueError(f"k and ratio must be >= 1, got k={k}, ratio={ratio}")
    if step is not None and step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    kk = _k_eff(k, n_blocks)
    if n_blocks == 0 or T == 0:
        z = torch.zeros(T, kk, dtype=torch.long, device=q.device)
        return z, z.bool()
    # slotted queries each read their own keys: one query per program, the decode tiles
    tiles = tiles or dispatch.indexer_tiles(1 if slots is not None else T, n_blocks, IH, D, dispatch.launch_backend(q))
    if tiles.block_d < D:
        raise ValueError(f"tiles.block_d={tiles.block_d} is below Dq={D}")
    if slots is not None and tiles.block_t != 1:
        raise ValueError("slotted queries take one query per program (block_t 1)")
    q = q if q.stride(2) == 1 else q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys[:n_blocks].contiguous()
    pos = pos.contiguous()
    step = _column_step(T, kk, n_blocks, tiles.block_n, step)
    plan = dispatch.select_plan(n_blocks, kk, dispatch.launch_backend(q), rows=T)
    if plan is not None and step < n_blocks:  # column blocks of whole first-stage chunks, or torch.topk
        if plan.chunks > 1 and plan.mid is None and step >= plan.chunk:
            step -= step % plan.chunk
        else:
            plan = None
    buf = torch.empty(T, kk + step, dtype=torch.int64, device=q.device)  # [running top k | column block]
    cand = torch.empty(T, plan.chunks * kk, dtype=torch.int64, device=q.device) if plan and plan.chunks > 1 else None
    for n0 in range(0, n_blocks, step):
        n1 = min(n0 + step, n_blocks)
        grid = (triton.cdiv(n1 - n0, tiles.block_n), triton.cdiv(T, tiles.block_t))
        _indexer_kernel[grid](
            q, w, keys, pos, slots if slots is not None else pos, buf, T, IH, D, n0, n1, kk, q.stride(0), q.stride(1),
            w.stride(0), keys.stride(-2), buf.stride(0), keys.stride(0) if slots is not None else 0, ratio, w_scale,
            BLOCK_T=tiles.block_t, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_D=tiles.block_d,
            USE_DOT=tiles.dot, DOT_FP16=fp16_dot, SLOTS=slots is not None, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, **pdl(q))
        last = n1 == n_blocks
        if plan is not None:  # select in programs that hold their keys in registers
            if cand is None:  # one column block, one stage
                return _select_last(buf, kk, n_blocks, pos, ratio, kk, plan.last)
            _select_first(buf, kk, n1 - n0, n0, pos, ratio, kk, plan.chunk, plan.first, cand)
            if not last:
                continue
            if plan.mid is not None:  # one column block (step >= n_blocks), few rows: a middle stage
                mid = torch.empty(T, plan.mid_chunks * kk, dtype=torch.int64, device=q.device)
                _select_first(cand, 0, plan.chunks * kk, 0, pos, ratio, kk, plan.mid_chunk, plan.mid, mid)
                return _select_last(mid, 0, plan.mid_chunks * kk, pos, ratio, kk, plan.last)
            return _select_last(cand, 0, plan.chunks * kk, pos, ratio, kk, plan.last)
        cand_keys = buf[:, kk:kk + n1 - n0] if n0 == 0 else buf[:, :kk + n1 - n0]
        top = torch.topk(cand_keys, kk, dim=1, sorted=last).values  # the keys are distinct: no tie to break
        if not last:
            buf[:, :kk].copy_(top)
    ids = _LOW - (top & 0xFFFFFFFF)
    valid = (ids + 1) * ratio <= pos[:, None].long() + 1
    return ids, valid
