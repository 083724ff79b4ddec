"""envoykit's vLLM plugin acts in envoykit's engines only.

vLLM runs every installed general plugin in every process it starts. In a plain vLLM process
the plugin must import nothing of envoykit: its engine imports nnsight, which gives every
object a ``save`` attribute, and vllm-lens's worker extension refused to load beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = (
    "import sys, envoykit_vllm_plugin as plugin; plugin.register(); "
    "print(sorted(m for m in ('envoykit.runtime.lifeline', 'nnsight') if m in sys.modules))"
)


def imported_by_register(environ: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_plain_vllm_process_imports_nothing_of_envoykit():
    environ = {k: v for k, v in os.environ.items() if k != "ENVOYKIT_ENGINE"}
    assert imported_by_register(environ) == "[]"


@pytest.mark.parametrize("value", ["0", ""])
def test_only_the_engines_marker_arms_it(value):
    assert imported_by_register({**os.environ, "ENVOYKIT_ENGINE": value}) == "[]"


def test_an_engine_process_arms_the_life_line():
    # The life line only: nnsight comes with the engine's worker, not with the plugin.
    assert imported_by_register({**os.environ, "ENVOYKIT_ENGINE": "1"}) == (
        "['envoykit.runtime.lifeline']"
    )


def test_it_is_the_entry_point_vllm_loads():
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found["envoykit_die_with_parent"] == "envoykit_vllm_plugin:register"
