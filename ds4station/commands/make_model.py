"""`ds4station make-model`: write a random-weight DS4 GGUF (the demo model, or any preset shape)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="demo", help="model shape: demo (the built-in demo model, default), tiny (the "
                   "small test shape) or flash (the full 284B shape)")
    p.add_argument("--out", required=True, help="path of the GGUF file to write")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same file)")
    p.add_argument("--quant", default="q2", choices=["q2", "q2-q4", "q4", "f16", "f32"],
                   help="q2: the quant types of the common q2 file (default); q2-q4: as q2 with Q4_K routed experts "
                        "in the last layers (Flash: 37-42, as the q2-q4-imatrix file); q4: Q4_K routed experts "
                        "everywhere (as q4-imatrix); f16/f32: float weights")
    p.add_argument("--mtp", action="store_true", help="add the MTP (next-token prediction) layer, for speculative "
                   "decoding with serve --draft mtp (random weights: its drafts are rarely accepted)")
    p.add_argument("--device", default="cpu", help="where the random weights are drawn: cpu (default) or cuda "
                   "(much faster for the flash shape; the file differs from the CPU one)")


def run(args: argparse.Namespace) -> int:
    from ds4station.engine.demo import make_model
    from ds4station.model.gguf import GGUFFile

    path = make_model(args.out, preset=args.preset, seed=args.seed, quant=args.quant, device=args.device,
                      mtp=args.mtp)
    f = GGUFFile.open(path)
    print(f"wrote {path}: {len(f.specs)} tensors, {f.total_bytes / 2**20:.1f} MiB, "
          f"{f.config.n_layers} layers{' and the MTP layer' if f.has_mtp else ''}, vocab {f.config.vocab_size}")
    return 0
