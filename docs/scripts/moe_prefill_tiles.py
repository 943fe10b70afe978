"""`moe_prefill` on one Flash layer's 256 random q2 experts (IQ2_XXS gate + up, Q2_K down), 6 experts per token:
ms per layer and TFLOP/s at the dispatched tiles and a few others, the per-kernel split (torch profiler) of the
fastest, each case a CUDA graph over 4 routings. Needs a CUDA GPU. Compares trees when run from each with its own
PYTHONPATH. usage: moe_prefill_tiles.py [TOKENS,...] (default 2048)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ds4station.engine.gpu import Experts, RandomWeights
from ds4station.kernels import dispatch
from ds4station.kernels.benchmark import _graph_time_us
from ds4station.kernels.moe_prefill import moe_prefill
from ds4station.model.config import FLASH

SLOTS, ROUTINGS = 6, 4
MT = dispatch.MatmulTiles
VARIANTS = [MT(bm, bn, bk, 1, nw, ns) for bm, bn, bk, nw, ns in
            ((64, 64, 128, 4, 1), (64, 128, 64, 4, 1), (64, 128, 64, 8, 1), (32, 64, 64, 4, 1), (128, 64, 64, 4, 1),
             (64, 64, 64, 4, 2), (64, 64, 64, 8, 1), (128, 128, 64, 8, 1), (128, 64, 64, 8, 1), (256, 64, 64, 8, 1))]


def main(token_counts: list[int]) -> None:
    dev = torch.device("cuda")
    w = RandomWeights(FLASH, "q2", range(3, 4), embed=False, output=False, device="cuda")
    ex = Experts(w["blk.3.ffn_gate_exps.weight"], w["blk.3.ffn_up_exps.weight"], w["blk.3.ffn_down_exps.weight"],
                 10.0, dev)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in token_counts:
        ids = [torch.rand(t, FLASH.n_experts, device=dev, generator=gen).topk(SLOTS, dim=1).indices.to(torch.int32)
               for _ in range(ROUTINGS)]
        wts = torch.rand(t, SLOTS, device=dev, generator=gen) + 0.1
        x = torch.randn(t, FLASH.dim, device=dev, generator=gen) * 0.5
        base = dispatch.moe_prefill_tiles(t * SLOTS, "cuda")
        want = moe_prefill(x, ex.gate, ex.up, ex.down, ids[0], wts, 10.0, tiles=base)
        flop = 2 * t * SLOTS * 3 * FLASH.dim * ex.gate.n
        best = None
        for v in [base, *VARIANTS]:
            try:
                got = moe_prefill(x, ex.gate, ex.up, ex.down, ids[0], wts, 10.0, tiles=v)
            except Exception as exc:  # a tile that does not compile or fit
                print(f"T={t} m{v.block_m} n{v.block_n} k{v.block_k} w{v.num_warps} s{v.num_stages}: failed "
                      f"({type(exc).__name__}: {str(exc)[:80]})", flush=True)
                continue
            err = ((got - want).norm() / want.norm()).item()
            def launch(i: int, v: dispatch.MatmulTiles = v, x: torch.Tensor = x, ids: list = ids,
                       wts: torch.Tensor = wts) -> torch.Tensor:
                return moe_prefill(x, ex.gate, ex.up, ex.down, ids[i], wts, 10.0, tiles=v)

            us = _graph_time_us(launch, ROUTINGS)
            best = min(best or (us, v), (us, v), key=lambda r: r[0])
            print(f"T={t} m{v.block_m} n{v.block_n} k{v.block_k} w{v.num_warps} s{v.num_stages}: {us / 1e3:7.3f} ms"
                  f"  {flop / us / 1e6:6.1f} TFLOP/s  diff {err:.1e}", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            moe_prefill(x, ex.gate, ex.up, ex.down, ids[0], wts, 10.0, tiles=best[1])
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=50))


if __name__ == "__main__":
    main([int(a) for a in (sys.argv[1] if len(sys.argv) > 1 else "2048").split(",")])
