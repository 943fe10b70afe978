"""The per-sequence KV cache of one layer slice: what DeepSeek-V4 keeps between tokens, by layer type.

Every layer keeps a raw ring of its shared K=V rows (the sliding window). Compressed layers (ratio r > 0)
also keep the compressed rows (one per closed block of r positions) and the compressor's *frontier*: the
projected kv and gate scores of recent positions, from which the next block is pooled. Ratio-4 layers
additionally keep the lightning indexer's own compressed keys and frontier.

Rings are larger than the model strictly needs, by `slack = max(chunk, rollback)` positions:
- a prefill chunk of up to `chunk` tokens writes all its rows into the ring before attending to it;
- `truncate(n)` can roll the sequence back by up to `slack` tokens (live-KV prefix reuse in the server),
  because the raw rows and frontier projections that position n needs are still in the rings.
Further back, a *checkpoint* serves: `checkpoint()` copies what the rings hold for the current position (the
last `window` raw rows and the frontier rows of the blocks still open), and `rewind(n)` goes back to it from
any later position, however far; the server takes one at the end of every prompt, so the next turn of the
conversation reuses the whole earlier prompt whatever the answer after it was (reasoning dropped by the
client, an edited answer). Compressed rows and indexer keys are kept per block for the whole context.

Sizes follow model/footprint.py's `kv_bytes`, the one formula the planner and the engine use;
`KVCache.nbytes()` equals it (tested).

A server's sessions come from a `KVPool`: every tensor a decode step reads or writes (rings, compressed rows,
indexer keys, frontiers) is allocated once for all of them, [sessions, ...], and session s's cache holds
slot s of each; a batched decode step then reaches each of its sequences' KV through one slot index per row
(kernels take the pool and `slots`), so one captured graph serves any set of sessions of a batch size.
Raw/compressed rows and indexer keys are stored in `dtype`; frontiers always in float32 because the
compressor pools in fp32 (DeepSeek's reference: "compression need fp32").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds4station.kernels.reference import frontier_read
from ds4station.model.config import ModelConfig
from ds4station.model.footprint import CHECKPOINT_MARGIN, frontier_rows, kv_slack

DEFAULT_CHUNK = 256


def dtype_name(dtype: torch.dtype) -> str:
    """The footprint formula's name for a KV dtype ("f32", "f16", "bf16")."""
    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise ValueError(f"KV rows are kept in float32, float16 or bfloat16, not {dtype}")
    return names[dtype]


