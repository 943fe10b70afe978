"""The DS4 tensor table: every tensor's name, ggml shape and quant type, for any ModelConfig.

This is the one description of the file layout. The GGUF writer emits it, the reader validates a file
against it (ds4 rejects any mismatch with a message naming the tensor; so do we), the planner sums its
bytes per layer, and the benchmark builds random weights from it.

Shapes are in ggml order (ne[0] is the contiguous, innermost dimension); `torch_shape` reverses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .config import ModelConfig

# role -> quant type, per recipe. Roles are the tensor names with the "blk.N." prefix and ".weight" removed.
_Q2 = {
    "token_embd": Q.F16, "output": Q.Q8_0,
    "attn_q_a": Q.Q8_0, "attn_q_b": Q.Q8_0, "attn_kv": Q.Q8_0,
    "attn_output_a": Q.Q8_0, "attn_output_b": Q.Q8_0,
    "ffn_gate_shexp": Q.Q8_0, "ffn_up_shexp": Q.Q8_0, "ffn_down_shexp": Q.Q8_0,
    "ffn_gate_exps": Q.IQ2_XXS, "ffn_up_exps": Q.IQ2_XXS, "ffn_down_exps": Q.Q2_K,
    "e_proj": Q.Q8_0, "h_proj": Q.Q8_0,
}
# q2-q4: as the published "q2-q4-imatrix" Flash file, the routed experts of the last layers in Q4_K (Flash: 37-42,
# 6 of 43; a smaller model: the same share, at least one layer); q4: as "q4-imatrix", Q4_K routed experts in
# every layer. The other tensors are the q2 recipe's.
RECIPES = ("q2", "q2-q4", "q4", "f16", "f32")
_ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def q4_expert_layers(cfg: ModelConfig, recipe: str) -> range:
    """The layers whose routed experts the recipe stores in Q4_K."""
    n = cfg.n_layers
    if recipe == "q4":
        return range(n)
    if recipe == "q2-q4":
        return range(n - -(-6 * n // 43), n)
    return range(0)

# Tensors that hold norms, scales, biases and sinks stay F32 in every recipe.
F32_ROLES = {
    "hc_attn_scale", "hc_attn_base", "hc_ffn_scale", "hc_ffn_base", "attn_norm", "ffn_norm",
    "attn_q_a_norm", "attn_kv_a_norm", "attn_sinks", "attn_compressor_norm", "indexer_compressor_norm",
    "exp_probs_b", "output_hc_scale", "output_hc_base", "output_norm",
    "enorm", "hnorm", "norm", "hc_head_scale", "hc_head_base",
}
# DeepSeek-V4's next-token-prediction (MTP) layer: tensors named MTP_PREFIX + role (ds4's names), in the model
# file (make-model --mtp) or a GGUF of its own (the published DeepSeek-V4-Flash-MTP file, serve --mtp FILE).
MTP_PREFIX = "mtp.0."


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # ggml order
    qtype: Q
    layer: int | None  # None for global tensors

    @property
    def role(self) -> str:
        return role_of(self.name)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        return tensor_bytes(self.shape, self.qtype)

    @property
    def is_routed_expert(self) -> bool:
        return self.role in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def role_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] in ("blk", "mtp"):
        parts = parts[2:]
    if parts[-1] in ("weight", "bias"):
        parts = parts[:-1]
    return ".".join(parts)


def tensor_bytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    if shape[0] % block:
        raise ValueError(f"innermost dim {shape[0]} is not a multiple of the {qtype.name} block ({block})")
    return n // block * size


def quant_type(role: str, recipe: str, q4_experts: bool = False) -> Q:
    """The recipe's type for a tensor role; `q4_experts`: the layer is one of `q4_expert_layers`."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown quant recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if role == "ffn_gate_tid2eid":
        return Q.I32
    if role in F32_ROLES or recipe == "f32":
        return Q.F32
    if recipe in ("q2", "q2-q4", "q4"):
        return Q.Q4_K if q4_experts and role in _ROUTED else _Q2.get(role, Q.F16)
    return Q.F16


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The model's config with the MTP block as one more layer, `cfg.n_layers`: a window-only layer (ratio 0,
    no compressor or indexer), routed by its scores (not hashed), clamped like the last layer (DeepSeek's
    reference builds it as `Block(n_layers, ...)`; ds4 runs it with the window-only layers' RoPE)."""
    return dataclasses.replace(cfg, n_layers=cfg.n_layers + 1, compress_ratios=(*cfg.compress_ratios, 0),
                               swiglu_clamp=(*cfg.swiglu_clamp, cfg.swiglu_clamp[-1]),
                               swiglu_clamp_shared=(*cfg.swiglu_clamp_shared, cfg.swiglu_clamp_shared[-1]))


def mtp_name(name: str, cfg: ModelConfig) -> str:
    """A tensor name of mtp_config's last layer (blk.N.x) as the MTP file spells it (mtp.0.x)."""
    prefix = f"blk.{cfg.n_layers}."
    return MTP_PREFIX + name[len(prefix):] if name.startswith(prefix) else name


def mtp_tensors(cfg: ModelConfig, recipe: str = "q2") -> list[TensorSpec]:
    """The MTP layer's tensors (ds4's list): its input projections and norms (the token embedding's `e_proj` /
    `enorm`, the model's last hidden state's `h_proj` / `hnorm`), its own hyper-connection head and norm (the
    model's embedding and output matrix are shared), then a whole block (mtp_config's last layer)."""
    d = cfg.dim
    head = {"e_proj": (d, d), "h_proj": (d, d), "enorm": (d,), "hnorm": (d,), "norm": (d,),
            "hc_head_fn": (cfg.hc_dim, cfg.hc_mult), "hc_head_scale": (1,), "hc_head_base": (cfg.hc_mult,)}
    specs = [TensorSpec(f"{MTP_PREFIX}{role}.weight", shape, quant_type(role, recipe), None)
             for role, shape in head.items()]
    mcfg = mtp_config(cfg)
    return specs + [TensorSpec(mtp_name(s.name, cfg), s.shape, s.qtype, None)
                    for s in layer_tensors(mcfg, cfg.n_layers, recipe)]


def layer_tensors(cfg: ModelConfig, layer: int, recipe: str = "q2") -> list[TensorSpec]:
    d, H, M = cfg.dim, cfg.hc_dim, cfg.hc_mix
    shapes: dict[str, tuple[int, ...]] = {
        "hc_attn_fn": (H, M), "hc_attn_scale": (3,), "hc_attn_base": (M,),
        "attn_norm": (d,),
        "attn_q_a": (d, cfg.q_lora_rank), "attn_q_a_norm": (cfg.q_lora_rank,),
        "attn_q_b": (cfg.q_lora_rank, cfg.n_heads * cfg.head_dim),
        "attn_kv": (d, cfg.head_dim), "attn_kv_a_norm": (cfg.head_dim,),
        "attn_sinks": (cfg.n_heads,),
        "attn_output_a": (cfg.heads_per_group * cfg.head_dim, cfg.o_groups * cfg.o_lora_rank),
        "attn_output_b": (cfg.o_groups * cfg.o_lora_rank, d),
    }
    r = cfg.ratio(layer)
    if r:
        w = cfg.compressor_width(layer)
        shapes |= {"attn_compressor_ape": (w, r), "attn_compressor_kv": (d, w),
                   "attn_compressor_gate": (d, w), "attn_compressor_norm": (cfg.head_dim,)}
    if cfg.has_indexer(layer):
        iw = 2 * cfg.index_dim
        shapes |= {"indexer.attn_q_b": (cfg.q_lora_rank, cfg.index_heads * cfg.index_dim),
                   "indexer.proj": (d, cfg.index_heads),
                   "indexer_compressor_ape": (iw, 4), "indexer_compressor_kv": (d, iw),
                   "indexer_compressor_gate": (d, iw), "indexer_compressor_norm": (cfg.index_dim,)}
    shapes |= {"hc_ffn_fn": (H, M), "hc_ffn_scale": (3,), "hc_ffn_base": (M,),
               "ffn_norm": (d,), "ffn_gate_inp": (d, cfg.n_experts)}
    if cfg.is_hash_layer(layer):
        shapes["ffn_gate_tid2eid"] = (cfg.n_experts_used, cfg.vocab_size)
    else:
        shapes["exp_probs_b"] = (cfg.n_experts,)
    f, E = cfg.expert_ffn, cfg.n_experts
    shapes |= {"ffn_gate_exps": (d, f, E), "ffn_up_exps": (d, f, E), "ffn_down_exps": (f, d, E)}
    if cfg.n_shared_experts:
        fs = f * cfg.n_shared_experts
        shapes |= {"ffn_gate_shexp": (d, fs), "ffn_up_shexp": (d, fs), "ffn_down_shexp": (fs, d)}
    q4 = layer in q4_expert_layers(cfg, recipe)
    return [
        TensorSpec(f"blk.{layer}.{role}.{'bias' if role == 'exp_probs_b' else 'weight'}", shape,
                   quant_type(role, recipe, q4), layer)
        for role, shape in shapes.items()
    ]


def global_tensors(cfg: ModelConfig, recipe: str = "q2", *, embed: bool = True,
                   output: bool = True) -> list[TensorSpec]:
    specs = []
    if embed:
        specs.append(("token_embd", (cfg.dim, cfg.vocab_size)))
    if output:
        specs += [("output_hc_fn", (cfg.hc_dim, cfg.hc_mult)), ("output_hc_scale", (1,)),
                  ("output_hc_base", (cfg.hc_mult,)), ("output_norm", (cfg.dim,)),
                  ("output", (cfg.dim, cfg.vocab_size))]
    return [TensorSpec(f"{role}.weight", shape, quant_type(role, recipe), None) for role, shape in specs]


def model_tensors(cfg: ModelConfig, recipe: str = "q2", layers: range | None = None, *,
                  embed: bool = True, output: bool = True, mtp: bool = False) -> list[TensorSpec]:
    """The tensors of a layer slice (default: the whole model) plus the embedding / output head (and with
    `mtp` the MTP layer after them)."""
    layers = range(cfg.n_layers) if layers is None else layers
    specs = global_tensors(cfg, recipe, embed=embed, output=False)
    for i in layers:
        specs += layer_tensors(cfg, i, recipe)
    return specs + global_tensors(cfg, recipe, embed=False, output=output) + (mtp_tensors(cfg, recipe) if mtp else [])
