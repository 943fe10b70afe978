"""`ds4station bench` of the flash q2 shape cut to its first N layers, random weights in VRAM, for cards that
cannot hold the full shape (an 80 GB H100: 36 layers fit). Compares two trees on one card; not the product's
figure. usage: bench_layers.py N"""
import sys

import torch

from ds4station.engine import benchmark

n = int(sys.argv[1])
cfg, recipe = benchmark.SHAPES["flash-q2"]
benchmark.SHAPES["flash-q2"] = (cfg.replace(n_layers=n, compress_ratios=cfg.compress_ratios[:n],
                                            swiglu_clamp=cfg.swiglu_clamp[:n],
                                            swiglu_clamp_shared=cfg.swiglu_clamp_shared[:n]), recipe)
res = benchmark.run("flash-q2", prompts=(2048,), prefills=(2048, 8192), runs=3, log=lambda s: None)
print(res.table())
print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
