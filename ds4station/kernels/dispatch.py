"""Which backend runs a kernel, and every tile / warp choice per backend, in one place.

Owns: the backend of a device (`cuda`, `hip64` = wave64 gfx9 such as gfx906, `hip32` = wave32 RDNA such as
gfx1100 / gfx1151, `cpu`), the compile targets the portability check builds for, and the block sizes,
num_warps and num_stages every Triton launcher uses. Launchers ask here and nowhere else, and
`ds4station bench compile` compiles exactly these choices, so what is checked is what would run.

Rules that shape the numbers (see docs/PERFORMANCE.md):
- decode matvecs are bandwidth-bound: a few output rows per program, the whole K row in one or two chunks,
  >= 256 programs, and one warp's worth of work that does not depend on the warp size (we never assume 32);
- wave64 (gfx906) has twice the lanes per warp, so the same tile needs half the warps to keep the per-thread
  vector width; Vega20 has neither bf16 nor matrix cores, so its prefill tiles are smaller;
- prefill matmuls feed fp16 into tl.dot (never bf16: Vega20 lacks it) and accumulate in fp32.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import Literal

import torch

Backend = Literal["cuda", "hip64", "hip32", "cpu"]
BACKENDS: tuple[Backend, ...] = ("cuda", "hip64", "hip32", "cpu")


@dataclass(frozen=True)
class CompileTarget:
    """A GPU the portability check compiles for, ahead of time, without the card."""

    name: str
    backend: str  # triton's backend name: "cuda" or "hip"
    arch: int | str  # 90 / 86 for NVIDIA, "gfx906" etc. for AMD
    warp_size: int
    shared_limit: int  # shared memory / LDS bytes one program may use (sm_90 227 KB, sm_86 99 KB, AMD 64 KB)

    @property
    def kernel_backend(self) -> Backend:
        if self.backend == "cuda":
            return "cuda"
        return "hip64" if self.warp_size == 64 else "hip32"


COMPILE_TARGETS: tuple[CompileTarget, ...] = (
    CompileTarget("sm90", "cuda", 90, 32, 232448),
    CompileTarget("sm86", "cuda", 86, 32, 101376),
    CompileTarget("gfx906", "hip", "gfx906", 64, 65536),
    CompileTarget("gfx1100", "hip", "gfx1100", 32, 65536),
    CompileTarget("gfx1151", "hip", "gfx1151", 32, 65536),
)


def device_backend(device: torch.device | str) -> Backend:
    """The kernel backend for a torch device (ROCm devices report type 'cuda' too)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    if torch.version.hip is None:
        return "cuda"
    props = torch.cuda.get_device_properties(device)
    warp = getattr(props, "warp_size", None)
    if warp is None:  # older torch: gfx9 (GCN/CDNA) is wave64, gfx10+ (RDNA) runs wave32 kernels
        warp = 64 if str(getattr(props, "gcnArchName", "gfx9")).startswith("gfx9") else 32
    return "hip64" if warp == 64 else "hip32"


