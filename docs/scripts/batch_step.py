"""The batched decode step on the H200: ms per step for B = 1, 2, 4, 8 (graph replays), the capture cost, and
where the B = 4 step's time goes (kernels inside the graph, CUPTI)."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ds4station.engine.engine import Engine

eng = Engine.load(sys.argv[1], ctx=32768, sessions=8)
cfg = eng.cfg
g = torch.Generator().manual_seed(0)
ss = [eng.new_session() for _ in range(8)]
for s in ss:
    s.extend(torch.randint(1000, cfg.vocab_size, (600,), generator=g).tolist())
torch.cuda.synchronize()
def steps(B, n):
    for _ in range(n):
        eng.decode_batch(ss[:B], [1234 + i for i in range(B)])
    torch.cuda.synchronize()
for B in (1, 2, 4, 8):
    t = time.perf_counter()
    steps(B, 1)
    cap = time.perf_counter() - t
    t = time.perf_counter()
    steps(B, 20)
    dt = (time.perf_counter() - t) / 20
    print(f"B={B}: first step (capture) {cap*1000:.0f} ms, then {dt*1000:.2f} ms/step = {B/dt:.1f} tok/s", flush=True)
t = time.perf_counter()
for _ in range(20):
    ss[0].extend([77])
torch.cuda.synchronize()
dt = (time.perf_counter() - t) / 20
print(f"single session extend: {dt*1000:.2f} ms/step", flush=True)
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    steps(4, 5)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
