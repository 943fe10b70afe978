"""`ds4station inspect`: validate a DS4 GGUF and print its config and bytes per layer by tensor."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path of a DS4 GGUF file")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from ds4station.model.gguf import GGUFError, GGUFFile

    try:
        f = GGUFFile.open(args.model)
    except GGUFError as e:
        print(f"error: {e}")
        return 2
    layers = f.bytes_by_layer()
    if args.json:
        print(json.dumps({"config": dataclasses.asdict(f.config), "total_bytes": f.total_bytes,
                          "tensors": len(f.specs), "bytes": layers}, indent=1))
        return 0
    print(f"{f.path}: {len(f.specs)} tensors, {f.total_bytes / 2**30:.2f} GiB")
    for k, v in dataclasses.asdict(f.config).items():
        print(f"  {k:24} {v}")
    print(f"\n{'part':10} {'MiB':>10}  largest tensors")
    for key, roles in layers.items():
        top = sorted(roles.items(), key=lambda kv: -kv[1])[:3]
        print(f"{key:10} {sum(roles.values()) / 2**20:10.2f}  " + ", ".join(f"{r} {b / 2**20:.2f}" for r, b in top))
    return 0
