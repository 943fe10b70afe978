"""The package's layers: model/, planner/, hardware/ and tui/ (and the CLI parser) never import torch or
triton, so `ds4station plan`, `inspect`, `detect` and the control panel start light; kernels/ never imports
the engine (the engine builds on the kernels, not the other way round)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from import_watch import WATCH

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "ds4station"
TORCH_FREE = ("model", "planner", "hardware", "tui")
HEAVY = ("torch", "triton")

# Run in a fresh interpreter (pytest has torch loaded already). A meta-path finder records the stack the
# first time torch or triton is asked for, so a failure names the import chain, not just the fact.
_IMPORT_ALL = WATCH + r"""
import importlib, json, pkgutil

imported = []
for pkg in ("ds4station.model", "ds4station.planner", "ds4station.hardware", "ds4station.tui"):
    mod = importlib.import_module(pkg)
    imported.append(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
import ds4station.cli
ds4station.cli.build_parser()  # imports every ds4station/commands module (their module level only)
imported.append("ds4station.cli")
print(json.dumps({"imported": imported, "heavy": sorted(m for m in sys.modules if m.split(".")[0] in
                  ("torch", "triton")), "chain": Watch.chain}))
"""


def test_light_packages_import_without_torch_in_a_fresh_interpreter() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    chain = "\n".join(report["chain"] or [])
    assert report["heavy"] == [], f"imported {report['heavy'][:5]} through:\n{chain}"
    # every module of the four packages was actually imported (a walk that found nothing proves nothing)
    expected = {".".join(_module_name(f)) for p in TORCH_FREE for f in (PKG / p).rglob("*.py")}
    expected |= {"ds4station.model.gguf", "ds4station.model.footprint", "ds4station.tui.screens.plan"}
    assert len(expected) >= 25
    assert expected <= set(report["imported"]), sorted(expected - set(report["imported"]))


def _module_name(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(REPO).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path, package: tuple[str, ...] | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in the file, at any depth (inside functions too). A
    `from X import a, b` also yields X.a and X.b, since a and b may be submodules (`from .. import engine`).
    `package` is the file's package (default: from its place in the repository)."""
    if package is None:
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                assert base, f"{path}:{node.lineno}: relative import above the top package"
                module = ".".join((*base, node.module) if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names if a.name != "*"]
    return found


def _within(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def test_the_import_resolver_sees_relative_and_nested_imports(tmp_path: Path) -> None:
    # the static checks below are only as good as this resolver: it must catch every spelling
    probe = tmp_path / "probe.py"  # as if it were ds4station/kernels/probe.py
    probe.write_text("from ..engine import weights\nfrom .. import engine\n\ndef f():\n    import torch.nn\n"
                     "    from ds4station.engine.demo import make_model\n")
    mods = _imports(probe, ("ds4station", "kernels"))
    assert (1, "ds4station.engine") in mods and (2, "ds4station.engine") in mods
    assert (5, "torch.nn") in mods and (6, "ds4station.engine.demo") in mods
    assert (1, "ds4station.engine.weights") in mods


def test_kernels_never_import_the_engine() -> None:
    files = sorted((PKG / "kernels").rglob("*.py"))
    assert len(files) > 10
    bad = [f"{f.relative_to(REPO)}:{line}: {mod}" for f in files for line, mod in _imports(f)
           if _within(mod, ("ds4station.engine",))]
    assert not bad, "kernels/ imports the engine:\n" + "\n".join(bad)


def test_light_packages_have_no_torch_or_triton_import_anywhere() -> None:
    # Not even inside a function: model/ planner/ hardware/ tui/ run where torch is absent or slow to load.
    # The engine and the kernels import torch at module level, so reaching them counts too. The tui may use
    # ds4station.commands.* (e.g. serve's option list); those are torch-free at module level, which the
    # fresh-interpreter test above checks.
    forbidden = (*HEAVY, "ds4station.engine", "ds4station.kernels")
    bad = []
    checked = 0
    for sub in TORCH_FREE:
        for f in sorted((PKG / sub).rglob("*.py")):
            checked += 1
            bad += [f"{f.relative_to(REPO)}:{line}: {mod}" for line, mod in _imports(f) if _within(mod, forbidden)]
    assert checked >= 25
    assert not bad, "heavy imports in a torch-free package:\n" + "\n".join(bad)
