"""Programmatic dependent launch (kernels/pdl.py) is safe only if every kernel that may be launched early waits
for the kernel before it first. Checked on the source, so that a kernel added later cannot miss it on a
machine without a GPU (where pdl() launches nothing early): every Triton kernel of ds4station takes the PDL
constexpr and begins with enter(PDL) (after, at most, index arithmetic and weight loads: pdl.py), and every
launch passes pdl(...). The compile check
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


def _touches_more_than_weights(node: ast.AST, helpers: dict[str, ast.FunctionDef]) -> str:
    """What in `node` (recursing into the module's jit helpers it calls) touches memory other than by a weight
    load (`tl.load(..., eviction_policy="evict_first")`), or ""."""
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        name = ast.unparse(call.func)
        if name == "tl.load":
            policy = [ast.unparse(k.value) for k in call.keywords if k.arg == "eviction_policy"]
            if policy != ["'evict_first'"]:
                return f"a load that is not a weight stream's ({ast.unparse(call)[:60]})"
        elif name in helpers:
            bad = _touches_more_than_weights(helpers[name], helpers)
            if bad:
                return f"{name}: {bad}"
        elif any(w in name for w in ("store", "atomic", "asm", "enter")):
            return name
    return ""


def test_every_kernel_waits_first_and_every_launch_passes_pdl() -> None:
    kernels, launches, early = 0, 0, 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        helpers = {f.name: f for f in _jit_functions(tree)}
        launched = {c.func.value.id for c in _launches(tree)}  # type: ignore[attr-defined]
        for fn in _jit_functions(tree):
            if fn.name not in launched and not fn.name.endswith("_kernel"):
                continue  # a helper inlined into kernels
            kernels += 1
            names = [a.arg for a in fn.args.args]
            assert names[-1] == "PDL", f"{path.name}:{fn.name} does not end with the PDL constexpr"
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            entered = [i for i, st in enumerate(body) if ast.unparse(st) == "enter(PDL)"]
            assert entered, f"{path.name}:{fn.name} does not call enter(PDL) in its body"
            for st in body[:entered[0]]:  # before the wait: index arithmetic and weight loads only (pdl.py)
                bad = _touches_more_than_weights(st, helpers)
                assert not bad, f"{path.name}:{fn.name} does {bad} before enter(PDL)"
            early += entered[0] > 0
        for call in _launches(tree):
            launches += 1
            spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
            assert any(s.startswith("pdl(") for s in spread), \
                f"{path.name}:{call.lineno} launches {call.func.value.id} without **pdl(...)"  # type: ignore[attr-defined]
    assert kernels >= 28 and launches >= 28
    assert early >= 2  # the Q8_0 integer-dot and F16 matvecs load their first weights before the wait


def test_pdl_launches_nothing_early_off_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (and so in the interpreter) and when switched off, pdl() adds no launch arguments: the kernels
    keep their PDL=False default and Triton launches them in plain stream order."""
    assert pdl.pdl(torch.zeros(1)) == {}
    monkeypatch.setattr(pdl, "ON", False)
    assert not pdl.enabled(torch.device("cuda", 0))


def test_the_weights_rule_refuses_any_other_early_access() -> None:
    """The source check's rule itself: a weight load (directly or in a helper) may precede enter(PDL); any other
    load, a store or an atomic may not."""
    helpers = {f.name: f for f in _jit_functions(ast.parse(
        "@triton.jit\ndef _w(p, r):\n    return tl.load(p + r, mask=r < 4, eviction_policy='evict_first')\n"
        "@triton.jit\ndef _x(p, r):\n    return tl.load(p + r)\n"))}
    assert _touches_more_than_weights(ast.parse("q = _w(a, rows).to(tl.float32) * tl.arange(0, 4)"), helpers) == ""
    assert "not a weight stream" in _touches_more_than_weights(ast.parse("q = _x(a, rows)"), helpers)
    assert "not a weight stream" in _touches_more_than_weights(
        ast.parse("q = tl.load(a, eviction_policy='evict_last')"), helpers)
    assert _touches_more_than_weights(ast.parse("tl.store(a, q)"), helpers) == "tl.store"
    assert _touches_more_than_weights(ast.parse("tl.atomic_add(a, 1)"), helpers) == "tl.atomic_add"
