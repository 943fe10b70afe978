"""IQ2_XXS kernels (ds4station/kernels/iq2_xxs.py): the repack and torch dequantisation bit for bit against
gguf-py's numpy oracle, and the sign decode for every field. (The decode matvec over IQ2_XXS is
test_kernels_rows_matvec.py's.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ds4station.kernels.iq2_xxs import (
    _sign_selectors,
    dequantize_iq2_xxs,
    repack_iq2_xxs,
)
from ds4station.kernels.quants import random_blocks, row_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def raw_iq2(lead: tuple[int, ...], k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return random_blocks(Q.IQ2_XXS, int(np.prod(lead)) * k, g, 0.05).view(*lead, row_bytes(Q.IQ2_XXS, k))


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_repack_and_dequantize_match_gguf(lead: tuple[int, ...]) -> None:
    k = 512
    raw = raw_iq2(lead, k, seed=7)
    # every sign / scale / grid pattern is valid: make the payload fully random, keep d finite
    raw.view(-1, 66)[:, 2:] = torch.randint(0, 256, (raw.numel() // 66, 64), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(1))
    w = repack_iq2_xxs(raw, k)
    assert w.qs.shape == (*lead, k // 16) and w.qs.dtype == torch.int32 and w.d.shape == (*lead, k // 256)
    want = np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), Q.IQ2_XXS))
    assert torch.equal(dequantize_iq2_xxs(w), torch.from_numpy(want))


def test_repack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_iq2_xxs(torch.zeros(66, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="does not hold rows"):
        repack_iq2_xxs(torch.zeros(67, dtype=torch.uint8), 256)


@triton.jit
def _selectors_kernel(s7_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, _sign_selectors(tl.load(s7_ptr + offs)))


def test_sign_selectors_for_every_field() -> None:
    """The decode's sign arithmetic (popc + three multiply-and-mask steps) for all 128 7-bit sign fields
    against the format's rule: sign e of the 8 (the 8th the parity of the 7) at bit 2 of nibble e."""
    s7 = torch.arange(128, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(s7)
    _selectors_kernel[(1,)](s7, out, N=128)
    for field in range(128):
        sign8 = field | (bin(field).count("1") % 2) << 7
        want = sum(((sign8 >> e) & 1) << (4 * e + 2) for e in range(8))
        assert int(out[field]) & 0xFFFFFFFF == want
