"""A candidate Q8_0 integer-dot decode matvec whose weights arrive through Hopper's TMA (tensor descriptors:
Triton's pipeliner issues the bulk copies STAGES K steps ahead into shared memory, so no registers hold loads
in flight), against the dispatched `q8_0_matvec_q16` at the model's shapes. Not in the engine: it goes there
only if this sweep says it wins (issue 20; docs/PERFORMANCE.md, thirty-ninth session).

A program walks (row block, K step) pairs as one flat loop, so the copies also run ahead across row blocks;
with PER_SM > 0 the grid is persistent (PER_SM programs per SM, each taking every grid-th row block). The math
is the engine's own `_q8_0_i8_step` (two dp4a per weight word, exact int32 block sums). The weights must be
16-byte aligned and K a multiple of BLOCK_K (the scales' rows are K/32 fp16: TMA wants 16-byte rows).

usage: q8_0_tma.py check   correctness against the torch reference (GPU, or TRITON_INTERPRET=1 on the CPU)
       q8_0_tma.py bench   GPU: every spec at every Q8_0 decode shape (ROWS=1,2,4 for several activation rows),
                           the dispatched kernel beside it, the 43-layer weighted sums, and
                           BEST_SPEC=bn,bk,warps,stages,per_sm
"""
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q
from triton.tools.tensor_descriptor import TensorDescriptor

from ds4station.kernels import benchmark as kb
from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import quantize_act16
from ds4station.kernels.q8_0 import PackedQ8_0, _q8_0_i8_step, q8_0_matvec_q16, q8_0_matvec_q16_ref, repack_q8_0

SPECS = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4), (0, 1)))


