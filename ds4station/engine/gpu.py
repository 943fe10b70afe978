"""The fast execution path of one stage: quantised weights in kernel form, preallocated KV, graph decode.

`GpuStage` runs the same DeepSeek-V4 layer slice as the reference `DS4Model` (model.py), on its `KVCache`,
with every op a kernel of ds4station/kernels:
- weights stay quantised, repacked once into what the Triton kernels read (Q8_0 -> int8 + fp16 scales,
  Q4_K -> nibble words + scale bytes, IQ2_XXS / Q2_K experts -> packed words); F16 tensors stay fp16;
  projections of the same input are stacked into one matvec (q_a + kv; the compressors' kv / gate and the
  indexer's head weights; the shared expert's gate + up);
- each row is finished in one launch (norm, RoPE, Hadamard, FP8 / FP4 round trip, KV ring write), the
  compressor update and the indexer's top-k are one kernel each, attention reads the window from the ring;
- every decode op has a static shape and no host synchronisation, so a whole decode step is captured in
  one CUDA graph (HIP graph on ROCm) and replayed; the context-dependent parts (indexer keys, compressed
  rows) are read up to a power-of-two position bucket, one graph per bucket; a stage without the
  embedding or the head captures its layers alone, from and to a static HC state;
- a short prefill (up to 32 tokens: a chat turn's first prompt, a settled answer) is the same static-shape
  step over a row class of 4-32 positions (the prompt padded with rows past its end, which nothing reads
  before real tokens overwrite them), replayed from a graph per (row class, bucket): eager launches of
  ~2,300 kernels cost more host time than the whole step takes on the GPU;
- longer prefill runs in chunks with bounded scratch: the indexer keeps a running top-k over column blocks,
  the attention kernel one query per program with an online softmax (no [T, keys] x heads tensor).
On a CPU tensor every kernel call falls back to the kernels' torch references, so the same code is tested
against the reference model without a GPU (tests/test_gpu_stage.py), and under `interpreted_kernels()` the
Triton kernels themselves run in the interpreter.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

from ds4station.kernels import dispatch, ops, pdl
from ds4station.kernels import hc as hc_k
from ds4station.kernels.attention import attention_decode, attention_prefill
from ds4station.kernels.compressor import Finish, compress_blocks, compress_decode, compress_rows
from ds4station.kernels.f16 import f16_matvec
from ds4station.kernels.indexer import index_topk
from ds4station.kernels.iq2_xxs import PackedIQ2XXS
from ds4station.kernels.norm import rms_norm, rope_, swiglu
from ds4station.kernels.q2_k import PackedQ2K
from ds4station.kernels.q4_k import PackedQ4K
from ds4station.kernels.q8_0 import PackedQ8_0
from ds4station.kernels.quants import QTensor
from ds4station.kernels.reference import HyperConnection, Rope
from ds4station.kernels.router import router
from ds4station.kernels.rows import finish_rows
from ds4station.kernels.splitk import counter_lane, split_counters
from ds4station.model.config import ModelConfig
from ds4station.model.layout import MTP_PREFIX, model_tensors, mtp_config, mtp_name

from .experts import ExpertCache
from .kv import DEFAULT_CHUNK, Frontier, KVCache, KVPool, pooled_caches
from .model import RoundTrips

log = logging.getLogger(__name__)

Tensor = torch.Tensor
Weight = QTensor | Tensor

SCRATCH_BYTES = 256 << 20  # bound on one prefill attention / indexer score block
MIN_BUCKET = 4096  # smallest decode position bucket
# Row classes of the static-shape short prefill: a prompt of 2..32 tokens runs padded to the next class. 2 and 3
# are a verification of one or two drafts: on the H200 a step costs about its rows (batched decode: 12.9 ms at 2
# rows, 17.2 at 4, against 8.9 at one), so padding them to 4 rows threw that away.
SHORT_ROWS = (2, 3, 4, 8, 16, 24, 32)
# The head form of a static step that returns every real row's logits (a draft's verification), beside
# False (the stage's output state) and True (the last real row's logits).
ALL_ROWS = "all"


def _q(w: Weight) -> QTensor:
    if isinstance(w, QTensor):
        return w
    if w.dtype == torch.int32:
        return QTensor(w.contiguous().view(torch.uint8).view(-1), Q.I32, tuple(w.shape))
    return QTensor(w.float().contiguous().view(torch.uint8).view(-1), Q.F32, tuple(w.shape))


def _dense(w: Weight, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A float weight on the device; F16 raw blocks are viewed, not dequantised, on the way."""
    q = _q(w)
    if q.qtype == Q.F16:
        t = q.data.view(torch.float16).view(q.shape)
    elif q.qtype == Q.I32:
        return q.data.view(torch.int32).view(q.shape).to(device)
    else:
        t = q.dequantize()
    return t.to(device=device, dtype=dtype)


def _kept(w: Weight, device: torch.device) -> Tensor:
    """A float matrix as the kernel stage holds it: fp16 on a GPU (no bf16: Vega20 has none); on the CPU in
    the file's own width (F16 stays fp16, converted exactly to fp32 where it is used; anything else fp32)."""
    q = _q(w)
    return _dense(q, device, torch.float16 if device.type == "cuda" or q.qtype == Q.F16 else torch.float32)


def _cat_rows(ws: list[Weight]) -> Weight:
    """Weights of one type and width stacked by rows: projections of the same input become one matvec."""
    qs = [_q(w) for w in ws]
    if len({(q.qtype, q.shape[-1]) for q in qs}) != 1 or any(len(q.shape) != 2 for q in qs):
        raise ValueError("only 2-D weights of one type and width can be stacked")
    return QTensor(torch.cat([q.data.view(-1) for q in qs]), qs[0].qtype, (sum(q.shape[0] for q in qs), qs[0].shape[1]))


