"""The model's Q8_0 projections at 1, 2, 3, 4 and 8 fp32 activation rows through ops.linear (the engine's
routing: matvec or split-K matmul), each replayed in a CUDA graph over rotating weight copies, and their sum over
one step (43 layers + the head), for whichever ds4station is first on sys.path. usage: q8_0_rows.py TAG
(run it twice, the second time with an older checkout first on PYTHONPATH, to compare two versions in one run)."""
import sys

import torch
import triton.testing
from gguf import GGMLQuantizationType as Q

import ds4station
from ds4station.kernels import benchmark as kb
from ds4station.kernels import ops
from ds4station.kernels.q8_0 import PackedQ8_0, repack_q8_0

kb._median_ms = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
tag = sys.argv[1]
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
print(f"[{tag}] {ds4station.__file__}")
tot = {}
for name, n, k, groups in kb.Q8_0_DECODE:
    wbytes = n * k * 34 // 32
    copies = kb._copies(wbytes)
    packed = repack_q8_0(kb._random_raw(Q.Q8_0, (copies, n), k, gen, 0.02), k)
    ws = [PackedQ8_0(packed.qs[i], packed.d[i]) for i in range(copies)]
    row = []
    for m in (1, 2, 3, 4, 8):
        x = torch.randn(m, groups * k, device=dev, dtype=torch.float32)
        t = kb._graph_time_us(lambda i, x=x, ws=ws, groups=groups: ops.linear(x, ws[i], groups=groups,
                                                                         out_dtype=torch.float32), copies)
        row.append(t)
        per_step = 43 if name != "output_head" else 1
        tot[m] = tot.get(m, 0.0) + t * per_step
    print(f"[{tag}] | {name} {n}x{k} | " + " | ".join(f"{t:.1f}" for t in row) + " |", flush=True)
    packed = ws = None  # free the copies before the next shape
print(f"[{tag}] | all Q8_0 of one step (43 layers + head), ms | "
      + " | ".join(f"{tot[m] / 1e3:.2f}" for m in (1, 2, 3, 4, 8)) + " |")
