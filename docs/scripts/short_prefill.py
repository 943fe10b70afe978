"""Short prefill on the served path's kernel stage: all 43 Flash layers (random q2 weights made in VRAM, no
file), the static-step graphs (the default for 2-32 new tokens) against the chunked eager prefill, and one
decode step for scale. Needs a CUDA GPU with ~85 GiB free. From the repository root:

    python docs/scripts/short_prefill.py

docs/PERFORMANCE.md has its runs. The logits of the two forms differ by summation order (different kernels);
on random weights such a difference can flip an expert or indexer choice, so only the timing is compared.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ds4station.engine.gpu import GpuStage, RandomWeights
from ds4station.model.config import FLASH


def timed(fn: Callable[[], object], n: int = 8) -> tuple[float, float]:
    """(wall ms, GPU ms) per call, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3, a.elapsed_time(b) / n


def main() -> None:
    t0 = time.perf_counter()
    stage = GpuStage(FLASH, RandomWeights(FLASH, "q2", device="cuda"), device="cuda")
    cache = stage.new_cache(16384, chunk=2048)
    torch.cuda.synchronize()
    print(f"stage built in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    graphs = stage.capture(cache, embedded=True, logits=True, positions=16384)
    torch.cuda.synchronize()
    print(f"{graphs} step graphs captured in {time.perf_counter() - t0:.1f} s")

    def at(p0: int, tokens: torch.Tensor, graph: bool | None) -> Callable[[], object]:
        def run() -> object:
            cache.length = p0  # the same positions again: what they overwrite is what they wrote
            return stage.prefill(tokens, cache, logits=True, graph=graph)
        return run

    for p0 in (0, 8192):
        if p0:
            cache.length = 0
            stage.prefill(torch.randint(2, FLASH.vocab_size, (p0,), device="cuda"), cache)
        for n in (2, 5, 8, 16, 20, 22, 24, 32):
            tokens = torch.randint(2, FLASH.vocab_size, (n,), device="cuda")
            eager_wall, eager_gpu = timed(at(p0, tokens, False))
            graph_wall, graph_gpu = timed(at(p0, tokens, None))
            cache.length = p0
            rows = stage.short_rows(n, cache)
            print(f"prefill of {n:2d} tokens at {p0:5d}: chunked eager {eager_wall:6.2f} ms wall "
                  f"({eager_gpu:6.2f} GPU); static step, {rows} rows, graph {graph_wall:6.2f} ms wall "
                  f"({graph_gpu:6.2f} GPU)")

    def decode() -> object:
        cache.length = 8192
        return stage.decode(5, cache, logits=True)

    wall, gpu = timed(decode)
    print(f"decode step at 8192: {wall:.2f} ms wall ({gpu:.2f} GPU)")


if __name__ == "__main__":
    main()
