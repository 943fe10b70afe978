"""A CPU stage at the full Flash shape, cut to its first N layers (random q2 weights in RAM, as the bench builds
them): the prefill of P tokens and the decode steps after it (with the experts' integer-dot and fp32 matvecs,
alternately, where the integer dot is built), on this machine's cores. Compares trees (run it from each); not the
product's figure. usage: cpu_layers.py N [P [profile]]"""
import statistics
import sys
import time

import torch

from ds4station.engine import benchmark
from ds4station.engine.gpu import GpuStage, RandomWeights
from ds4station.kernels import cpu

n = int(sys.argv[1])
p = int(sys.argv[2]) if len(sys.argv) > 2 else 64
cfg, recipe = benchmark.SHAPES["flash-q2"]
cfg = cfg.replace(n_layers=n, compress_ratios=cfg.compress_ratios[:n], swiglu_clamp=cfg.swiglu_clamp[:n],
                  swiglu_clamp_shared=cfg.swiglu_clamp_shared[:n], n_hash_layers=min(n, cfg.n_hash_layers))
t = time.perf_counter()
stage = GpuStage(cfg, RandomWeights(cfg, recipe, device=torch.device("cpu"), seed=0), device=torch.device("cpu"))
print(f"flash q2 cut to {n} layers on the CPU ({torch.get_num_threads()} threads), built in "
      f"{time.perf_counter() - t:.0f} s")
cache = stage.new_cache(4096, chunk=256)
tokens = torch.randint(2, cfg.vocab_size, (p,), generator=torch.Generator().manual_seed(0))
t = time.perf_counter()
stage.prefill(tokens, cache, logits=True)
print(f"prefill {p} tokens: {time.perf_counter() - t:.2f} s ({p / (time.perf_counter() - t):.1f} tok/s)")
token = int(tokens[-1])
# the experts' integer-dot matvecs (the default where built), alternately with their fp32 form (int_dot False)
modes = [("int8 experts", None), ("fp32 experts", False)] * 3 if cpu.int8_matvec("iq2_xxs") else [("", None)]
for label, int_dot in modes:
    for block in stage.blocks:
        block.experts.int_dot = int_dot
    steps = []
    for _ in range(6):
        t = time.perf_counter()
        token = int(stage.decode(token, cache, logits=True).argmax())
        steps.append(time.perf_counter() - t)
    med = statistics.median(steps[1:])
    print(f"decode step after {p}: {med * 1e3:.0f} ms median of 5 ({1 / med:.2f} tok/s), {n} layers + head"
          + (f", {label}" if label else ""))
if len(sys.argv) > 3 and sys.argv[3] == "profile":  # where a decode step's time goes, by function
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        token = int(stage.decode(token, cache, logits=True).argmax())
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
