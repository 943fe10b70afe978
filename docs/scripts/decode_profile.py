"""Where a one-row decode step's time goes: the flash q2 shape cut to its first N layers, random weights in VRAM,
one sequence after P prompt tokens, the step's CUDA graph replayed under the torch profiler. Prints, per kernel
family, launches and summed duration per step, then the step's span, the kernels' summed time and the gaps
between them. Run it with DS4STATION_PDL=0 for each kernel's own time (with PDL a kernel's duration includes its
wait for the one before). With B > 1, B sequences of P prompt tokens each decode together (the batched step's
graph, as serve runs B streams). usage: decode_profile.py N [P] [B]"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ds4station.engine import benchmark
from ds4station.engine.gpu import GpuStage, RandomWeights

n = int(sys.argv[1])
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 1
cfg, recipe = benchmark.SHAPES["flash-q2"]
cfg = cfg.replace(n_layers=n, compress_ratios=cfg.compress_ratios[:n], swiglu_clamp=cfg.swiglu_clamp[:n],
                  swiglu_clamp_shared=cfg.swiglu_clamp_shared[:n])
dev = torch.device("cuda")
stage = GpuStage(cfg, RandomWeights(cfg, recipe, device=dev, seed=0), device=dev)
caches = stage.new_caches(rows, prompt + 256, chunk=2048)
for b, cache in enumerate(caches):
    stage.prefill(torch.randint(2, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(b)), cache,
                  logits=True)
tokens = [7 + b for b in range(rows)]


def step() -> torch.Tensor:
    if rows == 1:
        return stage.decode(tokens[0], caches[0], logits=True)[None]
    return stage.decode_batch(tokens, caches, logits=True)


for _ in range(8):  # capture and warm up
    tokens = step().argmax(-1).tolist()
torch.cuda.synchronize()
steps = 10
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(steps):
    step()
end.record()
torch.cuda.synchronize()
print(f"{n} layers, {rows} row(s) after {prompt}: {start.elapsed_time(end) / steps:.3f} ms/step queued (events)")
with profile(activities=[ProfilerActivity.CUDA]) as p:
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
kernels = sorted((e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                 key=lambda e: e.time_range.start)
fam: dict[str, list[float]] = collections.defaultdict(list)
for e in kernels:
    fam[e.name[:60]].append(e.time_range.elapsed_us())
span = (kernels[-1].time_range.end - kernels[0].time_range.start) / steps
busy = sum(e.time_range.elapsed_us() for e in kernels) / steps
print(f"{'kernel':60} {'launches':>8} {'us/step':>9} {'us each':>8}")
for name, d in sorted(fam.items(), key=lambda kv: -sum(kv[1])):
    print(f"{name:60} {len(d) / steps:8.0f} {sum(d) / steps:9.1f} {sum(d) / len(d):8.2f}")
print(f"launches {len(kernels) / steps:.0f}/step; span {span:.1f} us/step; kernels' summed time {busy:.1f} us; "
      f"gaps {span - busy:.1f} us")