class Linear:
    """y = x @ W^T in fp32, with W in the form its kernel reads. `groups` = G splits W's rows into G
    groups, group g reading x[:, g*K:(g+1)*K] (the grouped attention output projection)."""

    def __init__(self, w: Weight, device: torch.device, groups: int = 1) -> None:
        q = _q(w)
        self.groups = groups
        self.n, self.k = q.shape[0], q.shape[-1]
        self.packed: PackedQ8_0 | None = None
        self.dense: Tensor | None = None
        if q.qtype == Q.Q8_0 or (q.qtype == Q.Q4_K and groups == 1):  # kernel forms (grouped: Q8_0 only)
            self.packed = ops.repack(q.data, q.qtype.name, self.k, device)
        else:
            self.dense = _kept(q, device)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else self.dense.numel() * self.dense.element_size()

    def act16(self, x: Tensor) -> bool:
        """Whether this projection reads x's rows quantised to 16 bits (ops.linear_act16): then x's producer may
        emit them so (norm.rms_norm(quant="act16")) and pass them as `act`."""
        return self.packed is not None and ops.linear_act16(x, self.packed)

    def __call__(self, x: Tensor, act: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        if self.dense is not None:
            if self.groups == 1 and self.dense.dtype == torch.float16 and x.shape[0] <= ops.MAX_MATVEC_ROWS \
                    and dispatch.use_triton(x):
                return f16_matvec(x, self.dense)
            w = self.dense if self.dense.device.type == "cuda" else self.dense.float()  # CPU: fp32 math
            if self.groups == 1:
                return (x.to(w.dtype) @ w.T).float()
            xg = x.to(w.dtype).view(x.shape[0], self.groups, self.k)
            return torch.einsum("mgk,gnk->mgn", xg, w.view(self.groups, -1, self.k)).flatten(1).float()
        return ops.linear(x if dispatch.use_triton(x) else x.float(), self.packed, self.groups,
                          out_dtype=torch.float32, act=act)


def _pack_experts(w: Weight, device: torch.device) -> PackedIQ2XXS | PackedQ2K | PackedQ4K | PackedQ8_0 | Tensor:
    """A layer's routed experts [E, N, K] in the form the MoE reads: IQ2_XXS / Q2_K / Q4_K / Q8_0 packed for
    the fused kernels; float types (F32 / F16 / BF16 files) dense, fp16 on a GPU, exact fp32 on the CPU."""
    q = _q(w)
    k = q.shape[-1]
    if q.qtype in (Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.Q8_0):
        return ops.repack(q.data.view(*q.shape[:-1], -1), q.qtype.name, k, device)  # raw [E, N, row bytes]
    if q.qtype in (Q.F32, Q.F16, Q.BF16):
        return _kept(q, device)
    raise NotImplementedError(f"the kernel stage has routed-expert kernels for IQ2_XXS, Q2_K, Q4_K and Q8_0 "
                              f"(and float experts), not {q.qtype.name}")


class Experts:
    """A layer's routed experts, packed: gate/up [E, F, D], down [E, D, F]. `int_dot` picks the decode
    kernels' integer-dot path (int8 activations, as llama.cpp's q8_1; default on CUDA) or exact fp32 math."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, clamp: float, device: torch.device,
                 int_dot: bool | None = None) -> None:
        self.gate, self.up, self.down = (_pack_experts(w, device) for w in (gate, up, down))
        self.clamp = clamp if clamp > 0 else None
        self.int_dot = int_dot

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() if isinstance(w, Tensor) else w.nbytes
                   for w in (self.gate, self.up, self.down))

    def act_layout(self, xn: Tensor) -> str | None:
        """The layout the MoE reads xn's rows quantised in (ops.moe_act_layout), or None."""
        return ops.moe_act_layout(xn, self.gate, self.down, self.int_dot)

    def __call__(self, xn: Tensor, ids: Tensor, wts: Tensor, last: Tensor | None = None,
                 xq: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """xn [T, D], ids / wts [T, S] -> [T, D] fp32. `last` (device, [1]): the last real token of a padded
        static step; the decode kernels may skip the tokens after it (their rows are never read). `xq`: xn
        quantised in `act_layout`'s layout by its producer."""
        return ops.moe(xn, self.gate, self.up, self.down, ids, wts, self.clamp, int_dot=self.int_dot, last=last,
                       xq=xq)


class StreamedExperts:
    """A layer's routed experts read from the stage's ExpertCache: the selection becomes slots of the cache's
    pool through the slot table (on the device; the layer loop has made sure they are loaded, see
    GpuStage._run_layers), and the same MoE kernels read the pool through them."""

    nbytes = 0  # the pool is the cache's, counted once for the stage

    def __init__(self, cache: ExpertCache, layer: int, clamp: float, int_dot: bool | None = None) -> None:
        self.cache, self.layer = cache, layer
        self.clamp = clamp if clamp > 0 else None
        self.int_dot = int_dot

    def act_layout(self, xn: Tensor) -> str | None:
        gate, _, down = self.cache.parts()
        return ops.moe_act_layout(xn, gate, down, self.int_dot)

    def __call__(self, xn: Tensor, ids: Tensor, wts: Tensor, last: Tensor | None = None,
                 xq: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        gate, up, down = self.cache.parts()
        return ops.moe(xn, gate, up, down, self.cache.lookup(self.layer, ids), wts, self.clamp,
                       int_dot=self.int_dot, last=last, xq=xq)


# ---- one layer's weights -----------------------------------------------------------------------------------
@dataclass
class CompressorW:
    """A compressor: its kv and score projections are columns [offset, offset + width) and
    [offset + width, offset + 2 * width) of the layer's fused projection of the attention input."""

    ape: Tensor  # [r, width] fp32
    ratio: int
    width: int  # coff * d
    offset: int
    fin: Finish


class GpuLayer:
    """One layer's weights in kernel form. Projections of the same input are stacked into one matvec: q_a
    and kv (Q8_0), the compressors' kv / gate and the indexer's head weights (F16), shared gate and up."""

    def __init__(self, cfg: ModelConfig, i: int, w: Mapping[str, Weight], dev: torch.device,
                 int_dot: bool | None = None, rt: RoundTrips = RoundTrips(),
                 experts: ExpertCache | None = None) -> None:
        p = f"blk.{i}"

        def f32(name: str) -> Tensor:
            return _dense(w[f"{p}.{name}"], dev, torch.float32)

        def lin(name: str, groups: int = 1) -> Linear:
            return Linear(w[f"{p}.{name}.weight"], dev, groups)

        def stacked(*names: str) -> Linear:
            return Linear(_cat_rows([w[f"{p}.{n}.weight"] for n in names]), dev)

        self.layer, self.ratio = i, cfg.ratio(i)
        self.hc_attn = HyperConnection(f32("hc_attn_fn.weight"), f32("hc_attn_scale.weight"),
                                       f32("hc_attn_base.weight"), cfg)
        self.hc_ffn = HyperConnection(f32("hc_ffn_fn.weight"), f32("hc_ffn_scale.weight"),
                                      f32("hc_ffn_base.weight"), cfg)
        self.attn_norm, self.ffn_norm = f32("attn_norm.weight"), f32("ffn_norm.weight")
        self.q_lora = cfg.q_lora_rank
        self.q_kv = stacked("attn_q_a", "attn_kv")  # -> [q_lora | head_dim]
        self.q_a_norm, self.q_b = f32("attn_q_a_norm.weight"), lin("attn_q_b")
        self.kv_norm = f32("attn_kv_a_norm.weight")
        self.sinks = f32("attn_sinks.weight")
        self.out_a, self.out_b = lin("attn_output_a", cfg.o_groups), lin("attn_output_b")
        self.rope = Rope(cfg, compressed=self.ratio > 0, device=dev)
        self.comp = self.index_comp = self.proj = None
        if self.ratio:
            names = ["attn_compressor_kv", "attn_compressor_gate"]
            kv_rt = "fp8" if rt.fp8_kv else None
            self.comp = CompressorW(f32("attn_compressor_ape.weight"), self.ratio, cfg.compressor_width(i), 0,
                                    Finish(f32("attn_compressor_norm.weight"), cfg.rms_eps, self.rope.inv_freq,
                                           kv_rt, cfg.nope_dim))
            if cfg.has_indexer(i):
                names += ["indexer_compressor_kv", "indexer_compressor_gate", "indexer.proj"]
                fp4 = rt.indexer_fp4
                self.index_comp = CompressorW(f32("indexer_compressor_ape.weight"), 4, 2 * cfg.index_dim,
                                              2 * self.comp.width,
                                              Finish(f32("indexer_compressor_norm.weight"), cfg.rms_eps,
                                                     self.rope.inv_freq, "fp4" if fp4 else None, 0, fp4))
                self.index_w = 2 * (self.comp.width + self.index_comp.width)  # indexer head weights column
                self.index_q_b = lin("indexer.attn_q_b")
            self.proj = stacked(*names)
        self.gate_inp = lin("ffn_gate_inp")
        self.tid2eid = _dense(w[f"{p}.ffn_gate_tid2eid.weight"], dev, torch.int32).long() \
            if cfg.is_hash_layer(i) else None
        self.bias = None if cfg.is_hash_layer(i) else f32("exp_probs_b.bias")
        self.experts: Experts | StreamedExperts = StreamedExperts(experts, i, cfg.swiglu_clamp[i], int_dot) \
            if experts is not None else Experts(w[f"{p}.ffn_gate_exps.weight"], w[f"{p}.ffn_up_exps.weight"],
                                                w[f"{p}.ffn_down_exps.weight"], cfg.swiglu_clamp[i], dev, int_dot)
        self.shared = (stacked("ffn_gate_shexp", "ffn_up_shexp"), lin("ffn_down_shexp")) \
            if cfg.n_shared_experts else None
        self.shared_clamp = cfg.swiglu_clamp_shared[i]


class _MtpWeights(Mapping[str, Weight]):
    """The MTP layer's tensors under the names of mtp_config's last layer (blk.N.x for mtp.0.x)."""

    def __init__(self, weights: Mapping[str, Weight], cfg: ModelConfig) -> None:
        self.weights, self.cfg = weights, cfg

    def __getitem__(self, name: str) -> Weight:
        return self.weights[mtp_name(name, self.cfg)]

    def __iter__(self):  # noqa: ANN204
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


class GpuMTP:
    """The MTP layer in kernel form (model.MTPLayer's math): its block as a GpuLayer of mtp_config, its input
    projections and its hyper-connection head; the output matrix is the stage's, and so is the token embedding
    (a copy of its own on a stage that does not embed)."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, Weight], dev: torch.device, int_dot: bool | None,
                 rt: RoundTrips, token_embd: Tensor) -> None:
        self.cfg, self.mcfg, self.token_embd = cfg, mtp_config(cfg), token_embd
        self.block = GpuLayer(self.mcfg, cfg.n_layers, _MtpWeights(w, cfg), dev, int_dot, rt)
        self.e_proj, self.h_proj = (Linear(w[f"{MTP_PREFIX}{k}.weight"], dev) for k in ("e_proj", "h_proj"))
        self.enorm, self.hnorm, self.norm = (_dense(w[f"{MTP_PREFIX}{k}.weight"], dev, torch.float32)
                                             for k in ("enorm", "hnorm", "norm"))
        self.hc = HyperConnection(*(_dense(w[f"{MTP_PREFIX}hc_head_{k}.weight"], dev, torch.float32)
                                    for k in ("fn", "scale", "base")), cfg)


# ---- the stage -----------------------------------------------------------------------------------------------
@dataclass
class _Routed:
    """A layer's state at its router: the HC state after attention, the FFN input and its hyper-connection
    mix, and the experts chosen with their weights."""

    X: Tensor
    xn: Tensor
    post: Tensor
    comb: Tensor
    ids: Tensor
    wts: Tensor
    xq: tuple[Tensor, Tensor, Tensor] | None = None  # xn quantised for the experts' integer-dot kernels
    x16: tuple[Tensor, Tensor, Tensor] | None = None  # ... and for the shared expert's gate + up


@dataclass
class Step:
    """Where a forward call sits: positions pos [T] (device) and, for chunked prefill, their host bounds.
    `bucket` > 0 marks a static-shape step (decode, or a padded short prefill) that reads context up to
    `bucket` positions and bounds nothing by a host integer."""

    pos: Tensor
    p0: int | None
    p1: int | None
    bucket: int = 0
    last: Tensor | None = None  # a padded static step: the index of its last real row, [1] on the device
    slots: Tensor | None = None  # a static step: row b's KV is slot slots[b] of the pool, [T] on the device

    @property
    def static(self) -> bool:
        return self.bucket > 0


@dataclass
class _Pooled:
    """A static step's KV (a decode step of one sequence or of a batch, a short prefill): the pool its
    sequences' caches are slots of (layer i: the pool's [S, ...] tensors, which the kernels index by
    Step.slots)."""

    pool: KVPool

    def __getitem__(self, layer: int):  # noqa: ANN204 (LayerKV)
        return self.pool.layers[layer]


class GpuStage:
    """Layers `layers` of DeepSeek-V4 with the embedding and/or head, on one device (GPU, or CPU for tests)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Weight], layers: range | None = None, *,
                 embed: bool = True, output: bool = True, device: str | torch.device = "cuda",
                 round_trips: RoundTrips = RoundTrips(), int_dot: bool | None = None,
                 experts: ExpertCache | None = None, mtp: bool = False) -> None:
        """`int_dot`: the MoE decode kernels' integer-dot path (None = the backend's default, on for CUDA);
        False gives fp32 math, for comparisons with the reference. `experts`: stream the routed experts through
        this cache (engine/experts.py) instead of holding them; every other weight stays resident (the MTP
        layer's experts too). `mtp`: the MTP layer as well (`mtp_step`; needs the head, and the token embedding
        among `weights`)."""
        self.cfg, self.device = cfg, torch.device(device)
        self.layers = range(cfg.n_layers) if layers is None else layers
        self.has_embed, self.has_output, self.rt = embed, output, round_trips
        if mtp and not output:
            raise ValueError("the MTP layer runs on the stage that holds the output head")
        needed = [s.name for s in model_tensors(cfg, "f32", self.layers, embed=embed or mtp, output=output, mtp=mtp)]
        missing = [n for n in needed if n not in weights]
        if missing:
            raise KeyError(f"weights for the stage are missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if self.device.type == "cuda":  # fp16 GEMMs accumulate in fp32, as the reference does
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
            split_counters(self.device, lane=0)  # the split-K matmul's counters, before any graph is captured
        dev = self.device
        self.token_embd = _kept(weights["token_embd.weight"], dev) if embed else None
        self.experts = experts
        self.blocks = [GpuLayer(cfg, i, weights, dev, int_dot, round_trips, experts) for i in self.layers]
        if output:
            self.out_hc = HyperConnection(*(_dense(weights[f"output_hc_{k}.weight"], dev, torch.float32)
                                            for k in ("fn", "scale", "base")), cfg)
            self.output_norm = _dense(weights["output_norm.weight"], dev, torch.float32)
            self.output = Linear(weights["output.weight"], dev)
        # the MTP layer reads the token embedding: the stage's, or on a stage that does not embed its own copy
        self.mtp = GpuMTP(cfg, weights, dev, int_dot, round_trips,
                          _kept(weights["token_embd.weight"], dev) if self.token_embd is None else self.token_embd) \
            if mtp else None
        self._graphs: dict[tuple, _StepGraph | _SegmentedStep | _BatchGraph | _MultiGraph | _MtpGraph] = {}
        self.graph_pool: tuple | None = None  # the CUDA graph memory pool all of this stage's graphs share
        # decode steps as captured CUDA / HIP graphs (on a GPU); DS4STATION_CUDA_GRAPHS=0 launches eagerly
        self.graphs = _env_on("DS4STATION_CUDA_GRAPHS")
        # static steps run the projections that do not wait on each other on two streams (GPU; _beside):
        # DS4STATION_OVERLAP=0 keeps them on one
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" and _env_on("DS4STATION_OVERLAP") \
            else None
        if self.side is not None:
            split_counters(self.device, lane=1)

    # ---- building blocks -----------------------------------------------------------------------------------
    def new_cache(self, ctx: int, *, chunk: int = DEFAULT_CHUNK, rollback: int = 0,
                  dtype: torch.dtype = torch.float32) -> KVCache:
        """KV rows in float32 or float16 (the kernels read both; the frontiers stay float32)."""
        return self.new_caches(1, ctx, chunk=chunk, rollback=rollback, dtype=dtype)[0]

    def new_caches(self, n: int, ctx: int, *, chunk: int = DEFAULT_CHUNK, rollback: int = 0,
                   dtype: torch.dtype = torch.float32) -> list[KVCache]:
        """n caches, the slots of one KVPool: any of them decode together in one batched step (decode_batch)."""
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the kernel stage keeps KV in float32 or float16, not {dtype}")
        return pooled_caches(self.cfg, self.layers, n, ctx, dtype=dtype, chunk=chunk, rollback=rollback,
                             device=self.device)

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.token_embd[tokens].float()
        return x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def head(self, X: Tensor) -> Tensor:
        return self._logits(X, self.out_hc, self.output_norm)

    def _logits(self, X: Tensor, h: HyperConnection, norm: Tensor) -> Tensor:
        """The output matrix over RMSNorm of the HC state X's head stream sum (hc_head_pre; its rows quantised in
        the same launch when the output matrix reads them so)."""
        cfg = self.cfg
        xn, act = hc_k.hc_head_pre(X, h.fn, h.scale, h.base, cfg.rms_eps, cfg.hc_eps, norm,
                                   "act16" if self.output.act16(X[:, 0]) else None)
        return self.output(xn, act)

    def _compress(self, c: CompressorW, proj: Tensor, st: Step, frontier: Frontier, rows: Tensor) -> None:
        """Write these positions' projections into the frontier and pool the blocks they close (one kernel for
        decode; a static step decides on the device which blocks its positions close)."""
        kv, sc = proj[:, c.offset:c.offset + c.width], proj[:, c.offset + c.width:c.offset + 2 * c.width]
        if st.static and st.last is None:  # a decode step: one row per sequence (one, or a batch's)
            compress_decode(kv, sc, c.ape, st.pos, frontier.kv, frontier.score, rows, c.ratio, c.fin, slots=st.slots)
            return
        frontier.write(st.pos, kv, sc + c.ape[st.pos % c.ratio], st.slots)
        if st.static:  # several positions of one sequence: written first, then each pools the block it closes
            compress_rows(frontier.kv, frontier.score, rows, st.pos, c.ratio, c.fin, slots=st.slots)
            return
        b0 = st.p0 // c.ratio
        compress_blocks(frontier.kv, frontier.score, rows, b0, st.p1 // c.ratio - b0, c.ratio, c.fin)

    def _index(self, L: GpuLayer, proj: Tensor, iq: Tensor, st: Step, kv) -> tuple[Tensor, Tensor]:
        """Lightning indexer over its query projection iq [T, heads * dim] -> (selected block ids [T, k],
        valid [T, k])."""
        cfg, T = self.cfg, iq.shape[0]
        self._compress(L.index_comp, proj, st, kv.index_frontier, kv.index_keys)
        n_blocks = st.bucket // 4 if st.static else st.p1 // 4
        if n_blocks == 0:
            z = torch.zeros(T, 1, dtype=torch.long, device=iq.device)
            return z, z.bool()
        fp4 = self.rt.indexer_fp4
        q = finish_rows(iq.view(T * cfg.index_heads, cfg.index_dim), st.pos, cfg.index_heads,
                        inv_freq=L.rope.inv_freq, hadamard=fp4, rt="fp4" if fp4 else None)
        w = proj[:, L.index_w:L.index_w + cfg.index_heads]  # scaled as the kernel reads it (no launch of its own)
        # fp16 dot operands are exact for FP4-round-tripped queries and keys, and only then
        return index_topk(q.view(T, cfg.index_heads, cfg.index_dim), w, kv.index_keys, n_blocks, st.pos, 4,
                          cfg.index_topk, fp16_dot=fp4, slots=st.slots,
                          w_scale=cfg.index_dim ** -0.5 * cfg.index_heads ** -0.5)

    def _attention(self, L: GpuLayer, xn: Tensor, act: tuple[Tensor, Tensor, Tensor] | None, st: Step,
                   kv) -> Tensor:
        """Attention of rows xn [T, dim] (attn_norm's output; `act`: its rows quantised for q_kv's integer-dot
        matvec where q_kv reads them so: `_to_router`). `kv`: the layer's LayerKV of the sequence they extend, or for a
        batched decode step (st.slots) the pool's (row b is one token of sequence slots[b]). The projections
        run over all rows at once (the weights are read once for the batch), and so does what touches the KV:
        each kernel reaches a row's sequence through its slot."""
        cfg, T = self.cfg, xn.shape[0]
        H, D, eps = cfg.n_heads, cfg.head_dim, cfg.rms_eps
        with self._beside(st):  # the compressor / indexer projections need only xn: beside the query's
            proj = L.proj(xn) if L.comp is not None else None
        q_kv = L.q_kv(xn, act)
        qr, (act,) = _norm(q_kv[:, :L.q_lora], L.q_a_norm, eps, "act16" if L.q_b.act16(q_kv) else None)
        with self._beside(st):
            iq = L.index_q_b(qr) if L.index_comp is not None else None
            # the KV writes and the indexer need q_kv, proj and iq only: beside q_b and the query's finish (on
            # the side stream in a static step: off the path a decode step waits on)
            ids, valid = self._write_kv(L, q_kv, proj, iq, st, kv)
        q = finish_rows(L.q_b(qr, act).view(T * H, D), st.pos, H, norm=True, eps=eps, inv_freq=L.rope.inv_freq)
        self._join(st)
        # RoPE undone on its rotated dims; quantised for out_a's integer-dot matvec where it reads that
        o, act = self._attend_kv(L, q, ids, valid, st, kv, L.out_a.act16(xn))
        return L.out_b(L.out_a(o.reshape(T, -1), act))

    def _write_kv(self, L: GpuLayer, q_kv: Tensor, proj: Tensor | None, iq: Tensor | None, st: Step,
                  kv) -> tuple[Tensor | None, Tensor | None]:
        """What attention writes to the KV before it reads it: the K=V rows into the ring, the compressors'
        frontiers and pooled rows, and (a ratio-4 layer) the indexer's keys and its selection -> (ids, valid) of
        the selected compressed rows per query, or (None, None) for a layer without the indexer."""
        cfg = self.cfg
        finish_rows(q_kv[:, L.q_lora:], st.pos, 1, norm=True, weight=L.kv_norm, eps=cfg.rms_eps,
                    inv_freq=L.rope.inv_freq, rt="fp8" if self.rt.fp8_kv else None, nope=cfg.nope_dim, ring=kv.raw,
                    slots=st.slots)
        if L.comp is not None:
            self._compress(L.comp, proj, st, kv.comp_frontier, kv.comp)
        if L.index_comp is None:
            return None, None
        return self._index(L, proj, iq, st, kv)  # per-query row ids into kv.comp

    def _attend_kv(self, L: GpuLayer, q: Tensor, ids: Tensor | None, valid: Tensor | None, st: Step, kv,
                   act16: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """Attention of the queries q [T * H, D] over the KV `_write_kv` wrote (with the indexer's selection
        ids / valid on a ratio-4 layer) -> ([T, H, D] (one sequence's, or with st.slots one row of each sequence
        of a batch, kv the pool's), the inverse RoPE applied to its rotated dims, and with act16 in a static
        step its rows quantised as quantize_act16 gives them, else None; both in the decode kernel's combine
        launch)."""
        cfg, T = self.cfg, q.shape[0] // self.cfg.n_heads
        H, D, W = cfg.n_heads, cfg.head_dim, cfg.window
        indexed = L.index_comp is not None
        if st.static:  # split-K over the keys, per query; window and visible rows derived from the positions
            n_blocks = st.bucket // L.ratio if L.ratio else 0
            kc = kv.comp if indexed else kv.comp[..., :n_blocks, :] if n_blocks else None
            o = attention_decode(q.view(T, H, D), kv.raw, None, kc, valid if indexed else None, L.sinks, D ** -0.5,
                                 ids=ids if indexed else None, pos=st.pos, window=W, ratio=0 if indexed else L.ratio,
                                 slots=st.slots, unrope=L.rope.inv_freq, act16=act16)
            return o if act16 else (o, None)
        if dispatch.use_triton(q):  # prefill kernel: each query's own window and rows, online softmax
            kc = kv.comp if indexed else kv.comp[:st.p1 // L.ratio] if L.ratio else None
            o = attention_prefill(q.view(T, H, D), kv.raw, kc, valid, L.sinks, D ** -0.5, ids, st.pos, W,
                                  0 if indexed else L.ratio)
        else:
            raw_pos = st.p0 - (W - 1) + torch.arange(W + T - 1, device=q.device)
            keys_w = kv.read_raw(raw_pos.clamp(min=0))
            allow_w = (raw_pos[None] <= st.pos[:, None]) & (raw_pos[None] > st.pos[:, None] - W) & (raw_pos[None] >= 0)
            keys_c, allow_c = ids, valid
            if L.comp is not None and not indexed:
                n_blocks = st.p1 // L.ratio
                keys_c = kv.comp[:n_blocks]
                allow_c = (torch.arange(n_blocks, device=q.device)[None] + 1) * L.ratio <= st.pos[:, None] + 1
            o = self._attend(q.view(T, H, D), keys_w, allow_w, kv.comp, keys_c, allow_c, L.sinks, indexed)
        return _rope(L.rope, o.view(T, H, D), st.pos, inverse=True), None

    @staticmethod
    def _attend(q: Tensor, kw: Tensor, aw: Tensor, comp: Tensor | None, kc: Tensor | None, ac: Tensor | None,
                sinks: Tensor, indexed: bool) -> Tensor:
        """Prefill sink attention in torch (the CPU path; GPUs run kernels/attention.py's prefill kernel) of
        q [T, H, D] over shared window keys kw [Nw, D] (mask aw [T, Nw]) and compressed rows: shared kc [Nc, D]
        (mask ac [T, Nc]) or, indexed, per-query row ids kc [T, k] into comp. Queries go in blocks so the logits
        never exceed SCRATCH_BYTES."""
        T, H, D = q.shape
        scale = D ** -0.5
        n_keys = kw.shape[0] + (0 if kc is None else kc.shape[-1] if indexed else kc.shape[0])
        per_query = 4 * (H * max(n_keys, 1) + (kc.shape[-1] * D if indexed else 0))  # logits + gathered rows
        qb = max(1, SCRATCH_BYTES // per_query)
        out = []
        for t0 in range(0, T, qb):
            qs, sl = q[t0:t0 + qb], slice(t0, t0 + qb)
            z = torch.einsum("thd,nd->thn", qs, kw) * scale
            mask = aw[sl]
            if kc is not None:
                if indexed:
                    rows = comp[kc[sl]].float()  # [t, k, D]
                    zc = torch.einsum("thd,tkd->thk", qs, rows) * scale
                else:
                    rows = kc.float()
                    zc = torch.einsum("thd,nd->thn", qs, rows) * scale
                z, mask = torch.cat((z, zc), -1), torch.cat((mask, ac[sl]), -1)
            z = z.masked_fill(~mask.unsqueeze(1), float("-inf"))
            m = torch.maximum(z.amax(-1), sinks)
            e = torch.exp(z - m.unsqueeze(-1))
            p = e / (e.sum(-1) + torch.exp(sinks - m)).unsqueeze(-1)
            nw = kw.shape[0]
            o = torch.einsum("thn,nd->thd", p[..., :nw], kw)
            if kc is not None:
                o = o + (torch.einsum("thk,tkd->thd", p[..., nw:], rows) if indexed
                         else torch.einsum("thn,nd->thd", p[..., nw:], rows))
            out.append(o)
        return torch.cat(out)

    def _run_layers(self, X: Tensor, tokens: Tensor, cache: KVCache | _Pooled, st: Step) -> Tensor:
        """The stage's layers over X [T, C, dim] -> [T, C, dim]: segment after segment (see _segment), a
        streaming stage loading each routed layer's selected experts in between (and the hash-routed layers'
        ahead, from the tokens). `cache`: the sequence's KV, or a batched decode step's pool (rows by st.slots)."""
        n = len(self.blocks)
        if self.experts is not None:
            self.experts.prefetch(tokens)
        state: Tensor | _Routed = X
        for k in range(n + 1):
            state = self._segment(k, state, tokens, cache, st)
            if k < n and self.experts is not None:
                assert isinstance(state, _Routed)
                self.experts.ensure(self.blocks[k].layer, state.ids)
        assert isinstance(state, Tensor)
        return state

    def _segment(self, k: int, state: Tensor | _Routed, tokens: Tensor, cache: KVCache | _Pooled,
                 st: Step) -> Tensor | _Routed:
        """Segment k of the layer loop, cut at the routers: the FFN of layer k-1 (from its routed state; k = 0
        starts from the HC state X) and then layer k up to its router (-> its routed state; k = n ends with the
        stage's output HC state). A streaming stage's decode captures each segment as a graph and loads the
        experts a router chose between two replays (_SegmentedStep)."""
        part = None
        if k == 0:
            assert isinstance(state, Tensor)
            X = state
        else:
            assert isinstance(state, _Routed)
            # in a static step hc_post of layer k-1's FFN computes the mix partials of layer k's first hc_pre
            X, part = self._ffn(self.blocks[k - 1], state, st, self.blocks[k].hc_attn.fn
                                if k < len(self.blocks) and st.static else None)
        if k == len(self.blocks):
            return X
        L = self.blocks[k]
        return self._to_router(L, X, tokens, cache[L.layer], st, part)

    def _ffn(self, L: GpuLayer, state: _Routed, st: Step, mix: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """A layer's FFN from its routed state: the routed experts and the shared one, then hc_post -> (the HC
        state, on a GPU with `mix` (the next hc_pre's fn) its mix partials for that hc_pre, else None). In a
        padded static step the padding rows stay copies of the last real row (hc_post's `last`)."""
        shared = None
        if L.shared is not None:
            gate_up, down = L.shared
            with self._beside(st):  # the shared expert beside the routed ones
                gu = gate_up(state.xn, state.x16)
                # quantised in swiglu's launch for down's integer-dot matvec, where it reads that
                q16 = down.act16(gu)
                h, act = swiglu(gu, L.shared_clamp, act16=True) if q16 else (swiglu(gu, L.shared_clamp), None)
                shared = down(h, act)
        y = L.experts(state.xn, state.ids, state.wts, st.last, state.xq)
        self._join(st)
        # y + shared summed in hc_post; a padded step's padding rows take the last real row's (the MoE kernels
        # skipped them): they stay copies of it, so their KV writes (the same rows) are its own
        return hc_k.hc_post(y, state.X, state.post, state.comb, shared, mix, st.last)

    @contextlib.contextmanager
    def _beside(self, st: Step) -> Iterator[None]:
        """The block's launches go to the stage's second stream (`side`), after all that the current stream has
        issued so far, in a static step on a GPU (elsewhere they run in place, in order). They overlap the
        current stream's next launches until `_join`; the block's split-K matmuls count on lane 1."""
        if self.side is None or not st.static:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side), counter_lane(1):
            yield

    def _join(self, st: Step) -> None:
        """The current stream waits for what `_beside` put on the side stream (before anything reads it, and
        before the step's tensors it read can be freed)."""
        if self.side is not None and st.static:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def _to_router(self, L: GpuLayer, X: Tensor, tokens: Tensor, kv, st: Step, part: Tensor | None = None) -> _Routed:
        """A layer from its input HC state X (with `part`, its mix partials for the first hc_pre, computed by the
        hc_post that made it) up to its router (kv: the layer's LayerKV, or a static step's pool layer); the
        fused hyper-connection kernels: in a static step 2 launches per hc_post + hc_pre pair (hc_post computes
        the next mix partials; 3 for a stage's first hc_pre), else 3 (at a prefill chunk's rows the partials'
        own kernel is faster: H100, 12 layers, 2,048 rows: 16.4 ms in both against 31.4 ms fused)."""
        cfg, x = self.cfg, X[:, 0]  # (x: a row of the stream sum's shape, for the consumers' routes)
        # attn_norm in hc_pre's launch, quantised there for q_kv's integer-dot matvec where it reads that
        xn, (act,), post, comb = self._hc_pre(L.hc_attn, X, L.attn_norm, part, "act16" if L.q_kv.act16(x) else None)
        X, part = hc_k.hc_post(self._attention(L, xn, act, st, kv), X, post, comb,
                               mix=L.hc_ffn.fn if st.static else None)
        # ffn_norm likewise, quantised for the shared expert's and the routed experts' integer-dot kernels
        shared_act = L.shared is not None and L.shared[0].act16(x)
        xn, (x16, xq), post, comb = self._hc_pre(L.hc_ffn, X, L.ffn_norm, part, "act16" if shared_act else None,
                                                 L.experts.act_layout(x))
        # router: sqrt-softplus, selection by p + bias (or the hash table), normalised weights
        ids, wts = router(L.gate_inp(xn), L.bias, L.tid2eid, tokens, cfg.n_experts_used, cfg.expert_weights_norm,
                          cfg.expert_weights_scale)
        return _Routed(X, xn, post, comb, ids, wts, xq, x16)

    @torch.inference_mode()
    def mtp_step(self, H: Tensor, tokens: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """The MTP layer (model.MTPLayer) over H [T, C, dim] and the tokens after them, at positions
        cache.length.. of its own cache (`new_mtp_caches`), eager launches -> (its HC states, logits [T, vocab])."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
        H = H.to(self.device, torch.float32)
        T = H.shape[0]
        cache.check_room(T)
        p0 = cache.length
        st = Step(torch.arange(p0, p0 + T, device=self.device), p0, p0 + T)
        X = self._mtp_block(H, tokens, cache[self.cfg.n_layers], st)
        cache.advance(T)
        return X, self._mtp_head(X)

    @torch.inference_mode()
    def mtp_draft(self, H: Sequence[Tensor], tokens: Sequence[Tensor | Sequence[int]], caches: Sequence[KVCache],
                  k: int, graph: bool | None = None) -> Tensor:
        """Drafts from the MTP layer for several sequences at once: sequence i's pairs (H[i][j], tokens[i][j]) at
        positions caches[i].length.. (a catch-up's, then the model's last state with the token about to be fed),
        then a chain of k depths, each from the state and greedy token of the one before -> the tokens [N, k] on
        the device. Every sequence's pairs run as one static step (its rows padded to a row class with copies of
        the last row), then k - 1 steps of one row per sequence: on CUDA one captured graph per (row class,
        sequences, k) over the pool's slots (`new_mtp_caches`), captured on first use; anywhere else (or with
        `graph=False`) the same launches eagerly. A catch-up that does not fit the step runs its first pairs
        through mtp_step. Each cache holds its pairs and its chain's rows after them (the caller cuts it back)."""
        H = [h.to(self.device, torch.float32) for h in H]
        tokens = [torch.as_tensor(t, dtype=torch.long).view(-1) for t in tokens]
        if not caches or k < 1 or len(H) != len(caches) or len(tokens) != len(caches) or any(
                t.numel() < 1 or h.shape[0] != t.numel() for h, t in zip(H, tokens, strict=True)):
            raise ValueError(f"an MTP draft needs one state per token, at least one pair per sequence and k >= 1 "
                             f"({[h.shape[0] for h in H]} states, {[t.numel() for t in tokens]} tokens, k {k})")
        if len({id(c) for c in caches}) != len(caches) or any(c.pool is not caches[0].pool for c in caches):
            raise ValueError("an MTP draft of several sequences takes each once, all slots of one pool")
        # a catch-up longer than the step takes, or without room for its chain: all but its last pair eagerly,
        # the longest first
        for i in sorted(range(len(caches)), key=lambda i: -tokens[i].numel()):
            n, c = tokens[i].numel(), caches[i]
            if n > 1 and (sum(t.numel() for t in tokens) > SHORT_ROWS[-1] or n + k - 1 > c.chunk or
                          c.length + n + k - 1 > c.ctx):
                self.mtp_step(H[i][:-1], tokens[i][:-1], c)
                H[i], tokens[i] = H[i][-1:], tokens[i][-1:]
        for t, c in zip(tokens, caches, strict=True):
            c.check_room(t.numel() + k - 1)
        n = sum(t.numel() for t in tokens)
        rows = next(r for r in (1, *SHORT_ROWS) if r >= n)
        key = ("mtp", id(caches[0].pool), rows, len(caches), k)
        g = self._graph(graph, key, lambda: _MtpGraph(self, caches, H, tokens, rows, k))
        if g is None:
            inp = _MtpInputs(self, caches[0].pool, rows, len(caches))
            inp.set(H, tokens, caches)
            out = self._mtp_chain(inp, caches[0].ctx, k)
        else:
            out = g.run(H, tokens, caches)
        for t, c in zip(tokens, caches, strict=True):
            c.advance(t.numel() + k - 1)
        return out

    def capture_mtp(self, cache: KVCache, k: int) -> int:
        """Capture, ahead of use, the mtp_draft graphs of a request drafting k tokens alone (catch-ups of 1..k+1
        pairs: the drafts it accepted and its token) on an empty MTP cache of the pool (the captures write its
        first rows; it is left empty). -> graphs held."""
        if cache.length or not self._graphs_on() or k < 1:
            return 0
        cfg, n = self.cfg, 0
        for rows in (r for r in (1, *SHORT_ROWS) if r <= k + 1 and r + k - 1 <= min(cache.chunk, cache.ctx)):
            H = [torch.zeros(rows, cfg.hc_mult, cfg.dim, device=self.device)]
            tokens = [torch.zeros(rows, dtype=torch.long)]
            if self._graph(True, ("mtp", id(cache.pool), rows, 1, k), lambda H=H, t=tokens, r=rows: _MtpGraph(
                    self, [cache], H, t, r, k)) is None:
                break
            n += 1
        cache.reset()
        return n

    def _mtp_chain(self, inp: _MtpInputs, ctx: int, k: int) -> Tensor:
        """mtp_draft's static step (what its graph captures): the MTP block over inp's rows (every sequence's
        pairs, padded), then k depths of one row per sequence, from its last real row -> the greedy tokens
        [N, k]. The block is window-only: the bucket bounds nothing it reads."""
        rows, kv = inp.tok.numel(), _Pooled(inp.pool)[self.cfg.n_layers]
        st = Step(inp.pos, None, None, ctx, None if rows == 1 else inp.last, inp.slots)
        X = self._mtp_block(inp.x, inp.tok, kv, st)
        pos, slots = inp.pos, inp.slots
        if rows > 1:  # each sequence's last pair
            pos, slots, X = (t.index_select(0, inp.ends) for t in (inp.pos, inp.slots, X))
        out = []
        for depth in range(k):
            out.append(torch.argmax(self._mtp_head(X), dim=-1))
            if depth < k - 1:
                pos = pos + 1
                X = self._mtp_block(X, out[-1], kv, Step(pos, None, None, ctx, None, slots))
        return torch.stack(out, dim=1)

    def _mtp_block(self, H: Tensor, tokens: Tensor, kv, st: Step) -> Tensor:  # noqa: ANN001 (LayerKV or pooled)
        """The MTP layer's input projections and block over H [T, C, dim] and tokens [T] -> its HC states."""
        m = self.mtp
        assert m is not None
        cfg, eps, T = self.cfg, self.cfg.rms_eps, H.shape[0]
        e = m.e_proj(rms_norm(m.token_embd[tokens].float(), m.enorm, eps))  # [T, dim]
        h = m.h_proj(rms_norm(H.reshape(T * cfg.hc_mult, cfg.dim), m.hnorm, eps)).view(T, cfg.hc_mult, cfg.dim)
        L = m.block
        return self._ffn(L, self._to_router(L, (h + e.unsqueeze(1)).contiguous(), tokens, kv, st), st)[0]

    def _mtp_head(self, X: Tensor) -> Tensor:
        """The MTP layer's own hyper-connection head and norm, then the stage's output matrix -> [T, vocab]."""
        m = self.mtp
        assert m is not None
        return self._logits(X, m.hc, m.norm)

    def new_mtp_caches(self, n: int, ctx: int, chunk: int) -> list[KVCache]:
        """n caches of the MTP layer, the slots of one KVPool (one draft graph serves all of them)."""
        assert self.mtp is not None
        return pooled_caches(self.mtp.mcfg, range(self.cfg.n_layers, self.cfg.n_layers + 1), n, ctx, chunk=chunk,
                             device=self.device)

    def _hc_pre(self, h: HyperConnection, X: Tensor, norm: Tensor, part: Tensor | None,
                *quant: str | None) -> tuple[Tensor, list, Tensor, Tensor]:
        """hc_pre and the RMSNorm after it (hc_k.hc_pre) -> (xn, per entry of `quant` its quantised rows or None,
        post, comb)."""
        cfg = self.cfg
        return hc_k.hc_pre(X, h.fn, h.scale, h.base, cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, norm, quant, part)

    # ---- the backend interface (engine/stage.py drives it) ---------------------------------------------------
    @torch.inference_mode()
    def prefill(self, tokens: Tensor | list[int], cache: KVCache, X: Tensor | None = None, *,
                logits: bool = False, graph: bool | None = None, all_logits: bool = False) -> Tensor:
        """Append tokens [T] at positions cache.length.. to the cache. X: their HC state [T, C, dim] coming
        from the previous stage (None: embedded here). -> the HC state [T, C, dim] out of this stage's layers,
        or with `logits` the head's logits of the last position [vocab] (with `all_logits` too, of every
        position [T, vocab]: a draft's verification).
        A short prompt (2..32 tokens, see `short_rows`) runs as one static-shape step padded to its row class,
        on CUDA from a captured graph (as decode does; a verification's graph has the head over every row), and
        anywhere with `graph=True` (eager launches of the same ops where graphs are off). Longer prompts, short
        ones on a CPU by default, and any with `graph=False` run in pieces of at most cache.chunk with eager
        launches."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
        rows = self.short_rows(tokens.numel(), cache)  # the padded rows fit the chunk and the context
        if rows and (graph if graph is not None else self._graphs_on()):
            return self._static(tokens, cache, X, ALL_ROWS if logits and all_logits else logits, rows, graph)
        outs = []
        for s in range(0, tokens.numel(), cache.chunk):
            t = tokens[s:s + cache.chunk]
            T = t.numel()
            cache.check_room(T)
            p0 = cache.length
            st = Step(torch.arange(p0, p0 + T, device=self.device), p0, p0 + T)
            x = self.embed(t) if X is None else X[s:s + T].to(self.device, torch.float32)
            outs.append(self._run_layers(x, t, cache, st))
            cache.advance(T)
        if logits:
            return self.head(torch.cat(outs)) if all_logits else self.head(outs[-1][-1:])[0]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def decode(self, token: int | Tensor, cache: KVCache, X: Tensor | None = None, *, logits: bool = False,
               graph: bool | None = None) -> Tensor:
        """One token at position cache.length, as `prefill` does it (X [1, C, dim] or None, -> [1, C, dim] or
        with `logits` [vocab]): the static-shape step of one row; on CUDA it replays a captured graph (one per
        cache, position bucket and form; embedding and head inside it when they run here). `graph=False`
        launches the same ops eagerly (see _graph for when that happens by itself). The result is the
        graph's static output buffer: read (or copy) it before the next decode step overwrites it."""
        cache.check_room(1)
        return self._static(token, cache, X, logits, 1, graph)

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int] | Tensor, caches: list[KVCache], X: Tensor | None = None, *,
                     logits: bool = False, graph: bool | None = None) -> Tensor:
        """One decode step of B sequences at once: tokens[b] at position caches[b].length of caches[b] (X:
        their HC states [B, C, dim], or None to embed here) -> [B, C, dim], or with `logits` [B, vocab]. Row b
        equals `decode(tokens[b], caches[b])`: the projections, router and experts run over the B rows together
        (each weight read once for all of them), and so does what reads or writes a KV, each row reaching its
        own sequence through its slot of the caches' KVPool (`new_caches`). On CUDA it replays the graph
        captured for (pool, B, the position bucket of the longest), whichever sessions of the pool take part
        (captured on first use, or ahead by `capture_batches`). Caches of different pools, and a streaming
        stage (its segmented graphs are per sequence), decode one after another. The result is the graph's
        output buffer: read it before the next step. `tokens` may be a tensor [B] on this device (the previous
        step's picks): copied into the step's inputs where they are, never read on the host."""
        if len(tokens) != len(caches) or not caches:
            raise ValueError(f"a batched step needs one token per sequence ({len(tokens)} tokens, {len(caches)} "
                             "caches)")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a batched step holds each sequence once")
        for c in caches:
            c.check_room(1)
        pool = caches[0].pool
        if len(caches) == 1 or self.experts is not None or any(c.pool is not pool for c in caches):
            return self._decode_each(tokens, caches, X, logits, graph)
        if X is not None:
            X = X.to(self.device, torch.float32)
        bucket = max(self.bucket(c) for c in caches)
        key = ("batch", id(pool), len(caches), bucket, X is None, logits)
        g = self._graph(graph, key, lambda: _BatchGraph(self, pool, caches, bucket, X is None, logits))
        if g is None:
            g = _BatchInputs(self, pool, len(caches), X is None)
            g.set(tokens, caches, X)
            out = self._batch_step(g, bucket, logits)
        else:
            out = g.run(tokens, caches, X)
        for c in caches:
            c.advance(1)
        return out

    def capture_batches(self, caches: list[KVCache], *, embedded: bool, logits: bool, positions: int) -> int:
        """Capture, ahead of use, the batched decode graphs of every batch size 2..len(caches) (empty caches of
        one pool) for each position bucket up to `positions`. -> graphs held."""
        if any(c.length for c in caches):
            raise ValueError("batched step graphs are captured ahead on empty caches only")
        if len(caches) < 2 or not self._graphs_on() or self.experts is not None:
            return 0
        pool, n, first = caches[0].pool, 0, 0
        assert pool is not None and all(c.pool is pool for c in caches)
        while True:
            for c in caches:
                c.length = first
            bucket = self.bucket(caches[0])
            for b in range(2, len(caches) + 1):
                key = ("batch", id(pool), b, bucket, embedded, logits)
                if self._graph(True, key, lambda b=b, bucket=bucket: _BatchGraph(
                        self, pool, caches[:b], bucket, embedded, logits)) is None:
                    break
                n += 1
            if bucket >= min(positions, caches[0].ctx):
                break
            first = bucket
        for c in caches:
            c.reset()
        return n

    def _decode_each(self, tokens: list[int] | Tensor, caches: list[KVCache], X: Tensor | None, logits: bool,
                     graph: bool | None) -> Tensor:
        """decode_batch's result by one decode step per sequence (graph replays on CUDA, whose output buffers
        the next replay of the same graph reuses: each result is copied)."""
        each = tokens.view(-1, 1) if isinstance(tokens, Tensor) else tokens  # a device token as a [1] tensor
        outs = [self.decode(t, c, None if X is None else X[b:b + 1], logits=logits, graph=graph).clone()
                for b, (t, c) in enumerate(zip(each, caches, strict=True))]
        return torch.stack(outs) if logits else torch.cat(outs)

    def multi_rows(self, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache]) -> int:
        """The row class verify_batch runs these sequences' rows in, or 0 when it cannot (more rows than the
        largest class, caches of different pools, a streaming stage, or a sequence without room)."""
        n = sum(len(t) for t in tokens)
        if not tokens or self.experts is not None or any(not t for t in tokens) or len(tokens) != len(caches):
            return 0
        if len({id(c) for c in caches}) != len(caches) or any(c.pool is not caches[0].pool for c in caches):
            return 0
        if any(c.length + len(t) > c.ctx or len(t) > c.chunk for t, c in zip(tokens, caches, strict=True)):
            return 0
        return next((r for r in SHORT_ROWS if r >= n), 0)

    @torch.inference_mode()
    def verify_batch(self, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache], *, logits: bool = True,
                     graph: bool | None = None) -> list[Tensor]:
        """Several sequences' rows in one static step (a request's token and its drafts each: sequence i's at
        positions caches[i].length..): every row reaches its own sequence's KV through its slot of the pool, as
        a batched decode step's one row does, and the rows of one sequence attend to each other as a short
        prefill's do; padded to its row class with copies of the last row (they write what it writes). On
        CUDA it replays the graph of (pool, row class, position bucket), captured on first use. -> per
        sequence its rows' logits [n_i, vocab] (row j what `prefill` of tokens[i][:j + 1] gives), or without
        `logits` their HC states [n_i, C, dim]."""
        rows = self.multi_rows(tokens, caches)
        if not rows:
            raise ValueError(f"{sum(len(t) for t in tokens)} rows of {len(tokens)} sequence(s) do not make one "
                             f"verification step (at most {SHORT_ROWS[-1]} rows, one pool, room in each)")
        pool = caches[0].pool
        bucket = max(self.bucket(c, len(t)) for t, c in zip(tokens, caches, strict=True))
        key = ("multi", id(pool), rows, bucket, logits)
        g = self._graph(graph, key, lambda: _MultiGraph(self, pool, tokens, caches, rows, bucket, logits))
        if g is None:
            g = _MultiInputs(self, pool, rows)
            g.set(tokens, caches)
            out = self._multi_step(g, bucket, logits)
        else:
            out = g.run(tokens, caches)
        res, at = [], 0
        for t, c in zip(tokens, caches, strict=True):
            res.append(out[at:at + len(t)].clone())  # the graph's buffer is reused by its next replay
            at += len(t)
            c.advance(len(t))
        return res

    def _multi_step(self, inp: _MultiInputs, bucket: int, logits: bool) -> Tensor:
        """verify_batch's step (what its graph captures): the layers over every row, the head over every row."""
        st = Step(inp.pos, None, None, bucket, inp.last, inp.slots)
        X = self._run_layers(self.embed(inp.tok), inp.tok, _Pooled(inp.pool), st)
        return self.head(X) if logits else X

    def _batch_step(self, inp: _BatchInputs, bucket: int, logits: bool) -> Tensor:
        """The batched decode step (what its graph captures): layers over the B rows, the head over all."""
        st = Step(inp.pos, None, None, bucket, None, inp.slots)
        X = self._run_layers(self.embed(inp.tok) if inp.x is None else inp.x, inp.tok, _Pooled(inp.pool), st)
        return self.head(X) if logits else X

    def short_rows(self, n: int, cache: KVCache) -> int:
        """The row class a prompt of n tokens runs in as one static-shape step at cache.length, or 0 when it
        runs chunked (a single token decodes; longer than the largest class; the padding would pass the
        chunk or the context)."""
        if self.experts is not None:  # streaming: padded rows would route (and load experts) for nothing
            return 0
        rows = next((r for r in SHORT_ROWS if r >= n), 0) if n > 1 else 0
        return rows if rows and rows <= cache.chunk and cache.length + rows <= cache.ctx else 0

    def _static(self, tokens: Tensor | int, cache: KVCache, X: Tensor | None, logits: bool | str, rows: int,
                graph: bool | None) -> Tensor:
        """tokens (a token id, or [T] with T <= rows) as one static-shape step of `rows` positions at
        cache.length: a captured graph's replay (see _graph for when), eager launches otherwise. `logits`:
        False (the state of the real rows), True (the last real row's logits) or ALL_ROWS (every real row's).
        The step reaches the cache as its slot of its KVPool, so one graph serves every session of the pool."""
        n = 1 if isinstance(tokens, int) else tokens.numel()
        p0, bucket = cache.length, self.bucket(cache, rows)
        if X is not None:
            X = X.to(self.device, torch.float32)
        key = self._static_key(cache, rows, bucket, X is None, logits)
        g = self._graph(graph, key, lambda: self._make_graph(cache, rows, bucket, X is None, logits))
        if g is None:
            g = _StepInputs(self, rows, X is None, p0)
            g.set(tokens, p0, X, cache.slot)
            out = self._step(g, cache, bucket, logits)
        else:
            out = g.run(tokens, p0, X, cache.slot)
        cache.advance(n, p0 + rows)
        if rows == 1:
            return out
        # a prefill's result outlives the next replay
        return out.clone() if logits is True else out[:n].clone()

    def _step(self, inp: _StepInputs, cache: KVCache, bucket: int, logits: bool | str) -> Tensor:
        """The static-shape step (what a graph captures): layers over inp's rows, on the cache's pool at the slot
        inp.slots names, the head over its last real row (ALL_ROWS: over every row; the padding's are not
        read)."""
        st = Step(inp.pos, None, None, bucket, None if inp.tok.numel() == 1 else inp.last, inp.slots)
        X = self._run_layers(self.embed(inp.tok) if inp.x is None else inp.x, inp.tok, _Pooled(cache.pool), st)
        if not logits:
            return X
        if logits == ALL_ROWS:
            return self.head(X)
        return self.head(X if X.shape[0] == 1 else X.index_select(0, inp.last))[0]

    def capture(self, cache: KVCache, *, embedded: bool, logits: bool, positions: int,
                rows: tuple[int, ...] = (1, *SHORT_ROWS)) -> int:
        """Capture, ahead of use, the static-step graphs of an empty `cache` (decode: 1 row; short prefill:
        the row classes) for every position bucket up to `positions` (what the engine does before it says
        ready, so that no request pays for a capture; a capture's warm-up step writes KV rows of the bucket's
        first positions, which must hold nothing yet). -> graphs held."""
        if cache.length:
            raise ValueError("step graphs are captured ahead on an empty cache only")
        if not self._graphs_on():
            return 0
        n, length, first = 0, cache.length, 0
        while True:  # first: the first position of a bucket (0, then each bucket's predecessor)
            for r in rows:
                cache.length = first
                if (r > 1 and not self.short_rows(r, cache)) or first + r > cache.ctx:
                    continue
                bucket = self.bucket(cache, r)
                key = self._static_key(cache, r, bucket, embedded, logits)

                def make(r: int = r, bucket: int = bucket) -> _StepGraph | _SegmentedStep:
                    return self._make_graph(cache, r, bucket, embedded, logits)

                if self._graph(True, key, make) is None:
                    cache.length = length
                    return n
                n += 1
            cache.length = first
            bucket = self.bucket(cache)
            if bucket >= min(positions, cache.ctx):
                break
            first = bucket  # the next bucket's first position; nothing is written here
        cache.length = length
        return n

    def _static_key(self, cache: KVCache, rows: int, bucket: int, embedded: bool, logits: bool | str) -> tuple:
        """A static step's graph serves every session of the cache's pool (it reads the slot from its inputs);
        a streaming stage's segmented decode is the cache's own."""
        if self.experts is not None:
            return (id(cache), rows, bucket, embedded, logits)
        return ("static", id(cache.pool), rows, bucket, embedded, logits)

    def _make_graph(self, cache: KVCache, rows: int, bucket: int, embedded: bool,
                    logits: bool | str) -> _StepGraph | _SegmentedStep:
        """A static step's captured form: one graph (resident experts), or one graph per segment between the
        routers (streamed experts: rows == 1, the decode step)."""
        if self.experts is not None:
            return _SegmentedStep(self, cache, bucket, embedded, logits)
        return _StepGraph(self, cache, rows, bucket, embedded, logits)

    def bucket(self, cache: KVCache, rows: int = 1) -> int:
        """A static step of `rows` positions at cache.length reads context up to this many positions: a power
        of two > the last position it writes (or ctx)."""
        return min(max(MIN_BUCKET, 1 << (cache.length + rows - 1).bit_length()), cache.ctx)

    def _graphs_on(self) -> bool:
        return self.device.type == "cuda" and self.graphs

    def _graph(self, graph: bool | None, key: tuple, make: Callable[[], _StepGraph | _SegmentedStep | _BatchGraph |
               _MultiGraph | _MtpGraph]) -> _StepGraph | _SegmentedStep | _BatchGraph | _MultiGraph | _MtpGraph | None:
        """The captured graph for `key` (captured now if new), or None to launch eagerly: on a CPU (unless
        `graph` is True), when `graph` is False, with DS4STATION_CUDA_GRAPHS=0, or after a capture failed on
        this stage (warned once; steps go on with eager launches of the same ops)."""
        if not (self.device.type == "cuda" if graph is None else graph) or not self.graphs:
            return None
        g = self._graphs.get(key)
        if g is None:
            try:
                g = self._graphs[key] = make()
            except Exception as exc:  # e.g. a driver / ROCm build without graph support: eager launches instead
                if pdl.enabled(self.device):  # a driver that cannot capture dependent launches: keep the graphs
                    pdl.ON = False
                    log.warning("step graph capture with dependent launches failed on %s (%s: %s); capturing "
                                "with launches in stream order (DS4STATION_PDL=0)", self.device, type(exc).__name__,
                                exc)
                    return self._graph(graph, key, make)
                self.graphs = False
                log.warning("step graph capture failed on %s (%s: %s); running with eager launches",
                            self.device, type(exc).__name__, exc)
                return None
        return g

    def drop_graphs(self, cache: KVCache) -> None:
        """Release the step graphs of a cache's pool (they write into every slot's tensors) and the cache's own
        (a streaming stage's), when the cache goes."""
        for key in [k for k in self._graphs if k[0] == id(cache) or (k[0] in ("static", "batch", "multi") and
                                                                      k[1] == id(cache.pool))]:
            del self._graphs[key]


