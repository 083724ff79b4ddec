"""Stop an engine's processes and remove what they made, from the process that owns them.

`Engine.close()`, its garbage collection and interpreter exit all end in `shutdown`; the
janitor (`envoykit.runtime.janitor`) does the same from outside when the owner itself is killed.
What an engine makes: an engine-core and rank processes, shared-memory segments in
``/dev/shm`` (vLLM's message queues, Python ``SharedMemory`` named ``psm_*``, and its CPU
all-reduce buffers, made by C++), and a scratch directory for its sockets and rendezvous file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import TYPE_CHECKING, Any

from envoykit.runtime import forkserver
from envoykit.runtime import janitor as _janitor
from envoykit.runtime.janitor import SHM

if TYPE_CHECKING:
    import psutil

    from envoykit.runtime.janitor import Janitor
    from envoykit.runtime.rank_watch import RankWatch

# Python's SharedMemory names its segments so (multiprocessing.shared_memory); only those are
# registered with a resource tracker.
_PYTHON_SEGMENT_PREFIX = "psm_"
# How a named POSIX semaphore appears in /dev/shm; multiprocessing names its own "/mp-*".
_SEMAPHORE_PREFIX = "sem."
_PYTHON_SEMAPHORE_PREFIX = "sem.mp-"


def descendants() -> set[psutil.Process]:
    """This process's live descendants, less Python's shared-memory resource tracker and
    its fork server (one each per process, shared by every engine, kept for the life of the
    process by design; see `envoykit.runtime.forkserver`)."""
    import psutil

    found, shared = set(), forkserver.running()
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.pid not in shared and "resource_tracker" not in " ".join(process.cmdline()):
                found.add(process)
    return found


def mapped_segments(processes: set[psutil.Process]) -> set[str]:
    """Names of the shared-memory segments the processes have mapped (see
    `envoykit.runtime.janitor.mapped_segments`)."""
    return {os.path.basename(path) for path in _janitor.mapped_segments([p.pid for p in processes])}


def engine_semaphores(processes: set[psutil.Process]) -> set[str]:
    """Names of the named semaphores in /dev/shm the processes have open and this process
    has not.

    The engine made those (vLLM's engine core makes a ``multiprocessing`` lock for its
    ranks); a semaphore this process made and handed to them is open here too. Matched by
    inode: ``sem_open`` creates a semaphore under a temporary name and links it to its own,
    so its maker maps only the temporary name, already unlinked.
    """
    theirs = set(_janitor.mapped_shm([p.pid for p in processes], unlinked=True).values())
    theirs -= set(_janitor.mapped_shm([os.getpid()], unlinked=True).values())
    with os.scandir(SHM) as entries:
        return {
            entry.name
            for entry in entries
            if entry.name.startswith(_SEMAPHORE_PREFIX) and entry.inode() in theirs
        }


def shutdown(
    llm: Any,
    processes: set[psutil.Process],
    janitor: Janitor,
    scratch: str,
    rank_watch: RankWatch | None = None,
) -> None:
    """Shut the engine core down, then make sure every process and segment it made is gone.

    vLLM's shutdown asks the engine core to stop its ranks and unlink their shared memory,
    and force-kills the core after a grace period; a force-killed process never unlinks its
    segments (Python's resource tracker would, but only when this whole process exits).
    Waiting for each process, killing what outlives a second grace period, then unlinking
    what is left of the segments they made means ``close()`` returning implies nothing is
    left. Those segments are the ones mapped now and the ones mapped at start (the janitor
    holds that list): a rank that died before ``close()`` is no longer there to ask. The
    janitor, which would do the same had this process been killed, is told the engine is
    closed and exits. The ``rank_watch`` (`envoykit.runtime.rank_watch`) stops first: ranks
    leaving one after the other are a close, not a death; what it read before killing a
    dead engine's processes is unlinked too.
    """
    left_behind: set[str] = set()
    if rank_watch is not None:
        rank_watch.stop()
        left_behind = rank_watch.left_behind
    at_start = {os.path.basename(p) for p in janitor.paths if os.path.dirname(p) == SHM}
    segments = at_start | left_behind | mapped_segments(processes) | engine_semaphores(processes)
    entry = getattr(llm, "vllm_entrypoint", None)
    if entry is not None:
        # A dead engine core has nothing left to stop; what is left of it is stopped below.
        with contextlib.suppress(Exception):
            stop_engine_core(entry)
    stop(processes, grace=10)
    for name in sorted(segments):
        unlink_segment(name)
    shutil.rmtree(scratch, ignore_errors=True)
    janitor.release()


def orphans_since(before: set[str]) -> set[str]:
    """Segments in /dev/shm made since the listing ``before`` that no process maps now.

    For a start that failed: its ranks can map a segment (vLLM's CPU all-reduce buffers)
    and die between two of the janitor's looks, and then no process can be asked what it
    made. A segment another engine made meanwhile is mapped by that engine's processes and
    is left alone.
    """
    new = set(os.listdir(SHM)) - before
    if not new:
        return set()
    everyone = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    mapped = {os.path.basename(path) for path in _janitor.mapped_shm(everyone)}
    return new - mapped


def stop_engine_core(entry: Any) -> None:
    """Ask vLLM to stop the engine core of ``entry``: ``vllm.LLM`` holds the core's client in
    its ``LLMEngine``; ``AsyncLLM`` (a served engine) holds it itself, and its own shutdown
    also ends its output loop."""
    if hasattr(entry, "llm_engine"):
        entry.llm_engine.engine_core.shutdown()
    else:
        entry.shutdown()


def stop(processes: set[psutil.Process], grace: float = 0) -> None:
    """Wait up to ``grace`` seconds for ``processes`` to exit, then kill what is left."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def unlink_segment(name: str) -> None:
    """Unlink a segment its maker left behind, and tell this process's resource tracker.

    The engine's processes share this process's tracker (spawned processes inherit it), so a
    Python ``SharedMemory`` segment or ``multiprocessing`` semaphore made by one of them is
    registered here; unlinked without
    unregistering, the tracker would try again at exit and warn about a leak. Only a segment
    this call unlinked is unregistered: one its maker unlinked was unregistered by its maker,
    and telling the tracker about a name it does not hold, or one that is not Python's (vLLM's
    C++ all-reduce buffers, whose names hold ``:``), prints a traceback from the tracker into
    the notebook (``KeyError: '/psm_…'``, ``ValueError: too many values to unpack``).
    """
    try:
        os.unlink(os.path.join(SHM, name))
    except OSError:  # gone already: its maker unlinked it
        return
    from multiprocessing import resource_tracker

    if name.startswith(_PYTHON_SEGMENT_PREFIX):
        resource_tracker.unregister(f"/{name}", "shared_memory")
    elif name.startswith(_PYTHON_SEMAPHORE_PREFIX):
        resource_tracker.unregister(f"/{name[len(_SEMAPHORE_PREFIX) :]}", "semaphore")
