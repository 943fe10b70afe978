"""The `ds4station` CLI (or a script) with the CUDA decode attention tiles replaced, for a same-run A/B of a tile
choice at full shape before it goes into dispatch.attention_tiles:
  ATTN="n32 d512 dv512 w8 fp16" python3 docs/scripts/bench_attention_tiles.py bench --model FILE --prompts 8192 ...
  ATTN=... python3 docs/scripts/bench_attention_tiles.py docs/scripts/bench_layers.py 36
(n = keys per split, d = head-dim step, dv = output dims per program, w = warps, then the dot precision: the
names `attention_decode_tiles.py --sweep` prints). With no ATTN: the dispatched tiles.
  python3 docs/scripts/bench_attention_tiles.py --pick SWEEP_OUTPUT
prints the variant of a sweep's output with the least one-query time over a decode step's 43 layers (nothing
when the dispatched tiles won), and the totals per variant on stderr."""
import dataclasses
import os
import re
import runpy
import sys
from collections import defaultdict


def pick(path: str) -> str:
    tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for line in open(path):
        m = re.match(r"T=(\d) (.{18}) (.{24})\s+([\d.]+) us\s+\(x(\d+) layers: +([\d.]+) us\)", line)
        if m:
            tot[m.group(3).strip()][m.group(1) == "4"] += float(m.group(6))
    for name, (t1, t4) in sorted(tot.items(), key=lambda kv: kv[1][0]):
        print(f"{name:24} T=1 {t1:8.1f} us  T=4 {t4:8.1f} us", file=sys.stderr)
    best = min(tot, key=lambda name: tot[name][0]) if tot else "dispatched"
    return "" if best == "dispatched" else best


def patch(spec: str) -> None:
    from ds4station.kernels import dispatch

    n, d, dv, w, prec = spec.split()
    orig = dispatch.attention_tiles

    def tiles(h: int, dim: int, n_keys: int, backend: str) -> dispatch.AttentionTiles:
        t = orig(h, dim, n_keys, backend)
        if backend != "cuda":
            return t
        return dataclasses.replace(t, block_n=int(n[1:]), block_d=int(d[1:]), block_dv=int(dv[2:]),
                                   num_warps=int(w[1:]), precision=prec)

    dispatch.attention_tiles = tiles


if __name__ == "__main__":
    if sys.argv[1] == "--pick":
        print(pick(sys.argv[2]))
        sys.exit(0)
    if os.environ.get("ATTN"):
        patch(os.environ["ATTN"])
    print("decode attention tiles:", os.environ.get("ATTN") or "dispatched", flush=True)
    if sys.argv[1].endswith(".py"):
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        from ds4station.cli import main

        sys.exit(main(sys.argv[1:]))
