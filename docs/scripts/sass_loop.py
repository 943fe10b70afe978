"""Instructions in a kernel's hot loop, from the sm_90 SASS of the compile check's specs (Triton's bundled ptxas
and cuobjdump: no GPU needed). The loop is the longest backward branch; the count is per thread per trip.
usage: sass_loop.py NAME_SUBSTRING [CONSTEXPR=VALUE ...] (e.g. `sass_loop.py moe_prefill BLOCK_K=128`).
Counts differ between Triton versions (the IQ2_XXS table tile: 326 with 3.9, 395 with 3.6): for the GPU image's,
`PYTHONPATH=.venv/triton-min python docs/scripts/sass_loop.py ...` (make test installs Triton 3.6 there).
A count is a proxy: the fp16 table decode of IQ2_XXS halved it and ran 4% slower (docs/PERFORMANCE.md)."""
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ds4station.kernels import compile_check
from ds4station.kernels.dispatch import COMPILE_TARGETS

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def loop_counts(spec: compile_check.KernelSpec, **over: int) -> tuple[int, int, collections.Counter]:
    consts = {**spec.constexprs, **{k: v for k, v in over.items() if k not in ("num_warps", "num_stages")}}
    sig = dict(spec.signature)
    if "PDL" in spec.fn.arg_names:
        sig["PDL"], consts["PDL"] = "constexpr", True
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
    kernel = triton.compile(ASTSource(fn=spec.fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": over.get("num_warps", spec.num_warps),
                                     "num_stages": over.get("num_stages", spec.num_stages)})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(kernel.asm["cubin"])
        fh.flush()
        text = subprocess.run([f"{BIN}/cuobjdump", "-sass", fh.name], capture_output=True, text=True).stdout
        usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", fh.name], capture_output=True,
                               text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
           re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", text)]
    back = [(a - int(m.group(1), 16), int(m.group(1), 16), a) for a, op, rest in ins
            if op == "BRA" and (m := re.match(r"\s*0x([0-9a-f]+)", rest)) and int(m.group(1), 16) < a]
    lo, hi = max(back)[1:] if back else (0, -1)
    body = collections.Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)
    return sum(body.values()), int(re.search(r"REG:(\d+)", usage).group(1)), body


if __name__ == "__main__":
    target = next(t for t in COMPILE_TARGETS if t.name == "sm90")
    over = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
    for spec in compile_check._specs(target):
        if sys.argv[1] in spec.name:
            n, regs, body = loop_counts(spec, **over)
            print(f"{spec.name}: {n} instructions per trip, {regs} registers; "
                  + " ".join(f"{k} {v}" for k, v in body.most_common(12)))
