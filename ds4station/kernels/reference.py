"""Plain-torch references of the model's small numerics: what every fused kernel in this package is checked
against, and what the reference model (engine/model.py) computes with.

RMSNorm, the FP8 e4m3 / FP4 e2m1 round trips, the Hadamard rotation, RoPE (inverse frequencies with YaRN,
interleaved pairs on the last rope_dim dims), the hyper-connection mix and Sinkhorn, the sink attention and
the clamped SwiGLU, written from DS4-MODEL.md. fp32, no batch dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ds4station.model.config import ModelConfig

Tensor = torch.Tensor


# ---- small numerics ------------------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., n] -> x / rms(x) (* weight)."""
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def _pow2_ceil(x: Tensor) -> Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def fp8_e4m3_roundtrip(x: Tensor, block: int = 64) -> Tensor:
    """Quantise/dequantise the last dim in blocks with power-of-two scales (UE8M0), like DeepSeek's
    act_quant(..., scale_fmt="ue8m0") and ds4's dsv4_fp8_kv_quantize_row: scale = 2^ceil(log2(amax/448)),
    amax floored at 1e-4, values rounded to the nearest e4m3 value (ties to even)."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = _pow2_ceil(amax / 448.0)
    q = (xb / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


# e2m1 magnitudes and the rounding thresholds between neighbours. A tie goes to the even code
# (0, 1, 2, 4 at codes 0, 2, 4, 6), as ds4's dsv4_e2m1fn_dequant_cpu does: ties at 0.25, 1.25, 2.5, 5 round
# down, ties at 0.75, 1.75, 3.5 round up.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


_E2M1_VALUES: dict[torch.device, Tensor] = {}


def _e2m1_values(device: torch.device) -> Tensor:
    """The e2m1 magnitudes on a device, made once (a host-to-device copy cannot run inside a CUDA graph)."""
    if device not in _E2M1_VALUES:
        _E2M1_VALUES[device] = torch.tensor(_E2M1, device=device)
    return _E2M1_VALUES[device]


def fp4_e2m1_roundtrip(x: Tensor, block: int = 32) -> Tensor:
    """FP4 e2m1 quantise/dequantise in blocks, scale = 2^ceil(log2(amax / 6)) (DeepSeek fp4_act_quant)."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    scale = _pow2_ceil(amax / 6.0)
    v = (xb / scale).clamp(-6.0, 6.0)
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.long)
    for t, tie_up in _E2M1_UP:
        code += (a >= t if tie_up else a > t).long()
    q = _e2m1_values(x.device)[code] * torch.sign(v)
    return (q * scale).flatten(-2).to(x.dtype)


def hadamard(x: Tensor) -> Tensor:
    """Orthonormal Walsh-Hadamard transform of the last dim (Sylvester order, scale n^-1/2), by butterflies."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(shape) * n**-0.5).to(x.dtype)


# ---- rotary embedding ----------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig, compressed: bool) -> Tensor:
    """Per-pair frequencies [rope_dim / 2]. Window-only layers: plain, base rope_base. Compressed layers
    (and their indexer): base compress_rope_base with YaRN interpolation, without YaRN's magnitude scaling
    (DeepSeek's precompute_freqs_cis; ds4 cancels the mscale explicitly)."""
    n = cfg.rope_dim
    base = cfg.compress_rope_base if compressed else cfg.rope_base
    freqs = 1.0 / (base ** (torch.arange(0, n, 2, dtype=torch.float32) / n))
    if compressed and cfg.rope_factor > 1 and cfg.rope_orig_ctx > 0:
        def corr_dim(rot: float) -> float:
            return n * math.log(cfg.rope_orig_ctx / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corr_dim(cfg.beta_slow)), n - 1)
        ramp = ((torch.arange(n // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
        freqs = freqs / cfg.rope_factor * ramp + freqs * (1 - ramp)
    return freqs


class Rope:
    """Interleaved-pair RoPE (x[2i], x[2i+1]) on the LAST rope_dim dims of a vector."""

    def __init__(self, cfg: ModelConfig, compressed: bool, device: torch.device | None = None) -> None:
        self.dim = cfg.rope_dim
        self.inv_freq = rope_inv_freq(cfg, compressed).to(device)

    def __call__(self, x: Tensor, pos: Tensor, inverse: bool = False) -> Tensor:
        """x [T, ..., n], pos [T] -> x with its tail rotated by angle pos * freq (negative when inverse)."""
        ang = pos.float()[:, None] * self.inv_freq  # [T, rd/2]
        ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), -1)
        cos, sin = ang.cos(), ang.sin()
        if inverse:
            sin = -sin
        tail = x[..., -self.dim:].unflatten(-1, (-1, 2))
        a, b = tail[..., 0], tail[..., 1]
        rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., : -self.dim], rot), dim=-1)


