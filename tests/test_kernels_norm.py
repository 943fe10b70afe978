"""Small fused ops (ds4station/kernels/norm.py): the Triton RMSNorm and interleaved partial RoPE against
their torch references and against the reference model's own functions (engine/model.py), on odd widths,
fp16/fp32, with poisoned outputs; RoPE's inverse undoes it."""

from __future__ import annotations

import pytest
import torch

from ds4station.kernels.act_quant import dequantize_act, dequantize_act16, quantize_act, quantize_act16
from ds4station.kernels.norm import rms_norm, rms_norm_ref, rms_norm_triton, rope_, rope_ref, rope_triton_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _same_quant(got: tuple, want: tuple, quant: str) -> None:
    """Two quantisations of one row: bit for bit in the interpreter (one fp32 evaluation order). Compiled for a
    GPU, two kernels may contract the scaling's multiply-add differently (FMA), so a value on a rounding
    boundary can land one code apart: there the scales agree to fp32 rounding and each value to one code."""
    if DEVICE == "cpu":
        assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))
        return
    deq = (lambda q: dequantize_act16(*q)) if quant == "act16" else (lambda q: dequantize_act(q[0], q[1], quant))
    xs = want[-1] if quant == "act16" else want[1]
    torch.testing.assert_close(got[-1] if quant == "act16" else got[1], xs, rtol=1e-6, atol=0)
    assert ((deq(got) - deq(want)).abs() <= 1.001 * xs.repeat_interleave(32, dim=1)).all()


@pytest.mark.parametrize(("rows", "n", "dtype", "weighted"), [(3, 4096, torch.float32, True),
                                                              (5, 100, torch.float16, False),
                                                              (2, 512, torch.float16, True)])
def test_rms_norm(rows: int, n: int, dtype: torch.dtype, weighted: bool) -> None:
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(rows, n, generator=gen) * 4).to(DEVICE, dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(DEVICE) if weighted else None
    out = torch.full_like(x, float("nan"))
    rms_norm_triton(x, w, 1e-6, out=out)
    want = rms_norm_ref(x, w, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    from ds4station.kernels.reference import rms_norm as model_rms_norm

    torch.testing.assert_close(want.float(), model_rms_norm(x.float(), None if w is None else w.float(), 1e-6),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(rms_norm(x.cpu(), None if w is None else w.cpu(), 1e-6), want.cpu())


@pytest.mark.parametrize(("rows", "n", "quant", "dtype"), [(1, 4096, "act16", torch.float32),
                                                           (3, 1024, "act16", torch.float16),
                                                           (2, 4096, "iq2_xxs", torch.float32),
                                                           (3, 1536, "q2_k", torch.float32),
                                                           (1, 2048, "q4_k", torch.float16),
                                                           (2, 96, "iq2_xxs", torch.float32)])
def test_rms_norm_emits_its_output_quantised(rows: int, n: int, quant: str, dtype: torch.dtype) -> None:
    """rms_norm(quant=...) also stores its output quantised for an integer-dot consumer (the Q8_0 dp4a matvec's
    16-bit digits, or a MoE layout): the same codes and scales as the quantiser's own launch on the output,
    bit for bit in the interpreter, to one code on a GPU (`_same_quant`; a row of 1,536 or 96 values runs in a
    wider power-of-two block, its tail masked)."""
    gen = torch.Generator().manual_seed(n + rows)
    x = (torch.randn(rows, n, generator=gen) * 3).to(DEVICE, dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(DEVICE)
    y, (act,) = rms_norm(x, w, 1e-6, quant=(quant,))  # an fp16 row is quantised as stored (rounded to fp16)
    plain = rms_norm_triton(x, w, 1e-6)
    if DEVICE == "cpu":
        assert torch.equal(y, plain)
    else:
        torch.testing.assert_close(y, plain, rtol=1e-6, atol=1e-6)
    want = quantize_act16(y) if quant == "act16" else quantize_act(y, quant)
    _same_quant(act, want, quant)
    # two forms at once (the FFN norm: the shared expert's 16-bit digits and the routed experts' layout)
    other = "iq2_xxs" if quant == "act16" else "act16"
    y2, acts = rms_norm(x, w, 1e-6, quant=(quant, other))
    assert torch.equal(y2, y)
    _same_quant(acts[0], want, quant)
    _same_quant(acts[1], quantize_act16(y) if other == "act16" else quantize_act(y, other), other)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm(x[:, :40], w[:40], 1e-6, quant=(quant,))
    with pytest.raises(ValueError, match="quant must be one of"):
        rms_norm(x, w, 1e-6, quant=("q8_0",))
    with pytest.raises(ValueError, match="at most two"):
        rms_norm(x, w, 1e-6, quant=(quant, quant, quant))


@pytest.mark.parametrize(("tokens", "heads", "d", "rd", "dtype"), [(3, 4, 512, 64, torch.float32),
                                                                   (2, 1, 96, 32, torch.float16)])
def test_rope_matches_reference_and_inverts(tokens: int, heads: int, d: int, rd: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(d + heads)
    x = torch.randn(tokens * heads, d, generator=gen).to(DEVICE, dtype)
    pos = torch.tensor([0, 7, 65535][:tokens], dtype=torch.int64, device=DEVICE)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))).to(DEVICE)
    y = rope_triton_(x.clone(), pos, inv_freq, heads)
    want = rope_ref(x, pos, inv_freq, heads)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol * 10)
    assert torch.equal(y[:, : d - rd], x[:, : d - rd])  # non-RoPE dims untouched
    back = rope_triton_(y.clone(), pos, inv_freq, heads, inverse=True)
    torch.testing.assert_close(back.float(), x.float(), rtol=tol * 10, atol=tol * 10)
    cpu = rope_(x.cpu().clone(), pos.cpu(), inv_freq.cpu(), heads)
    torch.testing.assert_close(cpu, want.cpu())


def test_rope_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="T \\* heads"):
        rope_(torch.zeros(5, 64), torch.zeros(2), torch.ones(16), heads=2)
