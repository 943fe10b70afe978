"""Row finishing (kernels/rows.py), the compressor update (kernels/compressor.py) and the shared expert's
SwiGLU (kernels/norm.py) against the model's torch code, in the Triton interpreter: odd widths (192 = 3 FP8
blocks with a 64-dim RoPE tail), several heads, positions, both round trips, ring writes, poisoned outputs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ds4station.engine.kv import Frontier
from ds4station.engine.model import Compressor
from ds4station.kernels.compressor import (
    Finish,
    compress_blocks_ref,
    compress_blocks_triton,
    compress_decode_ref,
    compress_decode_triton,
    compress_rows_ref,
    compress_rows_triton,
)
from ds4station.kernels.norm import swiglu, swiglu_ref
from ds4station.kernels.reference import Rope, fp4_e2m1_roundtrip, fp8_e4m3_roundtrip, hadamard, rope_inv_freq
from ds4station.kernels.rows import finish_rows_ref, finish_rows_triton
from ds4station.model.config import FLASH, TINY

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F_TINY = rope_inv_freq(TINY, True)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 2e-6) -> None:
    assert not a.isnan().any(), "an output element was not written"
    assert torch.allclose(a.cpu(), b.cpu(), rtol=1e-5, atol=atol), (a.cpu() - b.cpu()).abs().max()


CASES = {
    "q heads": (4, 192, dict(norm=True, inv_freq=F_TINY)),
    "kv fp8": (1, 192, dict(norm=True, weight=True, inv_freq=F_TINY, rt="fp8", nope=128)),
    "index q fp4": (3, 128, dict(inv_freq=rope_inv_freq(FLASH, True), hadamard=True, rt="fp4")),
    "inverse rope": (2, 192, dict(inv_freq=F_TINY, inverse=True)),
    "fp8 only": (2, 256, dict(rt="fp8", nope=256)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_finish_rows_matches_the_model(case: str, seed: int) -> None:
    heads, d, kw = CASES[case]
    g = _gen(seed)
    kw = dict(kw)
    if kw.get("weight"):
        kw["weight"] = (torch.rand(d, generator=g) + 0.5).to(DEVICE)
    if "inv_freq" in kw:
        kw["inv_freq"] = kw["inv_freq"].to(DEVICE)
    t = 3
    x = (torch.randn(t * heads, d, generator=g) * 3).to(DEVICE)
    pos = torch.randint(0, 100_000, (t,), generator=g).to(DEVICE)
    _close(finish_rows_triton(x, pos, heads, **kw), finish_rows_ref(x, pos, heads, **kw))


def test_finish_rows_composes_the_model_functions() -> None:
    """The reference really is the model's chain (so the kernel is compared with the model, not with itself)."""
    x, pos = torch.randn(2 * 4, 128, generator=_gen(2)), torch.tensor([5, 900])
    rope = Rope(FLASH, compressed=True)
    want = fp4_e2m1_roundtrip(hadamard(rope(x.view(2, 4, 128), pos))).view(8, 128)
    got = finish_rows_ref(x, pos, 4, inv_freq=rope.inv_freq, hadamard=True, rt="fp4")
    assert torch.equal(got, want)
    y = torch.randn(3, 256, generator=_gen(3))
    assert torch.equal(finish_rows_ref(y, torch.zeros(3, dtype=torch.long), 1, rt="fp8", nope=128)[:, :128],
                       fp8_e4m3_roundtrip(y[:, :128]))


