"""Parity of the reference model with Hugging Face transformers' DeepseekV4ForCausalLM.

Random weights in our layout go through our GGUF writer (recipe f32) and reader, then into both models;
full-sequence logits over a prompt longer than the window, several ratio-4 and ratio-16 blocks and the
indexer's top-k must agree to fp32 rounding. The quantisation-aware round trips are off: transformers has
none (DS4-MODEL.md, "References").

Deliberate differences from transformers, set in the config rather than the model:
- The shared expert is clamped like the routed ones (transformers' DeepseekV4MLP does; so do ds4.c, whose
  shared-expert swiglu uses DS4_SWIGLU_CLAMP_EXP, and DeepSeek's inference/model.py, whose shared expert is
  `Expert(..., swiglu_limit=args.swiglu_limit)`); our config makes it a field (`swiglu_clamp_shared`).
- Indexer ties: when blocks score exactly the same (every head's ReLU at 0 for a query whose head weights
  are all negative), we keep the earlier block, as ds4.c's selection loop does, so the choice does not
  depend on chunking. transformers leaves the order of ties to `Tensor.topk`; the test gives its indexer
  the same rule (`_stable_topk`), which only changes which of several equal scores wins. Without it the
  two models pick different tied blocks on some seeds (seen: relative error 0.1 from position ~50).
- transformers' RoPE uses the same interleaved pairs on the trailing dims (glm's rotate_half on
  repeat_interleave'd cos/sin) as DeepSeek's reference and ds4, so weights map without permutation.
"""

from __future__ import annotations

import pytest
import torch

from ds4station.engine.engine import Engine
from ds4station.engine.model import OFF, DS4Model, random_weights
from ds4station.engine.tokenizer import build_demo_vocab, tokenizer_metadata
from ds4station.engine.weights import load_tensors, write_gguf
from ds4station.model.config import TINY, ModelConfig
from ds4station.model.gguf import GGUFFile

transformers = pytest.importorskip("transformers")

HF_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """Tensor.topk with ties resolved toward the lower index (what our indexer does)."""
    order = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))


def hf_config(cfg: ModelConfig):
    big = max(cfg.compress_ratios)
    return transformers.DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, partial_rotary_factor=cfg.rope_dim / cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.n_experts_used, n_routed_experts=cfg.n_experts, n_shared_experts=1,
        routed_scaling_factor=cfg.expert_weights_scale, norm_topk_prob=cfg.expert_weights_norm,
        rope_theta=cfg.rope_base, compress_rope_theta=cfg.compress_rope_base,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.rope_orig_ctx,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        max_position_embeddings=int(cfg.rope_orig_ctx * cfg.rope_factor),
        layer_types=[HF_LAYER_TYPE.get(r, "heavily_compressed_attention") for r in cfg.compress_ratios],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": big},
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)],
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_clamp[0], sliding_window=cfg.window, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_heads, index_head_dim=cfg.index_dim,
        index_topk=cfg.index_topk, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=False,
    )