@triton.jit
def _q8_0_matvec_tma_kernel(hi_ptr, lo_ptr, xs_ptr, w_desc, d_desc, y_ptr, N, K, rows_per_group, stride_xm,
                            stride_ym, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    KB: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_steps = tl.cdiv(K, BLOCK_K)
    mine = (tl.cdiv(N, BLOCK_N) - pid + grid - 1) // grid  # row blocks pid, pid + grid, ...
    cols = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for it in tl.range(0, mine * k_steps, num_stages=STAGES):
        rb = pid + (it // k_steps) * grid
        ks = it % k_steps
        k0 = ks * BLOCK_K
        q = w_desc.load([rb * BLOCK_N, k0 // 4]).reshape(BLOCK_N, KB, 8)  # rows past N come in as zeros
        s = d_desc.load([rb * BLOCK_N, k0 // 32]).to(tl.float32)
        acc = _q8_0_i8_step(acc, q, s, hi_ptr, lo_ptr, xs_ptr, (rb * BLOCK_N) // rows_per_group, k0, K, stride_xm,
                            M, BLOCK_K)
        if ks == k_steps - 1:
            offs_n = rb * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + cols[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
                     mask=(offs_n < N)[:, None] & (cols[None, :] < M))
            acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)


def descriptors(w: PackedQ8_0, spec: tuple[int, ...]) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The weight words [N, K/4] and scales [N, K/32] as tensor descriptors of spec's block shape."""
    bn, bk = spec[0], spec[1]
    return (TensorDescriptor.from_tensor(w.qs.view(torch.int32), [bn, bk // 4]),
            TensorDescriptor.from_tensor(w.d, [bn, bk // 32]))


def tma_matvec(act: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w: PackedQ8_0, groups: int,
               out: torch.Tensor, spec: tuple[int, ...], descs: tuple | None = None) -> torch.Tensor:
    """out [M, N] = x @ W^T from act = quantize_act16(x) for x [M, groups * K], as q8_0_matvec_q16."""
    hi = act[0]
    n, k = w.qs.shape
    bn, bk, warps, stages, per_sm = spec
    if k % bk or (groups > 1 and (n // groups) % bn):
        raise ValueError(f"spec {spec} does not tile [{n}, {k}] in {groups} groups")
    descs = descs or descriptors(w, spec)
    grid = triton.cdiv(n, bn)
    if per_sm:
        sms = torch.cuda.get_device_properties(hi.device).multi_processor_count if hi.is_cuda else 2
        grid = min(grid, sms * per_sm)
    _q8_0_matvec_tma_kernel[(grid,)](
        *act, *descs, out, n, k, n // groups, hi.stride(0), out.stride(0), M=hi.shape[0],
        M_PAD=triton.next_power_of_2(hi.shape[0]), BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, num_warps=warps)
    return out


def check(dev: torch.device) -> None:
    """Odd row counts (a last row block past N), groups, K loops with several steps, 1-3 rows, persistent grids."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k, groups, m, spec in ((96, 512, 1, 1, (32, 256, 4, 2, 0)), (80, 768, 1, 2, (32, 256, 4, 3, 0)),
                                  (128, 1024, 4, 3, (32, 512, 4, 2, 1)), (64, 256, 2, 1, (16, 256, 2, 2, 1))):
        w = repack_q8_0(kb._random_raw(Q.Q8_0, (n,), k, gen, 0.02), k)
        act = quantize_act16(torch.randn(m, groups * k, device=dev, generator=gen))
        ref = q8_0_matvec_q16_ref(act, w, groups=groups)
        err = kb._rel_err(tma_matvec(act, w, groups, torch.empty(m, n, device=dev), spec), ref)
        print(f"check n={n} k={k} groups={groups} m={m} spec={spec}: rel err {err:.1e}", flush=True)
        if not err < 1e-5:
            raise SystemExit(f"wrong result: {err:.1e}")


def bench(dev: torch.device) -> None:
    import triton.testing

    kb._median_ms = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [int(r) for r in os.environ.get("ROWS", "1").split(",")]
    totals: dict[tuple[int, ...], float] = {}
    counts: dict[tuple[int, ...], int] = {}
    cases, base_total = 0, 0.0
    for name, n, k, groups in kb.Q8_0_DECODE:
        wbytes = n * k * 34 // 32
        copies = kb._copies(wbytes)
        packed = repack_q8_0(kb._random_raw(Q.Q8_0, (copies, n), k, gen, 0.02), k)
        ws = [PackedQ8_0(packed.qs[i], packed.d[i]) for i in range(copies)]
        per_model = 1 if name == "output_head" else 43  # the head once, every other shape once a layer
        for m in rows:
            act = quantize_act16(torch.randn(m, groups * k, device=dev))
            ref = q8_0_matvec_q16_ref(act, ws[0], groups=groups)
            y = torch.empty(m, n, device=dev)
            tiles = dispatch.q8_0_int_dot_tiles(n, k, m)
            t0 = kb._graph_time_us(lambda i, a=act, w=ws, g=groups, o=y, t=tiles: q8_0_matvec_q16(a, w[i], groups=g,
                                                                                                 out=o, tiles=t),
                                   copies)
            cases += 1
            base_total += per_model * t0
            print(f"{name} {n}x{k} m={m}: dispatched {t0:.1f} us, {wbytes / 1e3 / t0:.0f} GB/s ({tiles})", flush=True)
            res = []
            for spec in SPECS:
                try:
                    descs = [descriptors(w, spec) for w in ws]
                    err = kb._rel_err(tma_matvec(act, ws[0], groups, y, spec, descs[0]), ref)
                    t = kb._graph_time_us(lambda i, a=act, w=ws, g=groups, o=y, sp=spec, d=descs: tma_matvec(
                        a, w[i], g, o, sp, d[i]), copies)
                except Exception as exc:  # a spec that does not tile the shape, or that the compiler refuses
                    print(f"    {spec} failed: {type(exc).__name__}: {str(exc)[:100]}")
                    continue
                if not err <= 1e-4:  # nan too
                    print(f"    {spec} wrong: rel err {err:.1e}")
                    continue
                res.append((t, spec))
                totals[spec] = totals.get(spec, 0.0) + per_model * t
                counts[spec] = counts.get(spec, 0) + 1
            for t, spec in sorted(res)[:4]:
                print(f"    {t:7.1f} us {wbytes / 1e3 / t:5.0f} GB/s  tma {spec} ({t0 / t:.2f}x)", flush=True)
        packed = ws = None  # free the copies before the next shape
    print(f"one decode step's Q8_0 matvecs (43 layers + head), dispatched: {base_total / 1e3:.3f} ms")
    ranked = sorted((t, s) for s, t in totals.items() if counts[s] == cases)
    for t, s in ranked[:5]:
        print(f"  tma {s}: {t / 1e3:.3f} ms ({base_total / t:.3f}x)")
    if ranked:
        print("BEST_SPEC=" + ",".join(map(str, ranked[0][1])))


if __name__ == "__main__":
    {"check": check, "bench": bench}[sys.argv[1]](torch.device("cuda" if torch.cuda.is_available() else "cpu"))
