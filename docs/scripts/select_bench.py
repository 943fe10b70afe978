"""The lightning indexer's scores and top-512 selection (kernels/indexer.py index_topk_triton) at long context,
on a GPU, for comparing two trees (run it from each: `cd TREE && PYTHONPATH=$PWD python3 select_bench.py LABEL`):
- decode: one query against n index blocks of which the position sees pos / 4, replayed from a CUDA graph of
  20 calls as the decode step's graph replays it (timed eagerly, a ~60 us call would measure the host); from
  8K tokens of context (2,048 blocks: one stage) to 1M (262,144: three stages, torch.topk before);
- prefill: the last 2,048-query chunk of a 128K prompt (32,768 blocks: column blocks), eagerly, as prefill runs.
Integer-valued queries and keys give exact scores, so two trees agree on the ids' sum exactly."""
import sys

import torch
from triton.testing import do_bench

from ds4station.kernels.indexer import index_topk_triton

HEADS, DIM, RATIO, TOP = 64, 128, 4, 512
label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)


def inputs(T: int, n: int, pos: torch.Tensor) -> tuple:
    q = torch.randint(-3, 4, (T, HEADS, DIM), device=dev, generator=gen).float()
    w = torch.rand(T, HEADS, device=dev, generator=gen)
    keys = torch.randint(-3, 4, (n, DIM), device=dev, generator=gen).half()
    return q, w, keys, n, pos, RATIO, TOP


for n, pos in ((2048, 8191), (8192, 32767), (16384, 60000), (32768, 131071), (65536, 131071), (65536, 200000),
               (65536, 262143), (262144, 600000), (262144, 1048575)):
    args = inputs(1, n, torch.tensor([pos], device=dev))
    ids = index_topk_triton(*args)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles outside the capture
        index_topk_triton(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            index_topk_triton(*args)
    us = do_bench(graph.replay, warmup=20, rep=300) * 1000 / 20
    print(f"{label}: decode, {n:6d} blocks, position {pos:6d}: {us:6.1f} us (ids sum {int(ids.sum())})")
n, T = 32768, 2048
args = inputs(T, n, torch.arange(RATIO * n - T, RATIO * n, device=dev))
ids = index_topk_triton(*args)[0]
us = do_bench(lambda: index_topk_triton(*args), warmup=5, rep=100) * 1000
print(f"{label}: prefill, {T} queries x {n} blocks: {us:8.1f} us (ids sum {int(ids.sum())})")