def shared_limit(t: torch.Tensor) -> int | None:
    """Shared memory bytes one program may use on this tensor's NVIDIA GPU (the opt-in maximum: 227 KB on
    sm_90, 163 KB on sm_80, 99 KB on sm_86 / sm_89 / sm_120), or None elsewhere."""
    if t.device.type != "cuda" or torch.version.hip is not None:
        return None
    props = torch.cuda.get_device_properties(t.device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def multiprocessors(t: torch.Tensor) -> int:
    """SMs / CUs of the GPU this tensor lives on (2 for a CPU tensor: the interpreter's stand-in)."""
    return torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 2


def tma_reads(t: torch.Tensor) -> bool:
    """Whether kernels may read weights through the tensor memory accelerator on this tensor's GPU (the Q8_0
    integer-dot matvec's `tma` tiles): NVIDIA sm_90 or newer, unless DS4STATION_Q8_TMA=0. On by default since
    the forty-first session (docs/PERFORMANCE.md): serve's decode after 8K on an H100, 30 layers, 205.0 ->
    209.3 tok/s (two alternating rounds)."""
    return os.environ.get("DS4STATION_Q8_TMA", "1") != "0" and hopper_or_newer(t.device)


def hopper_or_newer(device: torch.device) -> bool:
    """An NVIDIA GPU of sm_90 or newer (not ROCm): what PDL launches (pdl.py) and tensor descriptors need."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_KERNELS_ON_CPU = False


def use_triton(t: torch.Tensor) -> bool:
    """The public ops run Triton on a GPU tensor and the torch reference on a CPU tensor, except inside
    `interpreted_kernels()`, where CPU tensors go through the kernels in the Triton interpreter."""
    return t.is_cuda or (_KERNELS_ON_CPU and interpreting())


@contextmanager
def interpreted_kernels() -> Iterator[None]:
    """Run the engine's Triton kernels on CPU tensors in the interpreter (TRITON_INTERPRET=1): lets tests
    drive the GPU code path, kernel launches included, end to end on a machine without a GPU."""
    global _KERNELS_ON_CPU
    if not interpreting():
        raise RuntimeError("interpreted_kernels() needs TRITON_INTERPRET=1 set before triton is imported")
    before, _KERNELS_ON_CPU = _KERNELS_ON_CPU, True
    try:
        yield
    finally:
        _KERNELS_ON_CPU = before


def launch_backend(t: torch.Tensor) -> Backend:
    """Tile table for a launch on this tensor's device; "cpu" means the Triton interpreter, which runs
    programs one after another, so its tiles are few and wide."""
    return device_backend(t.device)


def use_int_dot(backend: Backend) -> bool:
    """Integer-dot (dp4a) decode kernels: NVIDIA only for now (PTX inline assembly). AMD has its own dot4
    instructions (gfx906 v_dot4_i32_i8, RDNA3 v_dot4_i32_iu8) but they are not wired yet; the interpreter
    cannot run inline assembly at all."""
    return backend == "cuda"


# ---------------------------------------------------------------------------------------------------------
# Decode matvec tiles (1-8 activation rows, quantised weights [N, K]).


@dataclass(frozen=True)
class MatvecTiles:
    block_n: int  # output rows per program
    block_k: int  # K elements per loop step (a multiple of the quant block)
    num_warps: int
    num_stages: int = 1
    tma: bool = False  # weights through tensor descriptors (Q8_0 integer dot, sm_90+); num_stages deep
    per_sm: int = 0  # with tma: a persistent grid of this many programs per SM (0: one per row block)


# Largest K chunk per step, per quant type (the whole row of DS4's matrices where registers allow).
_MAX_BLOCK_K = {"q8_0": 2048, "iq2_xxs": 4096, "q2_k": 2048, "q4_k": 1024}
# Weights per lane-owned unit in the one-lane-per-word kernels (one int64 word of IQ2_XXS, one int32 word of
# Q2_K, one int32 word of Q4_K).
_LANE_PER_UNIT = {"iq2_xxs": 32, "q2_k": 16, "q4_k": 8}
_QUANT_BLOCK = {"q8_0": 32, "iq2_xxs": 256, "q2_k": 256, "q4_k": 64}
# Target programs per launch: enough to cover 132 SMs / 60 CUs twice over.
_MIN_PROGRAMS = 256


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    return 1 << (max(1, v) - 1).bit_length()


def matvec_tiles(
    qtype: str, n: int, k: int, m: int, backend: Backend, rows_per_group: int | None = None
) -> MatvecTiles:
    """Tiles for y[m, n] = x[m, :] . W[n, :] with W in `qtype`.

    `rows_per_group` (grouped matvec): a program's rows must lie in one group, so block_n divides it.
    """
    if qtype not in _MAX_BLOCK_K:
        raise ValueError(f"no matvec kernel for quant type {qtype!r}; have {sorted(_MAX_BLOCK_K)}")
    block_k = max(_QUANT_BLOCK[qtype], min(_MAX_BLOCK_K[qtype], _pow2_ceil(k)))
    lanes = 64 if backend == "hip64" else 32
    if backend == "cpu":
        block_n, num_warps = min(256, _pow2_ceil(n)), 1
    elif qtype in _LANE_PER_UNIT:
        # 2-bit and Q4_K kernels: 2-D [rows, units] tiles, one lane per packed unit (32 weights IQ2_XXS, 16 Q2_K,
        # 8 Q4_K) of the chunk, each lane looping over the program's rows (x is loaded once per lane, reused per row).
        block_n = min(8, max(1, _pow2_floor(n // _MIN_PROGRAMS)))
        units = block_k // _LANE_PER_UNIT[qtype]
        num_warps = max(1, min(8, units // lanes))
    elif backend == "cuda" and 2 <= m <= 4:  # Q8_0 at a few fp32 rows: measured tiles of their own
        block_n, block_k, num_warps = _q8_0_few_row_tiles(n, k, rows_per_group)
    else:
        # Q8_0, from the H200 runs of 2026-11-29 (docs/PERFORMANCE.md): tall matrices (>= 4096 rows)
        # with K > 1024 were fastest at 4 rows x 1024 K per step; the rest (q_b's K = 1024, and the short
        # q_a / kv / shared-expert gate+up) at up to 8 rows and up to 2048 K per step. num_warps keeps
        # <= 64 weight bytes per lane (wave64 needs half the warps of wave32 for that).
        # A sweep of the model's Q8_0 shapes on the H200 (2026-11-29, third session) moved two: q_b (K = 1024)
        # 12% faster at 8 rows x 512, q_a + kv (1536 rows) 8% at 2 rows (>= 512 programs).
        tall = n >= 4096
        block_k = min(512 if k <= 1024 else 1024 if tall else 2048, max(32, _pow2_ceil(k)))
        block_n = min(4 if tall and k > 1024 else 8, max(1, _pow2_floor(n // (2 * _MIN_PROGRAMS))))
        if m > 4:  # more activation rows: more registers per weight; fewer rows per program
            block_n = max(1, block_n // 2)
        num_warps = (4 if block_n * block_k <= 8192 else 8) * 32 // lanes
    if rows_per_group is not None:
        while rows_per_group % block_n:
            block_n //= 2
    return MatvecTiles(block_n=block_n, block_k=block_k, num_warps=num_warps)


# Q8_0 matrices of at least this many weights (q_b, the output projections, the head) are "large" to the
# few-row tiles and to the matvec / matmul crossover.
_Q8_0_LARGE = 16 << 20
# ... and of at least this many (the shared expert's gate + up and down) leave the fp32 matvec after 2 rows.
_Q8_0_SHARED_EXPERT = 8 << 20


def _q8_0_few_row_tiles(n: int, k: int, rows_per_group: int | None) -> tuple[int, int, int]:
    """(block_n, block_k, num_warps) of the Q8_0 matvec at 2-4 fp32 activation rows on CUDA (a verification
    or a batched step; the engine's activations are fp32, so each lane reads 4 bytes of x per weight and row
    from L1). H200 sweep, fourteenth session (docs/PERFORMANCE.md: rows x K step x warps at 2, 3 and 4 rows,
    each shape's best at 2 rows against the one-row tiles): the matrices of >= 16M weights were fastest with one
    warp per program (output b 28.1 -> 25.0 us, output a 27.0 -> 24.3, q_b 24.8 -> 23.8, head 321.5 -> 300.8),
    the shared expert's gate + up at 4 x 1,024 (11.3 -> 8.4 us); the rest moved by <= 10%."""
    if n * k >= _Q8_0_LARGE:
        return (8 if rows_per_group is not None and rows_per_group < n else 4), (1024 if k > 4096 else 512), 1
    block_k = min(_pow2_ceil(k), 2048 if n <= 1024 else 1024 if k >= 4096 else 512)
    return (2 if n <= 512 else 4), block_k, 4


def q8_0_matvec_rows(n: int, k: int, backend: Backend) -> int:
    """The most activation rows a Q8_0 [n, k] projection runs through the fp32 matvec on this backend; more rows
    take the tl.dot matmul (small-M split-K tiles on CUDA; activations rounded to fp16, as in prefill).

    The matvec redoes its dequantisation math per row, the matmul's cost hardly depends on the rows up to its
    16-row tile. H200 (`ds4station bench kernels --rows 1,2,4,8,16 --only q8_0`, docs/PERFORMANCE.md, run Q1):
    at 2 rows the matvec won on every shape (q_b 19.2 us against 19.5 at 16 rows of the matmul); at 4 rows it
    won on the matrices under 16M weights (q_a 8.9 vs 10.7 us, kv 6.6 vs 9.8, shared gate+up 10.6 vs 13.5,
    down 11.0 vs 13.4) and lost on the larger (q_b 26.1 vs 19.5, output a / b 32.3 / 39.0 vs 26.7 / 29.3, head
    352.8 vs 220.7); at 8 rows it lost everywhere (head 994.7 vs 220.7). An int8 tensor-core form of the
    matvec tried in the same run (per-32 block int8 dots) lost to one of the two at every shape and row count.
    Other backends keep the matvec up to 8 rows (not measured).
    Fourteenth session, the same comparison with fp32 activations (what the engine passes; the runs above used
    fp16) and the few-row tiles (`_q8_0_few_row_tiles`): at 3 rows the matvec still won on the small matrices
    (q_a 7.6 vs 8.7 us, kv 6.4 vs 7.8, gate+up 10.3 vs 11.0, down 9.6 vs 10.7), at 4 rows the matmul won on
    all but kv (gate+up 11.1 vs 12.0, down 10.7 vs 11.4, q_a 8.8 vs 9.0); the large ones as before.
    Nineteenth session, against the few-row matmul (`_few_row_matmul_tiles`) at 2 and 3 rows: the shared
    expert's matrices (8M weights) lost the matvec at 3 rows (gate+up 10.3 vs 9.3 us, down 11.0 vs 9.0) and kept
    it at 2 (8.4 vs 9.3, 7.9 vs 8.9); q_a and kv keep it at 3 (7.0 vs 7.7, 6.4 vs 6.8: the matmul's 16-row
    tile costs the same at 3 and 4 rows)."""
    if backend != "cuda":
        return 8
    return 3 if n * k < _Q8_0_SHARED_EXPERT else 2


# Q8_0 matrices with at least this many rows (the output head): the integer-dot matvec up to 3 rows, wider
# few-row matmul tiles.
_Q8_0_HEAD_ROWS = 65536


def q8_0_route(n: int, k: int, m: int, backend: Backend, quantised: bool = False) -> str:
    """Which kernel runs a Q8_0 [n, k] projection of m fp32 activation rows: "int_dot" (the activation quantised
    to 16 bits by act_quant.quantize_act16 in a launch of its own, or by the RMSNorm that produces it (the
    engine's q_a + kv, q_b and head), then the dp4a matvec, `q8_0_int_dot_tiles`),
    "matvec" (fp32 math, up to q8_0_matvec_rows) or "matmul" (split-K tl.dot, `matmul_tiles`).

    H200, eighteenth session (docs/PERFORMANCE.md: the dp4a matvec at one row per program and one warp, against
    the engine's routing, us with the quantiser's ~1.9 us launch added): at one row the large matrices won (q_b
    16.2 -> 14.2, output a 16.0 -> 12.9, output b 16.2 -> 13.2, head 193.6 -> 129.0), the small ones lost (q_a
    4.2 -> 5.2, kv 3.8 -> 5.2, shared expert 5.9 / 5.6 -> 6.5 / 6.6: the extra launch costs more than the matvec
    saves); at 2 rows all the large won (q_b 23.6 -> 17.0, head 306.6 -> 167.8). Nineteenth session: against
    the few-row matmul (`_few_row_matmul_tiles`), the head keeps it to 3 rows (194.7 against 200.0 us), the
    other large ones to 2 (at 3 rows: q_b 22.1 -> 17.5, output a 21.0 -> 18.4-19.4, output b 20.5 against
    20.0-20.7). CUDA only (dp4a inline assembly).
    `quantised`: the rows come quantised by their producer (its launch emits them: no quantiser launch), and the
    integer dot takes the small matrices too at 1-2 rows (the eighteenth session's sweep without the quantiser:
    q_a 4.2 -> 3.7 us, kv 3.8 -> 3.3, shared expert down 5.6 -> 4.7 at one row; 6.1 -> 5.0, 5.1 -> 4.5, 7.9 -> 6.0
    at two). H100, thirty-fourth session (docs/PERFORMANCE.md): at 3 quantised rows the integer dot beats the split-K
    matmul on the matrices of at most 16M weights (q_a + kv + compressors 2,624 x 4,096 12.6 -> 9.5 us, the
    shared expert's gate + up 15.1 -> 10.2 and down 8.8 -> 6.4), not on q_b (20.6 against 22.5); at 4 rows it
    no longer pays."""
    rows = 3 if n >= _Q8_0_HEAD_ROWS or (quantised and n * k <= _Q8_0_LARGE) else 2
    if use_int_dot(backend) and (n * k >= _Q8_0_LARGE or quantised) and m <= rows:
        return "int_dot"
    return "matvec" if m <= q8_0_matvec_rows(n, k, backend) else "matmul"


# The tensor-descriptor form of the integer-dot matvec (`tma` tiles) where it won: q_b's 32,768 rows of K =
# 1,024 at one activation row.
_Q8_0_TMA = MatvecTiles(block_n=64, block_k=512, num_warps=4, num_stages=3, tma=True, per_sm=1)


def q8_0_int_dot_tiles(n: int, k: int, m: int, tma: bool = False, rows_per_group: int | None = None) -> MatvecTiles:
    """Tiles of the integer-dot Q8_0 matvec where `q8_0_route` picks it: one warp per program, one or two rows,
    the whole K row up to 2,048 per step at one activation row (the head at every row count), 512 beyond (the
    best of 1 / 2 / 4 / 8 rows x 512 / 1,024 / 2,048 x 1 / 2 / 4 warps per shape, same run).

    `tma` (the GPU reads through tensor descriptors: `tma_reads`): the many short rows of q_b (N >= 16,384, K <=
    1,024) at one activation row take `_Q8_0_TMA`. H100, fortieth session (docs/PERFORMANCE.md,
    `docs/scripts/q8_0_tma.py bench`: 48 specs at the eight decode shapes, each against these tiles): q_b 21.5
    -> 15.0 us (1,661 -> 2,374 GB/s) at 64 rows x 512, 4 warps, 3 stages, one program per SM; the other shapes
    lost (q_a 3.4 -> 6.7 us, kv 2.7 -> 6.5, the shared expert's gate + up 5.0 -> 7.4, the head 177.9 -> 182.5)
    or moved by <= 5% (output a / b, shared down)."""
    if (tma and m == 1 and n >= 16384 and k <= 1024 and k % _Q8_0_TMA.block_k == 0
            and (rows_per_group is None or rows_per_group % _Q8_0_TMA.block_n == 0)):
        return _Q8_0_TMA
    head = n >= _Q8_0_HEAD_ROWS
    block_k = min(2048, _pow2_ceil(k)) if m == 1 or head else 512
    block_n = 2 if not head and (m == 2 or k <= 1024) else 1
    return MatvecTiles(block_n=block_n, block_k=block_k, num_warps=1)


# ---------------------------------------------------------------------------------------------------------
# Fused MoE decode (selected experts of 1..few tokens).


@dataclass(frozen=True)
class MoeTiles:
    gate_up: MatvecTiles  # IQ2_XXS-style gate+up rows [F, D]
    down: MatvecTiles  # Q2_K-style down rows [D, F]


# Warps of the integer-dot IQ2_XXS gate + up: >= 2, so that its tl.gather goes through shared memory.
_MOE_I8_WARPS = 2
# Expert types of the fused MoE's integer-dot kernels (both gate/up and down must be one of them).
MOE_INT_DOT_QTYPES = ("iq2_xxs", "q2_k", "q4_k")


def moe_tiles(gate_qtype: str, down_qtype: str, d_model: int, d_ff: int, n_slots: int, backend: Backend) -> MoeTiles:
    """Tiles for the two fused MoE launches; n_slots = tokens x experts per token (the gate+up grid).

    The integer-dot IQ2_XXS gate + up (CUDA) steps through K 2,048 weights at a time in two warps: its grid
    lookups gather from shared memory, which Triton uses only when the table spans more than one warp (one
    warp gathers by shuffles). H200, fifteenth session (docs/PERFORMANCE.md), 6 of 256 Flash experts per token,
    us at 1 / 4 / 8 tokens: 2 warps x 2,048 18.3 / 60.7 / 115.0; 4 x 4,096 19.4 / 66.3 / 129.1; 8 x 8,192
    37.9 / 143.7 / 283.2; 4 rows per program instead of 8 20.4 / 70.6 / 137.0. (The global-memory lookups it
    replaced were best at 1 warp x 1,024: 30.2 / 103.0 / 190.2.)"""
    # The gate+up grid is (slots, row blocks): count all slots' rows when sizing the row blocks.
    gu = _expert_tiles(gate_qtype, d_ff * n_slots, d_model, backend)
    down = _expert_tiles(down_qtype, d_model, d_ff, backend)
    if not (use_int_dot(backend) and gate_qtype in MOE_INT_DOT_QTYPES and down_qtype in MOE_INT_DOT_QTYPES):
        return MoeTiles(gate_up=gu, down=down)
    if gate_qtype == "iq2_xxs":
        gu = replace(gu, block_k=min(gu.block_k, 2048), num_warps=_MOE_I8_WARPS)
    elif gate_qtype == "q4_k":
        gu = _q4_k_i8_tiles(gu, d_model)
    if down_qtype == "q4_k":
        down = _q4_k_i8_tiles(down, d_ff)
    return MoeTiles(gate_up=gu, down=down)


def _q4_k_i8_tiles(t: MatvecTiles, k: int) -> MatvecTiles:
    """The integer-dot Q4_K expert kernel has one lane per 32-weight sub-block (the fp32 one, per 8): up to
    2,048 weights per step, one warp per 1,024 (not yet timed on a GPU)."""
    block_k = max(256, min(2048, _pow2_ceil(k)))
    return replace(t, block_k=block_k, num_warps=max(1, block_k // 1024))


def _expert_tiles(qtype: str, n: int, k: int, backend: Backend) -> MatvecTiles:
    """The fused MoE's tiles for one weight type: the matvec's for the lane-per-unit types; Q8_0 experts
    (one lane per int32 word of 4 weights in the MoE, unlike the dense Q8_0 matvec's 3-D tiles) the same
    way, at most 1,024 weights per step (not yet timed)."""
    if qtype != "q8_0" or backend == "cpu":
        return matvec_tiles(qtype, n, k, 1, backend)
    block_k = max(32, min(1024, _pow2_ceil(k)))
    lanes = 64 if backend == "hip64" else 32
    return MatvecTiles(block_n=min(8, max(1, _pow2_floor(n // _MIN_PROGRAMS))), block_k=block_k,
                       num_warps=max(1, min(8, block_k // 4 // lanes)))


# ---------------------------------------------------------------------------------------------------------
# Prefill matmul tiles (dequantise a weight tile, fp16 tl.dot, fp32 accumulate).


@dataclass(frozen=True)
class MatmulTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    w_as_a: bool = False  # compute Y^T = W X^T (dequantised weights as the register operand of the dot)
    # K slices (split-K, q8_0_matmul only): > 1 writes fp32 partials [split_k, M, N], summed in the same launch
    split_k: int = 1


_MATMUL_TILES: dict[Backend, MatmulTiles] = {
    # Hopper/Ampere: big tiles for the tensor cores, 3-stage software pipeline.
    "cuda": MatmulTiles(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    # gfx906: no matrix cores; the dot lowers to packed fp16 dots (v_dot2_f32_f16), 256 lanes per program.
    "hip64": MatmulTiles(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=1),
    # RDNA3 (WMMA), wave32.
    "hip32": MatmulTiles(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2),
    "cpu": MatmulTiles(block_m=16, block_n=16, block_k=32, group_m=4, num_warps=1, num_stages=1),
}

# The H200's SM count: the small-M split-K below aims at two programs per SM.
_CUDA_SMS = 132
# Most activation rows that take the small-M tiles (short prefills: a chat turn's ~22 tokens).
_SMALL_M = 64
# Most activation rows that take the few-row tiles (one 16-row tile of the dot's A operand: decode steps).
_FEW_ROWS = 16
# Fewest block_k steps per K slice (256 weights at block_k 128; shorter slices only add partials).
_SPLIT_MIN_STEPS = 2


def _small_m_matmul_tiles(m: int, n: int, k: int, block_n: int = 64, block_k: int = 128) -> MatmulTiles:
    """CUDA tiles for a Q8_0 matmul of m <= 64 rows (short prefills), which is bound by the weight read.

    With the large-M tiles (128 x 128, the whole K per program) the model's shapes got 8-32 programs on 132
    SMs at 22 rows (559 calls, 48 us each, ~6% of the memory bandwidth). Here the dequantised weight tile is
    the dot's A operand (w_as_a: Hopper's wgmma wants A's M = 64 per warpgroup, so 64 weight rows and 4
    warps), the activation rows are the dot's N (16..64), and K is split into slices of whole block_k steps
    until there are ~2 programs per SM (fp32 partials, summed in a fixed order: bit-stable results).
    H200, the model's seven Q8_0 shapes in CUDA graphs over rotating weight copies (43 layers, grouped output
    a as 8 calls): 28.1 ms at 22 rows with the large-M tiles, 8.7 ms with these (8.2-9.6 ms at 9-64 rows);
    2 stages beat 3 (q_b at 64 rows 23 against 32 us), 256-wide slices beat >= 384 by ~4%, and 3-4 programs
    per SM differed from 2 by < 4% (better at 22 rows, worse at 64)."""
    block_m = min(_SMALL_M, max(16, _pow2_ceil(m)))
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    steps = _cdiv(k, block_k)
    split = 1
    if tiles < 2 * _CUDA_SMS:
        per = max(_SPLIT_MIN_STEPS, _cdiv(steps, _cdiv(2 * _CUDA_SMS, tiles)))  # block_k steps per slice
        split = _cdiv(steps, per)  # no empty slice: the kernel slices K into cdiv(steps, split) steps each
    return MatmulTiles(block_m=block_m, block_n=block_n, block_k=block_k, group_m=1, num_warps=4, num_stages=2,
                       w_as_a=True, split_k=split)


def _few_row_matmul_tiles(n: int, k: int) -> MatmulTiles:
    """CUDA tiles for a Q8_0 matmul of m <= 16 rows (the batched and verification decode steps): the activation
    rows are the dot's A operand (one 16-row tile), the dequantised weight tile its B, split-K to ~2 programs
    per SM as in `_small_m_matmul_tiles`. H200 sweep, nineteenth session (docs/PERFORMANCE.md: block_n 64 / 128
    x block_k 128 / 256 x 4 / 8 warps x 2 / 3 / 4 stages x either operand order at 4 rows, then the weights as B
    only with block_n 32-256 and block_k up to 512 at 2, 3 and 8 rows): the weights as B won on every shape,
    us at 4 rows against the w_as_a tiles: q_b 22.2 -> 17.5, output a 25.0 -> 18.4, output b 28.6 -> 20.0,
    head 254.1 (integer dot) / 291.3 at 8 rows -> 200.4, the shared expert 11.2 / 10.8 -> 9.3 / 8.9; the whole
    step's Q8_0 at 4 rows 5.14 -> 4.01 ms. 64 weight rows (128 on the head), 256-wide K steps in 2 stages where
    K >= 4,096, else 128-wide in 3."""
    head = n >= _Q8_0_HEAD_ROWS
    block_n, block_k = (128 if head else 64), (256 if k >= 4096 else 128)
    stages = 3 if head or block_k == 128 else 2
    return replace(_small_m_matmul_tiles(16, n, k, block_n, block_k), num_stages=stages, w_as_a=False)


def matmul_tiles(qtype: str, m: int, n: int, k: int, backend: Backend,
                 rows_per_group: int | None = None) -> MatmulTiles:
    """Tiles for Y[m, n] = X[m, k] @ W[n, k]^T with W in `qtype` (block_k a multiple of the quant block).

    Q8_0 on CUDA with m <= 16 rows takes the few-row tiles (`_few_row_matmul_tiles`), up to 64 the small-M
    split-K tiles (`_small_m_matmul_tiles`); the other backends, quant types (q4_k_matmul has no split-K) and
    larger m keep one tile table per backend."""
    if backend == "cuda" and qtype == "q8_0" and m <= _FEW_ROWS:
        tiles = _few_row_matmul_tiles(n, k)
    elif backend == "cuda" and qtype == "q8_0" and m <= _SMALL_M:
        tiles = _small_m_matmul_tiles(m, n, k)
    else:
        base = _MATMUL_TILES[backend]
        block_m = min(base.block_m, max(16, _pow2_ceil(m)))
        block_k = max(base.block_k, _QUANT_BLOCK.get(qtype, 32)) if qtype not in ("q8_0", "q4_k") else base.block_k
        tiles = MatmulTiles(block_m=block_m, block_n=base.block_n, block_k=block_k, group_m=base.group_m,
                            num_warps=base.num_warps, num_stages=base.num_stages, w_as_a=base.w_as_a)
    # A grouped projection in one launch: a program's rows must lie in one group (16 is tl.dot's least).
    block_n = tiles.block_n
    while rows_per_group is not None and block_n > 16 and rows_per_group % block_n:
        block_n //= 2
    return tiles if block_n == tiles.block_n else replace(tiles, block_n=block_n)


_MOE_PREFILL_TILES: dict[Backend, MatmulTiles] = {
    # Token tiles are short (a 2K-token prompt sends ~48 rows to each of 256 experts) and the 2-bit
    # dequantisation is element-wise work, so the tiles are smaller than the dense prefill matmul's.
    # H200 sweep of 2026-11-29 (the per-unit tile decode): 64x64x64 with 4 warps and 1 stage was the fastest of
    # 24 (block_m 32/64/128, block_n 64/128, 4/8 warps, 1/2 stages): 16.8 ms per 2,048-token layer. Since the
    # decodes got cheaper, 128 output columns per program are faster (docs/PERFORMANCE.md, twenty-eighth
    # session, `docs/scripts/moe_prefill_tiles.py`): H200 8.16 -> 7.34 ms at 2,048 tokens, 28.0 -> 24.4 at 8,192.
    "cuda": MatmulTiles(block_m=64, block_n=128, block_k=64, group_m=1, num_warps=4, num_stages=1),
    "hip64": MatmulTiles(block_m=32, block_n=64, block_k=32, group_m=1, num_warps=4, num_stages=1),
    "hip32": MatmulTiles(block_m=32, block_n=64, block_k=32, group_m=1, num_warps=4, num_stages=1),
    "cpu": MatmulTiles(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=1, num_stages=1),
}


def moe_prefill_tiles(n_rows: int, backend: Backend) -> MatmulTiles:
    """Tiles for moe_prefill over n_rows (token, expert) pairs; block_k is a multiple of 32 (IQ2_XXS groups)."""
    base = _MOE_PREFILL_TILES[backend]
    return MatmulTiles(block_m=min(base.block_m, max(16, _pow2_ceil(n_rows))), block_n=base.block_n,
                       block_k=base.block_k, group_m=1, num_warps=base.num_warps, num_stages=base.num_stages)


# ---------------------------------------------------------------------------------------------------------
# Small fused ops.


@dataclass(frozen=True)
class RowTiles:
    block: int
    num_warps: int


def row_tiles(width: int, backend: Backend) -> RowTiles:
    """One program per row for RMSNorm-like ops over a row of `width` elements."""
    block = _pow2_ceil(width)
    per_warp = 64 if backend == "hip64" else 32
    num_warps = max(1, min(8, block // (per_warp * 8)))
    return RowTiles(block=block, num_warps=num_warps)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def attention_prefill_tiles(h: int, d: int, backend: Backend, shared: int | None = None) -> AttentionTiles:
    """Tiles for prefill attention (one program per query and block of output dims, all heads, an online
    softmax over key blocks; block_dv > 0 always: the tl.dot form).

    CUDA: fp16 tensor-core dots (fp32 accumulation). Where a program may use >= 160 KB of shared memory
    (`shared`, the GPU's opt-in limit: sm_80, sm_90; None = unknown, taken as such) one program per query
    holds the query's whole [heads, d] tile for the key loop and all d output dims, 32 keys per step; with
    less (sm_86 / sm_89 / sm_120: 99 KB) the query is re-read in 128-wide head-dim steps, 64 keys per step and
    two programs per query (each recomputes the scores). H100, thirtieth session (docs/PERFORMANCE.md,
    `docs/scripts/attention_prefill_tiles.py --sweep`), ms per ratio-4 layer (2,048 queries x 128 + 512 rows)
    at an 8K prompt's last chunk: 32 keys x whole d x 512 out 4.73, 64 x 128-wide steps x 256 out 5.19,
    32 x whole x 256 6.48, 64 x whole x 512 10.89, 64 x whole x 256 21.69 (255 registers), 16 warps 23.61;
    the TF32 tiles before 12.25. AMD keeps exact fp32 dots (no TF32; gfx906 lowers them to FMAs) in 32-wide
    head-dim steps, the query re-read at each (its register budget)."""
    hp = max(16, _pow2_ceil(max(1, h)))
    dp = _pow2_ceil(max(1, d))
    if backend == "cpu":
        return AttentionTiles(block_h=hp, block_n=64, block_d=min(128, max(16, dp)), num_warps=1, block_s=1,
                              block_dc=1, num_warps_c=1, block_dv=min(256, max(16, dp)))
    if backend == "cuda":
        if shared is None or shared >= 160 * 1024:
            return AttentionTiles(block_h=hp, block_n=32, block_d=max(16, dp), num_warps=8, block_s=1, block_dc=1,
                                  num_warps_c=1, block_dv=max(16, dp), precision="fp16")
        return AttentionTiles(block_h=hp, block_n=64, block_d=min(128, max(16, dp)), num_warps=8, block_s=1,
                              block_dc=1, num_warps_c=1, block_dv=min(256, max(16, dp)), precision="fp16")
    lanes = 64 if backend == "hip64" else 32
    block_n, block_dv = 16 if backend == "hip64" else 32, min(64, max(16, dp))
    # The [heads, block_dv] accumulator at 16 fp32 per lane, leaving registers for the q / key / value tiles
    # of AMD's FMA-lowered dots, and 32-wide head-dim steps.
    num_warps = max(1, min(8, hp * block_dv // (lanes * 16)))
    return AttentionTiles(block_h=hp, block_n=block_n, block_d=min(32, max(16, dp)), num_warps=num_warps,
                          block_s=1, block_dc=1, num_warps_c=1, block_dv=block_dv, precision="ieee")


@dataclass(frozen=True)
class CompressorTiles:
    block_j: int  # frontier entries per step of the pooling loop (online softmax over the block's entries)
    num_warps: int


def compressor_tiles(width: int, entries: int, backend: Backend) -> CompressorTiles:
    """One program per closing block, the whole pooled row (width = head or index dim) in registers, so
    the norm, RoPE and round trip that follow the pooling run in the same program. A step of the pooling
    loads [block_j, width] kv and score values: ~32 fp32 values of each per lane whatever the warp size."""
    block = _pow2_ceil(width)
    if backend == "cpu":
        return CompressorTiles(block_j=min(64, _pow2_ceil(entries)), num_warps=1)
    lanes = 64 if backend == "hip64" else 32
    num_warps = max(1, min(8, block // (lanes * 4)))
    block_j = max(1, min(_pow2_ceil(entries), lanes * num_warps * 32 // block))
    return CompressorTiles(block_j=block_j, num_warps=num_warps)


@dataclass(frozen=True)
class HcTiles:
    block_k: int  # K elements of flatten(X) per step of the partial matvec
    chunk_k: int  # K elements per partial program (a multiple of block_k); nblk = cdiv(K, chunk_k)
    block_d: int  # dim elements per hc_post program
    num_warps: int  # partial matvec
    num_warps_d: int  # hc_post
    block_dm: int = 0  # dim elements per hc_post program that also computes the next mix partials (K chunks)
    num_warps_m: int = 1  # that hc_post
    num_warps_n: int = 1  # the finalize (with the RMSNorm after it): one program per token over the whole row


def hc_tiles(k: int, m: int, dim: int, t: int, backend: Backend) -> HcTiles:
    """Tiles for hc_pre / hc_head_pre / hc_post over T = t tokens, K = C * dim, M mix rows.

    The mix matvec reads only M x K weights (1.5 MiB fp32 for DS4), so at decode the whole cost is launch
    latency plus spreading that read over enough programs: ~64 K chunks per token at T = 1, fewer as T grows
    (one chunk per token from T >= 256, where the T programs already fill the GPU and the partials stay
    small). The interpreter runs programs one after another, so there the tiles are few and wide.
    """
    block_m = _pow2_ceil(m + 1)
    if backend == "cpu":
        block_k = min(4096, _pow2_ceil(k))
        block_d = min(4096, _pow2_ceil(dim))
        return HcTiles(block_k=block_k, chunk_k=block_k * _cdiv(k, block_k), block_d=block_d, num_warps=1,
                       num_warps_d=1, block_dm=block_d, num_warps_m=1, num_warps_n=1)
    lanes = 64 if backend == "hip64" else 32
    block_k = min(256, _pow2_ceil(k))
    steps = _cdiv(k, block_k)
    nblk = max(1, min(steps, _pow2_ceil(_cdiv(256, max(1, t)))))
    chunk_k = block_k * _cdiv(steps, nblk)
    block_d = min(256, _pow2_ceil(dim))
    # ~64 fp32 values of a [block_m, block_k] / [C, block_d] tile per lane, whatever the warp size.
    num_warps = max(1, min(8, block_m * block_k // (lanes * 64)))
    num_warps_d = max(1, min(8, 4 * block_d // (lanes * 16)))
    # hc_post with the next mix partials: ~256 K chunks per step like the partial kernel's (64-wide at one or
    # two tokens: 64 programs per token for DS4's dim), each [block_m, block_dm] fn tile at ~32 fp32 per lane
    block_dm = min(block_d, max(64, _pow2_floor(max(64, k * t // 256))))
    num_warps_m = max(1, min(8, block_m * block_dm // (lanes * 32)))
    # the finalize: the [C, dim] streams of one token at ~128 fp32 per lane (4 warps for DS4). H100,
    # one token, us per launch with / without the Sinkhorn's 19 last rounds (this session's docs/PERFORMANCE.md):
    # 2 warps 4.90 / 4.74, 4 warps 4.78 / 3.46, 8 warps 5.25 / 3.36 (its 4x4 reductions cross more warps)
    num_warps_n = max(1, min(16, _pow2_ceil(k) // (lanes * 128)))
    return HcTiles(block_k=block_k, chunk_k=chunk_k, block_d=block_d, num_warps=num_warps, num_warps_d=num_warps_d,
                   block_dm=block_dm, num_warps_m=num_warps_m, num_warps_n=num_warps_n)


@dataclass(frozen=True)
class RouterTiles:
    block_e: int  # the padded expert row, all in registers
    num_warps: int


def router_tiles(n_experts: int, backend: Backend) -> RouterTiles:
    """One program per token over the whole expert row. Each of the k selection rounds is a max and an
    argmax across the row, so cross-warp reductions cost more than the few values per lane: ~8 values per
    lane, at most 4 warps (E = 256 is one warp on every backend: 8 lanes' worth on wave32, 4 on wave64)."""
    block_e = max(2, _pow2_ceil(n_experts))
    if backend == "cpu":
        return RouterTiles(block_e=block_e, num_warps=1)
    lanes = 64 if backend == "hip64" else 32
    return RouterTiles(block_e=block_e, num_warps=max(1, min(4, block_e // (lanes * 8))))


@dataclass(frozen=True)
class AttentionTiles:
    block_h: int  # heads per split program (they share every key load: MQA)
    block_n: int  # keys per split program (one split = one key block)
    block_d: int  # head-dim elements per step of the split program's two passes
    num_warps: int
    block_s: int  # partials per step of the combine
    block_dc: int  # head-dim elements per combine program
    num_warps_c: int
    block_dv: int = 0  # > 0: the tl.dot split kernel (all heads per program, this many output dims each)
    precision: str = "ieee"  # tl.dot input precision of that kernel ("tf32" on NVIDIA tensor cores; "fp16": the
    # operands rounded to fp16)


def attention_tiles(h: int, d: int, n_keys: int, backend: Backend) -> AttentionTiles:
    """Tiles for decode attention of h heads of dim d over n_keys keys (window + compressed).

    A split program's working tile is [block_h, block_n, block_d]; it is kept at ~64 fp32 values per lane
    whatever the warp size. Short key lists (DS4: 128 window + up to 512 indexed rows) use 16-key splits,
    ~40 x 4 programs; longer lists (the ratio-128 layers at long context) widen the key block so the
    partials stay at ~64 splits x H x D (they are written and read once: at most a few MB)."""
    hp = _pow2_ceil(max(1, h))
    dp = _pow2_ceil(max(1, d))
    if backend == "cpu":  # the interpreter runs programs one after another: few, wide ones
        return AttentionTiles(block_h=min(64, hp), block_n=min(64, _pow2_ceil(max(1, n_keys))),
                              block_d=min(128, dp), num_warps=1, block_s=64, block_dc=min(512, dp), num_warps_c=1)
    if backend == "cuda":
        # Tensor cores: every program takes all heads (one key load serves them all), 32 keys (64 beyond 1,024
        # keys), the logits over the whole head dim by 64-wide tl.dot steps, and 128 output dims; TF32
        # operands with fp32 accumulation (finer than the bf16 of common flash-decoding kernels).
        block_n = 32 if n_keys <= 1024 else 64
        return AttentionTiles(block_h=max(16, hp), block_n=block_n, block_d=min(64, max(16, dp)), num_warps=4 if
                              block_n == 32 else 8, block_s=32, block_dc=min(128, dp), num_warps_c=4,
                              block_dv=min(128, max(16, dp)), precision="tf32")
    lanes = 64 if backend == "hip64" else 32
    block_h = min(16, hp)
    block_n = 16 if n_keys <= 1024 else min(128, _pow2_ceil(_cdiv(n_keys, 64)))
    budget = 8 * 32 * 64  # fp32 values of the split tile: 8 wave32 warps (4 wave64) at 64 per lane
    block_d = max(8, min(dp, budget // (block_h * block_n)))
    num_warps = max(1, min(8, block_h * block_n * block_d // (lanes * 64)))
    block_s, block_dc = 32, min(128, dp)
    num_warps_c = max(1, min(8, block_s * block_dc // (lanes * 32)))
    return AttentionTiles(block_h=block_h, block_n=block_n, block_d=block_d, num_warps=num_warps,
                          block_s=block_s, block_dc=block_dc, num_warps_c=num_warps_c)


# ---------------------------------------------------------------------------------------------------------
# F16 decode matvec (fp16 weights [N, K], 1-8 fp32/fp16 activation rows, fp32 math; kernels/f16.py).


@dataclass(frozen=True)
class F16Tiles:
    block_n: int  # output rows per program
    block_k: int  # K elements per loop step
    num_warps: int
    num_stages: int = 1


_F16_STEP_ELEMS = 8192  # weights per program per step (16 KB of fp16) where the row allows
_F16_PER_LANE = 32  # fp16 weights per lane per step: 64 bytes, four 16-byte vector loads


def f16_route(n: int, k: int, m: int, backend: Backend) -> str:
    """Which kernel runs an F16 [n, k] projection of m activation rows: "matvec" (fp32 FMAs, `f16_matvec_tiles`)
    or "matmul" (fp16 tensor-core dots on a two-part split of x, `f16_matmul_tiles`). The matvec's cost grows
    with the rows (a sum across lanes per row and step), the matmul's does not (one 16-row tile).
    H200, nineteenth session (docs/PERFORMANCE.md: both kernels over rotating weight copies in CUDA graphs, the
    matmul at its best tiles), us at 1 / 2 / 4 / 8 rows, matvec against matmul: stacked compressor + indexer
    2624 x 4096 7.6 / 10.5 / 23.7 / 40.3 against 10.7 / 11.0 / 11.0 / 11.1; indexer q_b 8192 x 1024 7.2 / 9.1 /
    14.6 / 23.0 against 8.8 / 9.1 / 9.2 / 9.2; compressor 1024 x 4096 4.4 / 6.3 / 8.9 / 14.2 against 7.8 / 8.0
    / 8.0 / 8.0; router 256 x 4096 2.7 / 3.5 / 4.9 / 7.8 against 5.9 / 5.9 / 5.9 / 6.0; indexer proj 64 x 4096
    2.3 / 2.8 / 3.9 / 6.1 against 5.3 / 5.5 / 5.4 / 5.5. So the matvec keeps 2 rows of the matrices of >= 8M
    weights, 3 of those of >= 2M (3 rows not measured: between its 2- and 4-row times, below the matmul's),
    4 of the smaller; on CUDA only (elsewhere the matvec, not measured)."""
    if backend != "cuda" or m > _FEW_ROWS:
        return "matvec"
    keep = 2 if n * k >= 8 << 20 else 3 if n * k >= 2 << 20 else 4
    return "matvec" if m <= keep else "matmul"


def f16_matmul_tiles(n: int, k: int, m: int) -> MatmulTiles:
    """Tiles of the few-row F16 matmul where `f16_route` picks it (CUDA): one 16-row activation tile, 64 weight
    rows per program where n >= 2,048 (else 32), 128-wide K steps in 3 stages, K split to ~2 programs per SM.
    The same sweep (block_n 16-128 x block_k 64-256 x 2-4 stages): 2624 x 4096 best at 64 x 128 (11.0 us; the
    Q8_0 few-row tiles' 64 x 256 in 2 stages 13.4), 8192 x 1024 at 64 x 64-128 (9.2-9.3), 1024 x 4096 and the
    router at 32 x 128 (8.0, 5.9; 64 x 256: 10.0, 7.9)."""
    return replace(_small_m_matmul_tiles(max(16, m), n, k, 64 if n >= 2048 else 32, 128), num_stages=3,
                   w_as_a=False)


def f16_matvec_tiles(n: int, k: int, m: int, backend: Backend) -> F16Tiles:
    """Tiles for y[m, n] = x[m, :] . W[n, :] with W fp16 [n, k] (bandwidth-bound, not yet timed).

    Up to 8 rows per program while >= 256 programs remain (DS4: 2624 x 4096 -> 8 rows, 328 programs;
    8192 x 1024 -> 8 rows, 1024 programs; 1024 x 4096 -> 4 rows, 256; 256 / 64 x 4096 -> 1 row, 256 / 64);
    a step covers ~8192 weights (the whole row when K allows) and num_warps keeps ~32 fp16 (64 bytes) per
    lane whatever the warp size. The interpreter runs programs one after another: few, wide ones.
    """
    kp = _pow2_ceil(max(1, k))
    if backend == "cpu":
        return F16Tiles(block_n=min(64, _pow2_ceil(max(1, n))), block_k=max(16, min(1024, kp)), num_warps=1)
    lanes = 64 if backend == "hip64" else 32
    block_n = min(8, max(1, _pow2_floor(n // _MIN_PROGRAMS)))
    block_k = max(16, min(kp, 4096, _F16_STEP_ELEMS // block_n))
    num_warps = max(1, min(8, block_n * block_k // (lanes * _F16_PER_LANE)))
    return F16Tiles(block_n=block_n, block_k=block_k, num_warps=num_warps)


@dataclass(frozen=True)
class IndexerTiles:
    block_t: int  # queries per program; 1 = one query per program with its heads as the rows of the dot
    block_h: int  # heads per dot step when block_t == 1 (padded heads are masked to zero)
    block_n: int  # index keys (compressed blocks) per program
    block_d: int  # the whole key row, padded to a power of two >= 16 (a tl.dot needs >= 16 per dim)
    dot: bool  # block_t == 1: tl.dot [block_h, block_d] x [block_d, block_n] (True) or per-head fp32 FMA sums
    num_warps: int
    num_stages: int = 1


def indexer_tiles(t: int, n_keys: int, heads: int, dim: int, backend: Backend) -> IndexerTiles:
    """Tiles for the lightning indexer's scores of t queries x n_keys compressed blocks (heads x dim each).

    Few queries (decode, t < 16): one query per program, its heads as the M rows of a tl.dot against the
    block's keys; DS4 (64 heads x 128) decodes over 1024..8192 blocks (262,144 at 1M context), and 16..64
    keys per program keep >= 64 programs at 1024 blocks and 128+ from 4096 on (132 SMs).
    Prefill (t >= 16): a [block_t, block_n] score tile per program that keeps its keys and loops over the
    heads, one [block_t, dim] x [dim, block_n] dot per head.
    From the ahead-of-time compiles (dim 128, fp16 dot operands): sm_90 decode 64 heads x 64 keys at 4 warps
    ~120 registers, prefill 64 x 128 at 8 warps 138, no spills; gfx906 (no matrix cores: the dot keeps its
    operands in registers) spills above 16 x 16 (decode) / 16 x 32 (prefill) at 4 warps; gfx1100 holds
    32 heads x 64 keys at 4 warps and a 32 x 64 prefill tile at 8 warps. Not yet timed on a GPU."""
    block_d = max(16, _pow2_ceil(dim))
    hp = max(16, _pow2_ceil(heads))
    if backend == "cpu":  # the interpreter runs programs one after another: few, wide ones
        block_n = max(16, min(128, _pow2_ceil(n_keys)))
        if t < 16:
            return IndexerTiles(block_t=1, block_h=min(64, hp), block_n=block_n, block_d=block_d, dot=True,
                                num_warps=1)
        return IndexerTiles(block_t=min(64, _pow2_ceil(t)), block_h=1, block_n=block_n, block_d=block_d, dot=True,
                            num_warps=1)
    if t < 16:
        max_h, max_n = {"cuda": (64, 64), "hip32": (32, 64), "hip64": (16, 16)}[backend]
        block_n = max(16, min(max_n, _pow2_floor(n_keys // 128)))
        return IndexerTiles(block_t=1, block_h=min(max_h, hp), block_n=block_n, block_d=block_d, dot=True,
                            num_warps=4)
    block_t, block_n, num_warps, num_stages = {"cuda": (64, 128, 8, 2), "hip32": (32, 64, 8, 1),
                                               "hip64": (16, 32, 4, 1)}[backend]
    return IndexerTiles(block_t=min(block_t, max(16, _pow2_ceil(t))), block_h=1, block_n=block_n, block_d=block_d,
                        dot=True, num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------------------------
# The indexer's top-k selection in one program per query (keys held in registers).


@dataclass(frozen=True)
class SelectTiles:
    block: int  # keys per program (a power of two >= n)
    num_warps: int


# Keys per query above which the selection falls back to torch.topk over column blocks: 32 keys per lane at
# 8 warps on CUDA (177 registers on sm_90, no spills); AMD spills at 8,192 (gfx906 192 B, gfx1100 372 B),
# so half as many there.
_SELECT_MAX = {"cuda": 8192, "hip64": 4096, "hip32": 4096, "cpu": 8192}


def select_max(backend: Backend) -> int:
    """The most keys per query `select_tiles` takes on this backend."""
    return _SELECT_MAX[backend]


def select_tiles(n_keys: int, backend: Backend) -> SelectTiles | None:
    """One program per query holding all n_keys int64 sort keys (16-32 per lane: each of the 63 counting
    rounds is a block-wide sum, so fewer, fuller lanes beat many warps); None above select_max(backend)."""
    if n_keys > _SELECT_MAX[backend]:
        return None
    block = max(16, _pow2_ceil(n_keys))
    if backend == "cpu":
        return SelectTiles(block=block, num_warps=1)
    lanes = 64 if backend == "hip64" else 32
    return SelectTiles(block=block, num_warps=max(1, min(8, block // (16 * lanes))))


@dataclass(frozen=True)
class SelectPlan:
    """How `indexer.index_topk_triton` picks k of n keys per query: `chunks` programs of `chunk` keys per query
    keep their k largest (tiles `first`; skipped when chunks == 1); with a middle stage (`mid`), `mid_chunks`
    programs of `mid_chunk` of those candidates keep their k largest again; then one program per query over
    what is left (tiles `last`)."""
    chunk: int
    chunks: int
    first: SelectTiles
    last: SelectTiles
    mid_chunk: int = 0
    mid_chunks: int = 0
    mid: SelectTiles | None = None


# Query rows up to which a selection too wide for two stages takes a middle stage (decode and verification
# steps: 256 KiB of first-stage candidates per row at 1M tokens of context); a prefill piece of more rows
# keeps torch.topk over column blocks there (model/footprint.py INDEXER_MID_ROWS counts the same).
SELECT_MID_ROWS = 64


def select_plan(n_keys: int, k: int, backend: Backend, rows: int = 1) -> SelectPlan | None:
    """One, two or three register-resident selection stages for k of n_keys per row, or None (torch.topk
    over column blocks) when the k-per-chunk candidates would not fit one program after a middle stage, or
    need one for more than SELECT_MID_ROWS rows. Chunks are half a program's capacity when the candidates
    still fit: more, shorter programs per query (H200, 2026-11-29, scores + selection of 512: 8,220 keys
    35.3 us in chunks of 8,192, 28.0 us in chunks of 4,096; 16,384 keys 34.8 / 28.7 us; torch.topk 78 / 98
    us). Three stages start past 16 x select_max keys (decode past 512K tokens of context on CUDA)."""
    top = _SELECT_MAX[backend]
    if n_keys <= top:
        t = select_tiles(n_keys, backend)
        assert t is not None
        return SelectPlan(chunk=n_keys, chunks=1, first=t, last=t)
    if k > top // 2:
        return None
    sizes = (top // 2, top)
    for chunk in sizes:
        chunks = -(-n_keys // chunk)
        last = select_tiles(chunks * k, backend)
        if last is not None:
            first = select_tiles(chunk, backend)
            assert first is not None
            return SelectPlan(chunk=chunk, chunks=chunks, first=first, last=last)
    if rows > SELECT_MID_ROWS:
        return None
    for chunk in sizes:
        chunks = -(-n_keys // chunk)
        for mid_chunk in sizes:
            mid_chunks = -(-chunks * k // mid_chunk)
            last = select_tiles(mid_chunks * k, backend)
            if last is not None:
                first, mid = select_tiles(chunk, backend), select_tiles(mid_chunk, backend)
                assert first is not None and mid is not None
                return SelectPlan(chunk=chunk, chunks=chunks, first=first, last=last, mid_chunk=mid_chunk,
                                  mid_chunks=mid_chunks, mid=mid)
    return None
    for chunk in (top // 2, top):
        chunks = -(-n_keys // chunk)
        last = select_tiles(chunks * k, backend)
        if last is not None:
            first = select_tiles(chunk, backend)
            assert first is not None
            return SelectPlan(chunk=chunk, chunks=chunks, first=first, last=last)
    return None