def to_hf_state(cfg: ModelConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GGUF tensor names (torch order) -> transformers parameter names. Same layouts, except the
    routed experts' gate and up, which transformers stacks as one gate_up_proj [E, 2*ffn, dim]."""
    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "lm_head.weight": w["output.weight"],
          "model.norm.weight": w["output_norm.weight"], "model.hc_head.hc_fn": w["output_hc_fn.weight"],
          "model.hc_head.hc_base": w["output_hc_base.weight"], "model.hc_head.hc_scale": w["output_hc_scale.weight"]}
    names = {
        "self_attn.sinks": "attn_sinks.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_norm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_proj.weight": "attn_kv.weight", "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
        "self_attn.o_a_proj.weight": "attn_output_a.weight", "self_attn.o_b_proj.weight": "attn_output_b.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "attn_hc.fn": "hc_attn_fn.weight", "attn_hc.base": "hc_attn_base.weight",
        "attn_hc.scale": "hc_attn_scale.weight", "ffn_hc.fn": "hc_ffn_fn.weight",
        "ffn_hc.base": "hc_ffn_base.weight", "ffn_hc.scale": "hc_ffn_scale.weight",
    }
    comp = {"position_bias": "ape", "kv_proj.weight": "kv", "gate_proj.weight": "gate", "kv_norm.weight": "norm"}
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"blk.{i}."
        for k, v in names.items():
            sd[hf + k] = w[ours + v]
        sd[hf + "mlp.experts.gate_up_proj"] = torch.cat(
            (w[ours + "ffn_gate_exps.weight"], w[ours + "ffn_up_exps.weight"]), dim=1)
        if cfg.is_hash_layer(i):
            sd[hf + "mlp.gate.tid2eid"] = w[ours + "ffn_gate_tid2eid.weight"].long()
        else:
            sd[hf + "mlp.gate.e_score_correction_bias"] = w[ours + "exp_probs_b.bias"]
        if cfg.ratio(i):
            for k, v in comp.items():
                sd[f"{hf}self_attn.compressor.{k}"] = w[f"{ours}attn_compressor_{v}.weight"]
        if cfg.has_indexer(i):
            ix = f"{hf}self_attn.compressor.indexer."
            for k, v in comp.items():
                sd[ix + k] = w[f"{ours}indexer_compressor_{v}.weight"]
            sd[ix + "q_b_proj.weight"] = w[ours + "indexer.attn_q_b.weight"]
            sd[ix + "scorer.weights_proj.weight"] = w[ours + "indexer.proj.weight"]
    return sd


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_logits_match_transformers(tmp_path, seed, monkeypatch):
    # TINY's shapes and layer pattern (window 8, ratio 4 with top-3, ratio 16); the shared expert clamped
    # as in transformers (see the module docstring). Few Sinkhorn rounds and peaked HC biases keep the comb
    # matrices far from converged, so a mis-ordered or transposed Sinkhorn changes the logits (it does by
    # ~0.3 relative; 20 rounds on near-uniform matrices would hide it).
    cfg = TINY.replace(hc_sinkhorn_iters=3)
    weights = random_weights(cfg, seed=seed)
    for name in weights:
        if name.endswith(("hc_attn_base.weight", "hc_ffn_base.weight")):
            weights[name] = 6 * weights[name]
    path = write_gguf(tmp_path / "tiny-f32.gguf", cfg, weights, recipe="f32",
                      tokenizer_meta=tokenizer_metadata(build_demo_vocab(cfg.vocab_size)))
    gf = GGUFFile.open(path)
    assert gf.config == cfg
    loaded = {name: q.dequantize() for name, q in load_tensors(gf).items()}
    ours = DS4Model(gf.config, loaded, round_trips=OFF)

    hf = transformers.DeepseekV4ForCausalLM(hf_config(cfg)).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state(cfg, loaded), strict=False)
    assert not unexpected
    assert all("rotary_emb" in k for k in missing), missing  # only the derived RoPE buffers are not loaded

    tokens = torch.randint(0, cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(torch.Tensor, "topk", _stable_topk)  # only the indexer calls the method form
    with torch.no_grad():
        ref = hf(input_ids=tokens[None], use_cache=False).logits[0]
    monkeypatch.undo()
    got = ours.head(ours.prefill(tokens, ours.new_cache(100, chunk=100)))
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, f"max relative logit error {err:.2e}"
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # the same file through the engine everything runs on: a chunked prefill, then one token at a time
    engine = Engine.load(path, ctx=128, device="cpu", chunk=16, round_trips=OFF)
    session = engine.new_session()
    steps = [session.extend(tokens[:50].tolist())] + [session.extend([int(t)]) for t in tokens[50:]]
    err = (torch.stack(steps) - ref[49:]).abs().max() / ref.abs().max()
    assert err < 1e-4, f"max relative logit error through the engine {err:.2e}"
    engine.close()


def test_rope_frequencies_match_transformers():
    from ds4station.kernels.reference import rope_inv_freq

    hf = transformers.DeepseekV4ForCausalLM(hf_config(TINY)).model.rotary_emb
    torch.testing.assert_close(rope_inv_freq(TINY, compressed=False), hf.main_inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(rope_inv_freq(TINY, compressed=True), hf.compress_inv_freq, rtol=1e-6, atol=0)
