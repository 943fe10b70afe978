"""DeepSeek-V4-Flash in plain PyTorch: the numerical reference for every kernel and faster path.

Written from /work/shared/DS4-MODEL.md and checked against DeepSeek's reference `inference/model.py`,
antirez/ds4 `ds4.c` and transformers' `DeepseekV4ForCausalLM` (tests/test_model_transformers.py).
Everything is fp32, one sequence (no batch dimension), one code path: a forward over T new tokens at
positions p0..p0+T-1 reads and extends a `KVCache`. A full-sequence forward is that with an empty cache;
decoding is T = 1; chunked prefill is several calls. Shapes in comments: T new tokens, N keys, H heads,
D head_dim, C hc_mult, E experts.

A `DS4Model` is any contiguous layer slice, with or without the embedding and the output head, so a
pipeline stage builds and runs exactly its part: `prefill` / `decode` take the HC state from the previous
stage (or embed the tokens) and give the next stage's state (or the head's logits).

The quantisation-aware round trips of the real model (FP8 e4m3 on the non-RoPE KV dims; Hadamard + FP4
e2m1 in the lightning indexer) are on by default and switchable (`RoundTrips`) for comparisons with
references that lack them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4station.kernels.reference import (
    HyperConnection,
    Rope,
    fp4_e2m1_roundtrip,
    fp8_e4m3_roundtrip,
    hadamard,
    hc_mix,
    rms_norm,
    sink_attention,
    swiglu,
)
from ds4station.model.config import ModelConfig
from ds4station.model.layout import MTP_PREFIX, model_tensors, mtp_config, mtp_name

from .kv import DEFAULT_CHUNK, Frontier, KVCache, LayerKV, pooled_caches

Tensor = torch.Tensor


@dataclass(frozen=True)
class RoundTrips:
    """The model's quantisation-aware-training round trips (both on in the real model)."""

    fp8_kv: bool = True  # FP8 e4m3 on KV dims [:nope] of raw and compressed rows
    indexer_fp4: bool = True  # Hadamard-128 rotation + FP4 e2m1 on indexer queries and keys


OFF = RoundTrips(fp8_kv=False, indexer_fp4=False)


