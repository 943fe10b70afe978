"""Prefill attention (`attention_prefill_triton`) at DS4's shape (64 heads x 512, window 128) over one
2,048-query chunk: the last chunk of an 8K prompt (the ratio-4 layers' 512 indexed rows of 2,048, the ratio-128
layers' 64 rows) and the first chunk of any prompt (position 0: 512 rows seen causally), ms per layer at the
dispatched tiles, and with `--sweep` at others; then one chunk's attention over the 43 layers (21 ratio-4, 20
ratio-128, 2 window-only). Each case the median of `triton.testing.do_bench`. Compares trees when run from
each with its own PYTHONPATH (an older tree runs its dispatched tiles only).
usage: attention_prefill_tiles.py [--sweep] [--fp16-kv]"""
import dataclasses
import sys

import torch

from ds4station.kernels import dispatch
from ds4station.kernels.attention import attention_prefill_ref, attention_prefill_triton
from ds4station.kernels.benchmark import _median_ms

H, D, W, T, TOPK = 64, 512, 128, 2048, 512
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
kv_dtype = torch.float16 if "--fp16-kv" in sys.argv else torch.float32
q = torch.randn(T, H, D, device=dev, generator=gen) * 0.5
ring = torch.randn(W + T, D, device=dev, generator=gen).to(kv_dtype)
comp = torch.randn(2048, D, device=dev, generator=gen).to(kv_dtype)
sinks = torch.randn(H, device=dev, generator=gen)


def cases(start: int) -> dict:
    pos = start + torch.arange(T, device=dev)
    if start:  # every query's own top 512 of the 2,048 rows of an 8K prompt, all visible
        ids = torch.argsort(torch.rand(T, 2048, device=dev, generator=gen), dim=1)[:, :TOPK].sort(dim=1).values
        valid = torch.ones(T, TOPK, dtype=torch.bool, device=dev)
    else:  # the first chunk: the 512 rows closed by its end, each seen from its closing position on
        ids = torch.arange(TOPK, device=dev).expand(T, TOPK).contiguous()
        valid = (ids + 1) * 4 <= pos[:, None] + 1
    n_hca = (start + T) // 128
    return {"ratio 4": (dict(kc=comp, mask_c=valid, ids=ids), 21),
            "ratio 128": (dict(kc=comp[:n_hca], mask_c=None, ids=None, ratio=128), 20),
            "window": (dict(kc=None, mask_c=None, ids=None), 2)}, pos


base = dispatch.attention_prefill_tiles(H, D, "cuda")
variants = [("dispatched", base)]
if "--sweep" in sys.argv:
    for bn, bd, dv, w, prec in [(32, 512, 256, 8, "fp16"), (64, 512, 128, 8, "fp16"), (64, 512, 512, 8, "fp16"),
                                (64, 512, 512, 16, "fp16"), (32, 512, 512, 8, "fp16"), (64, 512, 256, 8, "tf32"),
                                (64, 128, 256, 8, "fp16")]:
        variants.append((f"n{bn} d{bd} dv{dv} w{w} {prec}", dataclasses.replace(
            base, block_n=bn, block_d=bd, block_dv=dv, num_warps=w, precision=prec)))
print(f"{torch.cuda.get_device_name()}, KV {kv_dtype}, dispatched {base}")
for start, label in ((6144, "last chunk of 8K"), (0, "first chunk")):
    layers, pos = cases(start)
    for name, tiles in variants:
        total, line = 0.0, []
        for kind, (kw, n_layers) in layers.items():
            try:
                ms = _median_ms(lambda kw=kw, pos=pos, tiles=tiles: attention_prefill_triton(
                    q, ring, sinks=sinks, scale=D ** -0.5, pos=pos, window=W, tiles=tiles, **kw))
            except Exception as exc:  # a tile that does not compile or fit
                line.append(f"{kind} failed ({type(exc).__name__}: {str(exc)[:60]})")
                total = float("nan")
                continue
            total += ms * n_layers
            line.append(f"{kind} {ms:.3f}")
        err = ""
        if name == "dispatched":
            kw = layers["ratio 4"][0]
            got = attention_prefill_triton(q[:4], ring, sinks=sinks, scale=D ** -0.5, pos=pos[:4], window=W,
                                           tiles=tiles, **kw | {"mask_c": kw["mask_c"][:4], "ids": kw["ids"][:4]})
            want = attention_prefill_ref(q[:4].cpu(), ring.float().cpu(), kw["kc"].float().cpu(),
                                         kw["mask_c"][:4].cpu(), sinks.cpu(), D ** -0.5, kw["ids"][:4].cpu(),
                                         pos[:4].cpu(), W)
            err = f"  rel err {((got.cpu() - want).norm() / want.norm()).item():.1e}"
        print(f"{label:17} {name:22} ms/layer: {', '.join(line)}; 43 layers {total:.1f} ms{err}")
