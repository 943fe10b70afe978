"""A CPU stage's native kernels (ds4station/kernels/cpu.py, cpu_kernels.c): built with this machine's compiler,
their dequantisation bit for bit against gguf-py's numpy code, their fp32 matvecs against the dequantised matrix
at 1-40 rows and in groups, the integer-dot matvecs (int8 activations) against the GPU integer kernels' torch
reference, both independent of the thread count; `linear` and `moe` on the CPU through them against the torch
references; the build's cache and its failures."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from numerics import rel_err

from ds4station.kernels import cpu, ops
from ds4station.kernels.moe import _expert, matvec_ref, moe_decode_ref
from ds4station.kernels.q8_0 import q8_0_matvec_ref

TYPES = {"q8_0": Q.Q8_0, "iq2_xxs": Q.IQ2_XXS, "q2_k": Q.Q2_K, "q4_k": Q.Q4_K}
# byte offsets of each block's fp16 fields (d; Q2_K d and dmin at the block's end; Q4_K d and dmin first)
F16_AT = {Q.Q8_0: (0,), Q.IQ2_XXS: (0,), Q.Q2_K: (80, 82), Q.Q4_K: (0, 2)}
# fp16 edges: zeros, the smallest and largest subnormal, the smallest normal, 1, the largest finite
EDGES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF], dtype=np.uint16)

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler to build the CPU kernels")
needs_int8 = pytest.mark.skipif(not cpu.int8_matvec("iq2_xxs"), reason="no integer-dot CPU kernels (x86 AVX2)")


def raw_rows(qtype: Q, n: int, k: int, seed: int, edges: bool = True) -> np.ndarray:
    """uint8 [n, row bytes]: random blocks (every quant / scale byte random) with finite fp16 fields (~0.01),
    the fp16 edges planted in the first blocks (`edges`)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        f16 = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint16)
        if edges:
            f16[: len(EDGES)] = EDGES[: len(raw)]
        raw[:, at:at + 2] = f16.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def packed(name: str, n: int, k: int, seed: int = 0, edges: bool = True) -> ops.Packed:
    return ops.repack(torch.from_numpy(raw_rows(TYPES[name], n, k, seed, edges)), name, k)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_gguf_bit_for_bit(name: str) -> None:
    n, k = 9, 768
    raw = raw_rows(TYPES[name], n, k, seed=3)
    want = np.ascontiguousarray(gguf_quants.dequantize(raw, TYPES[name]), dtype=np.float32)
    got = cpu.dequantize(ops.repack(torch.from_numpy(raw), name, k))
    assert got.shape == (n, k) and torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 40])
def test_matvec_matches_the_dequantised_matrix(name: str, m: int) -> None:
    w = packed(name, 67, 512, seed=m)  # odd row count: the threads' split is uneven
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    y = cpu.matvec(x, w)
    assert y.shape == (m, 67) and y.dtype == torch.float32
    assert rel_err(y, x.double() @ ops.dequantize(w).double().T) < 1e-6


@pytest.mark.parametrize("name", TYPES)
def test_grouped_matvec_reads_each_groups_columns(name: str) -> None:
    groups, k = 4, 256
    w = packed(name, 32, k, seed=5)
    x = torch.randn(2, groups * k, generator=torch.Generator().manual_seed(0))
    wf = ops.dequantize(w).double().reshape(groups, 32 // groups, k)
    want = torch.einsum("mgk,gnk->mgn", x.double().reshape(2, groups, k), wf).reshape(2, 32)
    assert rel_err(cpu.matvec(x, w, groups=groups), want) < 1e-6
    with pytest.raises(ValueError, match="does not match"):
        cpu.matvec(x[:, :k + 32], w, groups=groups)


@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_int8)])
def test_results_do_not_depend_on_the_thread_count(int8: bool) -> None:
    w = packed("iq2_xxs", 301, 1024, seed=1)
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.matvec(x, w, int8=int8)
        torch.set_num_threads(max(2, threads))
        many = cpu.matvec(x, w, int8=int8)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def int8_want(x: torch.Tensor, w: ops.Packed, groups: int = 1) -> torch.Tensor:
    """The integer kernels' values: each row of x quantised per 32 (act_quant.py's rule), per group of weight rows."""
    k, rows = w.k, w.n // groups
    return torch.stack([torch.cat([matvec_ref(ops._row_block(w, g * rows, (g + 1) * rows), xm[g * k:(g + 1) * k], True)
                                   for g in range(groups)]) for xm in x])


