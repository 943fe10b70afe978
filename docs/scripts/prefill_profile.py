"""Kernel times of one 2,048-token prefill chunk (torch profiler) of the flash q2 shape cut to its first N
layers, random weights in VRAM, after a warm-up chunk; with CONTEXT, the chunk that follows CONTEXT tokens
already in the cache (e.g. 131072: the last chunk of a 128K prompt). usage: prefill_profile.py N [CONTEXT]"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ds4station.engine import benchmark
from ds4station.engine.gpu import GpuStage, RandomWeights

n = int(sys.argv[1])
cfg, recipe = benchmark.SHAPES["flash-q2"]
cfg = cfg.replace(n_layers=n, compress_ratios=cfg.compress_ratios[:n], swiglu_clamp=cfg.swiglu_clamp[:n],
                  swiglu_clamp_shared=cfg.swiglu_clamp_shared[:n])
dev = torch.device("cuda")
stage = GpuStage(cfg, RandomWeights(cfg, recipe, device=dev, seed=0), device=dev)
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 0
size = ctx + 4096
tok = torch.randint(2, cfg.vocab_size, (ctx + 2048,), generator=torch.Generator().manual_seed(0))


def context() -> object:
    """A cache holding the first ctx tokens (prefilled in 2,048-token chunks, untimed)."""
    cache = stage.new_cache(size, chunk=2048)
    if ctx:
        stage.prefill(tok[:ctx], cache)
    return cache


stage.prefill(tok[ctx:], context(), logits=True)  # warm-up (compiles)
torch.cuda.synchronize()
cache = context()
torch.cuda.synchronize()
t = time.perf_counter()
stage.prefill(tok[ctx:], cache, logits=True)
torch.cuda.synchronize()
print(f"prefill 2048 after {ctx}: {2048 / (time.perf_counter() - t):.1f} tok/s")
cache = context()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    stage.prefill(tok[ctx:], cache, logits=True)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
