"""Every private name of nnsight, vLLM, torch and CPython that envoykit uses is in
``envoykit/_compat.py``, exists in the installed packages, and is touched nowhere else.

An upgrade that moves one of them fails `test_each_private_name_exists` with the name, its
owner and what in envoykit needs it; `test_no_module_but_compat_reaches_for_one` scans the
package's source (ast) so that a new use outside the compat layer fails too.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import warnings
from pathlib import Path

import pytest

from envoykit import _compat

PACKAGE = Path(__file__).resolve().parents[2] / "envoykit"
FOREIGN = {"nnsight", "vllm", "torch", "multiprocessing", "forkserver", "transformers"}
OWN_SOURCE = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "_compat.py")


def assigned_in(owner: type, name: str) -> bool:
    """``self.name = ...`` (or an annotated one) in the source of ``owner`` or a base."""
    pattern = re.compile(rf"self\.{re.escape(name)}\s*[:=]")
    for cls in owner.__mro__:
        try:
            if pattern.search(inspect.getsource(cls)):
                return True
        except (OSError, TypeError):  # builtins
            continue
    return False


@pytest.mark.parametrize("private", _compat.PRIVATE, ids=lambda p: f"{p.owner}.{p.name}")
def test_each_private_name_exists(private):
    owner = private.resolve()
    if private.instance:
        found = assigned_in(owner, private.name)
    else:  # an attribute, or a submodule not imported yet
        found = hasattr(owner, private.name) or (
            inspect.ismodule(owner) and importlib.util.find_spec(f"{owner.__name__}.{private.name}")
        )
    assert found, (
        f"{private.owner} has no {private.name} any more: {private.needed_by} needs it "
        "(see envoykit/_compat.py)"
    )


# Names accessed as attributes that only the compat layer may touch: the private names that
# are not hooks, less those envoykit also uses for attributes of its own (``_model`` is a
# connection's too), which the scan cannot tell apart.
OWN_NAMES = {
    name for pair in re.findall(r"self\.(_\w+)\s*[:=]|def (_\w+)\(", OWN_SOURCE) for name in pair
}
GUARDED = {p.name for p in _compat.PRIVATE if not p.hook} - OWN_NAMES


PRIVATE_PATH = re.compile(r"(torch|vllm|nnsight)(\.\w+)*\._\w+.*")


def violations(source: str) -> list[str]:
    """Each place in ``source`` that reaches for another package's private name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            private = [a.name for a in node.names if a.name.startswith("_")]
            if node.module.split(".")[0] in FOREIGN and private:
                found.append(f"line {node.lineno}: from {node.module} import {private}")
            elif any(part.startswith("_") for part in node.module.split(".")[1:]) and (
                node.module.split(".")[0] in FOREIGN
            ):
                found.append(f"line {node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in FOREIGN and any(p.startswith("_") for p in parts[1:]):
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Attribute):
            if node.attr in GUARDED:
                found.append(f"line {node.lineno}: .{node.attr}")
            elif node.attr.startswith("_") and not node.attr.startswith("__"):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in FOREIGN:
                    found.append(f"line {node.lineno}: {root.id}....{node.attr}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (node.value in GUARDED or PRIVATE_PATH.fullmatch(node.value))
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize(
    "module",
    sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_compat.py"),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_module_but_compat_reaches_for_one(module):
    found = violations(module.read_text())
    assert not found, f"{module.relative_to(PACKAGE)} uses private names outside _compat: {found}"


@pytest.mark.parametrize(
    "planted",
    [
        "envoy._module",
        "from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop",
        "import vllm._custom_ops",
        "torch._C._dispatch_has_kernel_for_dispatch_key('x', 'Meta')",
        "model._attach_mediators([])",
        "getattr(server, '_build_tracer')",
        "logging.getLogger('torch._library.triton')",
    ],
)
def test_the_scan_finds_a_planted_use(planted):
    assert violations(planted), planted


def test_the_scan_leaves_envoykits_own_private_names_alone():
    assert not violations("self._lock = None\nself._model = None\nengine._result_meta()")


def test_an_untested_version_is_named_with_what_it_may_break(monkeypatch):
    monkeypatch.setitem(_compat.TESTED, "nnsight", "0.0.1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        said = _compat.check_versions()
    assert len(said) == 1 and "nnsight==0.0.1" in said[0] and "envoykit serve" in said[0]
    assert [str(w.message) for w in caught] == said


def test_the_tested_versions_say_nothing():
    assert _compat.check_versions() == []


def test_each_accessor_uses_a_listed_name():
    """The compat layer reaches only for names it lists (and their nested attributes)."""
    source = (PACKAGE / "_compat.py").read_text()
    listed = {p.name for p in _compat.PRIVATE} | {"_library", "_C", "_custom_ops"}
    touched = set(re.findall(r"\.(_[a-zA-Z]\w*)\b", source)) - {"_compat"}
    assert touched <= listed, touched - listed
