"""Kernel profile of a short prompt's static-step graph on the served path's kernel stage: all 43 Flash layers
(random q2 weights made in VRAM, no file), the prompt at position 0, the graph replayed under torch.profiler.
Needs a CUDA GPU with ~85 GiB free. From the repository root:

    python docs/scripts/short_step_profile.py [tokens ...]

docs/PERFORMANCE.md has its runs (sixth session: 23 tokens before and after the MoE and attention changes).
"""
from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ds4station.engine.gpu import GpuStage, RandomWeights
from ds4station.model.config import FLASH


def profile_rows(stage: GpuStage, cache, t: int) -> None:  # type: ignore[no-untyped-def]
    tokens = torch.randint(2, 100000, (t,), device="cuda")

    def run() -> None:
        cache.length = 0  # the same positions again: what they overwrite is what they wrote
        stage.prefill(tokens, cache, logits=True)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        run()
    b.record()
    torch.cuda.synchronize()
    print(f"T={t}: static graph {a.elapsed_time(b) / 10:.2f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main(rows: list[int]) -> None:
    stage = GpuStage(FLASH, RandomWeights(FLASH, "q2", device="cuda"), device="cuda")
    cache = stage.new_cache(16384, chunk=2048)
    stage.capture(cache, embedded=True, logits=True, positions=16384)
    for t in rows:
        profile_rows(stage, cache, t)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [23])
