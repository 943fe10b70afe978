"""Small fused ops: RMSNorm (optionally weighted) and interleaved partial RoPE, with torch references.

- `rms_norm(x, weight, eps)`: y = x / sqrt(mean(x^2) + eps) (* weight) per row, fp32 math, one program per
  row (DS4: rows of 4096 for attn/ffn norms, 1024 / 512 for the q / kv low-rank norms, 512 per query head).
- `rope_(x, pos, inv_freq, heads, inverse)`: in place on the LAST 2 * len(inv_freq) dims of each row, pairs
  (x[2i], x[2i+1]) rotated by pos * inv_freq[i] (negated when inverse); x is [T * heads, D] with one
  position per token. The frequencies (plain or YaRN) come from the model; the kernel only rotates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import act16_tile, quant_buffers, quant_flags, quant_tile, quantize_act16
from ds4station.kernels.pdl import enter, pdl


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, a0_ptr, a1_ptr, a2_ptr, b0_ptr, b1_ptr, b2_ptr, N, stride_x, stride_y, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = 0,
                     LAYOUT: tl.constexpr = 0, QUANT_B: tl.constexpr = 0, LAYOUT_B: tl.constexpr = 0,
                     PDL: tl.constexpr = False):
    """y = x / rms(x) * w over one row per program; with QUANT also y quantised into a0 / a1 / a2, with QUANT_B
    a second form into b0 / b1 / b2 (act_quant.quant_tile: 1 as quantize_act16, 2 as quantize_act in the
    layout): from the values stored, so the same codes as the quantiser's own launch on y gives."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * r
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    if QUANT:  # from the values stored (an fp16 y quantised as its reader would see it)
        quant_tile(tl.reshape(y.to(tl.float32), (BLOCK // 32, 32)), row, 0, N // 32, a0_ptr, a1_ptr, a2_ptr, QUANT,
                   LAYOUT)
    if QUANT_B:
        quant_tile(tl.reshape(y.to(tl.float32), (BLOCK // 32, 32)), row, 0, N // 32, b0_ptr, b1_ptr, b2_ptr, QUANT_B,
                   LAYOUT_B)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, quant: tuple[str, ...] = ()):  # noqa: ANN201
    """RMSNorm over the last dim of x [..., N]: Triton on a GPU tensor, the torch reference on CPU. With `quant`
    (one or two of act_quant.QUANTS: "act16", a MoE layout) -> (y, per form the rows [-1, N] of y quantised as
    quantize_act16 / quantize_act(layout) gives them), in the same launch (Triton only: the integer-dot
    consumers run there)."""
    if quant:
        return rms_norm_triton(x, weight, eps, quant=quant)
    return rms_norm_triton(x, weight, eps) if dispatch.use_triton(x) else rms_norm_ref(x, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    out: torch.Tensor | None = None, quant: tuple[str, ...] = ()):  # noqa: ANN201
    """The Triton launcher of rms_norm (any device the Triton backend or interpreter runs on)."""
    if len(quant) > 2:
        raise ValueError(f"rms_norm emits at most two quantised forms, got {quant}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2) if out is None else out.view(-1, n)
    tiles = dispatch.row_tiles(n, dispatch.launch_backend(x))
    m = x2.shape[0]
    acts = tuple(quant_buffers(m, n, q, x.device) for q in quant)
    a, b = (*acts, (x2,) * 3, (x2,) * 3)[:2]
    flags_b = quant_flags(quant[1] if len(quant) > 1 else None)
    _rms_norm_kernel[(m,)](
        x2, weight if weight is not None else x2, y, *a, *b, n, x2.stride(0), y.stride(0), float(eps),
        HAS_WEIGHT=weight is not None, BLOCK=tiles.block, **quant_flags(quant[0] if quant else None),
        QUANT_B=flags_b["QUANT"], LAYOUT_B=flags_b["LAYOUT"], num_warps=tiles.num_warps, **pdl(x2))
    return (y.view(x.shape), acts) if quant else y.view(x.shape)


def rope_ref(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, heads: int,
             inverse: bool = False) -> torch.Tensor:
    """Torch reference of `rope_` (returns a new tensor)."""
    rd = 2 * inv_freq.numel()
    ang = pos.float()[:, None] * inv_freq.float()  # [T, rd/2]
    cos, sin = (f.repeat_interleave(heads, dim=0) for f in (ang.cos(), ang.sin()))  # [T * heads, rd/2]: once a row
    if inverse:
        sin = -sin
    tail = x[:, -rd:].float().unflatten(-1, (-1, 2))
    a, b = tail[..., 0], tail[..., 1]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[:, :-rd], rot.to(x.dtype)), dim=-1)


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, f_ptr, D, stride_x, heads, sign,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + row // heads).to(tl.float32)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HALF
    ang = p * tl.load(f_ptr + offs, mask=mask, other=0.0)
    c = tl.cos(ang)
    s = tl.sin(ang) * sign
    base = x_ptr + row * stride_x + (D - 2 * HALF) + 2 * offs
    a = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (a * c - b * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + 1, (a * s + b * c).to(x_ptr.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, heads: int,
          inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * len(inv_freq) dims of x [T * heads, D] in place; pos [T]. Triton on a GPU tensor,
    the torch reference on CPU."""
    if dispatch.use_triton(x):
        return rope_triton_(x, pos, inv_freq, heads, inverse)
    _check_rope(x, pos, heads)
    x.copy_(rope_ref(x, pos, inv_freq, heads, inverse))
    return x


def _check_rope(x: torch.Tensor, pos: torch.Tensor, heads: int) -> None:
    if x.dim() != 2 or x.shape[0] != pos.numel() * heads:
        raise ValueError(f"x must be [T * heads, D] = [{pos.numel()} * {heads}, D], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("rope_ works in place and needs unit stride on the last dim")


def rope_triton_(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, heads: int,
                 inverse: bool = False) -> torch.Tensor:
    """The Triton launcher of rope_."""
    _check_rope(x, pos, heads)
    half = inv_freq.numel()
    _rope_kernel[(x.shape[0],)](
        x, pos, inv_freq.float().contiguous(), x.shape[1], x.stride(0), heads, -1.0 if inverse else 1.0,
        HALF=half, BLOCK_H=triton.next_power_of_2(half), num_warps=1, **pdl(x))
    return x


def swiglu_ref(gu: torch.Tensor, clamp: float) -> torch.Tensor:
    """gu [T, 2F] = (gate | up) -> silu(gate) * up [T, F], with DeepSeek's clamp (gate <= c, up in [-c, c];
    c <= 0 disables it), as engine/model.py's swiglu."""
    from ds4station.kernels.reference import swiglu as swiglu_model

    f = gu.shape[-1] // 2
    return swiglu_model(gu[:, :f].float(), gu[:, f:].float(), clamp)


@triton.jit
def _swiglu_kernel(gu_ptr, y_ptr, hi_ptr, lo_ptr, xs_ptr, F, stride_gu, stride_y, clamp, CLAMP: tl.constexpr,
                   BLOCK: tl.constexpr, ACT16: tl.constexpr = False, PDL: tl.constexpr = False):
    """y = silu(gate) * up over BLOCK values of one row; ACT16: y also stored quantised as quantize_act16 gives it
    (BLOCK and F multiples of 32)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + F + offs, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, clamp)
        u = tl.minimum(tl.maximum(u, -clamp), clamp)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    if ACT16:
        act16_tile(tl.reshape(y, (BLOCK // 32, 32)), row, tl.program_id(1) * (BLOCK // 32), F // 32, hi_ptr, lo_ptr,
                   xs_ptr)


def swiglu(gu: torch.Tensor, clamp: float, act16: bool = False):  # noqa: ANN201
    """One launch on a GPU tensor (the shared expert's gate and up come from one fused matvec), else torch.
    act16 (GPU only: for the down projection's integer-dot matvec) -> (y, y quantised as quantize_act16 gives
    it), in the same launch."""
    if not dispatch.use_triton(gu):
        if act16:
            raise ValueError("act16 is for the integer-dot kernels, which run on a GPU")
        return swiglu_ref(gu, clamp)
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.stride(-1) != 1:
        raise ValueError(f"swiglu takes unit-stride [T, 2F] (gate | up), got {tuple(gu.shape)}")
    f = gu.shape[1] // 2
    y = torch.empty(gu.shape[0], f, dtype=torch.float32, device=gu.device)
    tiles = dispatch.row_tiles(min(f, 1024), dispatch.launch_backend(gu))
    quant = act16 and tiles.block % 32 == 0 and f % 32 == 0
    act = quant_buffers(gu.shape[0], f, "act16", gu.device) if quant else (y, y, y)
    _swiglu_kernel[(gu.shape[0], triton.cdiv(f, tiles.block))](
        gu, y, *act, f, gu.stride(0), y.stride(0), float(clamp), CLAMP=clamp > 0, BLOCK=tiles.block, ACT16=quant,
        num_warps=tiles.num_warps, **pdl(gu))
    if not act16:
        return y
    return y, act if quant else quantize_act16(y)
