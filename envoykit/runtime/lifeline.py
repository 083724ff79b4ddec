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

On the CPU the engine core also forks its ranks instead of spawning them (`fork_ranks`):
a spawned rank imports torch, vLLM and nnsight afresh, one rank after another on few cores.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
from collections.abc import Mapping

_PR_SET_PDEATHSIG = 1
# Set in the engine's environment (`envoykit.runtime.platform.rank_environment`): "1" makes the
# engine core fork its ranks.
FORK_RANKS = "ENVOYKIT_FORK_RANKS"
# Set there too: "1" when ranks share cores (more ranks than cores), and a forked rank then
# runs one thread where the scheduler puts it instead of binding to its core.
UNBOUND_RANKS = "ENVOYKIT_UNBOUND_RANKS"
# Set there too, on the CPU: "1" makes the engine's processes wait for each other's messages
# without spinning (`wait_quietly`).
QUIET_WAITS = "ENVOYKIT_QUIET_WAITS"
# Whether this process has asked for its parent's death signal (`die_with_parent`).
_armed = False


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGTERM this process when its parent exits, and leave the parent's
    process group (Linux only). Once per process: vLLM's plugin loader calls it too.

    ``parent``: the process that made this one, where that is not the one multiprocessing
    names (the fork server makes engine cores for the owner, `envoykit.runtime.forkserver`).

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
    global _armed
    if parent is None:
        made_by = multiprocessing.parent_process()
        parent = None if made_by is None else made_by.pid
    if _armed or parent is None or not sys.platform.startswith("linux"):
        return
    _armed = True
    _signal_at_parent_death(parent)
    os.setpgid(0, 0)
    is_rank = multiprocessing.current_process().name.startswith("VllmWorker")
    atexit.register(gc.freeze if is_rank else _collect_then_freeze)
    if not is_rank and os.environ.get(FORK_RANKS) == "1":
        fork_ranks()


def wait_quietly() -> None:
    """Where the engine asks for it (`QUIET_WAITS`), this process waits for the next message
    on vLLM's shared-memory queues asleep, woken by the writer's notification.

    vLLM's reader yields the core in a loop for 1 s after each message it reads, so that a
    busy GPU engine never sleeps between steps. On a few cores that loop is a thread at
    100% beside the ranks' threads: the engine core, waiting for a TP=1 rank's answer, took
    a share of the rank's cores in every step (one lens of 15 tokens in three or four took
    260-420 ms instead of 150-180, its core spending 70-130 ms of CPU), and the engine spent
    a core's second of CPU after every request (`bench/quiet_waits.py`).
    """
    if os.environ.get(QUIET_WAITS) == "1":
        from envoykit import _compat as compat

        compat.wait_without_spinning()


def _signal_at_parent_death(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def fork_ranks() -> None:
    """In the engine core, before it starts its ranks: have vLLM fork them.

    Spawned, each rank imports torch, vLLM and nnsight afresh: 8.4 s at TP=1, and 21 s for
    three ranks importing at once on two cores (`bench/startup.py`). Forked, a rank starts
    with the engine core's imports and runs 1.4 s after it (3 s for three). vLLM's CPU
    platform asks for spawn, and it binds each rank's OpenMP threads through variables
    (``GOMP_CPU_AFFINITY``, ``OMP_PLACES``, ``KMP_AFFINITY``) that the OpenMP runtime
    reads once, when it loads: a forked rank inherits a runtime the engine core loaded
    without them, so it binds itself (`_forked_rank`). Unbound, three ranks on two cores ran
    a forward 40x slower.

    The signal a parent's death sends is not inherited either, so a forked rank asks for it
    again; it stays in the engine core's process group, out of the kernel's. A forked rank
    leaves with ``os._exit`` (multiprocessing's way), so it skips interpreter shutdown and
    its collections altogether.
    """
    core = os.getpid()
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    os.register_at_fork(after_in_child=lambda: _forked_rank(core))


def _forked_rank(core: int) -> None:
    """A forked rank's first step: die with the engine core, bind to the cores vLLM gave it.

    Where ranks share cores (`UNBOUND_RANKS`), a rank runs one thread, unbound: bound
    round-robin, two of three ranks on two cores took turns on one core while the other
    core idled whenever its rank waited in a collective (the corpus lens at TP=3 ran
    1.17x its floor bound, 1.05-1.07x unbound, with identical statistics).
    """
    _signal_at_parent_death(core)
    cpus = omp_cpus(os.environ)
    if cpus:
        import torch  # already loaded: the engine core imported it

        if os.environ.get(UNBOUND_RANKS) == "1":
            torch.set_num_threads(1)
            return
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


def omp_cpus(environ: Mapping[str, str]) -> list[int]:
    """The cores vLLM's OpenMP variables in ``environ`` bind a rank to (none: not bound).

    >>> omp_cpus({"GOMP_CPU_AFFINITY": "0 1"}), omp_cpus({"OMP_PLACES": "{2,3}"})
    ([0, 1], [2, 3])
    >>> omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[1]"}), omp_cpus({})
    ([1], [])
    """
    if "GOMP_CPU_AFFINITY" in environ:
        listed = environ["GOMP_CPU_AFFINITY"]
    elif "OMP_PLACES" in environ:
        listed = environ["OMP_PLACES"].strip("{}")
    else:
        listed = environ.get("KMP_AFFINITY", "").partition("proclist=[")[2].partition("]")[0]
    return [int(cpu) for cpu in listed.replace(",", " ").split()]


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()
