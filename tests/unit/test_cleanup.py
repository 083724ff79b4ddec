"""What `close()` removes beside the processes, without an engine: the named semaphores an
engine's process made and left behind, and never one this process made."""

from __future__ import annotations

import multiprocessing
import os
import time

import psutil

from envoykit.runtime import cleanup

SPAWN = multiprocessing.get_context("spawn")


def hold(lock, made, ready) -> None:
    """Open ``lock`` (made by the parent), make a lock of its own, report its name, wait."""
    with lock:
        pass
    own = made()
    ready.send(own._semlock.name)
    time.sleep(60)


def test_a_semaphore_a_killed_child_made_is_removed_and_the_parents_is_kept():
    parents = SPAWN.Lock()
    receive, send = SPAWN.Pipe(duplex=False)
    child = SPAWN.Process(target=hold, args=(parents, SPAWN.Lock, send))
    child.start()
    try:
        childs = receive.recv()  # "/mp-…", as multiprocessing names it
        found = cleanup.engine_semaphores({psutil.Process(child.pid)})
        assert found == {f"sem.{childs[1:]}"}
        assert f"sem.{parents._semlock.name[1:]}" not in found
    finally:
        child.kill()  # as a force-killed engine core: its finalizers never run
        child.join()
    for name in found:
        assert os.path.exists(f"/dev/shm/{name}")
        cleanup.unlink_segment(name)  # also unregisters it from the shared tracker
        assert not os.path.exists(f"/dev/shm/{name}")
    with parents:  # still usable: not unlinked
        pass
