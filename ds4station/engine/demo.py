"""Random-weight DS4 models: the built-in demo model and any preset shape, written as a real GGUF.

The weights are random but well-scaled (projections ~ 1/sqrt(fan_in), norms ~ 1), quantised blocks are
random *valid* blocks of the recipe's type, so the file exercises exactly the tensor names, ggml shapes
and quant types of the real q2 file. Same seed, same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from ds4station.cache import cache_dir
from ds4station.kernels.quants import QTensor, random_blocks
from ds4station.model.config import PRESETS, ModelConfig
from ds4station.model.layout import TensorSpec, model_tensors

from .tokenizer import EOS_ID, build_demo_vocab, tokenizer_metadata
from .weights import write_gguf

DEMO_PRESET = "demo"
# Bump when the demo model's contents change: the cached file of an older version is replaced on first use.
# 3: with the MTP layer (serve --draft mtp runs on the demo; the model's weights are version 2's).
DEMO_VERSION = 3


# The built-in demo model ends its answers: its output head's row for EOS is this many times longer than the
# others, so that EOS is sampled every few dozen tokens instead of once in ~8K (an agent's turn then ends with
# end_turn / stop, as with a real model, rather than at max_tokens).
DEMO_EOS_GAIN = {"demo": 6.0}


def random_weight(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator,
                  eos_gain: float = 0.0) -> torch.Tensor | QTensor:
    """One tensor of a random model: float for F32/F16/I32 roles, random valid blocks for quantised ones;
    `eos_gain` > 0 makes the output head float (quantised by the writer) with the EOS row scaled by it."""
    role, shape, dev = spec.role, spec.torch_shape, gen.device  # made where the generator lives
    if role == "output" and eos_gain > 0:
        head = spec.shape[0] ** -0.5 * torch.randn(shape, generator=gen, device=dev)
        head[EOS_ID] *= eos_gain
        return head
    if role == "ffn_gate_tid2eid":  # hash routing: n_used distinct experts per token
        scores = torch.rand(shape[0], cfg.n_experts, generator=gen, device=dev)
        return scores.argsort(dim=-1)[:, : cfg.n_experts_used].to(torch.int32)
    if role.endswith("norm"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=dev)
    if role in ("hc_attn_scale", "hc_ffn_scale", "output_hc_scale", "hc_head_scale"):
        return 0.5 + 0.1 * torch.rand(shape, generator=gen, device=dev)
    if role in ("hc_attn_base", "hc_ffn_base", "output_hc_base", "hc_head_base", "attn_sinks", "exp_probs_b"):
        return 0.5 * torch.randn(shape, generator=gen, device=dev)
    fan_in = spec.shape[0]
    scale = 1.0 if role == "token_embd" else fan_in ** -0.5
    if role.endswith("_ape"):
        scale = 0.1
    if spec.qtype in (Q.F32, Q.F16, Q.BF16):
        return scale * torch.randn(shape, generator=gen, device=dev)
    return QTensor(random_blocks(spec.qtype, spec.n_elements, gen, scale), spec.qtype, shape)


class _RandomTensors(Mapping[str, "torch.Tensor | QTensor"]):
    """The tensors of a random model, each made when the writer asks for it, in layout order, from one
    generator (so the same seed gives the same bytes, and the whole model never sits in memory)."""

    def __init__(self, cfg: ModelConfig, specs: list[TensorSpec], seed: int, device: str = "cpu",
                 eos_gain: float = 0.0) -> None:
        self.cfg, self.specs, self.next, self.eos_gain = cfg, {s.name: s for s in specs}, 0, eos_gain
        self.order = list(self.specs)
        self.gen = torch.Generator(device).manual_seed(seed)

    def __getitem__(self, name: str) -> torch.Tensor | QTensor:
        if self.next >= len(self.order) or self.order[self.next] != name:
            raise KeyError(f"{name}: random tensors are made once each, in layout order")
        self.next += 1
        return random_weight(self.specs[name], self.cfg, self.gen, self.eos_gain)

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def make_model(out: str | os.PathLike[str], preset: str = "tiny", seed: int = 0, quant: str = "q2",
               device: str = "cpu", mtp: bool = False) -> Path:
    """Write a complete DS4 GGUF of the named shape with random weights and the demo tokenizer, one tensor at
    a time (the full Flash shape needs its ~81 GiB of disk, not of RAM). `device="cuda"` draws the weights
    on the GPU (the Flash shape in about a minute instead of ~8 on 16 cores); the same seed gives the same
    bytes on the same kind of device. `mtp`: the MTP layer too (its tensors drawn after the model's, so the
    model's weights are those of the same seed without it)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    specs = model_tensors(cfg, quant, mtp=mtp)
    tensors = _RandomTensors(cfg, specs, seed, device, DEMO_EOS_GAIN.get(preset, 0.0))
    meta = tokenizer_metadata(build_demo_vocab(cfg.vocab_size))
    extra = {"general.name": f"ds4station random {preset} ({quant}{', MTP' if mtp else ''}, seed {seed})"}
    return write_gguf(out, cfg, tensors, recipe=quant, tokenizer_meta=meta, extra_meta=extra, specs=specs)


def demo_model_path() -> Path:
    """The built-in demo model (with its MTP layer, for serve --draft mtp), created on first use in the user's
    cache directory; the files of older demo versions there are removed when it is."""
    path = cache_dir() / f"demo-q2-v{DEMO_VERSION}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, preset=DEMO_PRESET, mtp=True)
        for old in path.parent.glob("demo-*q2-v*.gguf"):
            if old != path:
                old.unlink(missing_ok=True)
    return path