def _norm(x: Tensor, weight: Tensor, eps: float, *quant: str | None) -> tuple[Tensor, list]:
    """RMSNorm of x -> (xn, per entry of `quant` xn's rows quantised in that form (act_quant.QUANTS) for an
    integer-dot consumer, in the same launch, or None where the entry is None)."""
    wanted = tuple(q for q in quant if q)
    if not wanted:
        return rms_norm(x, weight, eps), [None] * len(quant)
    xn, acts = rms_norm(x, weight, eps, quant=wanted)
    it = iter(acts)
    return xn, [next(it) if q else None for q in quant]


def _env_on(name: str) -> bool:
    """An on/off environment switch, on unless set to 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def _rope(rope: Rope, x: Tensor, pos: Tensor, inverse: bool = False) -> Tensor:
    """Interleaved partial RoPE of x [T, ..., D] at positions pos [T], rotating x in place (every caller
    passes a fresh tensor); the fused kernel on a GPU."""
    x = x.contiguous()
    rope_(x.view(-1, x.shape[-1]), pos, rope.inv_freq, x[0].numel() // x.shape[-1], inverse)
    return x


def _capture(stage: GpuStage, step: Callable[[], Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """`step` captured in a CUDA graph -> (the graph, its output buffer): first run on a side stream (Triton
    compiles, caches fill), then captured into the stage's one memory pool (its graphs replay one at a time and
    each output is read before the next replay, so their temporaries may share memory, as vLLM's captures do),
    then replayed once: the first launch of a graph uploads it to the device, paid here rather than by the first
    request that replays it, on the warm-up's inputs, so it writes what the warm-up wrote."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if stage.graph_pool is None:
        stage.graph_pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=stage.graph_pool):
        out = step()
    graph.replay()
    return graph, out