@needs_int8
@pytest.mark.parametrize("name", cpu.INT8_TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_int8_matvec_matches_the_integer_reference(name: str, m: int) -> None:
    """x quantised to int8 per 32 values (scale amax / 127) times the weights' codes as exact integer dots: the
    GPU integer-dot kernels' values (moe.matvec_ref with act_quant), Q2_K / Q4_K's min term on the exact x;
    clearly apart from the fp32 matvec's (the quantisation is real, not a no-op)."""
    assert cpu.int8_matvec(name) and not cpu.int8_matvec("q8_0")
    w = packed(name, 67, 512, seed=m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    y = cpu.matvec(x, w, int8=True)
    assert y.shape == (m, 67) and rel_err(y, int8_want(x, w)) < 1e-5
    assert rel_err(y, x @ ops.dequantize(w).T) > 1e-4


@needs_int8
@pytest.mark.parametrize("name", cpu.INT8_TYPES)
def test_int8_grouped_matvec_reads_each_groups_columns(name: str) -> None:
    groups, k = 4, 256
    w = packed(name, 32, k, seed=5)
    x = torch.randn(2, groups * k, generator=torch.Generator().manual_seed(0))
    assert rel_err(cpu.matvec(x, w, groups=groups, int8=True), int8_want(x, w, groups)) < 1e-5


def test_int8_matvec_is_refused_for_types_without_it() -> None:
    with pytest.raises(ValueError, match="no integer-dot CPU matvec for q8_0"):
        cpu.matvec(torch.randn(1, 256), packed("q8_0", 8, 256, seed=0), int8=True)


def test_expert_slices_and_row_blocks_are_read_in_place() -> None:
    """A stacked expert tensor's [e] and a block of rows (views the engine passes) give the whole matrix's rows."""
    raw = torch.from_numpy(raw_rows(Q.Q2_K, 3 * 48, 512, seed=2)).view(3, 48, -1)
    w = ops.repack(raw, "q2_k", 512)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    whole = ops.dequantize(w)
    assert torch.equal(cpu.dequantize(_expert(w, 1)), whole[1])
    assert rel_err(cpu.matvec(x, _expert(w, 2)), x @ whole[2].T) < 1e-6
    assert torch.equal(cpu.dequantize(ops._row_block(_expert(w, 0), 16, 40)), whole[0, 16:40])


@pytest.mark.parametrize("m", [1, 4, ops.CPU_MATVEC_ROWS + 9])  # the native matvec, and dequantised blocks
@pytest.mark.parametrize("groups", [1, 8])
def test_linear_on_the_cpu_matches_the_reference(m: int, groups: int, monkeypatch) -> None:
    w = packed("q8_0", 64, 256, seed=m, edges=False)  # (65504 as a scale would overflow the fp16 output)
    x = torch.randn(m, groups * 256, generator=torch.Generator().manual_seed(m)).half()
    want = q8_0_matvec_ref(x, w, groups=groups, out_dtype=torch.float32)
    monkeypatch.setattr(ops, "CPU_DEQUANT_BYTES", 4 * 256 * 3)  # 3 rows per block: blocks cross no group
    got = ops.linear(x, w, groups=groups)
    assert got.dtype == torch.float16 and rel_err(got.float(), want) < 1e-3  # the fp16 output's rounding
    assert rel_err(ops.linear(x, w, groups=groups, out_dtype=torch.float32), want) < 1e-6


def test_prefill_rows_dequantise_into_one_kept_buffer() -> None:
    """Past CPU_MATVEC_ROWS the blocks of rows are dequantised into the thread's one scratch buffer (a fresh
    allocation per block costs more in page faults than the decode), which later calls reuse."""
    w = packed("iq2_xxs", 96, 512, seed=8, edges=False)
    x = torch.randn(ops.CPU_MATVEC_ROWS + 1, 512, generator=torch.Generator().manual_seed(8))
    first = ops.linear(x, w, out_dtype=torch.float32)
    buf = ops._scratch.buf
    assert buf.numel() * 4 == ops.CPU_DEQUANT_BYTES
    assert torch.equal(ops.linear(x, w, out_dtype=torch.float32), first) and ops._scratch.buf is buf
    assert rel_err(first, x @ ops.dequantize(w).T) < 1e-6


@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_int8)])
def test_moe_on_the_cpu_matches_the_reference(int8: bool) -> None:
    """Routed experts (IQ2_XXS gate / up, Q2_K down) of 3 and 30 tokens, each used expert once over its tokens:
    with int_dot, through the integer dot, against the reference with the activations quantised as the kernels
    do; without, the fp32 matvecs against the plain reference."""
    e, d, f = 8, 256, 512
    gate, up = (ops.repack(torch.from_numpy(raw_rows(Q.IQ2_XXS, e * f, d, seed=s)).view(e, f, -1), "iq2_xxs", d)
                for s in (1, 2))
    down = ops.repack(torch.from_numpy(raw_rows(Q.Q2_K, e * d, f, seed=3)).view(e, d, -1), "q2_k", f)
    g = torch.Generator().manual_seed(4)
    for t in (3, 30):
        x = torch.randn(t, d, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(t)])
        weights = torch.rand(t, 3, generator=g)
        want = moe_decode_ref(x, gate, up, down, ids, weights, clamp=10.0, act_quant=int8)
        got = ops.moe(x, gate, up, down, ids, weights, clamp=10.0, int_dot=int8)
        assert rel_err(got, want) < 1e-5