# ---- hyper-connections (mHC) ---------------------------------------------------------------------------
def hc_mix(X: Tensor, fn: Tensor, rms_eps: float) -> Tensor:
    """X [T, C, dim] -> mix = (fn @ flatten(X)) / rms(flatten(X))  [T, M]."""
    xf = X.flatten(1)  # [T, C*dim], stream-major
    return (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps)


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """[..., C, C] -> near doubly-stochastic: row softmax + eps, column-normalise, then iters-1 rounds of
    (row, column) normalisation, each denominator + eps (DeepSeek hc_split_sinkhorn)."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


@dataclass
class HyperConnection:
    """hc_pre / hc_post around one sublayer: C residual streams in, one sublayer input out, and back."""

    fn: Tensor  # [M, C*dim], M = (2 + C) * C
    scale: Tensor  # [3]: pre, post, comb
    base: Tensor  # [M]
    cfg: ModelConfig

    def pre(self, X: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """X [T, C, dim] -> (sublayer input [T, dim], post [T, C], comb [T, C, C])."""
        C = self.cfg.hc_mult
        mix = hc_mix(X, self.fn, self.cfg.rms_eps)
        pre = torch.sigmoid(mix[:, :C] * self.scale[0] + self.base[:C]) + self.cfg.hc_eps
        post = 2 * torch.sigmoid(mix[:, C:2 * C] * self.scale[1] + self.base[C:2 * C])
        comb = (mix[:, 2 * C:] * self.scale[2] + self.base[2 * C:]).unflatten(-1, (C, C))  # [T, C(j), C(k)]
        comb = sinkhorn(comb, self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps)
        return (pre.unsqueeze(-1) * X).sum(1), post, comb

    @staticmethod
    def post(out: Tensor, X: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """X'[k] = post[k] * out + sum_j comb[j, k] * X[j]  -> [T, C, dim]."""
        return post.unsqueeze(-1) * out.unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, X)


# ---- attention -----------------------------------------------------------------------------------------
def sink_attention(q: Tensor, keys: Tensor, allowed: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """q [T, H, D], keys [N, D] (also the values), allowed [T, N] -> [T, H, D]. The per-head sink logit
    joins the softmax denominator only: p = exp(z - m) / (sum exp(z - m) + exp(sink - m))."""
    z = torch.einsum("thd,nd->thn", q, keys) * scale
    z = z.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    m = torch.maximum(z.amax(-1), sinks)  # [T, H]; a query always sees itself, so z.amax is finite
    e = torch.exp(z - m.unsqueeze(-1))
    p = e / (e.sum(-1) + torch.exp(sinks - m)).unsqueeze(-1)
    return torch.einsum("thn,nd->thd", p, keys)



# ---- mixture of experts ---------------------------------------------------------------------------
def swiglu(g: Tensor, u: Tensor, clamp: float) -> Tensor:
    """silu(g) * u with DeepSeek's clamp: gate <= c (upper only), up in [-c, c]; c <= 0 disables it."""
    if clamp > 0:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return F.silu(g) * u


# ---- compressor frontier -------------------------------------------------------------------------------
def frontier_read(kv: Tensor, score: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """A frontier ring (kv / score [rows, width], position p at row p % rows) read at positions pos [...]
    -> kv, score [..., width]; positions < 0 read as kv = 0, score = -inf (no weight in the pooling)."""
    slots = pos.clamp(min=0) % kv.shape[0]
    before = (pos < 0).unsqueeze(-1)
    return kv[slots].masked_fill(before, 0.0), score[slots].masked_fill(before, float("-inf"))