class _StepInputs:
    """The device inputs of a static step of `rows` positions: token ids, positions, the index of the last
    real row and (for a stage that does not embed) the HC state. Rows past the real ones keep whatever they
    held: their results are never read, and a real row's never depends on them."""

    def __init__(self, stage: GpuStage, rows: int, embedded: bool, position: int) -> None:
        dev, cfg = stage.device, stage.cfg
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.base = torch.arange(rows, device=dev)
        self.pos = self.base + position
        self.slots = torch.zeros(rows, dtype=torch.long, device=dev)  # every row the one sequence's pool slot
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = None if embedded else torch.zeros(rows, cfg.hc_mult, cfg.dim, device=dev)

    def set(self, tokens: Tensor | int, position: int, X: Tensor | None, slot: int = 0) -> None:
        if isinstance(tokens, int):
            self.tok.fill_(tokens)
        else:
            n = tokens.numel()
            self.tok[:n].copy_(tokens.view(-1))
            if self.tok.numel() > 1:  # (a step of one row reads no last row)
                self.last.fill_(n - 1)
        torch.add(self.base, position, out=self.pos)
        self.slots.fill_(slot)
        if self.x is not None:
            self.x[:X.shape[0]].copy_(X)


class _StepGraph(_StepInputs):
    """A static step of `rows` positions of one sequence of a KVPool captured in a CUDA graph over static inputs
    (the head inside when `logits`); a replay steps the slot its inputs name. Captured on `cache`."""

    def __init__(self, stage: GpuStage, cache: KVCache, rows: int, bucket: int, embedded: bool,
                 logits: bool | str) -> None:
        super().__init__(stage, rows, embedded, cache.length)
        self.pool = cache.pool  # the graph writes into the pool's tensors: keep them alive with it
        self.slots.fill_(cache.slot)

        # The warm-up writes the positions' KV slots, which the real replay overwrites with the same positions'
        # values.
        self.graph, self.out = _capture(stage, lambda: stage._step(self, cache, bucket, logits))

    def run(self, tokens: Tensor | int, position: int, X: Tensor | None = None, slot: int = 0) -> Tensor:
        self.set(tokens, position, X, slot)
        self.graph.replay()
        return self.out


