"""The sweep behind the Q8_0 integer-dot matvec's `tma` tiles (dispatch.q8_0_int_dot_tiles; the kernel is
q8_0.py's `_q8_0_matvec_tma_kernel`: the weights through Hopper's tensor descriptors, the bulk copies STAGES K
steps ahead in shared memory, one flat loop over (row block, K step) pairs, with PER_SM > 0 a persistent grid).
Every spec at every Q8_0 decode shape against the plain integer-dot tiles (issue 20; docs/PERFORMANCE.md,
fortieth session). K must be a multiple of BLOCK_K, itself of 256.

usage: q8_0_tma.py check   correctness against the torch reference (GPU, or TRITON_INTERPRET=1 on the CPU)
       q8_0_tma.py bench   GPU: every spec at every Q8_0 decode shape (ROWS=1,2,4 for several activation rows),
                           the plain tiles beside it, the 43-layer weighted sums, and
                           BEST_SPEC=bn,bk,warps,stages,per_sm
"""
import itertools
import os
import sys

import torch
from gguf import GGMLQuantizationType as Q

from ds4station.kernels import benchmark as kb
from ds4station.kernels import dispatch
from ds4station.kernels.act_quant import quantize_act16
from ds4station.kernels.q8_0 import PackedQ8_0, q8_0_matvec_q16, q8_0_matvec_q16_ref, repack_q8_0

SPECS = list(itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4), (0, 1)))


def tiles(spec: tuple[int, ...]) -> dispatch.MatvecTiles:
    """A spec (block_n, block_k, warps, stages, per_sm) as the engine's `tma` tiles."""
    bn, bk, warps, stages, per_sm = spec
    return dispatch.MatvecTiles(bn, bk, warps, stages, tma=True, per_sm=per_sm)


def check(dev: torch.device) -> None:
    """Odd row counts (a last row block past N), groups, K loops with several steps, 1-3 rows, persistent grids."""
    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k, groups, m, spec in ((96, 512, 1, 1, (32, 256, 4, 2, 0)), (80, 768, 1, 2, (32, 256, 4, 3, 0)),
                                  (128, 1024, 4, 3, (32, 512, 4, 2, 1)), (64, 256, 2, 1, (16, 256, 2, 2, 1))):
        w = repack_q8_0(kb._random_raw(Q.Q8_0, (n,), k, gen, 0.02), k)
        act = quantize_act16(torch.randn(m, groups * k, device=dev, generator=gen))
        ref = q8_0_matvec_q16_ref(act, w, groups=groups)
        err = kb._rel_err(q8_0_matvec_q16(act, w, groups=groups, tiles=tiles(spec)), ref)
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
            plain = dispatch.q8_0_int_dot_tiles(n, k, m)  # the tiles without tensor descriptors
            t0 = kb._graph_time_us(lambda i, a=act, w=ws, g=groups, o=y, t=plain: q8_0_matvec_q16(a, w[i], groups=g,
                                                                                                 out=o, tiles=t),
                                   copies)
            cases += 1
            base_total += per_model * t0
            print(f"{name} {n}x{k} m={m}: plain {t0:.1f} us, {wbytes / 1e3 / t0:.0f} GB/s ({plain})", flush=True)
            res = []
            for spec in SPECS:
                try:
                    err = kb._rel_err(q8_0_matvec_q16(act, ws[0], groups=groups, out=y, tiles=tiles(spec)), ref)
                    t = kb._graph_time_us(lambda i, a=act, w=ws, g=groups, o=y, t=tiles(spec): q8_0_matvec_q16(
                        a, w[i], groups=g, out=o, tiles=t), copies)
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
    print(f"one decode step's Q8_0 matvecs (43 layers + head), plain tiles: {base_total / 1e3:.3f} ms")
    ranked = sorted((t, s) for s, t in totals.items() if counts[s] == cases)
    for t, s in ranked[:5]:
        print(f"  tma {s}: {t / 1e3:.3f} ms ({base_total / t:.3f}x)")
    if ranked:
        print("BEST_SPEC=" + ",".join(map(str, ranked[0][1])))


if __name__ == "__main__":
    {"check": check, "bench": bench}[sys.argv[1]](torch.device("cuda" if torch.cuda.is_available() else "cpu"))