class Compressor:
    """Gated pooling of each block of r positions into one row (DS4-MODEL.md 3, "Compressor").

    Ratio 4 overlaps: projections are 2 x d wide and block i pools 2r entries, block i-1's positions with
    channels [:d] and block i's with channels [d:] (block 0's predecessors: kv = 0, score = -inf).
    The pooled row is RMS-normed, RoPE'd at the block's first position, then round-tripped (`finish`).
    """

    def __init__(self, w: Callable[[str], Tensor], prefix: str, ratio: int, rope: Rope, eps: float,
                 finish: Callable[[Tensor], Tensor]) -> None:
        self.kv_w = w(f"{prefix}_kv.weight")  # [coff*d, dim]
        self.gate_w = w(f"{prefix}_gate.weight")  # [coff*d, dim]
        self.ape = w(f"{prefix}_ape.weight")  # [r, coff*d]
        self.norm = w(f"{prefix}_norm.weight")  # [d]
        self.ratio, self.rope, self.eps, self.finish = ratio, rope, eps, finish
        self.d = self.norm.numel()
        self.coff = self.kv_w.shape[0] // self.d

    def __call__(self, xn: Tensor, pos: Tensor, frontier: Frontier, rows: Tensor) -> None:
        """Project xn [T, dim] at positions pos [T] into the frontier; write the rows of every block that
        closes within these positions into `rows` [n_blocks_max, d]."""
        r, d, coff = self.ratio, self.d, self.coff
        kv = xn @ self.kv_w.T  # [T, coff*d]
        score = xn @ self.gate_w.T + self.ape[pos % r]  # [T, coff*d]
        frontier.write(pos, kv, score)
        p0, p1 = int(pos[0]), int(pos[-1]) + 1
        blocks = torch.arange(p0 // r, p1 // r, device=xn.device)  # blocks whose last position is in [p0, p1)
        if blocks.numel() == 0:
            return
        src = blocks[:, None] * r - (coff - 1) * r + torch.arange(coff * r, device=xn.device)  # [B, coff*r]
        kv_s, sc_s = frontier.read(src)  # [B, coff*r, coff*d]
        if coff == 2:  # previous block's entries use channels [:d], this block's [d:]
            kv_s = torch.cat((kv_s[:, :r, :d], kv_s[:, r:, d:]), dim=1)
            sc_s = torch.cat((sc_s[:, :r, :d], sc_s[:, r:, d:]), dim=1)
        pooled = (sc_s.softmax(dim=1) * kv_s).sum(1)  # [B, d], per-channel softmax over the entries
        pooled = self.rope(rms_norm(pooled, self.norm, self.eps), blocks * r)
        rows[blocks] = self.finish(pooled).to(rows.dtype)


class Indexer:
    """Lightning indexer of a ratio-4 layer: picks, per query, the top-k visible compressed blocks."""

    def __init__(self, cfg: ModelConfig, w: Callable[[str], Tensor], p: str, rope: Rope, rt: RoundTrips) -> None:
        self.cfg, self.rope = cfg, rope
        self.qat = (lambda x: fp4_e2m1_roundtrip(hadamard(x))) if rt.indexer_fp4 else (lambda x: x)
        self.q_b = w(f"{p}.indexer.attn_q_b.weight")  # [IH*idim, q_lora]
        self.proj = w(f"{p}.indexer.proj.weight")  # [IH, dim]
        self.compressor = Compressor(w, f"{p}.indexer_compressor", 4, rope, cfg.rms_eps, self.qat)

    def __call__(self, xn: Tensor, qr: Tensor, pos: Tensor, kv: LayerKV) -> Tensor:
        """-> allowed [T, n_blocks]: the top-min(k, n_blocks) visible blocks of each query."""
        cfg, T = self.cfg, xn.shape[0]
        assert kv.index_frontier is not None and kv.index_keys is not None
        self.compressor(xn, pos, kv.index_frontier, kv.index_keys)
        n_blocks = (int(pos[-1]) + 1) // 4
        visible = _visible_blocks(pos, n_blocks, 4)
        if n_blocks == 0:
            return visible
        keys = kv.index_keys[:n_blocks].float()  # [n, idim]
        q = (qr @ self.q_b.T).view(T, cfg.index_heads, cfg.index_dim)
        q = self.qat(self.rope(q, pos))
        w = (xn @ self.proj.T) * (cfg.index_dim**-0.5 * cfg.index_heads**-0.5)  # [T, IH]
        score = torch.einsum("th,thn->tn", w, torch.einsum("thd,nd->thn", q, keys).relu())
        score = score.masked_fill(~visible, float("-inf"))
        # Ties (e.g. blocks where every head's dot product is <= 0 score exactly 0) go to the earlier block,
        # as in ds4's selection loop; a stable sort makes that independent of chunking, torch.topk does not.
        top = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, : min(cfg.index_topk, n_blocks)]
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible  # early queries see fewer than k blocks: drop the -inf picks


def _visible_blocks(pos: Tensor, n_blocks: int, ratio: int) -> Tensor:
    """[T, n_blocks]: block i is visible to position s iff it has closed, (i + 1) * r <= s + 1."""
    i = torch.arange(n_blocks, device=pos.device)
    return (i[None] + 1) * ratio <= pos[:, None] + 1