class _RowInputs:
    """Per row of a pooled step, a token id, a position and a pool slot, and the index of the last real row: one
    device tensor, set by one copy from pinned host memory, which does not wait for the queued steps as a copy
    from pageable memory would (a small fill per value cost a launch each: 24 at 8 rows). The caching host
    allocator keeps a pinned buffer from reuse until its copy has run."""

    def __init__(self, stage: GpuStage, rows: int) -> None:
        self._width = rows + rows % 2  # each vector 16-byte aligned, as separate tensors were
        self._values = torch.zeros(3 * self._width + 1, dtype=torch.long, device=stage.device)
        self.tok, self.pos, self.slots = self._values[:3 * self._width].view(3, self._width)[:, :rows].unbind(0)
        self.last = self._values[3 * self._width:]
        self._pinned = stage.device.type == "cuda"

    def put(self, tok: list[int], pos: list[int], slots: list[int]) -> None:
        """The real rows' values; the rows past them take the last real row's."""
        pad = self._width - len(tok)
        host = torch.tensor([*tok, *tok[-1:] * pad, *pos, *pos[-1:] * pad, *slots, *slots[-1:] * pad, len(tok) - 1],
                            dtype=torch.long, pin_memory=self._pinned)
        self._values.copy_(host, non_blocking=True)


