"""Q2_K kernels (ds4station/kernels/q2_k.py): the repack and torch dequantisation bit for bit against
gguf-py's numpy oracle, and its refusals. (The decode matvec over Q2_K is test_kernels_rows_matvec.py's.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ds4station.kernels.q2_k import dequantize_q2_k, repack_q2_k
from ds4station.kernels.quants import random_blocks, row_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def raw_q2k(lead: tuple[int, ...], k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return random_blocks(Q.Q2_K, int(np.prod(lead)) * k, g, 0.05).view(*lead, row_bytes(Q.Q2_K, k))


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_repack_and_dequantize_match_gguf(lead: tuple[int, ...]) -> None:
    k = 512
    raw = raw_q2k(lead, k, seed=7)
    # every scale / quant byte is valid: make scales and quants fully random, keep d and dmin finite
    raw.view(-1, 84)[:, :80] = torch.randint(0, 256, (raw.numel() // 84, 80), dtype=torch.uint8,
                                             generator=torch.Generator().manual_seed(1))
    w = repack_q2_k(raw, k)
    assert w.qs.shape == (*lead, k // 4) and w.sc.shape == (*lead, k // 16) and w.dm.shape == (*lead, k // 128)
    want = np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), Q.Q2_K))
    assert torch.equal(dequantize_q2_k(w), torch.from_numpy(want))


def test_repack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_q2_k(torch.zeros(84, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="does not hold rows"):
        repack_q2_k(torch.zeros(67, dtype=torch.uint8), 256)
