"""``import envoykit`` imports nothing heavy, every public name still resolves, and the first
lookup of ``envoykit.Engine`` starts the engine core's fork server before torch is imported.

Each check runs in a fresh interpreter: this test process has imported everything already.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import envoykit

HEAVY = ("torch", "nnsight", "vllm", "transformers")


def run(code: str, **environ: str) -> Any:
    """What ``code`` prints last, as JSON, run in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **environ},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_package_imports_no_engine():
    loaded = run(
        f"import json, sys, envoykit; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    assert loaded == []


def test_every_public_name_resolves_to_what_type_checkers_see():
    # The names a type checker reads (the TYPE_CHECKING imports) are the objects looked up.
    tree = ast.parse(Path(envoykit.__file__).read_text())
    guarded = next(
        node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node)
    )
    seen = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert set(envoykit._HOMES) | {"plot"} == set(seen)
    for name, module in seen.items():
        assert getattr(envoykit, name) is getattr(importlib.import_module(module), name), name
    assert set(seen) <= set(envoykit.__all__)
    for name in envoykit.__all__:
        getattr(envoykit, name)
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        _ = envoykit.Engin


STARTED = (
    "import json, sys, envoykit; from envoykit.runtime import forkserver; "
    "forkserver.start_early(); "
    "print(json.dumps({'torch': 'torch' in sys.modules, 'server': forkserver.running()}))"
)


def test_looking_up_the_engine_starts_the_fork_server_before_torch():
    started = run(STARTED)
    assert started["torch"] is False
    assert len(started["server"]) == 2  # the server and its janitor
    looked_up = run(
        "import json, envoykit as ek; from envoykit.runtime import forkserver; ek.Engine; "
        "print(json.dumps(forkserver.running()))"
    )
    assert len(looked_up) == 2


@pytest.mark.parametrize(
    "environ", [{"ENVOYKIT_FORK_CORE": "0"}, {"ENVOYKIT_ENGINE": "1"}], ids=["spawn", "engine"]
)
def test_no_early_server_where_no_core_is_forked(environ):
    # Spawned cores need none; an engine's own processes (which import envoykit) neither.
    assert run(STARTED, **environ)["server"] == []