class _BatchInputs(_RowInputs):
    """The device inputs of a batched decode step of B rows: one token, one position and one pool slot per
    row, and for a stage that does not embed the HC states."""

    def __init__(self, stage: GpuStage, pool: KVPool, rows: int, embedded: bool) -> None:
        super().__init__(stage, rows)
        self.pool = pool  # a graph writes into the pool's tensors: keep them alive with it
        self.x = None if embedded else torch.zeros(rows, stage.cfg.hc_mult, stage.cfg.dim, device=stage.device)

    def set(self, tokens: list[int] | Tensor, caches: list[KVCache], X: Tensor | None) -> None:
        on_device = isinstance(tokens, Tensor)
        self.put([0] * len(caches) if on_device else [int(t) for t in tokens], [c.length for c in caches],
                 [c.slot for c in caches])
        if on_device:  # after the copy above, in stream order
            self.tok.copy_(tokens)
        if self.x is not None:
            self.x.copy_(X)


class _BatchGraph(_BatchInputs):
    """A batched decode step of B rows over a pool captured in a CUDA graph, as _StepGraph does it; the
    capture's warm-up runs on `caches` (it writes their next positions' rows, which a real step overwrites)."""

    def __init__(self, stage: GpuStage, pool: KVPool, caches: list[KVCache], bucket: int, embedded: bool,
                 logits: bool) -> None:
        super().__init__(stage, pool, len(caches), embedded)
        self.set([0] * len(caches), caches, None if self.x is None else self.x)
        self.graph, self.out = _capture(stage, lambda: stage._batch_step(self, bucket, logits))

    def run(self, tokens: list[int] | Tensor, caches: list[KVCache], X: Tensor | None = None) -> Tensor:
        self.set(tokens, caches, X)
        self.graph.replay()
        return self.out


