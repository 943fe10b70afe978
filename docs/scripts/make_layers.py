"""The flash q2 shape cut to its first N layers as a GGUF file with random weights (`make-model --preset flash`
otherwise): a flash-shaped model for a GPU that cannot hold all 43 layers (30 layers, 61 GB, fit an 80 GB H100).
usage: make_layers.py OUT N [DEVICE]  (DEVICE: where the weights are made, default cuda)"""
import dataclasses
import sys

from ds4station.engine import demo

out, n = sys.argv[1], int(sys.argv[2])
base = demo.PRESETS["flash"]
demo.PRESETS[f"flash{n}"] = dataclasses.replace(base, n_layers=n, compress_ratios=base.compress_ratios[:n],
                                                swiglu_clamp=base.swiglu_clamp[:n],
                                                swiglu_clamp_shared=base.swiglu_clamp_shared[:n])
print(demo.make_model(out, preset=f"flash{n}", device=sys.argv[3] if len(sys.argv) > 3 else "cuda"))
