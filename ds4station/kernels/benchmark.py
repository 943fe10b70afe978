"""Kernel benchmarks at DeepSeek-V4-Flash's real decode and prefill shapes (GPU only).

Measured in one run, so the numbers compare like with like (shared/BENCHMARKS.md's rules):
- ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 torch matmul;
- decode matvecs (Q8_0 projections at 1-N fp32 rows as the engine routes them, ops.linear: as
  dispatch.q8_0_route picks, the integer-dot or fp32 matvec or the split-K matmul; one IQ2_XXS / Q2_K expert)
  and the fused 6-expert MoE: each launch replayed in a CUDA graph over rotating weight copies (>= 4x the L2
  in total, so weights come from HBM),
  time per launch, GB/s over the weight + activation bytes, and % of the copy bandwidth; the same shape as a
  torch fp16 matvec on dequantised weights beside it;
- the integer-dot Q8_0 matvec on a pre-quantised activation, and the activation quantiser's own launch
  (CUDA only);
- the F16 decode projections (kernels/f16.py: compressor / indexer / router, at each of the rows as the
  engine routes them: the fp32 matvec or the few-row tensor-core matmul) against torch's fp16 x.half() @ w.T
  on the same rotating weights;
- prefill: the Q8_0 tl.dot matmul at 2048 tokens against a torch bf16 matmul of the same shape (TFLOP/s),
  and the routed experts of a 2048-token chunk (moe_prefill) against the bf16 8192^3 rate;
- Q4_K decode matvec and prefill matmul (`--only q4_k`);
- the layer's small kernels (`--only layer`): row finishing, compressor update, indexer top-k and attention,
  decode (in a CUDA graph) and prefill.
Every case is also checked against its torch reference (relative error printed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

ROTATE_BYTES = 512 << 20  # rotating weight copies per case: >= 4x the H200's 60 MB L2 (and MI50's 4 MB)
MAX_COPIES = 64
GRAPH_LAUNCHES = 32  # launches captured per graph; time per launch = replay time / launches


@dataclass
class Result:
    kernel: str
    shape: str
    rows: int
    time_us: float
    gbps: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None
    pct_bf16: float | None = None
    baseline: str = ""
    baseline_time_us: float | None = None
    baseline_pct: float | None = None
    rel_err: float | None = None


# name, N (output rows), K, groups (DS4-MODEL.md: the Q8_0 projections of one layer, and the head)
Q8_0_DECODE = [
    ("attn_q_a", 1024, 4096, 1),
    ("attn_q_b", 32768, 1024, 1),
    ("attn_kv", 512, 4096, 1),
    ("attn_output_a", 8192, 4096, 8),
    ("attn_output_b", 4096, 8192, 1),
    ("shexp_gate_up", 2048, 4096, 1),
    ("shexp_down", 4096, 2048, 1),
    ("output_head", 129280, 4096, 1),
]
Q8_0_PREFILL = [
    ("attn_q_a", 1024, 4096),
    ("attn_q_b", 32768, 1024),
    ("attn_output_b", 4096, 8192),
    ("shexp_gate_up", 2048, 4096),
    ("shexp_down", 4096, 2048),
]


def _median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _graph_time_us(launch: Callable[[int], object], copies: int) -> float:
    """Per-launch time of `launch(i)` for i cycling over copies, captured as one CUDA graph and replayed."""
    n = max(GRAPH_LAUNCHES, copies)
    for i in range(min(copies, 3)):  # compile / warm outside the capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            launch(i % copies)
    return _median_ms(graph.replay) * 1e3 / n


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got - want).norm() / want.norm()).item()


def _copies(nbytes: int) -> int:
    return max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / nbytes)))


def ceilings(device: torch.device) -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s on random 8192^3) measured now."""
    src = torch.randn(1 << 28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    t = _median_ms(lambda src=src, dst=dst: dst.copy_(src))
    copy_gbps = 2 * src.numel() * 4 / t / 1e6
    src = dst = None  # free the 2 GiB before the matmul operands
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = _median_ms(lambda: a @ b)
    return copy_gbps, 2 * 8192**3 / t / 1e9


def _random_raw(qtype, lead: tuple[int, ...], k: int, gen: torch.Generator, scale: float) -> torch.Tensor:
    from ds4station.kernels.quants import random_blocks, row_bytes

    return random_blocks(qtype, math.prod(lead) * k, gen, scale).view(*lead, row_bytes(qtype, k))


def bench_q8_0_decode(device: torch.device, rows: list[int], copy_gbps: float, only: str = "") -> list[Result]:
    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels import dispatch
    from ds4station.kernels.q8_0 import PackedQ8_0, dequantize_q8_0, repack_q8_0

    gen = torch.Generator(device=device).manual_seed(0)
    out: list[Result] = []
    for name, n, k, groups in Q8_0_DECODE:
        if only and only not in name:
            continue
        wbytes = n * k + n * k // 32 * 2
        copies = _copies(wbytes)
        packed = repack_q8_0(_random_raw(Q.Q8_0, (copies, n), k, gen, 0.02), k)
        ws = [PackedQ8_0(packed.qs[i], packed.d[i]) for i in range(copies)]
        # torch fp16 baseline on the dequantised weights, rotated the same way (fewer copies if huge)
        fp16_copies = max(2, min(copies, math.ceil(ROTATE_BYTES / (2 * n * k))))
        w16 = [dequantize_q8_0(ws[i]).half() for i in range(fp16_copies)]
        for m in rows:
            out.append(_q8_0_decode_case(name, n, k, groups, m, ws, w16, copy_gbps))
        if dispatch.use_int_dot(dispatch.launch_backend(ws[0].qs)):
            out.append(_q8_0_int_dot_case(name, n, k, groups, ws, copy_gbps))
        del packed, ws, w16
    return out


def _q8_0_decode_case(name: str, n: int, k: int, groups: int, m: int, ws: list, w16: list[torch.Tensor],
                      copy_gbps: float) -> Result:
    from ds4station.kernels import dispatch, ops
    from ds4station.kernels.q8_0 import q8_0_matvec_ref

    device = w16[0].device
    # fp32 activations and the engine's routing (ops.linear, dispatch.q8_0_route: the matvecs up to a few rows,
    # the split-K matmul beyond), as a decode, verification or batched step runs the projection
    x = torch.randn(m, groups * k, device=device, dtype=torch.float32)
    err = _rel_err(ops.linear(x, ws[0], groups=groups, out_dtype=torch.float32),
                   q8_0_matvec_ref(x, ws[0], groups=groups, out_dtype=torch.float32))
    t = _graph_time_us(lambda i: ops.linear(x, ws[i], groups=groups, out_dtype=torch.float32), len(ws))
    nbytes = n * k + n * k // 32 * 2 + x.numel() * 4 + m * n * 4
    xg = x.half().view(m, groups, k).transpose(0, 1)  # [G, M, K]
    tb = _graph_time_us(lambda i: torch.bmm(xg, w16[i].view(groups, n // groups, k).transpose(1, 2)), len(w16))
    gbps = nbytes / t / 1e3
    shape = f"{name} {n}x{k}" + (f" ({groups} groups)" if groups > 1 else "")
    kernel = {"int_dot": "q8_0_matvec int8 dot + quantiser", "matvec": "q8_0_matvec", "matmul": "q8_0_matmul"}[
        dispatch.q8_0_route(n, k, m, dispatch.launch_backend(x))]
    return Result(kernel, shape, m, t, gbps, 100 * gbps / copy_gbps, baseline="torch fp16",
                  baseline_time_us=tb, baseline_pct=100 * (2 * n * k) / tb / 1e3 / copy_gbps, rel_err=err)


def _q8_0_int_dot_case(name: str, n: int, k: int, groups: int, ws: list, copy_gbps: float) -> Result:
    """One row through the integer-dot Q8_0 kernel on an activation quantised beforehand (the producer is
    meant to emit it fused), at the tiles the engine gives it (`dispatch.q8_0_int_dot_tiles`, as ops.linear);
    the quantiser's own launch is timed in `quantize_act16` rows."""
    from ds4station.kernels import dispatch
    from ds4station.kernels.act_quant import quantize_act16
    from ds4station.kernels.q8_0 import q8_0_matvec_q16, q8_0_matvec_ref

    device = ws[0].qs.device
    x = torch.randn(1, groups * k, device=device, dtype=torch.float16)
    act = quantize_act16(x)
    y = torch.empty(1, n, device=device, dtype=torch.float32)
    tiles = dispatch.q8_0_int_dot_tiles(n, k, 1, dispatch.tma_reads(x), n // groups)
    err = _rel_err(q8_0_matvec_q16(act, ws[0], groups=groups, out=y, tiles=tiles),
                   q8_0_matvec_ref(x, ws[0], groups=groups, out_dtype=torch.float32))
    t = _graph_time_us(lambda i: q8_0_matvec_q16(act, ws[i], groups=groups, out=y, tiles=tiles), len(ws))
    gbps = (n * k + n * k // 32 * 2 + groups * k * 2.25 + n * 4) / t / 1e3
    shape = f"{name} {n}x{k}" + (f" ({groups} groups)" if groups > 1 else "")
    return Result("q8_0_matvec int8 dot", shape, 1, t, gbps, 100 * gbps / copy_gbps, rel_err=err)


# name, N (output rows), K: DS4's F16 projections in decode (fp32 activation in, fp32 logits out)
F16_DECODE = [
    ("compressor+indexer kv/gate (concat)", 2624, 4096),
    ("indexer_q_b", 8192, 1024),
    ("ffn_gate_inp (router)", 256, 4096),
    ("indexer_proj", 64, 4096),
    ("compressor kv/gate", 1024, 4096),
]
F16_MAX_COPIES = 1024  # small matrices (64 x 4096 = 512 KB) need many copies to rotate >= ROTATE_BYTES


def bench_f16_decode(device: torch.device, copy_gbps: float, only: str = "", sweep: bool = False,
                     rows: Sequence[int] = (1,)) -> list[Result]:
    """The F16 projections at each of `rows` fp32 activation rows as the engine routes them (`f16_matvec`,
    dispatch.f16_route: the fp32 matvec up to a few rows, the tensor-core matmul beyond; fp32 y, one launch)
    against torch's fp16 product x.half() @ w.T (input cast + cuBLAS; the engine also casts the result back to
    fp32), both over the same rotating weight copies (>= ROTATE_BYTES in total, so weights come from HBM), each
    launch replayed in a CUDA graph. With `sweep`, also the matvec's tile variants (rows x K step x warps) of
    each shape at one row, to tune dispatch.f16_matvec_tiles."""
    from ds4station.kernels import dispatch
    from ds4station.kernels.f16 import MAX_ROWS, f16_matvec, f16_matvec_ref

    gen = torch.Generator(device=device).manual_seed(6)
    res = []
    for name, n, k in F16_DECODE:
        if only and only not in "f16_matvec" and only not in "f16_matmul" and only not in name:
            continue
        wbytes = 2 * n * k
        copies = max(2, min(F16_MAX_COPIES, math.ceil(ROTATE_BYTES / wbytes)))
        wall = torch.randn(copies, n, k, device=device, dtype=torch.float16, generator=gen) * 0.02
        ws = [wall[i] for i in range(copies)]
        for m in sorted({min(max(1, r), MAX_ROWS) for r in rows}):
            x = torch.randn(m, k, device=device, dtype=torch.float32, generator=gen)
            y = torch.empty(m, n, device=device, dtype=torch.float32)
            err = _rel_err(f16_matvec(x, ws[0], out=y), f16_matvec_ref(x, ws[0]))
            t = _graph_time_us(lambda i, x=x, y=y, ws=ws: f16_matvec(x, ws[i], out=y), copies)
            tb = _graph_time_us(lambda i, x=x, ws=ws: x.half() @ ws[i].T, copies)
            gbps = (wbytes + x.numel() * 4 + y.numel() * 4) / t / 1e3
            kernel = f"f16_{dispatch.f16_route(n, k, m, dispatch.launch_backend(x))}"
            res.append(Result(kernel, f"{name} {n}x{k}", m, t, gbps, 100 * gbps / copy_gbps,
                              baseline="torch x.half() @ w.T", baseline_time_us=tb,
                              baseline_pct=100 * wbytes / tb / 1e3 / copy_gbps, rel_err=err))
            if sweep and m == 1:
                res += _f16_sweep(name, n, k, x, y, ws, copy_gbps)
        del wall, ws
    return res


def _f16_sweep(name: str, n: int, k: int, x: torch.Tensor, y: torch.Tensor, ws: list[torch.Tensor],
               copy_gbps: float) -> list[Result]:
    """f16_matvec_triton at tile variants: 8-64 fp16 weights per lane per step, >= 64 programs."""
    import itertools

    import triton

    from ds4station.kernels import dispatch
    from ds4station.kernels.f16 import f16_matvec_triton

    backend = dispatch.launch_backend(x)
    base = dispatch.f16_matvec_tiles(n, k, x.shape[0], backend)
    lanes = 64 if backend == "hip64" else 32
    res = []
    for bn, bk, nw in itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048, 4096), (2, 4, 8)):
        tiles = dispatch.F16Tiles(block_n=bn, block_k=bk, num_warps=nw)
        per_lane = bn * bk // (nw * lanes)
        too_wide = bk > max(512, triton.next_power_of_2(k)) or -(-n // bn) < min(64, n)
        if tiles == base or too_wide or not 8 <= per_lane <= 64:
            continue
        try:
            t = _graph_time_us(lambda i, tiles=tiles: f16_matvec_triton(x, ws[i], out=y, tiles=tiles), len(ws))
        except Exception as exc:  # a variant the compiler rejects is reported, not fatal
            print(f"sweep f16 {name} {tiles}: {type(exc).__name__}: {exc}"[:300])
            continue
        gbps = (2 * n * k + x.numel() * 4 + y.numel() * 4) / t / 1e3
        res.append(Result("f16 sweep", f"{name} {n}x{k} bn{bn} bk{bk} w{nw}", 1, t, gbps, 100 * gbps / copy_gbps))
    return res


def bench_quantize_act16(device: torch.device) -> list[Result]:
    from ds4station.kernels.act_quant import quantize_act16

    x = torch.randn(1, 4096, device=device, dtype=torch.float16)
    t = _graph_time_us(lambda i: quantize_act16(x), 1)
    return [Result("quantize_act16", "1x4096 (separate launch)", 1, t)]


def bench_expert_matvecs(device: torch.device, copy_gbps: float, d_model: int = 4096, d_ff: int = 2048) -> list[Result]:
    """One routed expert's gate (IQ2_XXS 2048x4096) and down (Q2_K 4096x2048) as plain matvecs."""
    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels.iq2_xxs import PackedIQ2XXS, iq2_xxs_matvec_ref, repack_iq2_xxs
    from ds4station.kernels.moe import rows_matvec
    from ds4station.kernels.q2_k import PackedQ2K, q2_k_matvec_ref, repack_q2_k

    gen = torch.Generator(device=device).manual_seed(1)
    return [_rotating_matvec("iq2_xxs_matvec", f"expert {d_ff}x{d_model}", Q.IQ2_XXS, d_ff, d_model, repack_iq2_xxs,
                             rows_matvec, iq2_xxs_matvec_ref, PackedIQ2XXS, gen, copy_gbps, torch.float16),
            _rotating_matvec("q2_k_matvec", f"expert {d_model}x{d_ff}", Q.Q2_K, d_model, d_ff, repack_q2_k,
                             rows_matvec, q2_k_matvec_ref, PackedQ2K, gen, copy_gbps, torch.float16)]


def _rotating_matvec(kname: str, shape: str, qtype, n: int, k: int, repack: Callable, fn: Callable,  # type: ignore[no-untyped-def]
                     ref: Callable, cls: type, gen: torch.Generator, copy_gbps: float, x_dtype: torch.dtype) -> Result:
    """One-row decode matvec of a packed weight type [n, k], timed over rotating copies of random weights
    (>= ROTATE_BYTES, so nothing is re-read from L2) and checked against its torch reference."""
    device = gen.device
    copies = _copies(repack(_random_raw(qtype, (1, n), k, gen, 0.02), k).nbytes)
    packed = repack(_random_raw(qtype, (copies, n), k, gen, 0.02), k)
    ws = [cls(*(getattr(packed, f)[i] for f in cls.__dataclass_fields__)) for i in range(copies)]
    x = torch.randn(1, k, device=device, dtype=x_dtype)
    y = torch.empty(1, n, device=device, dtype=torch.float32)
    err = _rel_err(fn(x, ws[0], out=y), ref(x, ws[0], out_dtype=torch.float32))
    t = _graph_time_us(lambda i: fn(x, ws[i], out=y), copies)
    gbps = (ws[0].nbytes + k * x.element_size() + n * 4) / t / 1e3
    return Result(kname, shape, 1, t, gbps, 100 * gbps / copy_gbps, rel_err=err)


def bench_q4_k(device: torch.device, copy_gbps: float, bf16_tflops: float, tokens: int = 2048) -> list[Result]:
    """Q4_K (kernels/q4_k.py; not in the q2 file, in other quantisations of the model): the decode matvec
    at 4096x4096 and 2048x4096 over rotating copies, and the prefill matmul at `tokens` rows."""
    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels.moe import rows_matvec
    from ds4station.kernels.q4_k import PackedQ4K, dequantize_q4_k, q4_k_matmul, q4_k_matvec_ref, repack_q4_k

    gen = torch.Generator(device=device).manual_seed(2)
    res = [_rotating_matvec("q4_k_matvec", f"{n}x{k}", Q.Q4_K, n, k, repack_q4_k, rows_matvec, q4_k_matvec_ref,
                            PackedQ4K, gen, copy_gbps, torch.float32) for n, k in ((4096, 4096), (2048, 4096))]
    w = repack_q4_k(_random_raw(Q.Q4_K, (4096,), 4096, gen, 0.02), 4096)
    x = torch.randn(tokens, 4096, device=device)
    want = x.half().float() @ dequantize_q4_k(w).half().float().T  # the fp16 dot operands, fp32 sums
    err = _rel_err(q4_k_matmul(x, w, out_dtype=torch.float32), want)
    t = _median_ms(lambda: q4_k_matmul(x, w, out_dtype=torch.float32)) * 1e3
    flop = 2 * tokens * 4096 * 4096
    res.append(Result("q4_k_matmul", f"{tokens} x 4096x4096", tokens, t, tflops=flop / t / 1e6,
                      pct_bf16=100 * flop / t / 1e6 / bf16_tflops, rel_err=err))
    return res


def bench_moe(device: torch.device, copy_gbps: float, n_experts: int = 256, d_model: int = 4096, d_ff: int = 2048,
              slots: int = 6) -> list[Result]:
    """The fused routed MoE of one token: 6 of 256 experts (IQ2_XXS gate/up, Q2_K down), each launch of the
    graph on a disjoint expert set so nothing is re-read from L2."""
    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels import dispatch
    from ds4station.kernels.iq2_xxs import repack_iq2_xxs
    from ds4station.kernels.moe import moe_decode, moe_decode_ref
    from ds4station.kernels.q2_k import repack_q2_k

    gen = torch.Generator(device=device).manual_seed(2)
    gate = repack_iq2_xxs(_random_raw(Q.IQ2_XXS, (n_experts, d_ff), d_model, gen, 0.02), d_model)
    up = repack_iq2_xxs(_random_raw(Q.IQ2_XXS, (n_experts, d_ff), d_model, gen, 0.02), d_model)
    down = repack_q2_k(_random_raw(Q.Q2_K, (n_experts, d_model), d_ff, gen, 0.02), d_ff)
    copies = n_experts // slots
    perm = torch.randperm(n_experts, device=device, generator=gen)
    ids = [perm[i * slots:(i + 1) * slots].view(1, slots).to(torch.int32).contiguous() for i in range(copies)]
    weights = torch.rand(1, slots, device=device, generator=gen) + 0.1
    x = torch.randn(1, d_model, device=device, dtype=torch.float16)
    y = torch.empty(1, d_model, device=device, dtype=torch.float32)
    per_expert = (gate.nbytes + up.nbytes + down.nbytes) / n_experts
    nbytes = slots * per_expert + d_model * 2 + d_model * 4 + slots * d_ff * 4 * 2
    exact = moe_decode_ref(x, gate, up, down, ids[0], weights)
    base = dispatch.moe_tiles(gate.qtype, down.qtype, d_model, d_ff, slots, dispatch.launch_backend(x))
    variants = [("fp32 math", False, base)]
    if dispatch.use_int_dot(dispatch.launch_backend(x)):
        variants.append(("int8 dot", True, base))
    res = []
    for label, int_dot, tiles in variants:
        err = _rel_err(moe_decode(x, gate, up, down, ids[0], weights, out=y, tiles=tiles, int_dot=int_dot), exact)
        t = _graph_time_us(lambda i, tiles=tiles, int_dot=int_dot: moe_decode(
            x, gate, up, down, ids[i], weights, out=y, tiles=tiles, int_dot=int_dot), copies)
        gbps = nbytes / t / 1e3
        res.append(Result("moe_decode", f"{label}: {slots} of {n_experts} experts {d_ff}x{d_model} iq2_xxs/q2_k", 1,
                          t, gbps, 100 * gbps / copy_gbps, rel_err=err))
    return res


def bench_q8_0_prefill(device: torch.device, tokens: int, only: str = "", sweep: bool = False) -> list[Result]:
    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels import dispatch
    from ds4station.kernels.q8_0 import dequantize_q8_0, q8_0_matmul, q8_0_matmul_ref, repack_q8_0

    gen = torch.Generator(device=device).manual_seed(3)
    res = []
    for name, n, k in Q8_0_PREFILL:
        if only and only not in name:
            continue
        w = repack_q8_0(_random_raw(Q.Q8_0, (n,), k, gen, 0.02), k)
        x = torch.randn(tokens, k, device=device, dtype=torch.float16)
        y = torch.empty(tokens, n, device=device, dtype=torch.float16)
        want = q8_0_matmul_ref(x, w, out_dtype=torch.float32)
        wb = dequantize_q8_0(w).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        tb = _median_ms(lambda xb=xb, wb=wb: xb @ wb.T) * 1e3
        flop = 2 * tokens * n * k
        base = dispatch.matmul_tiles("q8_0", tokens, n, k, dispatch.launch_backend(x))
        variants = [base]
        if sweep and name in ("attn_output_b", "attn_q_b"):
            variants += [dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                                             w_as_a=wa)
                         for wa in (False, True)
                         for bm, bn, bk, nw, ns in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                                                    (128, 128, 128, 8, 3), (64, 256, 64, 8, 3))]
        for tiles in dict.fromkeys(variants):
            try:
                err = _rel_err(q8_0_matmul(x, w, out=y, tiles=tiles), want)
                t = _median_ms(lambda x=x, w=w, y=y, tiles=tiles: q8_0_matmul(x, w, out=y, tiles=tiles)) * 1e3
            except Exception as exc:  # a tile the compiler rejects (shared memory) is reported, not fatal
                print(f"matmul {name} {tiles}: {type(exc).__name__}: {exc}"[:300])
                continue
            label = (f"{name} {n}x{k}" if tiles == base else
                     f"{name} {n}x{k} bm{tiles.block_m} bn{tiles.block_n} bk{tiles.block_k} w{tiles.num_warps} "
                     f"s{tiles.num_stages}{' WA' if tiles.w_as_a else ''}")
            res.append(Result("q8_0_matmul", label, tokens, t, tflops=flop / t / 1e6, pct_bf16=100 * tb / t,
                              baseline="torch bf16", baseline_time_us=tb, rel_err=err))
        del w, wb
    return res


def sweep_tiles(device: torch.device, copy_gbps: float) -> list[Result]:
    """Decode tile variants at a few real shapes (1 row), to choose dispatch's tables from measurements."""
    import itertools

    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels.dispatch import MatvecTiles
    from ds4station.kernels.iq2_xxs import PackedIQ2XXS, repack_iq2_xxs
    from ds4station.kernels.moe import rows_matvec
    from ds4station.kernels.q2_k import PackedQ2K, repack_q2_k

    gen = torch.Generator(device=device).manual_seed(4)
    cases = [
        ("iq2_xxs", "expert gate", 2048, 4096, Q.IQ2_XXS, repack_iq2_xxs, rows_matvec, PackedIQ2XXS, (4096,)),
        ("q2_k", "expert down", 4096, 2048, Q.Q2_K, repack_q2_k, rows_matvec, PackedQ2K, (2048,)),
    ]
    res = []
    for qname, name, n, k, qtype, repack, fn, cls, block_ks in cases:
        probe = repack(_random_raw(qtype, (1, n), k, gen, 0.02), k)
        copies = _copies(probe.nbytes)
        packed = repack(_random_raw(qtype, (copies, n), k, gen, 0.02), k)
        ws = [cls(*(getattr(packed, f)[i] for f in cls.__dataclass_fields__)) for i in range(copies)]
        x = torch.randn(1, k, device=device, dtype=torch.float16)
        y = torch.empty(1, n, device=device, dtype=torch.float32)
        nbytes = ws[0].nbytes + k * 2 + n * 4
        for bn, bk, nw in itertools.product((2, 4, 8, 16), block_ks, (1, 2, 4)):
            tiles = MatvecTiles(block_n=bn, block_k=bk, num_warps=nw)
            try:
                t = _graph_time_us(lambda i, tiles=tiles, fn=fn, ws=ws, x=x, y=y: fn(x, ws[i], out=y, tiles=tiles),
                                   copies)
            except Exception as exc:  # a variant the compiler rejects (e.g. out of registers) is reported
                print(f"sweep {qname} {name} {tiles}: {type(exc).__name__}: {exc}"[:300])
                continue
            gbps = nbytes / t / 1e3
            res.append(Result(f"{qname} sweep", f"{name} {n}x{k} bn{bn} bk{bk} w{nw}", 1, t, gbps,
                              100 * gbps / copy_gbps))
        del packed, ws
    return res


def bench_moe_prefill(device: torch.device, bf16_tflops: float, tokens: int = 2048, n_experts: int = 256,
                      d_model: int = 4096, d_ff: int = 2048, slots: int = 6) -> list[Result]:
    """Routed experts of a prefill chunk: `tokens` tokens x 6 of 256 experts, grouped by expert, tl.dot."""
    from gguf import GGMLQuantizationType as Q

    from ds4station.kernels.iq2_xxs import repack_iq2_xxs
    from ds4station.kernels.moe import moe_decode
    from ds4station.kernels.moe_prefill import moe_prefill
    from ds4station.kernels.q2_k import repack_q2_k

    gen = torch.Generator(device=device).manual_seed(5)
    gate = repack_iq2_xxs(_random_raw(Q.IQ2_XXS, (n_experts, d_ff), d_model, gen, 0.02), d_model)
    up = repack_iq2_xxs(_random_raw(Q.IQ2_XXS, (n_experts, d_ff), d_model, gen, 0.02), d_model)
    down = repack_q2_k(_random_raw(Q.Q2_K, (n_experts, d_model), d_ff, gen, 0.02), d_ff)
    ids = torch.stack([torch.randperm(n_experts, device=device, generator=gen)[:slots] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    weights = torch.rand(tokens, slots, device=device, generator=gen) + 0.1
    x = torch.randn(tokens, d_model, device=device, dtype=torch.float16)
    check = slice(0, 8)  # accuracy on a few tokens against the fp32 decode kernels
    err = _rel_err(moe_prefill(x[check], gate, up, down, ids[check], weights[check]),
                   moe_decode(x[check], gate, up, down, ids[check], weights[check], int_dot=False))
    t = _median_ms(lambda: moe_prefill(x, gate, up, down, ids, weights)) * 1e3
    flop = 2 * tokens * slots * 3 * d_ff * d_model
    return [Result("moe_prefill", f"{tokens} tokens x {slots} of {n_experts} experts {d_ff}x{d_model}", tokens, t,
                   tflops=flop / t / 1e6, pct_bf16=100 * flop / t / 1e6 / bf16_tflops,
                   baseline="bf16 8192^3 peak", rel_err=err)]


def bench_layer_ops(device: torch.device, copy_gbps: float, bf16_tflops: float, tokens: int = 2048,
                    ctx: int = 8192) -> list[Result]:
    """The layer's small decode kernels (row finishing, compressor update, indexer, attention) at DS4's shapes
    with `ctx` positions of context, each captured 32 times in a CUDA graph (the decode step's own cost per
    launch), and the prefill forms over a chunk of `tokens` (median of do_bench). Outputs against the torch
    references (the indexer: the fraction of selected blocks that differ from the reference's set)."""
    from ds4station.kernels import attention, compressor, indexer, rows
    from ds4station.kernels.reference import rope_inv_freq
    from ds4station.model.config import FLASH

    H, D, IH, ID, W, r4 = FLASH.n_heads, FLASH.head_dim, FLASH.index_heads, FLASH.index_dim, FLASH.window, 4
    gen = torch.Generator(device=device).manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    freq = rope_inv_freq(FLASH, True).to(device)
    pos = torch.tensor([ctx - 1], device=device)  # closes a ratio-4 and a ratio-128 block
    out: list[Result] = []

    def decode(kernel: str, shape: str, fn: Callable[[], object], nbytes: int, err: float | None) -> None:
        t = _graph_time_us(lambda i: fn(), 1)
        out.append(Result(kernel, shape, 1, t, gbps=nbytes / t / 1e3, pct_copy=100 * nbytes / t / 1e3 / copy_gbps,
                          rel_err=err))

    # row finishing: q heads (norm + RoPE), indexer queries (RoPE + Hadamard + FP4), the KV row into the ring
    q = randn(H, D)
    decode("finish_rows", f"q heads {H}x{D}: norm, RoPE", lambda: rows.finish_rows(q, pos, H, norm=True, inv_freq=freq),
           2 * q.numel() * 4, _rel_err(rows.finish_rows(q, pos, H, norm=True, inv_freq=freq),
                                       rows.finish_rows_ref(q, pos, H, norm=True, inv_freq=freq)))
    iq = randn(IH, ID)
    fp4 = {"inv_freq": freq, "hadamard": True, "rt": "fp4"}
    decode("finish_rows", f"indexer q {IH}x{ID}: RoPE, Hadamard, FP4", lambda: rows.finish_rows(iq, pos, IH, **fp4),
           2 * iq.numel() * 4, _rel_err(rows.finish_rows(iq, pos, IH, **fp4), rows.finish_rows_ref(iq, pos, IH, **fp4)))
    ring = torch.zeros(W + tokens, D, device=device)
    kv_row, kv_w = randn(1, D), randn(D).abs() + 0.5
    fp8 = {"norm": True, "weight": kv_w, "inv_freq": freq, "rt": "fp8", "nope": FLASH.nope_dim, "ring": ring}
    decode("finish_rows", f"KV row {D}: norm, RoPE, FP8, ring write", lambda: rows.finish_rows(kv_row, pos, 1, **fp8),
           2 * D * 4, None)

    # compressor update at a closing position (pooling included), ratio 4 (attention and indexer) and 128
    for label, ratio, d, fin_kw in (("r4 attention", 4, D, {"rt": "fp8", "nope": FLASH.nope_dim}),
                                    ("r4 indexer", 4, ID, {"rt": "fp4", "hadamard": True}),
                                    ("r128 attention", 128, D, {"rt": "fp8", "nope": FLASH.nope_dim})):
        coff = 2 if ratio == 4 else 1
        width = coff * d
        fin = compressor.Finish(randn(d).abs() + 0.5, FLASH.rms_eps, freq, **fin_kw)
        fkv, fsc = randn(coff * ratio + tokens, width), randn(coff * ratio + tokens, width)
        comp_rows = torch.zeros(ctx // ratio + 1, d, device=device)
        kv, sc, ape = randn(1, width), randn(1, width), randn(ratio, width)
        decode("compress_decode", f"{label} d{d}, block closes", lambda kv=kv, sc=sc, ape=ape, fkv=fkv, fsc=fsc,
               comp_rows=comp_rows, ratio=ratio, fin=fin: compressor.compress_decode(
                   kv, sc, ape, pos, fkv, fsc, comp_rows, ratio, fin), 2 * coff * ratio * width * 4, None)
        n_blocks = tokens // ratio
        got, want = comp_rows.clone(), comp_rows.clone()
        compressor.compress_blocks(fkv, fsc, got, 0, n_blocks, ratio, fin)
        compressor.compress_blocks_ref(fkv, fsc, want, 0, n_blocks, ratio, fin)
        t = _median_ms(functools.partial(compressor.compress_blocks, fkv, fsc, got, 0, n_blocks, ratio, fin)) * 1e3
        nbytes = 2 * n_blocks * coff * ratio * width * 4
        out.append(Result("compress_blocks", f"{label} d{d}, {n_blocks} blocks", tokens, t, gbps=nbytes / t / 1e3,
                          pct_copy=100 * nbytes / t / 1e3 / copy_gbps, rel_err=_rel_err(got, want)))

    # indexer: scores over ctx / 4 compressed keys and the top 512
    n_keys = ctx // r4
    keys = randn(n_keys, ID)

    def select_err(got: tuple, want: tuple) -> float:
        diff = [len(set(g[v].tolist()) ^ set(w[u].tolist())) / (2 * max(1, int(u.sum())))
                for g, v, w, u in zip(got[0], got[1], want[0], want[1], strict=True)]
        return sum(diff) / len(diff)

    iqd, iw = randn(1, IH, ID), randn(1, IH).abs()
    # one selection program per query; per-chunk programs first (dispatch.select_plan); decode after 128K tokens,
    # whose position bucket (a power of two) holds twice the blocks the query sees
    for n, seen in ((n_keys, n_keys), (8 * n_keys, 8 * n_keys), (32 * n_keys, 16 * n_keys)):
        k_all = keys if n == n_keys else randn(n, ID)
        args = (iqd, iw, k_all, n, torch.tensor([r4 * seen - 1], device=device), r4, FLASH.index_topk)
        decode("index_topk", f"1 query x {n} blocks" + (f" ({seen} seen)" if seen < n else "") +
               f", top {FLASH.index_topk}", lambda args=args: indexer.index_topk(*args), seen * ID * 4,
               select_err(indexer.index_topk(*args), indexer.index_topk_ref(*args)))
    iqp, iwp = randn(tokens, IH, ID), randn(tokens, IH).abs()
    for n in (n_keys, 16 * n_keys):  # the last chunk of an 8K and of a 128K prompt (column blocks of chunks)
        k_all = keys if n == n_keys else randn(n, ID)
        ppos = torch.arange(r4 * n - tokens, r4 * n, device=device)
        pargs = (iqp, iwp, k_all, n, ppos, r4, FLASH.index_topk)
        t = _median_ms(lambda pargs=pargs: indexer.index_topk(*pargs)) * 1e3
        flop = 2 * tokens * IH * n * ID
        out.append(Result("index_topk", f"{tokens} queries x {n} blocks", tokens, t, tflops=flop / t / 1e6,
                          pct_bf16=100 * flop / t / 1e6 / bf16_tflops,
                          rel_err=select_err(indexer.index_topk(*pargs), indexer.index_topk_ref(*pargs))))

    # attention: window from the ring + 512 indexed rows (ratio-4 layers), window + shared rows (ratio 128)
    ring.copy_(randn(*ring.shape))
    comp = randn(ctx // r4, D)
    sinks = randn(H)
    ids = torch.randint(0, ctx // r4, (FLASH.index_topk,), device=device, generator=gen)
    valid = torch.ones(FLASH.index_topk, dtype=torch.bool, device=device)
    for label, kw in ((f"window {W} + {FLASH.index_topk} indexed rows", {"kc": comp, "mask_c": valid, "ids": ids}),
                      (f"window {W} + {ctx // 128} rows of ratio 128", {"kc": comp[:ctx // 128], "mask_c": None,
                                                                        "ratio": 128})):
        def run(kw=kw, fn=attention.attention_decode) -> torch.Tensor:
            return fn(q, ring, None, sinks=sinks, scale=D ** -0.5, pos=pos, window=W, **kw)

        n_rows = W + (kw["ids"].numel() if "ids" in kw else kw["kc"].shape[0])
        decode("attention_decode", label, run, n_rows * D * 4, _rel_err(run(), run(fn=attention.attention_decode_ref)))
    pq = randn(tokens, H, D)
    pids = torch.randint(0, ctx // r4, (tokens, FLASH.index_topk), device=device, generator=gen)
    pvalid = torch.ones_like(pids, dtype=torch.bool)

    def prefill(fn=attention.attention_prefill, n: int = tokens) -> torch.Tensor:
        return fn(pq[:n], ring, comp, pvalid[:n], sinks, D ** -0.5, pids[:n], ppos[:n], W)

    t = _median_ms(prefill) * 1e3
    flop = 4 * tokens * H * (W + FLASH.index_topk) * D
    out.append(Result("attention_prefill", f"{tokens} queries x (window {W} + {FLASH.index_topk} indexed rows)",
                      tokens, t, tflops=flop / t / 1e6, pct_bf16=100 * flop / t / 1e6 / bf16_tflops,
                      rel_err=_rel_err(prefill(n=4), prefill(attention.attention_prefill_ref, 4))))
    return out


def run_all(rows: list[int], prefill_tokens: int, only: str = "", sweep: bool = False) -> tuple[dict, list[Result]]:
    """Every benchmark on the current CUDA/ROCm device; returns (ceilings and device info, results)."""
    import triton

    from ds4station.kernels import dispatch

    if not torch.cuda.is_available():
        raise RuntimeError("kernel benchmarks need a CUDA or ROCm GPU (torch.cuda.is_available() is False)")
    device = torch.device("cuda")
    copy_gbps, bf16_tflops = ceilings(device)
    info = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
            "copy_gbps": copy_gbps, "bf16_tflops": bf16_tflops}
    results = bench_q8_0_decode(device, rows, copy_gbps, only)
    if dispatch.use_int_dot(dispatch.device_backend(device)):
        results += bench_quantize_act16(device)
    results += bench_f16_decode(device, copy_gbps, only, sweep, rows)
    if not only or only in "expert":
        results += bench_expert_matvecs(device, copy_gbps)
    if not only or only in "moe":
        results += bench_moe(device, copy_gbps)
    results += bench_q8_0_prefill(device, prefill_tokens, only, sweep)
    if not only or only in "moe_prefill":
        results += bench_moe_prefill(device, bf16_tflops, prefill_tokens)
    if not only or only in "layer":
        results += bench_layer_ops(device, copy_gbps, bf16_tflops, prefill_tokens)
    if not only or only in "q4_k":
        results += bench_q4_k(device, copy_gbps, bf16_tflops, prefill_tokens)
    if sweep:
        results += sweep_tiles(device, copy_gbps)
    return info, results


def format_table(info: dict, results: list[Result]) -> str:
    """Markdown table of results with the ceilings in the header line."""
    lines = [f"device: {info['device']}, torch {info['torch']}, triton {info['triton']}; "
             f"copy {info['copy_gbps']:.0f} GB/s (read+write), bf16 matmul {info['bf16_tflops']:.0f} TFLOP/s",
             "",
             "| kernel | shape | rows | time us | GB/s | % copy | TFLOP/s | baseline | baseline us | baseline % | "
             "rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    for r in results:
        pct = f(r.pct_copy, ".0f") if r.pct_copy is not None else ""
        base_pct = f(r.baseline_pct, ".0f") if r.baseline_pct is not None else ""
        if r.pct_bf16 is not None:
            pct = f"{r.pct_bf16:.0f}% of bf16"
        lines.append(f"| {r.kernel} | {r.shape} | {r.rows} | {r.time_us:.1f} | {f(r.gbps, '.0f')} | {pct} | "
                     f"{f(r.tflops, '.0f')} | {r.baseline} | {f(r.baseline_time_us, '.1f')} | {base_pct} | "
                     f"{f(r.rel_err, '.1e')} |")
    return "\n".join(lines)


def as_dicts(results: list[Result]) -> list[dict]:
    return [asdict(r) for r in results]
