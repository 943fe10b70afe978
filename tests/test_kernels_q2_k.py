"""Q2_K kernels (ds4station/kernels/q2_k.py): the repack and torch dequantisation bit for bit against
gguf-py's numpy oracle, and the Triton decode matvec against torch on odd shapes, 1-8 rows, fp16/fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ds4station.kernels import dispatch
from ds4station.kernels.moe import rows_matvec
from ds4station.kernels.q2_k import dequantize_q2_k, q2_k_matvec_ref, repack_q2_k
from ds4station.kernels.quants import random_blocks, row_bytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def raw_q2k(lead: tuple[int, ...], k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return random_blocks(Q.Q2_K, int(np.prod(lead)) * k, g, 0.05).view(*lead, row_bytes(Q.Q2_K, k))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert not got.isnan().any(), "unwritten (NaN-poisoned) or NaN output"
    return ((got - want).norm() / want.norm()).item()


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


@pytest.mark.parametrize(
    ("n", "k", "m", "dtype", "tiles"),
    [
        (13, 512, 1, torch.float32, None),
        (9, 256, 3, torch.float16, None),
        (11, 768, 2, torch.float32, dispatch.MatvecTiles(block_n=4, block_k=512, num_warps=4)),  # K loop + tail
    ],
)
def test_matvec_matches_reference(n: int, k: int, m: int, dtype: torch.dtype, tiles) -> None:
    raw = raw_q2k((n,), k, seed=n * k + m)
    w = repack_q2_k(raw.to(DEVICE), k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.float32)
    rows_matvec(x, w, out=out, tiles=tiles)
    assert rel_err(out, q2_k_matvec_ref(x, w, out_dtype=torch.float32)) < 1e-5
    oracle = torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(raw.numpy(), Q.Q2_K))).double()
    assert rel_err(out, x.double().cpu() @ oracle.T) < 1e-5


def test_matvec_rejects_bad_shapes() -> None:
    w = repack_q2_k(raw_q2k((4,), 256, seed=0).to(DEVICE), 256)
    with pytest.raises(ValueError, match="does not match"):
        rows_matvec(torch.zeros(1, 512, device=DEVICE), w)
    with pytest.raises(ValueError, match="1-8 activation rows"):
        rows_matvec(torch.zeros(9, 256, device=DEVICE), w)
