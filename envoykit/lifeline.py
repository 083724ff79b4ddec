"""Make every process vLLM spawns die with the process that spawned it, and only then.

vLLM's engine-core and rank processes outlive a parent that is SIGKILLed, keeping their
``/dev/shm`` segments and memory. Linux can send a child a signal when its parent dies
(``PR_SET_PDEATHSIG``); this module asks for that in every process vLLM starts, through
vLLM's own ``vllm.general_plugins`` entry point, which vLLM runs at start-up in the engine
core and in every worker. The owning (kernel) process is left alone: it is not a
multiprocessing child.

Each of those processes also leaves its parent's process group. Jupyter signals a kernel's
whole group: its interrupt button sent SIGINT to every rank (vLLM's workers exit on it, so
stopping a cell killed the engine), and killing a kernel SIGKILLed every process at once, so
none could unlink its shared memory. Out of the group, an interrupt reaches the kernel alone,
and a killed kernel's engine gets the SIGTERM above and cleans up.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent exits, and leave the parent's
    process group (Linux only).

    SIGTERM rather than SIGKILL so vLLM's own handlers get to close their shared memory.
    The parent may already have died between the spawn and this call; then the
    signal would never come, so exit at once.
    """
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent.pid:
        os._exit(1)
    os.setpgid(0, 0)