def test_e4m3_and_e2m1_rounding_is_exact_at_every_code() -> None:
    """Every FP8 / FP4 code, the midpoints between neighbours (ties) and values just beside them."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[e4m3 <= 448].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    vals = torch.cat([e4m3, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    # one FP8 block of 64 per row whose amax is 448 (scale 1), the rest of the row carries the values
    vals = torch.cat((vals, torch.zeros(-vals.numel() % 63))).view(-1, 63)
    x = torch.cat((torch.full((vals.shape[0], 1), 448.0), vals), dim=1)
    x = torch.cat((x, -x)).to(DEVICE)
    pos = torch.zeros(x.shape[0], dtype=torch.long, device=DEVICE)
    _close(finish_rows_triton(x, pos, 1, rt="fp8", nope=64), finish_rows_ref(x, pos, 1, rt="fp8", nope=64), atol=0)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    mids = (e2m1[1:] + e2m1[:-1]) / 2
    vals = torch.cat([e2m1, mids, mids + 1e-6, mids - 1e-6])
    x = torch.zeros(1, 32)
    x[0, : vals.numel()] = vals  # 29 values
    x[0, -1] = 6.0  # amax 6: scale 1
    x = torch.cat((x, -x)).to(DEVICE)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    _close(finish_rows_triton(x, pos, 1, rt="fp4"), finish_rows_ref(x, pos, 1, rt="fp4"), atol=0)


def test_finish_rows_writes_only_its_ring_slots() -> None:
    g = _gen(4)
    d, ring_len = 192, 11
    x = torch.randn(3, d, generator=g).to(DEVICE)
    pos = torch.tensor([4, 16, 30], device=DEVICE)  # slots 4, 5, 8
    kw = dict(norm=True, weight=(torch.rand(d, generator=g) + 0.5).to(DEVICE), inv_freq=F_TINY.to(DEVICE),
              rt="fp8", nope=128)
    a = torch.full((ring_len, d), float("nan"), device=DEVICE)
    b = a.clone()
    finish_rows_triton(x, pos, 1, ring=a, **kw)
    finish_rows_ref(x, pos, 1, ring=b, **kw)
    written = torch.zeros(ring_len, dtype=torch.bool)
    written[[4, 5, 8]] = True
    assert a[~written.to(DEVICE)].isnan().all(), "wrote outside its slots"
    _close(a[written.to(DEVICE)], b[written.to(DEVICE)])


def test_finish_rows_rejects_bad_shapes() -> None:
    x, pos = torch.zeros(6, 96), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="heads"):
        finish_rows_ref(x, pos, 4)
    with pytest.raises(ValueError, match="power of two"):
        finish_rows_ref(x, pos, 2, hadamard=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        finish_rows_ref(x, pos, 2, rt="fp8", nope=32)
    with pytest.raises(ValueError, match="ring"):
        finish_rows_ref(x, pos, 2, ring=torch.zeros(4, 96))


def _finish(d: int, rt: str | None, seed: int) -> Finish:
    g = _gen(seed)
    freq = F_TINY if d >= 128 else rope_inv_freq(FLASH, True)[:8]
    return Finish((torch.rand(d, generator=g) + 0.5).to(DEVICE), 1e-6, freq.to(DEVICE), rt,
                  nope=d - 64 if rt == "fp8" else 0, hadamard=rt == "fp4")


@pytest.mark.parametrize("ratio,d,rt", [(4, 192, "fp8"), (16, 192, "fp8"), (4, 64, "fp4"), (8, 192, None)])
def test_compressor_decode_and_blocks_match_the_reference(ratio: int, d: int, rt: str | None) -> None:
    """Token by token through three blocks (frontier ring smaller than the sequence, so slots wrap), then the
    prefill pooling of the same blocks from the frontier; rows of unclosed blocks stay unwritten."""
    g = _gen(ratio + d)
    coff = 2 if ratio == 4 else 1
    W, Rf = coff * d, coff * ratio + 3
    fin = _finish(d, rt, ratio)
    ape = torch.randn(ratio, W, generator=g).to(DEVICE)
    A = [torch.zeros(Rf, W, device=DEVICE), torch.zeros(Rf, W, device=DEVICE),
         torch.full((6, d), float("nan"), device=DEVICE)]
    B = [t.clone() for t in A]
    for p in range(3 * ratio + 2):
        kv, sc = (torch.randn(1, 2 * W, generator=g).to(DEVICE) * 2)[:, ::2], torch.randn(1, W, generator=g).to(DEVICE)
        kv = kv.contiguous()
        pos = torch.tensor([p], device=DEVICE)
        compress_decode_triton(kv, sc, ape, pos, *A, ratio, fin)
        compress_decode_ref(kv, sc, ape, pos, *B, ratio, fin)
        _close(A[0], B[0])
        _close(A[1], B[1])
    assert A[2][3:].isnan().all(), "a row of an unclosed block was written"
    _close(A[2][:3], B[2][:3], atol=1e-5)
    # prefill: pool blocks 1 and 2 again (block 2's predecessors wrapped in the ring: still held)
    A[2].fill_(float("nan"))
    B[2].fill_(float("nan"))
    compress_blocks_triton(A[0], A[1], A[2], 1, 2, ratio, fin)
    compress_blocks_ref(B[0], B[1], B[2], 1, 2, ratio, fin)
    assert A[2][0].isnan().all() and A[2][3:].isnan().all()
    _close(A[2][1:3], B[2][1:3], atol=1e-5)
    # a static step of several positions: each pools the block it closes (here block 2 by its last position,
    # block 1 by its own; the positions that close nothing pool nothing), the same rows as the prefill pooling
    for R in (A, B):
        R[2].fill_(float("nan"))
    pos = torch.tensor([3 * ratio - 3, 3 * ratio - 2, 3 * ratio - 1, 2 * ratio - 1], device=DEVICE)
    compress_rows_triton(A[0], A[1], A[2], pos, ratio, fin)
    compress_rows_ref(B[0], B[1], B[2], pos, ratio, fin)
    assert A[2][0].isnan().all() and A[2][3:].isnan().all(), "a block no position closed was pooled"
    _close(A[2][1:3], B[2][1:3], atol=1e-5)


def test_compressor_reference_is_the_models() -> None:
    """compress_blocks_ref equals engine/model.py's Compressor on the same projections."""
    cfg = TINY
    d, ratio = cfg.head_dim, 4
    g = _gen(7)
    w = {f"c_{k}.weight": torch.randn(2 * d, cfg.dim, generator=g) * 0.05 for k in ("kv", "gate")}
    w["c_ape.weight"] = torch.randn(ratio, 2 * d, generator=g)
    w["c_norm.weight"] = torch.rand(d, generator=g) + 0.5
    rope = Rope(cfg, compressed=True)
    comp = Compressor(w.__getitem__, "c", ratio, rope, cfg.rms_eps, lambda x: x)
    xn, pos = torch.randn(12, cfg.dim, generator=g), torch.arange(12)
    fr, rows = Frontier.zeros(2 * ratio + 12, 2 * d, None), torch.zeros(3, d)
    comp(xn, pos, fr, rows)
    fr2, rows2 = Frontier.zeros(2 * ratio + 12, 2 * d, None), torch.zeros(3, d)
    fr2.write(pos, xn @ w["c_kv.weight"].T, xn @ w["c_gate.weight"].T + w["c_ape.weight"][pos % ratio])
    compress_blocks_ref(fr2.kv, fr2.score, rows2, 0, 3, ratio, Finish(w["c_norm.weight"], cfg.rms_eps, rope.inv_freq))
    assert torch.allclose(rows, rows2, atol=1e-6)


