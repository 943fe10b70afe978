"""Q4_K kernels (kernels/q4_k.py) in the Triton interpreter: the repack dequantises exactly as gguf-py does
(through engine/quants.py, itself bit-exact with gguf-py), the prefill tl.dot matmul matches the torch
reference at odd shapes with poisoned outputs, and the engine's Linear takes Q4_K weights. (The decode matvec
over Q4_K is test_kernels_rows_matvec.py's.)"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from ds4station.kernels import dispatch, ops
from ds4station.kernels.dispatch import MatmulTiles
from ds4station.kernels.q4_k import (
    dequantize_q4_k,
    q4_k_matmul,
    repack_q4_k,
)
from ds4station.kernels.quants import QTensor, random_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(Q.Q4_K, n * k, torch.Generator().manual_seed(seed), 0.05)
    return raw, raw.view(n, -1)


@pytest.mark.parametrize(("n", "k"), [(1, 256), (7, 512), (33, 768)])
def test_repack_dequantises_like_gguf_py(n: int, k: int) -> None:
    raw, rows = _weight(n, k, seed=n + k)
    want = torch.from_numpy(gguf_dequantize(raw.numpy(), Q.Q4_K).astype(np.float32)).view(n, k)
    assert torch.equal(dequantize_q4_k(repack_q4_k(rows, k)), want)
    assert torch.equal(QTensor(raw, Q.Q4_K, (n, k)).dequantize(), want)


@pytest.mark.parametrize("tiles", [None, MatmulTiles(block_m=16, block_n=16, block_k=64, group_m=1, num_warps=1,
                                                     num_stages=1)])
def test_matmul_matches_reference(poisoned_empty: None, tiles: MatmulTiles | None) -> None:
    _, rows = _weight(33, 512, seed=4)
    w = repack_q4_k(rows.to(DEVICE), 512)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = q4_k_matmul(x, w, out_dtype=torch.float32, tiles=tiles)
    want = x.half().float() @ dequantize_q4_k(w).half().float().T  # the fp16 dot operands, fp32 sums
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_linear_and_public_ops_take_q4_k() -> None:
    from ds4station.engine.gpu import Linear

    raw, rows = _weight(40, 512, seed=6)
    lin = Linear(QTensor(raw, Q.Q4_K, (40, 512)), torch.device("cpu"))
    assert lin.packed is not None and lin.nbytes < 40 * 512  # stays quantised (~0.58 B per weight)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    want = x @ QTensor(raw, Q.Q4_K, (40, 512)).dequantize().T
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)  # CPU: the torch reference
    # the kernels themselves, decode and prefill row counts: on the GPU, or in the interpreter on CPU
    packed = Linear(QTensor(raw, Q.Q4_K, (40, 512)), torch.device(DEVICE)).packed
    x20 = torch.randn(20, 512, generator=torch.Generator().manual_seed(8))
    with dispatch.interpreted_kernels() if DEVICE == "cpu" else contextlib.nullcontext():
        got = ops.linear(x.to(DEVICE), packed, out_dtype=torch.float32)
        got20 = ops.linear(x20.to(DEVICE), packed, out_dtype=torch.float32)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got20.cpu(), x20 @ dequantize_q4_k(lin.packed).T, rtol=2e-2, atol=2e-2)


def test_bad_input() -> None:
    _, rows = _weight(4, 256, seed=9)
    with pytest.raises(ValueError, match="multiple of 256"):
        repack_q4_k(rows, 100)
    with pytest.raises(TypeError, match="uint8"):
        repack_q4_k(rows.float(), 256)
