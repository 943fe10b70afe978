"""ModelConfig: the DeepSeek-V4-Flash hyper-parameters, read from and written to GGUF metadata.

One dataclass owns the shape. `FLASH` is the real model (DS4-MODEL.md), `TINY` the demo/test shape that
keeps Flash's layer pattern at small sizes. Every `deepseek4.*` key ds4's loader reads maps to one field
here; `from_metadata` names the missing or inconsistent key instead of failing later in a matmul.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any

ARCH = "deepseek4"


class ConfigError(ValueError):
    """The GGUF metadata does not describe a valid DeepSeek-V4 model."""


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int = 43
    dim: int = 4096
    vocab_size: int = 129280
    context_length: int = 1048576
    n_heads: int = 64
    n_kv_heads: int = 1
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    n_experts: int = 256
    n_experts_used: int = 6
    expert_ffn: int = 2048
    n_shared_experts: int = 1
    n_hash_layers: int = 3
    window: int = 128
    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    compress_ratios: tuple[int, ...] = ()
    swiglu_clamp: tuple[float, ...] = ()
    # Per layer; empty = the routed clamp. DeepSeek's reference (Expert(..., swiglu_limit)), ds4.c and
    # transformers all clamp the shared expert like the routed ones; ds4's files carry no key for it.
    swiglu_clamp_shared: tuple[float, ...] = ()
    rope_base: float = 10000.0
    compress_rope_base: float = 160000.0
    rope_factor: float = 16.0
    rope_orig_ctx: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    expert_weights_scale: float = 1.5
    expert_weights_norm: bool = True
    rms_eps: float = 1e-6
    bos_id: int = 0
    eos_id: int = 1

    def __post_init__(self) -> None:
        if not self.compress_ratios:
            object.__setattr__(self, "compress_ratios", flash_ratios(self.n_layers, 128))
        if not self.swiglu_clamp:
            object.__setattr__(self, "swiglu_clamp", (10.0,) * self.n_layers)
        if not self.swiglu_clamp_shared:
            object.__setattr__(self, "swiglu_clamp_shared", self.swiglu_clamp)
        elif isinstance(self.swiglu_clamp_shared, (int, float)):  # one value for every layer
            object.__setattr__(self, "swiglu_clamp_shared", (float(self.swiglu_clamp_shared),) * self.n_layers)
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        # GGUF stores these as f32: keep exactly what a file round trip gives, so configs compare equal.
        for name in ("swiglu_clamp", "swiglu_clamp_shared"):
            object.__setattr__(self, name, tuple(_f32(c) for c in getattr(self, name)))
        for f in dataclasses.fields(self):
            if f.type == "float":
                object.__setattr__(self, f.name, _f32(getattr(self, f.name)))
        self.validate()

    # ---- derived shape ------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        """Head dims without RoPE (the first ones); they take the FP8 round trip."""
        return self.head_dim - self.rope_dim

    @property
    def hc_dim(self) -> int:
        """Flattened hyper-connection state: hc_mult streams x dim."""
        return self.hc_mult * self.dim

    @property
    def hc_mix(self) -> int:
        """hc_pre mix width: pre (hc) + post (hc) + comb (hc x hc)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == 4

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def compressor_width(self, layer: int) -> int:
        """Overlapping ratio-4 compressors project 2 x head_dim; others 1 x."""
        r = self.compress_ratios[layer]
        return 0 if r == 0 else (2 if r == 4 else 1) * self.head_dim

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and f.name not in ("bos_id", "eos_id"):
                need(v >= 0, f"{f.name} must be >= 0, got {v}")
        need(self.n_layers > 0, "block_count must be > 0")
        need(len(self.compress_ratios) == self.n_layers,
             f"attention.compress_ratios has {len(self.compress_ratios)} entries, block_count is {self.n_layers}")
        need(len(self.swiglu_clamp) == self.n_layers,
             f"swiglu_clamp_exp has {len(self.swiglu_clamp)} entries, block_count is {self.n_layers}")
        need(len(self.swiglu_clamp_shared) == self.n_layers,
             f"swiglu_clamp_shexp has {len(self.swiglu_clamp_shared)} entries, block_count is {self.n_layers}")
        for i, r in enumerate(self.compress_ratios):
            need(r == 0 or r == 4 or (r > 4 and r & (r - 1) == 0),
                 f"attention.compress_ratios[{i}] = {r}: must be 0, 4 or a larger power of two")
        need(self.n_kv_heads == 1, f"attention.head_count_kv = {self.n_kv_heads}: DeepSeek-V4 uses one shared KV head")
        need(0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0,
             f"rope.dimension_count = {self.rope_dim} must be even and <= key_length {self.head_dim}")
        need(self.nope_dim % 64 == 0, f"key_length - rope dims = {self.nope_dim} must be a multiple of 64 (FP8 blocks)")
        need(self.o_groups > 0 and self.n_heads % self.o_groups == 0,
             f"attention.head_count {self.n_heads} is not divisible by output_group_count {self.o_groups}")
        need(0 < self.n_experts_used <= self.n_experts,
             f"expert_used_count {self.n_experts_used} must be in 1..expert_count {self.n_experts}")
        need(self.n_hash_layers <= self.n_layers, "hash_layer_count exceeds block_count")
        need(self.index_dim & (self.index_dim - 1) == 0 and self.index_dim % 32 == 0,
             f"attention.indexer.key_length {self.index_dim} must be a power of two >= 32 (Hadamard, FP4 blocks)")
        need(self.rope_dim <= self.index_dim, "rope.dimension_count exceeds attention.indexer.key_length")
        need(self.hc_mult >= 1, "hyper_connection.count must be >= 1")
        need(self.window > 0, "attention.sliding_window must be > 0")

    # ---- GGUF metadata ------------------------------------------------------------------------
    def to_metadata(self) -> dict[str, Any]:
        """`deepseek4.*` keys (without the prefix) -> value, as ds4's loader expects them."""
        return {k: _to_gguf_value(getattr(self, f)) for k, f in _KEYS.items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ModelConfig:
        """Build from a mapping of full GGUF keys (`deepseek4.block_count`, ...) to values."""
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise ConfigError(f"general.architecture is {arch!r}, expected {ARCH!r}")
        kw: dict[str, Any] = {}
        missing = []
        for key, fname in _KEYS.items():
            full = f"{ARCH}.{key}"
            if full in meta:
                kw[fname] = meta[full]
            elif key not in _OPTIONAL_KEYS:
                missing.append(full)
        if missing:
            raise ConfigError("GGUF metadata is missing required key(s): " + ", ".join(missing))
        for opt in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            if opt in meta:
                kw["bos_id" if "bos" in opt else "eos_id"] = int(meta[opt])
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for fname, v in list(kw.items()):
            kw[fname] = _from_gguf_value(v, types[fname], fname)
        for key in ("expert_group_count", "expert_group_used_count"):
            v = meta.get(f"{ARCH}.{key}", 0)
            if int(v) != 0:
                raise ConfigError(f"{ARCH}.{key} = {v}: group-limited routing is not part of DeepSeek-V4-Flash")
        return cls(**kw)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def flash_ratios(n_layers: int, big: int) -> tuple[int, ...]:
    """Flash's layer pattern: layers 0-1 window only, then even -> 4 (with indexer), odd -> `big`."""
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else big) for i in range(n_layers))


