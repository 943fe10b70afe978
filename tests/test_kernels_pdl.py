"""Programmatic dependent launch (kernels/pdl.py) is safe only if every kernel that may be launched early waits
for the kernel before it first. Checked on the source, so that a kernel added later cannot miss it on a
machine without a GPU (where pdl() launches nothing early): every Triton kernel of ds4station takes the PDL
constexpr and begins with enter(PDL), and every launch passes pdl(...). The compile check
(test_kernels_compile.py) checks the order in each kernel's sm_90 PTX."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ds4station.kernels import pdl

KERNELS = Path(__file__).resolve().parent.parent / "ds4station" / "kernels"


def _jit_functions(tree: ast.AST) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in n.decorator_list)]


def _launches(tree: ast.AST) -> list[ast.Call]:
    """kernel[grid](...) calls."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name) and n.func.value.id.endswith("_kernel")]


def test_every_kernel_waits_first_and_every_launch_passes_pdl() -> None:
    kernels, launches = 0, 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        launched = {c.func.value.id for c in _launches(tree)}  # type: ignore[attr-defined]
        for fn in _jit_functions(tree):
            if fn.name not in launched and not fn.name.endswith("_kernel"):
                continue  # a helper inlined into kernels
            kernels += 1
            names = [a.arg for a in fn.args.args]
            assert names[-1] == "PDL", f"{path.name}:{fn.name} does not end with the PDL constexpr"
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            assert ast.unparse(body[0]) == "enter(PDL)", f"{path.name}:{fn.name} does not begin with enter(PDL)"
        for call in _launches(tree):
            launches += 1
            spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            assert any(s.startswith("pdl(") for s in spread), \
                f"{path.name}:{call.lineno} launches {call.func.value.id} without **pdl(...)"  # type: ignore[attr-defined]
    assert kernels >= 30 and launches >= 30


def test_pdl_launches_nothing_early_off_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (and so in the interpreter) and when switched off, pdl() adds no launch arguments: the kernels
    keep their PDL=False default and Triton launches them in plain stream order."""
    assert pdl.pdl(torch.zeros(1)) == {}
    monkeypatch.setattr(pdl, "ON", False)
    assert not pdl.enabled(torch.device("cuda", 0))