class Attention:
    """Shared-KV MQA over the raw window + the layer's compressed rows, with sinks (DS4-MODEL.md 3)."""

    def __init__(self, cfg: ModelConfig, layer: int, w: Callable[[str], Tensor], rt: RoundTrips) -> None:
        p = f"blk.{layer}"
        self.cfg, self.layer, self.ratio = cfg, layer, cfg.ratio(layer)
        self.rope = Rope(cfg, compressed=self.ratio > 0, device=w(f"{p}.attn_sinks.weight").device)
        self.q_a, self.q_a_norm = w(f"{p}.attn_q_a.weight"), w(f"{p}.attn_q_a_norm.weight")
        self.q_b = w(f"{p}.attn_q_b.weight")  # [H*D, q_lora]
        self.kv, self.kv_norm = w(f"{p}.attn_kv.weight"), w(f"{p}.attn_kv_a_norm.weight")
        self.sinks = w(f"{p}.attn_sinks.weight")  # [H]
        self.out_a = w(f"{p}.attn_output_a.weight")  # [G*o_lora, (H/G)*D]
        self.out_b = w(f"{p}.attn_output_b.weight")  # [dim, G*o_lora]
        nope = cfg.nope_dim

        def kv_round_trip(x: Tensor) -> Tensor:
            if not rt.fp8_kv:
                return x
            return torch.cat((fp8_e4m3_roundtrip(x[..., :nope]), x[..., nope:]), dim=-1)

        self.kv_round_trip = kv_round_trip
        self.compressor = (Compressor(w, f"{p}.attn_compressor", self.ratio, self.rope, cfg.rms_eps, kv_round_trip)
                           if self.ratio else None)
        self.indexer = Indexer(cfg, w, p, self.rope, rt) if cfg.has_indexer(layer) else None

    def __call__(self, xn: Tensor, pos: Tensor, kv: LayerKV) -> Tensor:
        """xn [T, dim] (attn_norm'ed sublayer input) at positions pos [T] -> [T, dim]."""
        cfg, T = self.cfg, xn.shape[0]
        H, D, eps = cfg.n_heads, cfg.head_dim, cfg.rms_eps
        qr = rms_norm(xn @ self.q_a.T, self.q_a_norm, eps)  # [T, q_lora]
        q = rms_norm((qr @ self.q_b.T).view(T, H, D), None, eps)  # per-head norm, no weight
        q = self.rope(q, pos)
        row = self.rope(rms_norm(xn @ self.kv.T, self.kv_norm, eps), pos)  # [T, D]
        kv.write_raw(pos, self.kv_round_trip(row))

        # raw window: position s sees positions s-window+1 .. s
        p0, p1 = int(pos[0]), int(pos[-1]) + 1
        raw_pos = torch.arange(max(0, p0 - cfg.window + 1), p1, device=xn.device)
        keys = kv.read_raw(raw_pos)  # [Nr, D]
        allowed = (raw_pos[None] <= pos[:, None]) & (raw_pos[None] > pos[:, None] - cfg.window)
        if self.compressor is not None:
            assert kv.comp is not None and kv.comp_frontier is not None
            self.compressor(xn, pos, kv.comp_frontier, kv.comp)
            n_blocks = p1 // self.ratio
            sel = self.indexer(xn, qr, pos, kv) if self.indexer else _visible_blocks(pos, n_blocks, self.ratio)
            keys = torch.cat((keys, kv.comp[:n_blocks].float()))
            allowed = torch.cat((allowed, sel), dim=1)

        o = sink_attention(q, keys, allowed, self.sinks, D**-0.5)  # [T, H, D]
        o = self.rope(o, pos, inverse=True)  # values carry rotated dims: rotate back to the query position
        G = cfg.o_groups
        o = torch.einsum("tgi,gri->tgr", o.reshape(T, G, -1), self.out_a.view(G, cfg.o_lora_rank, -1))
        return o.reshape(T, -1) @ self.out_b.T


