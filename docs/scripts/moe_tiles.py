"""The fused routed-expert decode (`moe_decode`, integer dot) on one Flash layer's 256 random q2 experts: the
gate+up tiles (rows 4/8/16 x K chunk 1024/2048/4096 with 1/2/4 warps), or with `--down` the down
projection's (rows 1-16 x K chunk 512-2048 with 1-8 warps), at 1 token and at 23 (a short prompt's static
step), or at the token counts given, 6 experts per token. Each case is timed as a CUDA graph over 16
routings, so few experts come back from L2. Needs a CUDA GPU. From the repository root:

    python docs/scripts/moe_tiles.py [--down] [tokens ...]

docs/PERFORMANCE.md has its runs (sixth session: the sweep behind dispatch.moe_tiles; that run also timed the
sign decodes the kernel had then, of which it keeps the fastest).
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from ds4station.engine.gpu import Experts, RandomWeights
from ds4station.kernels import dispatch
from ds4station.kernels.benchmark import _graph_time_us
from ds4station.kernels.moe import moe_decode
from ds4station.model.config import FLASH

SLOTS = 6
ROUTINGS = 16


def variants(base: dispatch.MoeTiles, down: bool) -> list[dispatch.MoeTiles]:
    if down:
        return [dataclasses.replace(base, down=dataclasses.replace(base.down, block_n=bn, block_k=bk, num_warps=nw))
                for bn in (1, 2, 4, 8, 16)
                for bk, nw in ((512, 1), (1024, 1), (1024, 2), (2048, 2), (2048, 4), (2048, 8))]
    return [dataclasses.replace(base, gate_up=dataclasses.replace(base.gate_up, block_n=bn, block_k=bk, num_warps=nw))
            for bn in (4, 8, 16) for bk, nw in ((1024, 1), (2048, 2), (4096, 4))]


def sweep(experts: Experts, t: int, gen: torch.Generator, down: bool) -> None:
    dev = torch.device("cuda")
    ids = [torch.rand(t, FLASH.n_experts, device=dev, generator=gen).topk(SLOTS, dim=1).indices.to(torch.int32)
           .contiguous() for _ in range(ROUTINGS)]
    wts = torch.rand(t, SLOTS, device=dev, generator=gen) + 0.1
    x = torch.randn(t, FLASH.dim, device=dev, generator=gen)
    y = torch.empty(t, FLASH.dim, device=dev)
    base = dispatch.moe_tiles("iq2_xxs", "q2_k", FLASH.dim, experts.gate.n, t * SLOTS, "cuda")
    want = moe_decode(x, experts.gate, experts.up, experts.down, ids[0], wts, 10.0, tiles=base)
    print(f"T={t}: default tiles {base}", flush=True)
    for tiles in variants(base, down):
        def launch(i: int, tiles: dispatch.MoeTiles = tiles) -> torch.Tensor:
            return moe_decode(x, experts.gate, experts.up, experts.down, ids[i], wts, 10.0, out=y, tiles=tiles)

        err = ((launch(0) - want).norm() / want.norm()).item()
        us = _graph_time_us(launch, ROUTINGS)
        t_ = tiles.down if down else tiles.gate_up
        print(f"  {'down' if down else 'gate_up'} block_n {t_.block_n:2d} block_k {t_.block_k} warps {t_.num_warps}: "
              f"{us:8.1f} us  (diff {err:.1e})", flush=True)


def main(rows: list[int], down: bool = False) -> None:
    w = RandomWeights(FLASH, "q2", range(3, 4), embed=False, output=False, device="cuda")
    experts = Experts(w["blk.3.ffn_gate_exps.weight"], w["blk.3.ffn_up_exps.weight"],
                      w["blk.3.ffn_down_exps.weight"], 10.0, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in rows:
        sweep(experts, t, gen, down)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([int(a) for a in args if a != "--down"] or [1, 23], "--down" in args)
