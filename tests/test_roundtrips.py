"""The model's quantisation-aware round trips and the Hadamard transform against straightforward definitions.

The references here are written the slow, obvious way (enumerate the format's values, pick the nearest with
ties to the even code, as ds4.c's dsv4_e4m3fn_dequant_cpu / dsv4_e2m1fn_dequant_cpu do; the Hadamard
matrix by Sylvester's construction) and compared with the vectorised model functions.
"""

from __future__ import annotations

import math

import torch

from ds4station.kernels.reference import fp4_e2m1_roundtrip, fp8_e4m3_roundtrip, hadamard


def e4m3_values() -> list[float]:
    """All non-negative finite e4m3fn values by code (0..126; 127 is NaN), exponent bias 7."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest(values: list[float], v: float) -> float:
    """Nearest representable magnitude (clamped to the largest), ties to the even code."""
    a = min(abs(v), values[-1])
    best = min(range(len(values)), key=lambda i: (abs(a - values[i]), i % 2))
    return math.copysign(values[best], v)


def block_roundtrip_slow(x: torch.Tensor, block: int, fmt_max: float, amax_floor: float,
                         values: list[float]) -> torch.Tensor:
    out = []
    for row in x.tolist():
        res = []
        for b in range(0, len(row), block):
            blk = row[b: b + block]
            amax = max(max(abs(v) for v in blk), amax_floor)
            scale = 2.0 ** math.ceil(math.log2(amax / fmt_max))
            res += [nearest(values, max(-fmt_max, min(fmt_max, v / scale))) * scale for v in blk]
        out.append(res)
    return torch.tensor(out, dtype=torch.float32)


def test_fp8_roundtrip_matches_definition():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=gen) * torch.tensor([1e-6, 1e-3, 0.1, 1.0, 30.0, 1e4])[:, None]
    x[3, :64] = 0.0  # an all-zero block: amax floor 1e-4 keeps the scale finite
    want = block_roundtrip_slow(x, 64, 448.0, 1e-4, e4m3_values())
    got = fp8_e4m3_roundtrip(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, x)  # it does quantise


def test_fp8_roundtrip_ties_and_representable_values():
    # With amax = 448 * 2^k the scale is exactly 2^k: representable values survive, midpoints go to even.
    x = torch.zeros(1, 64)
    x[0, 0] = 448.0
    x[0, 1], x[0, 2] = 1.0625, 1.1875  # midpoints between 1, 1.125 (code even) and 1.125, 1.25 (code even)
    x[0, 3] = 3.5  # representable
    got = fp8_e4m3_roundtrip(x)[0]
    assert got[:4].tolist() == [448.0, 1.0, 1.25, 3.5]


def test_fp4_roundtrip_matches_definition():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=gen) * torch.tensor([1e-3, 0.5, 1.0, 7.0, 100.0])[:, None]
    want = block_roundtrip_slow(x, 32, 6.0, 6 * 2.0**-126, E2M1)
    torch.testing.assert_close(fp4_e2m1_roundtrip(x), want, rtol=0, atol=0)


def test_fp4_roundtrip_ties_go_to_even_codes():
    # amax 6 -> scale 1; every midpoint between neighbours must land on the even code (0, 1, 2, 4, 6 ...).
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0] + [0.0] * 22])
    got = fp4_e2m1_roundtrip(x)[0, :10].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def test_hadamard_matches_sylvester_matrix():
    x = torch.randn(3, 7, 128, generator=torch.Generator().manual_seed(2))
    want = x @ sylvester(128) / math.sqrt(128)
    torch.testing.assert_close(hadamard(x), want, rtol=1e-5, atol=1e-5)
    # orthonormal: applying it twice is the identity, and dot products are preserved
    torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=1e-5, atol=1e-5)


def test_hadamard_rejects_non_power_of_two():
    try:
        hadamard(torch.zeros(96))
    except ValueError as e:
        assert "96" in str(e)
    else:
        raise AssertionError("expected a ValueError")
