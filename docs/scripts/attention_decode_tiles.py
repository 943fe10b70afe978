"""Decode attention (`attention_decode_triton`: split + combine launches) at DS4's shape (64 heads x 512,
window 128) for one query and for 4 queries at once (a verification's or a short prompt's static step): a
ratio-4 layer (window + 512 indexed rows of 2,048), a ratio-128 layer at 8K and at 128K (64 / 1,024 rows) and a
window-only layer; us per call at the dispatched tiles and, with `--sweep`, at others (fp16 operands, the whole
head dim in one load and one dot, keys per split, output dims per program, warps), and one decode step's
attention over 43 layers (21 ratio-4, 20 ratio-128 at 8K, 2 window-only). Each case a CUDA graph of 32 calls, its
median replay. Compares trees when run from each with its own PYTHONPATH (an older tree: dispatched tiles
only). usage: attention_decode_tiles.py [--sweep]"""
import dataclasses
import sys

import torch

from ds4station.kernels import dispatch
from ds4station.kernels.attention import attention_decode_triton
from ds4station.kernels.benchmark import _graph_time_us

H, D, W, TOPK, POS = 64, 512, 128, 512, 8191
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
ring = torch.randn(W + 64, D, device=dev, generator=gen)
comp = torch.randn(32768, D, device=dev, generator=gen)
sinks = torch.randn(H, device=dev, generator=gen)


def cases(t: int) -> dict:
    q = torch.randn(t, H, D, device=dev, generator=gen) * 0.5
    pos = POS - t + 1 + torch.arange(t, device=dev)
    ids = torch.argsort(torch.rand(t, 2048, device=dev, generator=gen), dim=1)[:, :TOPK].sort(dim=1).values
    valid = torch.ones(t, TOPK, dtype=torch.bool, device=dev)
    out = {"ratio 4": (dict(kc=comp, mask_c=valid, ids=ids), 21, TOPK),
           "ratio 128 at 8K": (dict(kc=comp[:64], mask_c=None, ids=None, ratio=128), 20, 64),
           "ratio 128 at 128K": (dict(kc=comp[:1024], mask_c=None, ids=None, ratio=128), 0, 1024),
           "window": (dict(kc=None, mask_c=None, ids=None), 2, 0)}
    if t == 1:  # one query: [H, D] and [k] ids
        out = {k: (dict(kw, **({"mask_c": kw["mask_c"][0], "ids": kw["ids"][0]} if kw.get("ids") is not None
                               else {})), n, nc) for k, (kw, n, nc) in out.items()}
        return out, q[0], pos
    return out, q, pos


print(torch.cuda.get_device_name())
for t in (1, 4):
    layers, q, pos = cases(t)
    for kind, (kw, n_layers, nc) in layers.items():
        base = dispatch.attention_tiles(H, D, W + nc, "cuda")
        variants = [("dispatched", base)]
        if "--sweep" in sys.argv:
            for bn, bd, dv, w, prec in [(32, 64, 128, 4, "fp16"), (32, 512, 128, 4, "fp16"), (32, 512, 256, 8, "fp16"),
                                        (32, 512, 512, 8, "fp16"), (16, 512, 512, 8, "fp16"), (16, 512, 256, 4, "fp16"),
                                        (64, 512, 512, 8, "fp16"), (16, 64, 128, 4, "tf32")]:
                variants.append((f"n{bn} d{bd} dv{dv} w{w} {prec}", dataclasses.replace(
                    base, block_n=bn, block_d=bd, block_dv=dv, num_warps=w, precision=prec)))
        for name, tiles in variants:
            try:
                us = _graph_time_us(lambda _, kw=kw, tiles=tiles, q=q, pos=pos: attention_decode_triton(
                    q, ring, None, kw["kc"], kw["mask_c"], sinks, D ** -0.5, ids=kw["ids"], pos=pos, window=W,
                    ratio=kw.get("ratio", 0), tiles=tiles), 1)
                print(f"T={t} {kind:18} {name:24} {us:8.2f} us  (x{n_layers} layers: {us * n_layers:8.1f} us)")
            except Exception as exc:  # a tile that does not compile or fit
                print(f"T={t} {kind:18} {name:24} failed ({type(exc).__name__}: {str(exc)[:80]})")
