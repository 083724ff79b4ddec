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

And each of them leaves without the interpreter's last garbage collections of its whole
heap. A process holds about 650,000 objects (torch, transformers, vLLM, the model);
interpreter shutdown collects them several times over, 2.6 s on two cores for the imports
alone, after vLLM's own cleanup has run. Ranks took ~4.3 s to leave, past vLLM's 5 s grace
for the engine core, so every ``close()`` waited for a force-kill (5-6 s; now about 2 s).
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
    """Ask the kernel to SIGTERM this process when its parent exits, and leave the parent's
    process group (Linux only).

    SIGTERM rather than SIGKILL so vLLM's own handlers get to close their shared memory.
    The parent may already have died between the spawn and this call; then the
    signal would never come, so exit at once.

    At exit the heap is frozen (`gc.freeze`) so shutdown frees only what reference counting
    frees; vLLM's cleanup has run by then, and every atexit handler still runs. A rank drops
    its message queues explicitly on shutdown. The engine core holds its broadcast queue (a
    ``psm_*`` segment) and the ranks' lock (a ``sem.mp-*`` semaphore) in objects that a
    reference cycle may keep, so it collects once (0.5 s) before freezing: with every
    process frozen outright, one of three test-suite runs found such a pair left after
    ``close()``. What a process leaves anyway is removed by ``close()`` or the janitor, which
    look at what the processes have mapped.
    """
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent.pid:
        os._exit(1)
    os.setpgid(0, 0)
    is_rank = multiprocessing.current_process().name.startswith("VllmWorker")
    atexit.register(gc.freeze if is_rank else _collect_then_freeze)


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()
