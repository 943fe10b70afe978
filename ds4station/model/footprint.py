"""Footprint: the bytes one pipeline stage needs on its device, from the tensor table and the launch settings.

    predicted = weights + sessions x kv(ctx) + scratch(ctx, chunk) + runtime overhead
                (+ expert cache and its staging when streaming)

This is what `serve` allocates for the same settings (a launch file carries them: planner/launch.py):
- weights: the sum of `kept_bytes` over the stage's tensors (from a GGUF file's table or from a named shape
  such as `flash-q2`, the layout of config.FLASH with the "q2" recipe). The kernel stage keeps every tensor in
  its file type, on a GPU and on the CPU alike, except a few small ones it widens (WIDENED_ROLES). A
  streaming stage keeps everything but the
  routed experts resident and holds `expert_cache_bytes` of expert slots instead, plus its staging buffers
  (STAGING_EXPERTS experts, twice, on the device; as much pinned host memory).
- kv (DS4-MODEL.md "KV cache per layer"): per session and layer the raw window ring (window + slack rows x
  head_dim, slack = max(chunk, rollback)), the compressed rows ceil(ctx/r) x head_dim on compressed layers,
  the indexer keys ceil(ctx/4) x index_dim on ratio-4 layers, and each compressor's frontier ring
  (projections + scores, fp32, the unfinished block + slack rows). At f32 the per-token part is 13,760 bytes
  over Flash's 43 layers. This is engine/kv.py's allocation, byte for byte (a test compares them): the one
  formula, which the engine sizes its caches with. Every session is a KV slot allocated at load.
- scratch: the prefill chunk's activations (`activation_bytes_per_token` x chunk x the measured factor), the
  indexer's selection scratch (the engine bounds its [chunk, k + step] int64 block by SCRATCH_BYTES), the
  logits row on the stage holding the output head, and on a CPU stage the fp32 dequantisation blocks.
- runtime overhead: a per-process constant for the CUDA/ROCm context, kernel images and allocator slack
  (DEFAULT_RUNTIME_OVERHEAD; presets may change it). It is not in torch's allocator statistics but it is in
  the device's used memory, which is what must fit.

Decode cost per stage (for balancing) is the bytes read per token: every non-expert weight of its layers, the
routed experts' share n_used / n_experts, and the output head.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .config import DEMO, FLASH, TINY, ModelConfig
from .layout import MTP_PREFIX, TensorSpec, model_tensors, mtp_config, mtp_tensors
from .sizes import MiB

KV_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
FRONTIER_BYTES = 4  # the compressors accumulate in fp32 whatever the cache dtype
# Measured on an H200 (torch 2.11, CUDA 13, 2026-11-29): the CUDA context alone 529 MiB, with cuBLAS and one
# Triton kernel loaded 685 MiB. ROCm contexts on gfx906 are of the same order; keep a little above both.
DEFAULT_RUNTIME_OVERHEAD = 768 * MiB
# The engine's bound on one prefill column block of indexer selection keys (kernels/indexer.py SCRATCH_BYTES)
# (tests/test_kernels_indexer.py checks it) and the experts per staging buffer of a streaming stage
# (engine/experts.py STAGING_EXPERTS).
INDEXER_SCRATCH_BYTES = 256 * MiB
INDEXER_SELECT_MAX = 8192  # the most keys one selection program holds (kernels/dispatch.py _SELECT_MAX)
INDEXER_MID_ROWS = 64  # query rows up to which a selection takes a middle stage (kernels/dispatch.py SELECT_MID_ROWS)
STAGING_EXPERTS = 8
# On the CPU the kernel stage's prefill dequantises a quantised matrix to fp32 in blocks of rows of at most this
# many bytes, into one buffer it keeps (kernels/ops.py _cpu_linear; the routed experts go through the same): a CPU
# stage's dequantisation scratch. Decode reads the quantised weights directly.
CPU_DEQUANT_BYTES = 64 * MiB


# Tensors the kernel stage keeps wider than the file stores them (engine/gpu.py): the hyper-connection mixes and
# the compressors' position biases as fp32 (F16 in the q2 file), the hash-routing tables as int64 (I32).
WIDENED_ROLES = frozenset({"hc_attn_fn", "hc_ffn_fn", "output_hc_fn", "hc_head_fn", "attn_compressor_ape",
                           "indexer_compressor_ape", "ffn_gate_tid2eid"})
# The MTP layer's per-session ring of the model's last HC states (engine/mtp.py) holds the window and this many
# more positions.
MTP_RING_EXTRA = 64


def kept_bytes(spec: TensorSpec) -> int:
    """Bytes the kernel stage holds for this tensor: its file bytes, twice for a widened 2- or 4-byte type."""
    if spec.role in WIDENED_ROLES and spec.qtype.name in ("F16", "BF16", "I32"):
        return 2 * spec.n_bytes
    return spec.n_bytes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_token(cfg: ModelConfig, layers: Iterable[int], dtype: str = "f32") -> float:
    """The part of the KV cache that grows with context, in bytes per token, over `layers`."""
    b = KV_DTYPE_BYTES[dtype]
    total = 0.0
    for i in layers:
        r = cfg.ratio(i)
        if r:
            total += cfg.head_dim * b / r
        if cfg.has_indexer(i):
            total += cfg.index_dim * b / 4
    return total


def kv_slack(chunk: int, rollback: int) -> int:
    """Extra positions every ring keeps beyond what decoding needs: a prefill chunk is written before it
    is attended to, and `truncate` can roll back this far (live-KV prefix reuse)."""
    return max(chunk, rollback)


# A session's prompt checkpoint (engine/kv.py) also holds this many positions before the prompt's end, so a
# prompt whose last tokens (the assistant opening) the next turn renders otherwise still comes back to it.
CHECKPOINT_MARGIN = 16


def frontier_rows(ratio: int, slack: int) -> int:
    """Positions a compressor frontier ring holds: the pooled span (2r overlapping at ratio 4, r otherwise)
    + slack."""
    return (2 if ratio == 4 else 1) * ratio + slack


def layer_kv_bytes(cfg: ModelConfig, layer: int, ctx: int, dtype: str = "f32", *, chunk: int = 256,
                   rollback: int = 0) -> int:
    """Persistent KV state of one layer for `ctx` tokens: exactly what engine/kv.py's KVCache allocates (the
    one formula; a test compares them)."""
    b = KV_DTYPE_BYTES[dtype]
    slack = kv_slack(chunk, rollback)
    r = cfg.ratio(layer)
    n = (2 * cfg.window + slack + CHECKPOINT_MARGIN) * cfg.head_dim * b  # raw ring, and its rows in the checkpoint
    if r:
        n += _cdiv(ctx, r) * cfg.head_dim * b  # compressed rows
        # the frontier ring (kv + score, fp32) and its open-block rows in the checkpoint
        n += 2 * (frontier_rows(r, slack) + frontier_rows(r, CHECKPOINT_MARGIN)) * cfg.compressor_width(layer) \
            * FRONTIER_BYTES
    if cfg.has_indexer(layer):
        n += _cdiv(ctx, 4) * cfg.index_dim * b  # indexer keys
        n += 2 * (frontier_rows(4, slack) + frontier_rows(4, CHECKPOINT_MARGIN)) * 2 * cfg.index_dim * FRONTIER_BYTES
    return n


def state_bytes(cfg: ModelConfig, layers: Iterable[int] | None, n: int, dtype: str = "f32") -> int:
    """Bytes of a session's state at n positions over `layers` as a disk checkpoint saves it (engine/kv.py's
    `KVCache.state()`: the checkpoint rows, and the closed blocks' compressed rows and indexer keys)."""
    b = KV_DTYPE_BYTES[dtype]
    total = 0
    for i in range(cfg.n_layers) if layers is None else layers:
        r = cfg.ratio(i)
        total += (cfg.window + CHECKPOINT_MARGIN) * cfg.head_dim * b
        if r:
            total += n // r * cfg.head_dim * b + 2 * frontier_rows(r, CHECKPOINT_MARGIN) * cfg.compressor_width(i) \
                * FRONTIER_BYTES
        if cfg.has_indexer(i):
            total += n // 4 * cfg.index_dim * b + 2 * frontier_rows(4, CHECKPOINT_MARGIN) * 2 * cfg.index_dim \
                * FRONTIER_BYTES
    return total


