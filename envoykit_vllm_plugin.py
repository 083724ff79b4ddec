"""envoykit's vLLM plugin: the processes of an engine envoykit starts die with their parent
(`envoykit.runtime.lifeline.die_with_parent`), and on the CPU wait for each other's messages
asleep (`envoykit.runtime.lifeline.wait_quietly`).

vLLM runs every installed ``vllm.general_plugins`` entry point in every process it starts,
envoykit's or not. This module sits outside the ``envoykit`` package so that a plain vLLM
process pays nothing for it: envoykit's engine imports nnsight, which gives every Python
object a ``save`` attribute (vllm-lens's worker extension then refused to load beside it),
and the plugin would move a plain vLLM's processes out of their process group.
It acts only where envoykit's engine set `ENGINE` in the environment.
"""

from __future__ import annotations

import os

# Set by envoykit in the environment of the engines it starts (`envoykit.engine`).
ENGINE = "ENVOYKIT_ENGINE"


def register() -> None:
    """vLLM's plugin hook: arm the life line (and quiet waits) in envoykit's engines only."""
    if os.environ.get(ENGINE) == "1":
        from envoykit.runtime.lifeline import die_with_parent, wait_quietly

        die_with_parent()
        wait_quietly()
