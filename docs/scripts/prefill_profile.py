"""Kernel times of one 2,048-token prefill chunk (torch profiler) of the flash q2 shape cut to its first N
layers, random weights in VRAM, after a warm-up chunk. usage: prefill_profile.py N"""
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
tok = torch.randint(2, cfg.vocab_size, (2048,), generator=torch.Generator().manual_seed(0))
stage.prefill(tok, stage.new_cache(4096, chunk=2048), logits=True)  # warm-up (compiles)
torch.cuda.synchronize()
cache = stage.new_cache(4096, chunk=2048)
t = time.perf_counter()
stage.prefill(tok, cache, logits=True)
torch.cuda.synchronize()
print(f"prefill 2048: {2048 / (time.perf_counter() - t):.1f} tok/s")
cache = stage.new_cache(4096, chunk=2048)
with profile(activities=[ProfilerActivity.CUDA]) as p:
    stage.prefill(tok, cache, logits=True)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
