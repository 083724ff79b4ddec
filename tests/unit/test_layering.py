"""The package's folders are its layers: a module imports only its own layer and those below.

_compat (the private names of nnsight, vLLM, torch and CPython), errors -> model, results ->
ranks -> runtime -> analyses -> engine, plot -> serve, explorer -> the package's public names
(``__init__``) -> cli, which is a user of those names. Read from the
source (ast), every import counts, lazy ones inside functions included, and ``import envoykit``
or ``from envoykit import Engine`` inside the package counts as an import of the top
(``__init__``); imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are
left out. Within one layer, modules import each other without a circle, but for the documented
ones in `KNOWN_CYCLES`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "envoykit"

# Layer of each top-level name in the package; equal numbers may not import each other.
LAYERS = {
    "_compat": 0,
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
    "__init__": 7,
    "cli": 8,
}

# The one documented convenience that reaches up: ``LensResult.plot()`` draws with
# `envoykit.plot` (imported when called).
ALLOWED = {("results/lens.py", "plot")}

# Circles inside one layer that are kept on purpose, each with why.
KNOWN_CYCLES: set[frozenset[str]] = set()


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
            else:  # a layer by name, or a name the package's top exports
                found.update(a.name if a.name in LAYERS else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "envoykit":
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return {name for name in found if name in LAYERS}


def _module_name(module: Path, root: Path) -> str:
    parts = module.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(module: Path, known: set[str]) -> set[str]:
    """The package's modules (of ``known``, named without ``envoykit.``) that ``module``
    imports at run time."""
    tree = ast.parse(module.read_text())
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module.removeprefix("envoykit").lstrip(".")
            if node.module.split(".")[0] != "envoykit":
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}".lstrip(".")
                found.add(name if name in known else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "envoykit":
                    found.add(alias.name.removeprefix("envoykit").lstrip("."))
    return found & known


def cycles_within_layers(root: Path) -> set[frozenset[str]]:
    """Each circle of imports among the modules of one top-level folder of ``root``, as the
    set of its modules."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py") if "data" not in p.parts}
    folder = {name: name.split(".")[0] for name in modules}
    graph = {
        name: {t for t in imported_modules(path, set(modules)) if folder[t] == folder[name]}
        for name, path in modules.items()
    }
    found: set[frozenset[str]] = set()

    def visit(start: str, node: str, path: list[str]) -> None:
        for step in graph[node] - {folder[start]}:
            if step == start:
                found.add(frozenset(path))
            elif step not in path and step > start:  # each circle once, from its least module
                visit(start, step, [*path, step])

    for name in graph:
        visit(name, name, [name])
    return found


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


def test_no_circle_inside_a_layer_but_the_documented_ones():
    circles = cycles_within_layers(PACKAGE) - KNOWN_CYCLES
    assert not circles, [sorted(c) for c in circles]


def test_the_check_sees_the_package_top_imported_from_inside(tmp_path):
    """``import envoykit`` and ``from envoykit import Engine`` reach the top layer."""
    bad = tmp_path / "bad.py"
    bad.write_text("import envoykit\n\ndef f():\n    from envoykit import Engine\n")
    assert imported_units(bad) == {"__init__"}
    bad.write_text("from envoykit import errors, plot\n")
    assert imported_units(bad) == {"errors", "plot"}


def test_the_check_sees_a_circle_inside_a_layer(tmp_path):
    """Two modules of one folder that import each other (one lazily) are a circle; an
    import under TYPE_CHECKING is none."""
    folder = tmp_path / "analyses"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "a.py").write_text("from envoykit.analyses.b import g\n")
    (folder / "b.py").write_text("def g():\n    from envoykit.analyses import a\n")
    (folder / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from envoykit.analyses import a\n"
    )
    (folder / "d.py").write_text("import envoykit.analyses.c\n")
    assert cycles_within_layers(tmp_path) == {frozenset({"analyses.a", "analyses.b"})}
