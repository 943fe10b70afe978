"""The opening of a child script that records the first torch / triton import (test_layering.py and
test_tui_no_torch.py run their checks in a fresh interpreter, since pytest's own process has torch loaded):
a meta-path finder keeps the stack of that import in `Watch.chain`, so a failure names the import chain."""

WATCH = r"""
import sys, traceback

class Watch:
    chain = None
    def find_spec(self, name, path=None, target=None):
        if Watch.chain is None and name.split(".")[0] in ("torch", "triton"):
            Watch.chain = [name] + [f"{f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_stack()[:-1]
                                    if "importlib._bootstrap" not in f.filename]
        return None

sys.meta_path.insert(0, Watch())
"""