# GGUF key (after "deepseek4.") -> ModelConfig field
_KEYS: dict[str, str] = {
    "block_count": "n_layers",
    "context_length": "context_length",
    "embedding_length": "dim",
    "vocab_size": "vocab_size",
    "attention.head_count": "n_heads",
    "attention.head_count_kv": "n_kv_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "rope.dimension_count": "rope_dim",
    "attention.q_lora_rank": "q_lora_rank",
    "attention.output_lora_rank": "o_lora_rank",
    "attention.output_group_count": "o_groups",
    "expert_count": "n_experts",
    "expert_used_count": "n_experts_used",
    "expert_feed_forward_length": "expert_ffn",
    "expert_shared_count": "n_shared_experts",
    "hash_layer_count": "n_hash_layers",
    "attention.sliding_window": "window",
    "attention.indexer.head_count": "index_heads",
    "attention.indexer.key_length": "index_dim",
    "attention.indexer.top_k": "index_topk",
    "hyper_connection.count": "hc_mult",
    "hyper_connection.sinkhorn_iterations": "hc_sinkhorn_iters",
    "hyper_connection.epsilon": "hc_eps",
    "attention.compress_ratios": "compress_ratios",
    "swiglu_clamp_exp": "swiglu_clamp",
    "swiglu_clamp_shexp": "swiglu_clamp_shared",
    "rope.freq_base": "rope_base",
    "attention.compress_rope_freq_base": "compress_rope_base",
    "rope.scaling.factor": "rope_factor",
    "rope.scaling.original_context_length": "rope_orig_ctx",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
    "expert_weights_scale": "expert_weights_scale",
    "expert_weights_norm": "expert_weights_norm",
    "attention.layer_norm_rms_epsilon": "rms_eps",
}
_OPTIONAL_KEYS = {"swiglu_clamp_exp", "swiglu_clamp_shexp", "attention.value_length"}


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def _to_gguf_value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _from_gguf_value(v: Any, typ: Any, fname: str) -> Any:
    t = str(typ)
    try:
        if t.startswith("tuple") and not isinstance(v, (list, tuple)):
            return float(v)  # a scalar for every layer (swiglu_clamp_shexp in some converters)
        if t.startswith("tuple"):
            seq = list(v)
            return tuple(float(x) for x in seq) if "float" in t else tuple(int(x) for x in seq)
        if t == "bool":
            return bool(v)
        if t == "float":
            return float(v)
        return int(v)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"metadata for {fname} has an unusable value {v!r}: {e}") from e


FLASH = ModelConfig()

# The demo / test shape: Flash's pattern at small sizes. Dims are multiples of 256 where the q2 file
# uses 256-element super-blocks (IQ2_XXS, Q2_K). Prompts of ~100 tokens exceed the window (8), the
# ratio-4 top-k (3 of up to 25 blocks) and several ratio-16 blocks.
TINY = ModelConfig(
    n_layers=6,
    dim=256,
    vocab_size=512,
    context_length=4096,
    n_heads=4,
    head_dim=192,
    rope_dim=64,
    q_lora_rank=128,
    o_lora_rank=64,
    o_groups=2,
    n_experts=8,
    n_experts_used=3,
    expert_ffn=256,
    n_shared_experts=1,
    n_hash_layers=3,
    window=8,
    index_heads=4,
    index_dim=128,
    index_topk=3,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    compress_ratios=flash_ratios(6, 16),
    rope_orig_ctx=256,
    rope_factor=4.0,
)

# The built-in demo model (what `serve` and the control panel run without --model): TINY's layers, tensor names
# and quant types, with a context that real agents' prompts fit in (Claude Code's first request is ~25K tokens
# with this vocabulary) and a vocabulary trained on enough text (engine/tokenizer.py) that prompts tokenize to
# about 4 characters a token.
DEMO = dataclasses.replace(TINY, vocab_size=8192, context_length=131072)

PRESETS: dict[str, ModelConfig] = {"demo": DEMO, "tiny": TINY, "flash": FLASH}

__all__ = ["ARCH", "ConfigError", "DEMO", "FLASH", "ModelConfig", "PRESETS", "TINY", "flash_ratios"]