@pytest.mark.parametrize("clamp", [0.0, 1.5])
def test_swiglu(clamp: float) -> None:
    from ds4station.kernels import dispatch

    gu = (torch.randn(3, 2 * 300, generator=_gen(8)) * 3).to(DEVICE)
    want = swiglu_ref(gu, clamp)
    if DEVICE == "cpu":
        with dispatch.interpreted_kernels():
            got = swiglu(gu, clamp)
    else:
        got = swiglu(gu, clamp)
    _close(got, want)
    assert got.shape == (3, 300)


@pytest.mark.parametrize("f", [2048, 96])
def test_swiglu_emits_its_output_quantised(f: int) -> None:
    """`act16`: swiglu also stores its output quantised for the shared expert's down projection (the integer-dot
    matvec) in its launch: the words and scales of quantize_act16 on the output it stores, bit for bit, which
    is itself unchanged. A width that is not whole 32-groups is refused, and so is the CPU reference."""
    from ds4station.kernels import dispatch
    from ds4station.kernels.act_quant import quantize_act16

    gu = (torch.randn(2, 2 * f, generator=_gen(9)) * 3).to(DEVICE)
    ctx = dispatch.interpreted_kernels() if DEVICE == "cpu" else contextlib.nullcontext()
    with ctx:
        plain = swiglu(gu, 1.5)
        got, act = swiglu(gu, 1.5, act16=True)
        want = quantize_act16(plain)
        with pytest.raises(ValueError, match="multiple of 32"):
            swiglu(gu[:, :2 * 40], 1.5, act16=True)
    assert torch.equal(got, plain)
    for a, b in zip(act, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="act16"):
        swiglu(gu.cpu(), 1.5, act16=True)