# ---- mixture of experts --------------------------------------------------------------------------------
class MoE:
    """sqrt-softplus router (bias for selection only, or hash table), clamped SwiGLU experts + shared."""

    def __init__(self, cfg: ModelConfig, layer: int, w: Callable[[str], Tensor]) -> None:
        p = f"blk.{layer}"
        self.cfg, self.clamp, self.shared_clamp = cfg, cfg.swiglu_clamp[layer], cfg.swiglu_clamp_shared[layer]
        self.gate_inp = w(f"{p}.ffn_gate_inp.weight")  # [E, dim]
        self.hash = cfg.is_hash_layer(layer)
        self.tid2eid = w(f"{p}.ffn_gate_tid2eid.weight").long() if self.hash else None  # [vocab, k]
        self.bias = None if self.hash else w(f"{p}.exp_probs_b.bias")  # [E]
        self.gate, self.up = w(f"{p}.ffn_gate_exps.weight"), w(f"{p}.ffn_up_exps.weight")  # [E, ffn, dim]
        self.down = w(f"{p}.ffn_down_exps.weight")  # [E, dim, ffn]
        self.shared = None
        if cfg.n_shared_experts:
            self.shared = tuple(w(f"{p}.ffn_{k}_shexp.weight") for k in ("gate", "up", "down"))

    def route(self, xn: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """-> (expert ids [T, k], weights [T, k])."""
        p = torch.sqrt(F.softplus(xn @ self.gate_inp.T))  # [T, E]
        if self.tid2eid is not None:
            ids = self.tid2eid[tokens]
        else:
            ids = (p + self.bias).topk(self.cfg.n_experts_used, dim=-1).indices
        wts = p.gather(1, ids)
        if self.cfg.expert_weights_norm:
            wts = wts / wts.sum(-1, keepdim=True)
        return ids, wts * self.cfg.expert_weights_scale

    def __call__(self, xn: Tensor, tokens: Tensor) -> Tensor:
        """xn [T, dim] (ffn_norm'ed), tokens [T] -> [T, dim]."""
        ids, wts = self.route(xn, tokens)
        y = torch.zeros_like(xn)
        for e in ids.unique().tolist():
            t, slot = torch.where(ids == e)
            x = xn[t]
            h = swiglu(x @ self.gate[e].T, x @ self.up[e].T, self.clamp) * wts[t, slot, None]  # weight before down
            y.index_add_(0, t, h @ self.down[e].T)
        if self.shared is not None:
            g, u, d = self.shared
            y = y + swiglu(xn @ g.T, xn @ u.T, self.shared_clamp) @ d.T
        return y


class Block:
    """One layer: hc_pre -> attn_norm -> attention -> hc_post -> hc_pre -> ffn_norm -> MoE -> hc_post."""

    def __init__(self, cfg: ModelConfig, layer: int, w: Callable[[str], Tensor],
                 rt: RoundTrips) -> None:
        p = f"blk.{layer}"
        self.layer = layer
        self.hc_attn = HyperConnection(w(f"{p}.hc_attn_fn.weight"), w(f"{p}.hc_attn_scale.weight"),
                                       w(f"{p}.hc_attn_base.weight"), cfg)
        self.hc_ffn = HyperConnection(w(f"{p}.hc_ffn_fn.weight"), w(f"{p}.hc_ffn_scale.weight"),
                                      w(f"{p}.hc_ffn_base.weight"), cfg)
        self.attn_norm, self.ffn_norm = w(f"{p}.attn_norm.weight"), w(f"{p}.ffn_norm.weight")
        self.attn = Attention(cfg, layer, w, rt)
        self.moe = MoE(cfg, layer, w)
        self.eps = cfg.rms_eps

    def __call__(self, X: Tensor, tokens: Tensor, pos: Tensor, kv: LayerKV) -> Tensor:
        """X [T, C, dim] -> [T, C, dim]."""
        x, post, comb = self.hc_attn.pre(X)
        X = HyperConnection.post(self.attn(rms_norm(x, self.attn_norm, self.eps), pos, kv), X, post, comb)
        x, post, comb = self.hc_ffn.pre(X)
        return HyperConnection.post(self.moe(rms_norm(x, self.ffn_norm, self.eps), tokens), X, post, comb)


def hc_head(X: Tensor, hc: HyperConnection, norm: Tensor, output: Tensor, cfg: ModelConfig) -> Tensor:
    """HC state [T, C, dim] -> logits [T, vocab]: sigmoid-weighted stream sum (no Sinkhorn), norm, output."""
    mix = hc_mix(X, hc.fn, cfg.rms_eps)  # [T, C]
    pre = torch.sigmoid(mix * hc.scale + hc.base) + cfg.hc_eps
    return rms_norm((pre.unsqueeze(-1) * X).sum(1), norm, cfg.rms_eps) @ output.T


class MTPLayer:
    """DeepSeek-V4's next-token-prediction layer (DeepSeek's `MTPBlock`, ds4's `mtp.0.*` tensors). At position
    i it takes the model's last HC state h_i [C, dim] (what its head read) and the next token x_{i+1}, and
    predicts x_{i+2}: X = Block(e_proj(enorm(embed(x_{i+1}))) + h_proj(hnorm(h_i)), per stream), logits =
    output(norm(hc_head(X))). Its block is mtp_config's last layer (window-only, routed by scores) with a KV
    cache of its own; the embedding and the output matrix are the model's (on a slice that does not embed, the
    embedding's own copy). Drafting chains it: the next depth takes its own X in place of h (engine/mtp.py)."""

    def __init__(self, cfg: ModelConfig, w: Callable[[str], Tensor], token_embd: Tensor, output: Tensor,
                 rt: RoundTrips) -> None:
        self.cfg, self.mcfg, self.layer = cfg, mtp_config(cfg), cfg.n_layers
        self.block = Block(self.mcfg, self.layer, lambda name: w(mtp_name(name, cfg)), rt)
        self.e_proj, self.h_proj = w(MTP_PREFIX + "e_proj.weight"), w(MTP_PREFIX + "h_proj.weight")  # [dim, dim]
        self.enorm, self.hnorm, self.norm = (w(f"{MTP_PREFIX}{k}.weight") for k in ("enorm", "hnorm", "norm"))
        self.hc = HyperConnection(*(w(f"{MTP_PREFIX}hc_head_{k}.weight") for k in ("fn", "scale", "base")), cfg)
        self.token_embd, self.output = token_embd, output

    def new_cache(self, ctx: int, chunk: int, device: torch.device | str | None = None) -> KVCache:
        return KVCache(self.mcfg, range(self.layer, self.layer + 1), ctx, chunk=chunk, device=device)

    def __call__(self, H: Tensor, tokens: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """H [T, C, dim] (the model's HC states at positions cache.length..), tokens [T] (the tokens after them)
        -> (the layer's HC states [T, C, dim], logits [T, vocab]); the positions are appended to `cache`."""
        T, eps = tokens.numel(), self.cfg.rms_eps
        cache.check_room(T)
        pos = torch.arange(cache.length, cache.length + T, device=H.device)
        e = rms_norm(self.token_embd[tokens], self.enorm, eps) @ self.e_proj.T  # [T, dim]
        x = rms_norm(H, self.hnorm, eps) @ self.h_proj.T + e.unsqueeze(1)  # [T, C, dim]
        X = self.block(x, tokens, pos, cache[self.layer])
        cache.advance(T)
        return X, hc_head(X, self.hc, self.norm, self.output, self.cfg)


# ---- the model (one slice) -----------------------------------------------------------------------------
class DS4Model:
    """Layers `layers` of DeepSeek-V4 (default all), plus the embedding and/or the output head."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Tensor], layers: range | None = None, *,
                 embed: bool = True, output: bool = True, round_trips: RoundTrips = RoundTrips(),
                 mtp: bool = False) -> None:
        """`mtp`: build the MTP layer too (`self.mtp`; its tensors in `weights`, and the token embedding's;
        needs the head)."""
        self.cfg = cfg
        self.layers = range(cfg.n_layers) if layers is None else layers
        if self.layers.step != 1 or self.layers.start < 0 or self.layers.stop > cfg.n_layers:
            raise ValueError(f"layer slice {self.layers} is not a contiguous range within 0..{cfg.n_layers}")
        self.has_embed, self.has_output, self.round_trips = embed, output, round_trips
        if mtp and not output:
            raise ValueError("the MTP layer runs on the slice that holds the output head")
        needed = {s.name for s in model_tensors(cfg, "f32", self.layers, embed=embed or mtp, output=output, mtp=mtp)}
        missing = sorted(needed - set(weights))
        if missing:
            raise KeyError(f"weights for the slice are missing {len(missing)} tensor(s), e.g. {missing[:3]}")

        def w(name: str) -> Tensor:
            t = weights[name]
            return t if not t.is_floating_point() or t.dtype == torch.float32 else t.float()

        self.device = next(iter(weights.values())).device if weights else torch.device("cpu")
        self.token_embd = w("token_embd.weight") if embed else None  # [vocab, dim]
        self.blocks = [Block(cfg, i, w, round_trips) for i in self.layers]
        if output:
            self.out_hc = HyperConnection(w("output_hc_fn.weight"), w("output_hc_scale.weight"),
                                          w("output_hc_base.weight"), cfg)
            self.output_norm, self.output = w("output_norm.weight"), w("output.weight")  # [dim], [vocab, dim]
        # the MTP layer reads the token embedding: the slice's, or on a slice that does not embed its own copy
        self.mtp = MTPLayer(cfg, w, w("token_embd.weight") if self.token_embd is None else self.token_embd,
                            self.output, round_trips) if mtp else None

    def new_cache(self, ctx: int, *, chunk: int = DEFAULT_CHUNK, rollback: int = 0,
                  dtype: torch.dtype = torch.float32) -> KVCache:
        return KVCache(self.cfg, self.layers, ctx, dtype=dtype, chunk=chunk, rollback=rollback, device=self.device)

    def new_caches(self, n: int, ctx: int, *, chunk: int = DEFAULT_CHUNK, rollback: int = 0,
                   dtype: torch.dtype = torch.float32) -> list[KVCache]:
        """n caches, the slots of one KVPool (the kernel stage decodes such caches in one batched step)."""
        return pooled_caches(self.cfg, self.layers, n, ctx, dtype=dtype, chunk=chunk, rollback=rollback,
                             device=self.device)

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [T] -> HC state [T, C, dim]: C copies of the embedding."""
        if self.token_embd is None:
            raise RuntimeError("this model slice has no embedding")
        x = self.token_embd[tokens]
        return x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def head(self, X: Tensor) -> Tensor:
        """HC state [T, C, dim] -> logits [T, vocab]: sigmoid-weighted stream sum (no Sinkhorn), norm, output."""
        if not self.has_output:
            raise RuntimeError("this model slice has no output head")
        return hc_head(X, self.out_hc, self.output_norm, self.output, self.cfg)

    # ---- the backend interface (the same as engine/gpu.py's kernel stage; engine/stage.py drives both) ------
    @torch.inference_mode()
    def prefill(self, tokens: Tensor | list[int], cache: KVCache, X: Tensor | None = None, *,
                logits: bool = False, all_logits: bool = False) -> Tensor:
        """Append tokens [T] at positions cache.length.. to the cache, in pieces of at most cache.chunk. X:
        their HC state [T, C, dim] from the previous stage (None: embedded here). -> the HC state [T, C, dim]
        out of this slice's layers, or with `logits` the head's logits of the last position [vocab] (with
        `all_logits` too, of every position [T, vocab]: a draft's verification). Token ids are needed by the
        hash-routed layers."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
        outs = []
        for s in range(0, tokens.numel(), cache.chunk):
            t = tokens[s: s + cache.chunk]
            T = t.numel()
            cache.check_room(T)
            x = self.embed(t) if X is None else X[s: s + T].to(self.device, torch.float32)
            pos = torch.arange(cache.length, cache.length + T, device=self.device)
            for block in self.blocks:
                x = block(x, t, pos, cache[block.layer])
            cache.advance(T)
            outs.append(x)
        if logits:
            return self.head(torch.cat(outs)) if all_logits else self.head(outs[-1][-1:])[0]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def decode(self, token: int, cache: KVCache, X: Tensor | None = None, *, logits: bool = False) -> Tensor:
        """One token: `prefill` of [token] (the reference has no faster way)."""
        return self.prefill([token], cache, X, logits=logits)

    @torch.inference_mode()
    def mtp_step(self, H: Tensor, tokens: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """The MTP layer over H [T, C, dim] and the tokens after them, at positions cache.length.. of its own
        cache (`mtp.new_cache`) -> (its HC states, logits [T, vocab]); see MTPLayer."""
        assert self.mtp is not None
        return self.mtp(H.to(self.device, torch.float32), torch.as_tensor(tokens, device=self.device).view(-1), cache)

    @torch.inference_mode()
    def mtp_draft(self, H: Sequence[Tensor], tokens: Sequence[Tensor | Sequence[int]], caches: Sequence[KVCache],
                  k: int) -> Tensor:
        """Per sequence i: the pairs (H[i][j], tokens[i][j]) at positions caches[i].length.., then a chain of k
        depths, each from the state and greedy token of the one before, one mtp_step each -> the tokens [N, k]
        (GpuStage.mtp_draft's reference)."""
        drafts = []
        for h, t, cache in zip(H, tokens, caches, strict=True):
            X, logits = self.mtp_step(h, torch.as_tensor(t), cache)
            out = [logits[-1].argmax().view(1)]
            for _ in range(k - 1):
                X, logits = self.mtp_step(X[-1:], out[-1], cache)
                out.append(logits[-1].argmax().view(1))
            drafts.append(torch.cat(out))
        return torch.stack(drafts)

    def new_mtp_caches(self, n: int, ctx: int, chunk: int) -> list[KVCache]:
        assert self.mtp is not None
        return [self.mtp.new_cache(ctx, chunk, self.device) for _ in range(n)]


# ---- random weights (tests, benchmarks) ----------------------------------------------------------------
def random_weights(cfg: ModelConfig, seed: int = 0, layers: range | None = None, *, embed: bool = True,
                   output: bool = True, mtp: bool = False) -> dict[str, Tensor]:
    """Float weights of the layout with sensible scales (norms ~1, projections ~1/sqrt(fan_in)), the same
    values the demo model maker draws."""
    from .demo import random_weight

    gen = torch.Generator().manual_seed(seed)
    return {s.name: random_weight(s, cfg, gen)
            for s in model_tensors(cfg, "f32", layers, embed=embed, output=output, mtp=mtp)}