def test_without_the_library_the_cpu_runs_the_references(monkeypatch, caplog, tmp_path) -> None:
    """DS4STATION_CPU_KERNELS=0 (or a failed build) leaves the torch references, with one warning for a failure."""
    w = packed("q4_k", 48, 256, seed=6)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    native = ops.linear(x, w)
    try:
        monkeypatch.setenv("DS4STATION_CPU_KERNELS", "0")
        cpu._lib.cache_clear()
        assert not cpu.available()
        assert rel_err(ops.linear(x, w), native) < 1e-6
        with pytest.raises(RuntimeError, match="not available"):
            cpu.matvec(x, w)
        monkeypatch.setenv("DS4STATION_CPU_KERNELS", "1")
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        monkeypatch.setattr(cpu, "cache_dir", lambda: tmp_path)  # nothing built there yet
        cpu._lib.cache_clear()
        with caplog.at_level(logging.WARNING, logger="ds4station.kernels.cpu"):
            assert not cpu.available()
        assert "CPU kernels unavailable" in caplog.text and "false failed" in caplog.text
    finally:
        monkeypatch.undo()
        cpu._lib.cache_clear()
    assert cpu.available()


def test_build_is_cached_and_keyed_by_the_compiler(tmp_path, monkeypatch) -> None:
    first = cpu.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # not built again
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        cpu.build(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_compiler_without_openmp_builds_them_single_threaded(tmp_path, monkeypatch, caplog) -> None:
    """A compiler that refuses -fopenmp (clang without libomp) still builds the kernels, on one thread, with a
    warning; they compute the same as the OpenMP build."""
    real = cpu._compiler()
    wrapper = tmp_path / "cc-no-openmp"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && echo "no -fopenmp" >&2 && exit 1; '
                       f'done\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    with caplog.at_level(logging.WARNING, logger="ds4station.kernels.cpu"):
        path = cpu.build(tmp_path / "out")
    assert "could not build the CPU kernels with OpenMP (no -fopenmp)" in caplog.text
    lib = cpu.ctypes.CDLL(str(path))
    w = packed("q8_0", 40, 256, seed=9)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    ts, ptrs = cpu._weights(w)
    y = torch.empty(3, 40)
    lib.ds4_q8_0_matvec.argtypes = [cpu._p] * 2 + cpu._MATVEC
    lib.ds4_q8_0_matvec(*ptrs, x.data_ptr(), 256, y.data_ptr(), 40, 40, 256, 3, 40, 2)
    assert torch.equal(y, cpu.matvec(x, w))


@needs_int8
def test_the_integer_dot_is_the_cpu_moe_default_for_decode_steps(monkeypatch) -> None:
    """ops.moe's default on the CPU (int_dot None): the integer dot for up to CPU_MATVEC_ROWS tokens (decode and
    verification steps), fp32 past them (prefill, as the GPU's prefill kernels); DS4STATION_CPU_INT8=0 keeps fp32;
    float experts never."""
    w = packed("iq2_xxs", 64, 256, seed=1)
    down = packed("q2_k", 256, 64 * 4, seed=2)
    few, many = torch.randn(4, 256), torch.randn(ops.CPU_MATVEC_ROWS + 1, 256)
    monkeypatch.delenv("DS4STATION_CPU_INT8")
    assert ops.moe_int_dot(few, w, down) and ops.moe_int_dot(few, w, down, int_dot=True)
    assert not ops.moe_int_dot(many, w, down) and not ops.moe_int_dot(few, w, down, int_dot=False)
    assert not ops.moe_int_dot(few, torch.zeros(2, 64, 256), torch.zeros(2, 256, 64))
    monkeypatch.setenv("DS4STATION_CPU_INT8", "0")
    assert not ops.moe_int_dot(few, w, down) and ops.moe_int_dot(few, w, down, int_dot=True)
