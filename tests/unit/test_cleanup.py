"""What `close()` removes beside the processes, without an engine: the named semaphores an
engine's process made and left behind, and never one this process made; and the teardown's
collections, skipped in a process about to exit."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
import types

import psutil

from envoykit.model.loader_calls import no_collections
from envoykit.runtime import cleanup
from envoykit.runtime.janitor import Janitor

SPAWN = multiprocessing.get_context("spawn")


def hold(lock, made, ready) -> None:
    """Open ``lock`` (made by the parent), make a lock of its own, report its name, wait."""
    with lock:
        pass
    own = made()
    ready.send(own._semlock.name)
    time.sleep(60)


def test_close_removes_what_a_killed_child_made_and_keeps_the_parents(tmp_path):
    """What ``close()`` runs once an engine's process was force-killed (`cleanup.shutdown`,
    its finalizer): the semaphore the child made is found while it lives, and unlinked after
    it died without finalizing it; the parent's own semaphore is kept and still works, the
    engine's scratch directory is removed, and the janitor exits."""
    parents = SPAWN.Lock()
    receive, send = SPAWN.Pipe(duplex=False)
    child = SPAWN.Process(target=hold, args=(parents, SPAWN.Lock, send))
    child.start()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    janitor = Janitor([str(scratch)], existing=[])
    try:
        childs = receive.recv()  # "/mp-…", as multiprocessing names it
        process = psutil.Process(child.pid)
        found = cleanup.engine_semaphores({process})
        assert found == {f"sem.{childs[1:]}"}
        assert f"sem.{parents._semlock.name[1:]}" not in found
        # as the engine hands them to its janitor once started
        janitor.watch([child.pid], [f"/dev/shm/{name}" for name in found])
    finally:
        child.kill()  # as a force-killed engine core: its finalizers never run
        child.join()
    assert all(os.path.exists(f"/dev/shm/{name}") for name in found)
    cleanup.shutdown(None, {process}, janitor, str(scratch))
    assert not [name for name in found if os.path.exists(f"/dev/shm/{name}")]
    assert not scratch.exists()
    assert not psutil.pid_exists(janitor.pid)  # exited, and reaped
    with parents:  # still usable: not unlinked
        pass


class Cycle:
    """An object only a collection frees: it refers to itself."""

    def __init__(self, freed: list) -> None:
        self.me = self
        self.freed = freed

    def __del__(self) -> None:
        self.freed.append(True)


def test_teardown_skips_collections_and_then_collects_again():
    """`no_collections`: vLLM's teardown collections do nothing inside it (the process is
    about to exit), and the one collection after it still frees a cycle."""
    freed: list = []
    gc.disable()  # no automatic collection between the lines
    try:
        with no_collections():
            Cycle(freed)
            assert gc.collect() == 0
            assert not freed
        gc.collect()
    finally:
        gc.enable()
    assert freed == [True]


def test_overlapping_blocks_without_collections_give_collections_back_at_the_last_end():
    """Two engines' meta builds in two threads: blocks that overlap without nesting (the
    first to start ends first) skip collections until the last one ends, then restore
    Python's own."""
    freed: list = []
    first, second = no_collections(), no_collections()
    gc.disable()  # no automatic collection between the lines
    try:
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        Cycle(freed)
        gc.collect()  # the second block still runs
        assert not freed
        second.__exit__(None, None, None)
        assert isinstance(gc.collect, types.BuiltinFunctionType)
        gc.collect()
    finally:
        gc.enable()
    assert freed == [True]
