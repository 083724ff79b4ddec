"""Make every process vLLM spawns die with the process that spawned it, and leave promptly.

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

And each of them exits without a last garbage collection of its whole heap. A rank holds
about 700,000 objects (torch, transformers, vLLM, the model); the interpreter's shutdown
collects them several times over, about 3 s on two cores, after the rank has already closed
its queues and unlinked its shared memory. That pushed the rank past vLLM's 5 s shutdown
grace, so the engine core was force-killed on every ``close()``.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import multiprocessing
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent exits, leave the parent's
    process group, and skip the garbage collections of interpreter shutdown (Linux only).

    SIGTERM rather than SIGKILL so vLLM's own handlers get to close their shared memory.
    The parent may already have died between the spawn and this call; then the
    signal would never come, so exit at once.

    ``gc.freeze`` at exit moves every object out of the collector's reach, so shutdown frees
    only what reference counting frees. vLLM's own cleanup (queues closed, shared memory
    unlinked, distributed groups destroyed) runs before interpreter shutdown, and every
    atexit handler still runs. Objects kept alive only by a reference cycle are not
    finalized; should one of them own a shared-memory segment, ``close()``
    (`envoykit.cleanup`) or, for a killed owner, the janitor (`envoykit.janitor`) unlinks
    it: both look at what the processes have mapped, not only at what they mapped at start.
    """
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent.pid:
        os._exit(1)
    os.setpgid(0, 0)
    atexit.register(gc.freeze)
