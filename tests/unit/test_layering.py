"""The package's folders are its layers: a module imports only its own layer and those below.

errors -> model, results -> ranks -> runtime -> analyses -> engine, plot -> serve, explorer ->
cli. Read from the source (ast), every import counts, lazy ones inside functions included;
imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "envoykit"

# Layer of each top-level name in the package; equal numbers may not import each other.
LAYERS = {
    "errors": 0,
    "model": 1,
    "results": 1,
    "ranks": 2,
    "runtime": 3,
    "analyses": 4,
    "engine": 5,
    "plot": 5,
    "serve": 6,
    "explorer": 6,
    "cli": 7,
    "__init__": 8,
}

# The one documented convenience that reaches up: ``LensResult.plot()`` draws with
# `envoykit.plot` (imported when called).
ALLOWED = {("results/lens.py", "plot")}


def _unit(module: Path) -> str:
    parts = module.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imported_units(module: Path) -> set[str]:
    """The package's top-level names that ``module`` imports at run time."""
    tree = ast.parse(module.read_text())
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "envoykit":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "envoykit" and len(parts) > 1:
                    found.add(parts[1])
    return {name for name in found if name in LAYERS}


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "data" not in p.parts)


def test_every_module_has_a_layer():
    assert {_unit(m) for m in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: str(m.relative_to(PACKAGE)))
def test_imports_point_down(module):
    unit = _unit(module)
    rel = str(module.relative_to(PACKAGE))
    upward = sorted(
        name
        for name in imported_units(module) - {unit}
        if LAYERS[name] >= LAYERS[unit] and (rel, name) not in ALLOWED
    )
    assert not upward, f"{rel} (layer {LAYERS[unit]}) imports {upward} from its layer or above"


def test_the_check_sees_an_upward_import(tmp_path):
    """A module of `results` that imported an analysis would be found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from envoykit.analyses import lens\n")
    assert imported_units(bad) == {"analyses"}
