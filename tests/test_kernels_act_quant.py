"""Activation quantiser for the integer-dot kernels (ds4station/kernels/act_quant.py): the Triton kernel
against its torch reference bit for bit, every packed layout decoded back to the activation, and the
quantisation error bound (half a step of amax/127 per 32 values)."""

from __future__ import annotations

import pytest
import torch

from ds4station.kernels.act_quant import dequantize_act, quantize_act, quantize_act_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["iq2_xxs", "q2_k", "q4_k"])
@pytest.mark.parametrize(("m", "k", "dtype"), [(1, 96, torch.float32), (3, 256, torch.float16)])
def test_quantize_matches_reference_and_round_trips(layout: str, m: int, k: int, dtype: torch.dtype) -> None:
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)) * 3).to(DEVICE, dtype)
    x[0, :32] = 0.0  # an all-zero group must give scale 0 and zero codes, not NaN
    got = quantize_act(x, layout)
    want = quantize_act_ref(x, layout)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-5)
    xq, xs, xsum = got
    back = dequantize_act(xq, xs, layout)
    step = xs.repeat_interleave(32, dim=1)
    assert ((back - x.float()).abs() <= step * 0.5 + 1e-6).all()
    assert torch.allclose(xsum, x.float().reshape(m, k // 16, 16).sum(-1), atol=1e-4)
    assert not back[0, :32].any() and not xs[0, 0]


def test_quantize_rejects_bad_width() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act(torch.zeros(1, 48, device=DEVICE), "q2_k")