class Frontier:
    """Ring of a compressor's per-position projections (kv [width] and gate score + ape [width]); in a pool,
    kv and score are [sessions, rows, width]."""

    def __init__(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        self.rows = kv.shape[-2]
        self.kv, self.score = kv, score

    @classmethod
    def zeros(cls, rows: int, width: int, device: torch.device | str | None, lead: tuple[int, ...] = ()) -> Frontier:
        return cls(torch.zeros(*lead, rows, width, dtype=torch.float32, device=device),
                   torch.zeros(*lead, rows, width, dtype=torch.float32, device=device))

    def write(self, pos: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
              slots: torch.Tensor | None = None) -> None:
        """pos [T] absolute positions, kv/score [T, width]; in a pool, row t goes to session slots[t]'s ring."""
        rows = pos % self.rows
        where = rows if slots is None else (slots, rows)
        self.kv[where] = kv.float()
        self.score[where] = score.float()

    def read(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [...] -> kv, score [..., width]; positions < 0 read as kv = 0, score = -inf (no weight)."""
        return frontier_read(self.kv, self.score, pos)

    def nbytes(self) -> int:
        return self.kv.nbytes + self.score.nbytes

    def save(self, pos: torch.Tensor, into: Frontier) -> None:
        """Copy the entries of positions `pos` (all >= 0) into rows 0.. of `into` (a checkpoint)."""
        slots = pos % self.rows
        into.kv[: len(pos)] = self.kv[slots]
        into.score[: len(pos)] = self.score[slots]



@dataclass
class LayerKV:
    """One layer's cache; fields a layer type does not use are None."""

    raw: torch.Tensor  # [window + slack, head_dim] ring, row of position p at p % len
    comp: torch.Tensor | None = None  # [ceil(ctx / r), head_dim] compressed rows, block i at i
    comp_frontier: Frontier | None = None
    index_keys: torch.Tensor | None = None  # [ceil(ctx / 4), index_dim]
    index_frontier: Frontier | None = None
    # the checkpoint (KVCache.checkpoint): the last `window` raw rows and the frontiers' open-block rows
    saved_raw: torch.Tensor | None = None
    saved_comp: Frontier | None = None
    saved_index: Frontier | None = None

    def write_raw(self, pos: torch.Tensor, rows: torch.Tensor) -> None:
        self.raw[pos % self.raw.shape[0]] = rows.to(self.raw.dtype)

    def read_raw(self, pos: torch.Tensor) -> torch.Tensor:
        """pos [N] (all >= 0 and within the ring's reach) -> rows [N, head_dim] float32."""
        return self.raw[pos % self.raw.shape[0]].float()

    def slot(self, s: int) -> LayerKV:
        """Session s's view of a pool's layer (the tensors it steps, no checkpoint: that is per session)."""
        f = self.comp_frontier
        g = self.index_frontier
        return LayerKV(raw=self.raw[s], comp=None if self.comp is None else self.comp[s],
                       comp_frontier=None if f is None else Frontier(f.kv[s], f.score[s]),
                       index_keys=None if self.index_keys is None else self.index_keys[s],
                       index_frontier=None if g is None else Frontier(g.kv[s], g.score[s]))

    def nbytes(self) -> int:
        n = self.raw.nbytes
        for t in (self.comp, self.index_keys, self.saved_raw):
            n += 0 if t is None else t.nbytes
        for f in (self.comp_frontier, self.index_frontier, self.saved_comp, self.saved_index):
            n += 0 if f is None else f.nbytes()
        return n


def _stepped(cfg: ModelConfig, i: int, ctx: int, slack: int, dtype: torch.dtype, lead: tuple[int, ...],
             device: torch.device | str | None) -> LayerKV:
    """Layer i's tensors that the steps read and write (no checkpoint), each with leading dims `lead` (a pool:
    (sessions,))."""
    def zeros(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.zeros(*lead, *shape, dtype=dt, device=device)

    r = cfg.ratio(i)
    kv = LayerKV(raw=zeros(cfg.window + slack, cfg.head_dim))
    if r:
        kv.comp = zeros(math.ceil(ctx / r), cfg.head_dim)
        kv.comp_frontier = Frontier.zeros(frontier_rows(r, slack), cfg.compressor_width(i), device, lead)
    if cfg.has_indexer(i):
        kv.index_keys = zeros(math.ceil(ctx / 4), cfg.index_dim)
        kv.index_frontier = Frontier.zeros(frontier_rows(4, slack), 2 * cfg.index_dim, device, lead)
    return kv


class KVPool:
    """The stepped KV tensors of `sessions` caches allocated together (see the module docstring): `layers[i]` is
    layer i's LayerKV with [sessions, ...] tensors. `pooled_caches` makes a pool and the KVCache of each slot."""

    def __init__(self, cfg: ModelConfig, layers: range | None, sessions: int, ctx: int, *,
                 dtype: torch.dtype = torch.float32, chunk: int = DEFAULT_CHUNK, rollback: int = 0,
                 device: torch.device | str | None = None) -> None:
        if sessions < 1:
            raise ValueError(f"a KV pool holds at least one session, got {sessions}")
        _check_size(ctx, chunk, rollback)
        self.sessions = sessions
        slack = kv_slack(chunk, rollback)
        self.layers = {i: _stepped(cfg, i, ctx, slack, dtype, (sessions,), device)
                       for i in (range(cfg.n_layers) if layers is None else layers)}


def pooled_caches(cfg: ModelConfig, layers: range | None, sessions: int, ctx: int, *,
                  dtype: torch.dtype = torch.float32, chunk: int = DEFAULT_CHUNK, rollback: int = 0,
                  device: torch.device | str | None = None) -> list[KVCache]:
    """`sessions` caches, the slots of one new KVPool (each holds the pool; the pool holds no cache)."""
    pool = KVPool(cfg, layers, sessions, ctx, dtype=dtype, chunk=chunk, rollback=rollback, device=device)
    return [KVCache(cfg, layers, ctx, dtype=dtype, chunk=chunk, rollback=rollback, device=device, pool=pool, slot=s)
            for s in range(sessions)]


def _check_size(ctx: int, chunk: int, rollback: int) -> None:
    if ctx <= 0 or chunk <= 0 or rollback < 0:
        raise ValueError(f"bad KV cache size: ctx={ctx}, chunk={chunk}, rollback={rollback}")


class KVCache:
    """The cache of one sequence for the layers of one slice, sized for `ctx` positions: slot `slot` of a
    KVPool's tensors (a cache made on its own is the one slot of a pool of its own)."""

    def __init__(self, cfg: ModelConfig, layers: range | None, ctx: int, *, dtype: torch.dtype = torch.float32,
                 chunk: int = DEFAULT_CHUNK, rollback: int = 0, device: torch.device | str | None = None,
                 pool: KVPool | None = None, slot: int = 0) -> None:
        _check_size(ctx, chunk, rollback)
        self.cfg, self.ctx, self.dtype, self.chunk, self.rollback = cfg, ctx, dtype, chunk, rollback
        self.layer_range = range(cfg.n_layers) if layers is None else layers
        self.slack = kv_slack(chunk, rollback)
        if pool is None:
            pool, slot = KVPool(cfg, layers, 1, ctx, dtype=dtype, chunk=chunk, rollback=rollback, device=device), 0
        self.pool, self.slot = pool, slot
        self.length = 0  # positions written so far (the next token's position)
        # One past the highest position any step wrote rows for: a static-shape step of a short prompt pads it
        # to its row class and writes rows past `length` (never read: every read is bounded by the position).
        self.written = 0
        self.layers: dict[int, LayerKV] = {}
        for i in self.layer_range:
            r = cfg.ratio(i)
            kv = pool.layers[i].slot(slot)
            kv.saved_raw = torch.zeros(cfg.window + CHECKPOINT_MARGIN, cfg.head_dim, dtype=dtype, device=device)
            if r:
                kv.saved_comp = Frontier.zeros(frontier_rows(r, CHECKPOINT_MARGIN), cfg.compressor_width(i), device)
            if cfg.has_indexer(i):
                kv.saved_index = Frontier.zeros(frontier_rows(4, CHECKPOINT_MARGIN), 2 * cfg.index_dim, device)
            self.layers[i] = kv
        self.saved_at: int | None = None  # the checkpoint's position, None: none taken (or no longer valid)

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def nbytes(self) -> int:
        return sum(kv.nbytes() for kv in self.layers.values())

    @property
    def max_rollback(self) -> int:
        """How far back `truncate` can always go: the rings keep `slack` positions beyond what decoding needs."""
        return self.slack

    def check_room(self, n_new: int) -> None:
        if n_new > self.chunk:
            raise ValueError(f"{n_new} tokens in one step exceed the cache's chunk size {self.chunk}; split them")
        if self.length + n_new > self.ctx:
            raise ValueError(f"context full: {self.length} + {n_new} tokens exceed ctx {self.ctx}; "
                             "start a new session or load with a larger --ctx")

    def truncate(self, n: int) -> bool:
        """Roll the sequence back to its first `n` positions. False (cache unchanged) when the rings no
        longer hold what position n needs, i.e. when going back more than `max_rollback` tokens."""
        if n < 0 or n > self.length:
            return False
        if n == self.length:
            return True
        # A ring slot of a position p is next written by position p + its size: what n needs is gone once any
        # position more than `slack` beyond n was written, including a padded row, or a row of a turn that an
        # earlier truncate rolled back (hence the high-water mark, not the current length).
        if max(self.written, self.length) - n > self.slack:
            return False
        # Compressed rows of blocks that closed after n, frontier and ring entries at positions >= n are
        # simply overwritten later: every read is bounded by `length`.
        self.length = n
        if self.saved_at is not None and self.saved_at > n:
            self.saved_at = None  # it held a prefix the sequence no longer has
        return True

    def checkpoint(self) -> None:
        """Keep what the current position, and the CHECKPOINT_MARGIN positions before it, need: a later
        `rewind` can come back to any of them (a chat template renders the prompt's last tokens, its assistant
        opening, otherwise in the history than in the prompt). One checkpoint: it replaces the last."""
        c = self.length
        for i, kv in self.layers.items():
            for ring, saved, span in self._saved(i, kv):
                pos = self._positions(c, span + CHECKPOINT_MARGIN, kv.raw.device)
                if isinstance(ring, Frontier):
                    ring.save(pos, saved)  # type: ignore[arg-type]
                else:
                    saved[: len(pos)] = ring[pos % ring.shape[0]]  # type: ignore[index]
        self.saved_at = c

    def rewind(self, n: int) -> int:
        """Roll back to at most `n` positions: to n itself when `truncate` can, else to min(n, checkpoint)
        when that is within CHECKPOINT_MARGIN of the checkpoint (its rows restored). -> the new length, or -1
        (cache unchanged) when neither can."""
        if self.truncate(n):
            return n
        c = self.saved_at
        if c is None or c > self.length:
            return -1
        t = min(n, c)
        if t < c - CHECKPOINT_MARGIN:
            return -1
        self._restore(t, c)
        return t

    def _restore(self, t: int, c: int) -> None:
        """Write into the rings what position t needs, from the checkpoint taken at c (c - MARGIN <= t <= c)."""
        for i, kv in self.layers.items():
            for ring, saved, span in self._saved(i, kv):
                base = max(c - span - CHECKPOINT_MARGIN, 0)  # the first position the checkpoint holds
                pos = self._positions(t, span, kv.raw.device)  # what position t needs, no more (a ring slot
                rows = pos - base  # of a later position may be the same slot)
                if isinstance(ring, Frontier):
                    ring.write(pos, saved.kv[rows], saved.score[rows])  # type: ignore[union-attr]
                else:
                    ring[pos % ring.shape[0]] = saved[rows]  # type: ignore[index]
        # the rings hold position t's state again; what any later position wrote is overwritten before it is read.
        # Only what t needs was restored: the rows before t's window are stale, so `truncate` must not go below
        # t (the high-water mark says the slack is used up); further back only a checkpoint serves.
        self.length = t
        self.written = t + self.slack
        if t < c:
            self.saved_at = None  # its rows for positions after t are stale now

    # ---- the state as named tensors (disk checkpoints, engine/kvdisk.py) ---------------------------------
    def state(self) -> list[tuple[str, torch.Tensor]]:
        """Everything a fresh cache needs to continue from the current position: the checkpoint's rows (taken
        now unless it is at this position already) and the closed blocks' compressed rows and indexer keys.
        The tensors are views of the cache (copy them before the cache moves on)."""
        if self.saved_at != self.length:
            self.checkpoint()
        return self._state_views(self.length)

    def _state_views(self, n: int) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for i, kv in self.layers.items():
            assert kv.saved_raw is not None
            out.append((f"{i}.saved_raw", kv.saved_raw))
            if kv.comp is not None and kv.saved_comp is not None:
                out += [(f"{i}.comp", kv.comp[: n // self.cfg.ratio(i)]), (f"{i}.saved_comp.kv", kv.saved_comp.kv),
                        (f"{i}.saved_comp.score", kv.saved_comp.score)]
            if kv.index_keys is not None and kv.saved_index is not None:
                out += [(f"{i}.index_keys", kv.index_keys[: n // 4]), (f"{i}.saved_index.kv", kv.saved_index.kv),
                        (f"{i}.saved_index.score", kv.saved_index.score)]
        return out

    def load_state(self, n: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make this cache the one `state()` was taken from at position n (its checkpoint included). Every
        tensor must be there with the shape and dtype `state()` gives for n (ValueError otherwise, before
        anything is written); the cache must hold at least n positions."""
        if not 0 < n <= self.ctx:
            raise ValueError(f"a state of {n} positions does not fit a cache of {self.ctx}")
        targets = dict(self._state_views(n))  # where each tensor goes
        if set(targets) != set(tensors):
            missing, extra = sorted(set(targets) - set(tensors)), sorted(set(tensors) - set(targets))
            raise ValueError(f"the state does not fit these layers: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, dst in targets.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"state tensor {name}: {tuple(src.shape)} {src.dtype}, this cache holds "
                                 f"{tuple(dst.shape)} {dst.dtype}")
        for name, dst in targets.items():
            dst.copy_(tensors[name])
        self.reset()
        self.length = n
        self.saved_at = n
        self._restore(n, n)

    def _saved(self, layer: int, kv: LayerKV) -> list[tuple[torch.Tensor | Frontier, torch.Tensor | Frontier, int]]:
        """(ring, its checkpoint copy, the positions before the current one it must keep) of a layer."""
        out: list[tuple[torch.Tensor | Frontier, torch.Tensor | Frontier, int]] = []
        assert kv.saved_raw is not None
        out.append((kv.raw, kv.saved_raw, self.cfg.window))
        if kv.comp_frontier is not None and kv.saved_comp is not None:
            out.append((kv.comp_frontier, kv.saved_comp, frontier_rows(self.cfg.ratio(layer), 0)))
        if kv.index_frontier is not None and kv.saved_index is not None:
            out.append((kv.index_frontier, kv.saved_index, frontier_rows(4, 0)))
        return out

    @staticmethod
    def _positions(c: int, span: int, device: torch.device) -> torch.Tensor:
        return torch.arange(max(c - span, 0), c, device=device)

    def advance(self, n: int, written: int | None = None) -> None:
        """After a step: n more positions hold the sequence; rows were written up to `written` (default
        the new length)."""
        self.length += n
        self.written = max(self.written, self.length, written or 0)

    def reset(self) -> None:
        self.length = self.written = 0
        self.saved_at = None
