"""Host cost of one sampled token (`Sampler`) at DeepSeek-V4-Flash's vocabulary (129,280 logits), on the device
given (default cpu): flat and peaked random logits, three common settings, ms per token (mean of 50).

    python docs/scripts/sampler_cost.py [cpu|cuda]
"""
import sys
import time

import torch

from ds4station.engine.sampler import Sampler, SamplingParams

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
for name, logits in (("random", torch.randn(129280, generator=g).to(dev) * 3),
                     ("peaked", torch.randn(129280, generator=g).to(dev) * 12)):
    for p in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=40, top_p=0.95)):
        s = Sampler(p)
        for _ in range(3):
            s(logits)
        t = time.perf_counter()
        for _ in range(50):
            s(logits)
        print(name, p.temperature, p.top_p, p.top_k, f"{(time.perf_counter()-t)/50*1000:.2f} ms")
