"""The dense low-bit decode matvec (kernels/moe.py `rows_matvec`, the fused MoE kernels' row dot over one
IQ2_XXS, Q2_K or Q4_K weight) in the Triton interpreter: against each type's torch reference and against
gguf-py's numpy dequantisation, at odd row counts, 1-8 activation rows, fp16/fp32, several K steps and a K
tail, with NaN-poisoned outputs; and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from numerics import rel_err

from ds4station.kernels import ops
from ds4station.kernels.dispatch import MatvecTiles
from ds4station.kernels.iq2_xxs import iq2_xxs_matvec_ref
from ds4station.kernels.moe import rows_matvec
from ds4station.kernels.q2_k import q2_k_matvec_ref
from ds4station.kernels.q4_k import q4_k_matvec_ref
from ds4station.kernels.quants import random_blocks, row_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = {Q.IQ2_XXS: iq2_xxs_matvec_ref, Q.Q2_K: q2_k_matvec_ref, Q.Q4_K: q4_k_matvec_ref}


def raw_rows(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return random_blocks(qtype, n * k, g, 0.05).view(n, row_bytes(qtype, k))


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize(
    ("n", "k", "m", "dtype", "tiles"),
    [
        (13, 512, 1, torch.float32, None),
        (9, 256, 3, torch.float16, None),
        (5, 256, 8, torch.float32, None),
        (11, 768, 2, torch.float32, MatvecTiles(block_n=4, block_k=512, num_warps=4)),  # K loop + tail
        (33, 768, 2, torch.float16, MatvecTiles(block_n=4, block_k=256, num_warps=1)),  # 3 K steps, ragged rows
    ],
)
def test_matvec_matches_reference_and_gguf(qtype: Q, n: int, k: int, m: int, dtype: torch.dtype,
                                           tiles: MatvecTiles | None) -> None:
    raw = raw_rows(qtype, n, k, seed=n * k + m)
    w = ops.repack(raw, qtype.name.lower(), k, DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    assert rows_matvec(x, w, out=out, tiles=tiles) is out
    assert rel_err(out, TYPES[qtype](x, w, out_dtype=torch.float32)) < 1e-5
    oracle = torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), qtype))).double()
    assert rel_err(out, x.double().cpu() @ oracle.T) < 1e-5


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
def test_matvec_output_dtype(poisoned_empty: None, qtype: Q) -> None:
    w = ops.repack(raw_rows(qtype, 6, 256, seed=3), qtype.name.lower(), 256, DEVICE)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    assert rows_matvec(x, w).dtype == torch.float16  # the activation's, unless asked
    got = rows_matvec(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and rel_err(got, TYPES[qtype](x, w, out_dtype=torch.float32)) < 1e-5


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
def test_matvec_rejects_bad_shapes(qtype: Q) -> None:
    w = ops.repack(raw_rows(qtype, 4, 256, seed=0), qtype.name.lower(), 256, DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        rows_matvec(torch.zeros(1, 512, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        rows_matvec(torch.zeros(256, device=DEVICE), w)
    with pytest.raises(ValueError, match="1-8 activation rows"):
        rows_matvec(torch.zeros(9, 256, device=DEVICE), w)
    q8 = ops.repack(raw_rows(Q.Q8_0, 4, 256, seed=0), "q8_0", 256, DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        rows_matvec(torch.zeros(1, 256, device=DEVICE), q8)
