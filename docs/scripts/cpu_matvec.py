"""The CPU stage's ways to multiply a quantised matrix (kernels/ops.py _cpu_linear) at a few row counts: the
native matvec (kernels/cpu.py, 8 rows a call; beside it its integer dot, which the MoE runs for the 2-bit types
where built) against blocks of rows dequantised into the kept buffer and torch's matmul; best of 7, this machine's
threads, DS4 Flash shapes. Where the native matvec stops winning is CPU_MATVEC_ROWS.
usage: cpu_matvec.py [ROWS,...]"""
import sys
import time

import torch
from gguf import GGMLQuantizationType as Q

from ds4station.kernels import cpu, ops
from ds4station.kernels.benchmark import _random_raw

rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,4,8,16,32,64,128,256").split(",")]
gen = torch.Generator().manual_seed(0)


def best_ms(fn) -> float:
    fn()
    out = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


src = torch.empty(64 << 20, dtype=torch.float32).uniform_()
dst = torch.empty_like(src)
print(f"{torch.get_num_threads()} threads; copy {2 * src.numel() * 4 / best_ms(lambda: dst.copy_(src)) / 1e6:.1f} GB/s "
      "(read + write)")
print(f"{'matrix':26} {'rows':>5} {'native ms':>10} {'int8 ms':>8} {'blocks ms':>10} {'native Gw/s':>12}")
for qt, name, n, k in [(Q.Q8_0, "q8_0 attn_q_b", 32768, 1024), (Q.Q8_0, "q8_0 attn_output_b", 4096, 8192),
                       (Q.IQ2_XXS, "iq2_xxs expert gate", 2048, 4096), (Q.Q2_K, "q2_k expert down", 4096, 2048)]:
    w = ops.repack(_random_raw(qt, (n,), k, gen, 0.02), name.split()[0], k)
    for m in rows:
        x = torch.randn(m, k, generator=gen)
        ops.CPU_MATVEC_ROWS = 1 << 30
        native = best_ms(lambda x=x, w=w: ops.linear(x, w))
        int8 = f"{best_ms(lambda x=x, w=w: cpu.matvec(x, w, int8=True)):.2f}" if cpu.int8_matvec(w.qtype) else "-"
        ops.CPU_MATVEC_ROWS = 0
        blocks = best_ms(lambda x=x, w=w: ops.linear(x, w))
        print(f"{name + f' {n}x{k}':26} {m:5} {native:10.2f} {int8:>8} {blocks:10.2f} {n * k / native / 1e6:12.1f}")