class _MultiInputs(_RowInputs):
    """The device inputs of a verification step over several sequences' rows: per row a token, a position and
    a pool slot, the rows past the real ones copies of the last real row, and the index of that row."""

    def __init__(self, stage: GpuStage, pool: KVPool, rows: int) -> None:
        super().__init__(stage, rows)
        self.pool = pool  # a graph writes into the pool's tensors: keep them alive with it

    def set(self, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache]) -> None:
        rows = [(int(t), c.length + j, c.slot) for seq, c in zip(tokens, caches, strict=True)
                for j, t in enumerate(seq)]
        tok, pos, slots = (list(v) for v in zip(*rows, strict=True))
        self.put(tok, pos, slots)


class _MultiGraph(_MultiInputs):
    """verify_batch's step of a row class over a pool captured in a CUDA graph, as _BatchGraph does it (the
    capture's warm-up writes the rows of the sequences' next positions, which the real step overwrites)."""

    def __init__(self, stage: GpuStage, pool: KVPool, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache],
                 rows: int, bucket: int, logits: bool) -> None:
        super().__init__(stage, pool, rows)
        self.set(tokens, caches)
        self.graph, self.out = _capture(stage, lambda: stage._multi_step(self, bucket, logits))

    def run(self, tokens: Sequence[Sequence[int]], caches: Sequence[KVCache]) -> Tensor:
        self.set(tokens, caches)
        self.graph.replay()
        return self.out


