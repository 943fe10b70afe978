"""The Q8_0 matvec's tiles (rows per program x K step x warps) at 2-4 fp32 activation rows, at the model's shapes,
against the split-K matmul (one launch) and the engine's routing (ops.linear); each launch replayed in a CUDA
graph over rotating weight copies. usage: q8_0_few_row_sweep.py 2,3,4 (the H200 run behind
dispatch._q8_0_few_row_tiles, docs/PERFORMANCE.md)."""
import sys

import torch
import triton.testing
from gguf import GGMLQuantizationType as Q

from ds4station.kernels import benchmark as kb
from ds4station.kernels import dispatch, ops
from ds4station.kernels.dispatch import MatvecTiles
from ds4station.kernels.q8_0 import PackedQ8_0, q8_0_matmul, q8_0_matvec, q8_0_matvec_ref, repack_q8_0

kb._median_ms = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
ROWS = [int(r) for r in sys.argv[1].split(",")]
for name, n, k, groups in kb.Q8_0_DECODE:
    wbytes = n * k * 34 // 32
    copies = kb._copies(wbytes)
    packed = repack_q8_0(kb._random_raw(Q.Q8_0, (copies, n), k, gen, 0.02), k)
    ws = [PackedQ8_0(packed.qs[i], packed.d[i]) for i in range(copies)]
    rpg = n // groups
    for m in ROWS:
        x = torch.randn(m, groups * k, device=dev, dtype=torch.float32)
        ref = q8_0_matvec_ref(x, ws[0], groups=groups, out_dtype=torch.float32)
        y = torch.empty(m, n, device=dev, dtype=torch.float32)
        t_ops = kb._graph_time_us(
            lambda i, x=x, ws=ws, groups=groups: ops.linear(x, ws[i], groups=groups, out_dtype=torch.float32), copies)
        mt = dispatch.matmul_tiles("q8_0", m, n, k, "cuda", rpg if groups > 1 else None)
        t_mm = kb._graph_time_us(
            lambda i, x=x, ws=ws, y=y, groups=groups, mt=mt: q8_0_matmul(x, ws[i], out=y, groups=groups, tiles=mt),
            copies)
        e_mm = kb._rel_err(q8_0_matmul(x, ws[0], out=y, groups=groups, tiles=mt), ref)
        print(f"{name} {n}x{k} m={m}: ops {t_ops:.1f} | matmul one launch {t_mm:.1f} (split {mt.split_k}, "
              f"err {e_mm:.1e})", flush=True)
        res = []
        for bn in (2, 4, 8, 16):
            for bk in (512, 1024, 2048):
                for nw in (1, 2, 4):
                    if rpg % bn or bk > max(512, k):
                        continue
                    t_ = MatvecTiles(block_n=bn, block_k=bk, num_warps=nw)
                    err = kb._rel_err(q8_0_matvec(x, ws[0], groups=groups, out=y, tiles=t_), ref)
                    t = kb._graph_time_us(
                        lambda i, x=x, ws=ws, y=y, groups=groups, t_=t_: q8_0_matvec(x, ws[i], groups=groups, out=y,
                                                                                     tiles=t_),
                        copies)
                    res.append((t, t_, err))
        for t, t_, err in sorted(res, key=lambda r: r[0])[:3]:
            print(f"    {t:7.1f} us {wbytes / 1e3 / t:5.0f} GB/s  matvec bn{t_.block_n} bk{t_.block_k} "
                  f"w{t_.num_warps} err {err:.1e}")
    packed = ws = None  # free the copies before the next shape