def kv_bytes(cfg: ModelConfig, layers: Iterable[int] | None, ctx: int, dtype: str = "f32", *, chunk: int = 256,
             rollback: int = 0) -> int:
    """KV bytes of one session over `layers` (None: all of them)."""
    layers = range(cfg.n_layers) if layers is None else layers
    return sum(layer_kv_bytes(cfg, i, ctx, dtype, chunk=chunk, rollback=rollback) for i in layers)


def mtp_bytes(cfg: ModelConfig, specs: Iterable[TensorSpec], ctx: int, chunk: int, sessions: int) -> int:
    """What the MTP layer (serve --draft mtp) adds to the stage holding it: its tensors as kept (`specs`: the
    layer's, as its file stores them), and per session what engine/mtp.py allocates: the layer's own KV (a
    window-only layer whose pieces are at least a ring long) and the ring of the model's last HC states (fp32)."""
    ring = cfg.window + MTP_RING_EXTRA
    per_session = layer_kv_bytes(mtp_config(cfg), cfg.n_layers, ctx, chunk=max(chunk, ring)) + ring * cfg.hc_dim * 4
    return sum(kept_bytes(s) for s in specs) + sessions * per_session


def activation_bytes_per_token(cfg: ModelConfig) -> int:
    """fp32 activations live at once per prefill-chunk token (the widest moment of one layer)."""
    elems = (
        3 * cfg.hc_dim  # hyper-connection state in, out, and the flattened copy for hc_pre
        + 2 * cfg.n_heads * cfg.head_dim  # q and the attention output
        + cfg.q_lora_rank + cfg.head_dim + 4 * cfg.head_dim  # q low-rank, kv, compressor kv + gate (2 x 2 wide)
        + cfg.index_heads * cfg.index_dim  # indexer queries
        + cfg.n_heads * (cfg.window + cfg.index_topk)  # attention probabilities over window + selected rows
        + 3 * cfg.n_experts_used * cfg.expert_ffn  # routed gate, up, h
        + 3 * cfg.expert_ffn * cfg.n_shared_experts + cfg.n_experts  # shared expert, router logits
    )
    return 4 * elems