class _MtpInputs(_RowInputs):
    """The device inputs of mtp_draft's step: per row a token, a position and a pool slot and the model's HC
    state (the rows past the real ones copies of the last real row), and the index of each sequence's last row."""

    def __init__(self, stage: GpuStage, pool: KVPool, rows: int, sequences: int) -> None:
        super().__init__(stage, rows)
        self.pool = pool  # a graph writes into the pool's tensors: keep them alive with it
        self.x = torch.zeros(rows, stage.cfg.hc_mult, stage.cfg.dim, device=stage.device)
        self.ends = torch.zeros(sequences, dtype=torch.long, device=stage.device)

    def set(self, H: Sequence[Tensor], tokens: Sequence[Tensor], caches: Sequence[KVCache]) -> None:
        lens = [t.numel() for t in tokens]
        self.put(torch.cat(list(tokens)).tolist(), [c.length + j for c, n in zip(caches, lens, strict=True)
                                                    for j in range(n)],
                 [c.slot for c, n in zip(caches, lens, strict=True) for _ in range(n)])
        self.ends.copy_(torch.tensor([e - 1 for e in itertools.accumulate(lens)], pin_memory=self._pinned),
                        non_blocking=True)
        X = torch.cat(list(H))
        self.x[:X.shape[0]].copy_(X)
        self.x[X.shape[0]:].copy_(X[-1:].expand(self.x.shape[0] - X.shape[0], -1, -1))


class _MtpGraph(_MtpInputs):
    """mtp_draft's static step of `rows` pairs of N sequences and k depths over a pool of MTP caches, captured
    in a CUDA graph on `caches` with the draft's own inputs (the capture's warm-up writes the rows the replay
    writes)."""

    def __init__(self, stage: GpuStage, caches: Sequence[KVCache], H: Sequence[Tensor], tokens: Sequence[Tensor],
                 rows: int, k: int) -> None:
        super().__init__(stage, caches[0].pool, rows, len(caches))
        self.set(H, tokens, caches)
        self.graph, self.out = _capture(stage, lambda: stage._mtp_chain(self, caches[0].ctx, k))

    def run(self, H: Sequence[Tensor], tokens: Sequence[Tensor], caches: Sequence[KVCache]) -> Tensor:
        self.set(H, tokens, caches)
        self.graph.replay()
        return self.out


class _SegmentedStep(_StepInputs):
    """The decode step of a streaming stage: one CUDA graph per segment of the layer loop (GpuStage._segment:
    cut at the routers), captured over static inputs like _StepGraph. Between two replays the host reads the
    experts the last router chose and has the cache load the missing ones (the one synchronisation per
    routed layer); the next segment reads them through the slot table. The hash-routed layers' experts are
    loaded from the token before the first replay."""

    def __init__(self, stage: GpuStage, cache: KVCache, bucket: int, embedded: bool, logits: bool) -> None:
        super().__init__(stage, 1, embedded, cache.length)
        self.stage, self.cache = stage, cache
        st = Step(self.pos, None, None, bucket, None)
        n = len(stage.blocks)

        def segment(k: int, state: Tensor | _Routed | None) -> Tensor | _Routed:
            if k == 0:
                state = stage.embed(self.tok) if self.x is None else self.x
            assert state is not None
            out = stage._segment(k, state, self.tok, cache, st)
            if k == n and logits:
                assert isinstance(out, Tensor)
                return stage.head(out)[0]
            return out

        side = torch.cuda.Stream()  # warm-up on a side stream (Triton compiles), as _StepGraph does
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            state: Tensor | _Routed | None = None
            for k in range(n + 1):
                state = segment(k, state)
        torch.cuda.current_stream().wait_stream(side)
        if stage.graph_pool is None:
            stage.graph_pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.routed: list[_Routed] = []
        state = None
        for k in range(n + 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=stage.graph_pool):
                state = segment(k, state)
            self.graphs.append(g)
            if k < n:
                assert isinstance(state, _Routed)
                self.routed.append(state)
        assert isinstance(state, Tensor)
        self.out = state
        for g in self.graphs:  # uploaded now rather than by the first request (on the warm-up's inputs)
            g.replay()

    def run(self, tokens: Tensor | int, position: int, X: Tensor | None = None, slot: int = 0) -> Tensor:
        self.set(tokens, position, X, slot)  # its segments step its own cache (the slot is not read)
        experts = self.stage.experts
        assert experts is not None
        experts.prefetch([int(tokens) if isinstance(tokens, int) else int(tokens[0])])
        for k, g in enumerate(self.graphs):
            g.replay()
            if k < len(self.routed):
                experts.ensure(self.stage.blocks[k].layer, self.routed[k].ids)
        return self.out


class RandomWeights(Mapping[str, Weight]):
    """Random valid weights of the layout, made on `device` when a tensor is first asked for (the full
    Flash shape fits an H200 without any file, and raw blocks are freed as soon as they are repacked).
    Quantised tensors are random valid blocks; small float tensors as demo.py makes them. Each tensor
    has its own seed, so the values do not depend on the order of access."""

    def __init__(self, cfg: ModelConfig, recipe: str = "q2", layers: range | None = None, *, embed: bool = True,
                 output: bool = True, device: str | torch.device = "cuda", seed: int = 0) -> None:
        self.cfg, self.device, self.seed = cfg, torch.device(device), seed
        self.specs = {s.name: (i, s) for i, s in enumerate(model_tensors(cfg, recipe, layers, embed=embed,
                                                                         output=output))}

    def __getitem__(self, name: str) -> Weight:
        from ds4station.kernels.quants import random_blocks

        from .demo import random_weight

        i, spec = self.specs[name]
        if spec.qtype in (Q.F32, Q.I32):
            w = random_weight(spec, self.cfg, torch.Generator().manual_seed(self.seed * 100_003 + i))
            return w.to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 100_003 + i)
        role = spec.role
        scale = 1.0 if role == "token_embd" else 0.1 if role.endswith("_ape") else spec.shape[0] ** -0.5
        return QTensor(random_blocks(spec.qtype, spec.n_elements, gen, scale), spec.qtype, spec.torch_shape)

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)
