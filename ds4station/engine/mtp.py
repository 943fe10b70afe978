"""Drafts from the model's MTP layer (serve --draft mtp): the stage that holds the embedding, the head and the
MTP layer keeps, per session, what the layer needs, and proposes the next tokens on request.

The MTP layer (model.MTPLayer, gpu.GpuMTP) at position i reads the model's last HC state h_i and the next
token x_{i+1} and predicts x_{i+2}. Its block attends over a window of its own KV, so every position's pair
(h_i, x_{i+1}) must pass through it, in order. Rather than run it beside every step of the model (and undo it
on every rejected draft), a session records the model's last HC states and tokens of its latest positions
(`record`, on every step of the stage, into a ring of window + MTP_RING_EXTRA positions) and the layer
catches up only when drafts are asked for (`draft`, the sessions decoding together in one step): the pairs
from where its cache stands (at most one window back) to the last token in the KV, then the chain:
(h_{p-1}, x_p) gives d_1, (its own state, d_1) gives d_2, and so on. The chain's rows are dropped from the
layer's cache afterwards (its length goes back to p), so what the layer holds depends only on the sequence,
never on which drafts were tried. A truncated or rewound session clamps the layer's cache with it; positions
whose HC state the ring no longer holds (a rewind further back than the ring) are skipped, which changes the
drafts of the next window only, never the output: every draft is verified (the scheduler).

Pairs older than one window are skipped exactly: a pair's KV row depends on that pair alone, and the chain
reads the rows of its last window only.

Drafts are the layer's greedy tokens. With random weights (the demo model, `make-model --mtp`) they are
rarely right; DeepSeek trained the published layer to predict the model's next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4station.model.config import ModelConfig
from ds4station.model.footprint import MTP_RING_EXTRA

from .kv import KVCache


@dataclass
class _MtpSession:
    cache: KVCache  # the MTP layer's own KV (its length: the pairs (h_i, x_{i+1}) it holds, i < length)
    hidden: torch.Tensor  # [ring, C, dim]: the model's last HC state of recent positions, by position % ring
    tokens: list[int]  # the token at each ring position
    positions: list[int]  # the position each ring row holds (-1: none)


class MtpDrafts:
    """The MTP layer's state of every session of one stage, and its drafts. `model`: the stage's backend (a
    DS4Model or GpuStage built with the MTP layer: `mtp_draft`, `new_mtp_caches`). One state per KV slot is
    allocated here, at load (model/footprint.py's mtp_bytes counts them), and a session takes a free one."""

    def __init__(self, model, cfg: ModelConfig, ctx: int, chunk: int, device: torch.device,  # noqa: ANN001
                 slots: int) -> None:
        self.model, self.cfg, self.ctx, self.device = model, cfg, ctx, device
        self.ring = cfg.window + MTP_RING_EXTRA  # beyond the window: a verification's rows and the chain's start
        self.chunk = max(chunk, self.ring)  # the layer's cache takes a whole catch-up (at most a window) at once
        self.free_states = [_MtpSession(cache, torch.zeros(self.ring, cfg.hc_mult, cfg.dim, device=device),
                                        [0] * self.ring, [-1] * self.ring)
                            for cache in model.new_mtp_caches(slots, ctx, self.chunk)]
        self.allocated = [*self.free_states]
        self.sessions: dict[int, _MtpSession] = {}

    def new_session(self, sid: int) -> None:
        s = self.free_states.pop()  # the KV slots and these states are as many: a session has both or neither
        s.cache.reset()
        s.positions[:] = [-1] * self.ring
        self.sessions[sid] = s

    def free(self, sid: int) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            self.free_states.append(s)

    def record(self, sid: int, p0: int, tokens: torch.Tensor, X: torch.Tensor) -> None:
        """The model's last HC states X [T, C, dim] of tokens [T] at positions p0.. (the last `ring` are kept)."""
        s = self.sessions.get(sid)
        if s is None:
            return
        T = X.shape[0]
        k = min(T, self.ring)
        rows = X[T - k:].to(s.hidden.device, torch.float32)
        done = 0
        for a, b in self._spans(p0 + T - k, k):  # device copies only: an index tensor would wait for the GPU
            s.hidden[a:b] = rows[done:done + b - a]
            done += b - a
        ids = tokens.view(-1).tolist()
        for j in range(T - k, T):
            slot = (p0 + j) % self.ring
            s.tokens[slot], s.positions[slot] = int(ids[j]), p0 + j

    def _spans(self, start: int, n: int) -> list[tuple[int, int]]:
        """The ring rows of positions start..start+n-1 (n <= ring) as at most two slices, in order."""
        a = start % self.ring
        if a + n <= self.ring:
            return [(a, a + n)]
        return [(a, self.ring), (0, a + n - self.ring)]

    def truncate(self, sid: int, n: int) -> None:
        """The session keeps its first n positions: the layer keeps the pairs that only they make (i < n - 1)."""
        s = self.sessions.get(sid)
        if s is None:
            return
        m = min(s.cache.length, max(n - 1, 0))
        if not s.cache.truncate(m):  # its ring no longer holds what position m needs: caught up again
            s.cache.reset()
        for slot, q in enumerate(s.positions):
            if q >= n:
                s.positions[slot] = -1

    def _held(self, s: _MtpSession, q: int) -> bool:
        return q >= 0 and s.positions[q % self.ring] == q

    @torch.inference_mode()
    def draft(self, sids: Sequence[int], lengths: Sequence[int], tokens: Sequence[int],
              ks: Sequence[int]) -> list[list[int]]:
        """Per session sids[i]: up to ks[i] tokens after tokens[i], the token about to be fed at position
        lengths[i] (the session holds positions 0..lengths[i] - 1); [] when the ring does not hold the model's
        state at lengths[i] - 1. The sessions that draft as many tokens run as one MTP step (GpuStage.mtp_draft:
        each weight read once for all of them)."""
        W, out = self.cfg.window, [[] for _ in sids]
        groups: dict[int, list[tuple[int, torch.Tensor, list[int]]]] = {}
        for i, (sid, length, token, k) in enumerate(zip(sids, lengths, tokens, ks, strict=True)):
            s = self.sessions[sid]
            last = length - 1
            k = min(k, self.ctx - 1 - last)
            if k <= 0 or not self._held(s, last):
                continue
            cache = s.cache
            # pairs older than one window are never read again; the last pair is always (re)run
            held_from = max(min(cache.length, last), last - (W - 1))
            while held_from < last and not self._held(s, held_from):  # the ring lost them (a far rewind): skipped
                held_from += 1
            cache.length = held_from  # (forward only) rows before it that the window still reads are stale or zero
            # the pairs (h_i, x_{i+1}) for i in [held_from, last] (the last: the model's state at `last` and the
            # token about to be fed), then the chain: depth 1 from that last pair, each further one from the depth
            # before; the tokens read once at the end
            H = torch.cat([s.hidden[a:b] for a, b in self._spans(held_from, length - held_from)])
            nxt = [s.tokens[(q + 1) % self.ring] for q in range(held_from, last)] + [int(token)]
            groups.setdefault(k, []).append((i, H, nxt))
        for k, group in groups.items():
            caches = [self.sessions[sids[i]].cache for i, _, _ in group]
            drafts = self.model.mtp_draft([H for _, H, _ in group], [nxt for _, _, nxt in group], caches, k).tolist()
            for (i, _, _), cache, d in zip(group, caches, drafts, strict=True):
                cache.length = min(cache.length, lengths[i])  # the chain's rows past (h_last, token) are dropped
                out[i] = d
        return out

    def nbytes(self) -> int:
        """What the sessions' states hold, all of them (their caches and rings)."""
        return sum(s.cache.nbytes() + s.hidden.numel() * s.hidden.element_size() for s in self.allocated)