def indexer_scratch_bytes(cfg: ModelConfig, ctx: int, chunk: int) -> int:
    """The indexer's selection scratch for one prefill chunk: the [chunk, k + step] int64 key block (step: as
    many index blocks as keep it within INDEXER_SCRATCH_BYTES, at most ceil(ctx/4)), then the larger of the
    running top-k's values and indices (torch.topk) and a two-stage selection's int64 candidates with the
    ids and valid flags (at most INDEXER_SELECT_MAX per query, past 4,096 blocks and up to 16 chunks of
    8,192: an upper bound over the backends' plans, first-stage chunks of >= 2,048 blocks); for a chunk of
    at most INDEXER_MID_ROWS rows, which may take a middle stage past that, the first stage's candidates
    and a middle stage's (at most INDEXER_SELECT_MAX) at once."""
    n = max(_cdiv(ctx, 4), 1)
    k = min(cfg.index_topk, n)
    step = min(max(INDEXER_SCRATCH_BYTES // (8 * chunk) - k, k), n)
    cands = 0
    if n > 4096 and chunk <= INDEXER_MID_ROWS:
        cands = _cdiv(n, 2048) * k + INDEXER_SELECT_MAX
    elif 4096 < n <= 16 * INDEXER_SELECT_MAX:
        cands = min(INDEXER_SELECT_MAX, _cdiv(n, 2048) * k)
    return 8 * chunk * (k + step) + max(16 * chunk * k, 8 * chunk * cands + 9 * chunk * k)


def staging_bytes(slot_bytes: int) -> int:
    """Device bytes (and as many pinned host bytes) of a GPU streaming stage's two staging buffers."""
    return 2 * STAGING_EXPERTS * slot_bytes


@dataclass(frozen=True)
class ModelShape:
    """A model's config plus its tensor table, summarised per layer for the planner."""

    name: str
    cfg: ModelConfig
    specs: tuple[TensorSpec, ...] = field(repr=False)
    mtp_specs: tuple[TensorSpec, ...] = field(default=(), repr=False)  # the MTP layer's, when the model has one

    @cached_property
    def _tables(self) -> tuple[list[int], list[int], int, int, list[int]]:
        L = self.cfg.n_layers
        non_expert = [0] * L
        experts = [0] * L
        embed = output = 0
        for s in self.specs:
            n = kept_bytes(s)
            if s.layer is None:
                if s.role == "token_embd":
                    embed += n
                else:
                    output += n
            elif s.is_routed_expert:
                experts[s.layer] += n
            else:
                non_expert[s.layer] += n
        used, n = self.cfg.n_experts_used, max(self.cfg.n_experts, 1)
        read = [ne + e * used // n for ne, e in zip(non_expert, experts, strict=True)]
        return non_expert, experts, embed, output, read

    @property
    def non_expert_bytes(self) -> list[int]:
        return self._tables[0]

    @property
    def expert_bytes(self) -> list[int]:
        """Routed-expert bytes per layer: the whole expert table a streaming cache must be able to hold."""
        return self._tables[1]

    @property
    def embed_bytes(self) -> int:
        return self._tables[2]

    @property
    def output_bytes(self) -> int:
        return self._tables[3]

    @property
    def decode_read_bytes(self) -> list[int]:
        """Weight bytes read per decoded token, per layer."""
        return self._tables[4]

    @property
    def total_bytes(self) -> int:
        return sum(s.n_bytes for s in self.specs)

    def layer_weight_bytes(self, layer: int, streaming: bool = False) -> int:
        return self.non_expert_bytes[layer] + (0 if streaming else self.expert_bytes[layer])

    def expert_slot_bytes(self, layers: Iterable[int]) -> int:
        """Bytes of one routed expert (gate + up + down) of these layers: one cache slot."""
        return max((self.expert_bytes[i] // max(self.cfg.n_experts, 1) for i in layers), default=0)

    def min_expert_cache(self, layers: Iterable[int]) -> int:
        """The smallest streaming cache that still holds one full layer's expert table."""
        return max((self.expert_bytes[i] for i in layers), default=0)


DEMO_SHAPE = "demo-q2"  # the built-in demo model's shape (engine.demo makes exactly this file)
SHAPES: dict[str, tuple[ModelConfig, str]] = {
    "demo-q2": (DEMO, "q2"),
    "flash-q2": (FLASH, "q2"),
    "flash-q2-q4": (FLASH, "q2-q4"),
    "flash-q4": (FLASH, "q4"),
    "flash-f16": (FLASH, "f16"),
    "tiny-q2": (TINY, "q2"),
    "tiny-f16": (TINY, "f16"),
}


def named_shape(name: str) -> ModelShape:
    """`flash-q2` (the ~81 GiB q2 file), `demo-q2` (the built-in demo), `tiny-q2` (the test shape), ... without
    needing the file."""
    try:
        cfg, recipe = SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}") from None
    return ModelShape(name, cfg, tuple(model_tensors(cfg, recipe)), tuple(mtp_tensors(cfg, recipe)))


def shape_from_specs(name: str, cfg: ModelConfig, specs: Sequence[TensorSpec],
                     mtp: Sequence[TensorSpec] = ()) -> ModelShape:
    """From a GGUF file's tensor table (model.gguf.GGUFFile.tensor_specs(); `mtp`: its MTP layer's, or those of
    the layer's own file)."""
    return ModelShape(name, cfg, tuple(specs), tuple(mtp))


@dataclass(frozen=True)
class FootprintSettings:
    prefill_chunk: int = 2048
    kv_dtype: str = "f32"
    sessions: int = 2  # KV slots allocated at load (serve --sessions)
    rollback: int = 1024  # positions a live session can roll back (serve --rollback)
    runtime_overhead: int = DEFAULT_RUNTIME_OVERHEAD
    # Measured peak temporaries of a prefill chunk over `activation_bytes_per_token` x chunk. 1.0 is the budget
    # the shapes need; engine/gpu.py measured 2.8 (H200, layers 0-3 + head, chunk 256, 2026-11-29).
    activation_factor: float = 1.0
    mtp: bool = False  # the MTP layer beside the output head (serve --draft mtp): see mtp_bytes

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: choose one of {', '.join(KV_DTYPE_BYTES)}")
        if self.prefill_chunk <= 0:
            raise ValueError("prefill_chunk must be > 0")
        if self.sessions < 1 or self.rollback < 0:
            raise ValueError("sessions must be >= 1 and rollback >= 0")
        if self.activation_factor <= 0:
            raise ValueError("activation_factor must be > 0")


@dataclass(frozen=True)
class StageFootprint:
    weights_bytes: int  # resident weights (routed experts excluded when streaming)
    kv_bytes: int  # every session's KV slot
    scratch_bytes: int
    overhead_bytes: int
    expert_cache_bytes: int = 0  # the slot pool, its slot table and device staging buffers
    host_staging_bytes: int = 0  # pinned host memory of a GPU streaming stage (counted against host RAM)
    mtp_bytes: int = 0  # the MTP layer's weights and per-session state (serve --draft mtp)

    @property
    def predicted_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.scratch_bytes + self.overhead_bytes + self.expert_cache_bytes
                + self.mtp_bytes)


def stage_footprint(model: ModelShape, layers: range, ctx: int, settings: FootprintSettings, *,
                    embed: bool = False, output: bool = False, expert_cache_bytes: int = 0,
                    device_kind: str = "gpu") -> StageFootprint:
    """Predicted bytes for a stage holding `layers` (and optionally the embedding / output head), with
    `settings.sessions` KV slots; a streaming stage on a GPU also holds its staging buffers (device and
    pinned host); a CPU stage ("cpu") has neither staging nor a GPU runtime. With `settings.mtp`, the stage
    holding the head holds the MTP layer too (stage_mtp_bytes)."""
    cfg = model.cfg
    streaming = expert_cache_bytes > 0
    weights = sum(model.layer_weight_bytes(i, streaming) for i in layers)
    weights += (model.embed_bytes if embed else 0) + (model.output_bytes if output else 0)
    kv = settings.sessions * kv_bytes(cfg, layers, ctx, settings.kv_dtype, chunk=settings.prefill_chunk,
                                      rollback=settings.rollback)
    cache = expert_cache_device_bytes(model, layers, expert_cache_bytes, device_kind) if streaming else 0
    scratch = scratch_bytes(cfg, layers, ctx, settings, output=output)
    if device_kind == "cpu":
        scratch += CPU_DEQUANT_BYTES
    stage = staging_bytes(model.expert_slot_bytes(layers)) if streaming and device_kind != "cpu" else 0
    extra = stage_mtp_bytes(model, ctx, settings, embed=embed) if output else 0
    return StageFootprint(weights, kv, scratch, settings.runtime_overhead, cache, stage, extra)


def stage_mtp_bytes(model: ModelShape, ctx: int, settings: FootprintSettings, *, embed: bool) -> int:
    """What the MTP layer adds to the stage holding the output head (0 unless `settings.mtp`): mtp_bytes over
    the model's MTP tensors, and the token embedding's copy on a stage that does not embed."""
    if not settings.mtp:
        return 0
    if not model.mtp_specs:
        raise ValueError(f"{model.name} has no MTP layer to plan for (no {MTP_PREFIX}* tensors): give the layer's "
                         "own GGUF (--mtp FILE) or plan without --draft mtp")
    specs = [*model.mtp_specs, *([] if embed else [s for s in model.specs if s.role == "token_embd"])]
    return mtp_bytes(model.cfg, specs, ctx, settings.prefill_chunk, settings.sessions)


def expert_cache_device_bytes(model: ModelShape, layers: range, capacity: int, device_kind: str = "gpu") -> int:
    """What a streaming stage's ExpertCache holds on its device for a cache of `capacity` bytes: whole slots
    (capacity // slot bytes of them), the slot table (int64 per layer and expert) and, on a GPU, the device
    staging buffers (engine/experts.py; a test compares them)."""
    slot = model.expert_slot_bytes(layers)
    if not slot:
        return 0
    table = len(layers) * model.cfg.n_experts * 8
    return capacity // slot * slot + table + (staging_bytes(slot) if device_kind != "cpu" else 0)


def scratch_bytes(cfg: ModelConfig, layers: range, ctx: int, settings: FootprintSettings, *,
                  output: bool = False) -> int:
    chunk = settings.prefill_chunk
    n = int(activation_bytes_per_token(cfg) * chunk * settings.activation_factor)
    if any(cfg.has_indexer(i) for i in layers):
        n += indexer_scratch_bytes(cfg, ctx, chunk)
    if output:
        n += 2 * cfg.vocab_size * 4  # logits row + sampler copy
    return n


__all__ = [
    "CHECKPOINT_MARGIN", "CPU_DEQUANT_BYTES", "DEFAULT_RUNTIME_OVERHEAD", "DEMO_SHAPE", "FootprintSettings",
    "INDEXER_SCRATCH_BYTES", "INDEXER_SELECT_MAX", "KV_DTYPE_BYTES",
    "ModelShape", "SHAPES", "STAGING_EXPERTS", "StageFootprint", "WIDENED_ROLES", "activation_bytes_per_token",
    "expert_cache_device_bytes", "frontier_rows", "indexer_scratch_bytes", "kept_bytes",
    "kv_bytes", "kv_bytes_per_token", "kv_slack", "layer_kv_bytes", "named_shape", "scratch_bytes",
    "shape_from_specs", "stage_footprint", "staging_bytes", "mtp_bytes", "stage_mtp_bytes",
]
