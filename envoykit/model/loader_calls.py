"""Calls vLLM makes while it builds or tears down a model that a process may skip: full
collections of the heap, and the accelerator's cache calls where there is no accelerator."""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def structure_only() -> Iterator[None]:
    """Build nnsight's structure-only model tree (on the meta device) without the two.

    vLLM's loader collects the whole heap twice while it builds a model, to release the
    transient tensors of the weights it loaded: 0.75 s of a 1.2 s build in the owner of an
    engine, whose heap holds torch, vLLM and nnsight, for a tree that loads none. It also
    empties the accelerator's cache, where torch raises without one.
    """
    with _no_accelerator_calls(), no_collections():
        yield


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """Explicit collections (``gc.collect()``) do nothing inside this block.

    Process-wide, so only for a short block, where a skipped collection costs nothing but
    the garbage kept until the next automatic one: a structure-only build (`structure_only`),
    or a teardown. vLLM's teardown unfreezes the heap and collects it whole, in the rank (its
    runner's shutdown) and in the engine core (``cleanup_dist_env_and_memory``), so that an
    engine closed inside a longer-lived process gives its memory back. A rank or an engine
    core exits right after, and each collection cost 0.35-0.4 s of ``close()`` at TP=1. The
    engine core still collects once as it leaves (``envoykit.runtime.forkserver``), for the
    shared memory that reference cycles hold. Blocks may overlap (two engines starting in
    two threads): collections come back when the last one ends.
    """
    global _skipping
    with _SKIPPING_LOCK:
        _skipping += 1
        gc.collect = _skipped
    try:
        yield
    finally:
        with _SKIPPING_LOCK:
            _skipping -= 1
            if not _skipping:
                gc.collect = _COLLECT


_COLLECT = gc.collect
_SKIPPING_LOCK = threading.Lock()
_skipping = 0  # blocks inside `no_collections` now


def _skipped(generation: int = 2) -> int:
    return 0


# The threads building a structure-only model now (`_no_accelerator_calls`).
_BUILDERS: set[int] = set()


@contextlib.contextmanager
def _no_accelerator_calls() -> Iterator[None]:
    """vLLM's loader empties the accelerator's cache while it builds a model, and torch
    raises where there is no accelerator; the structure-only build makes nothing worth a cache,
    so on the building thread both calls are no-ops. Every other thread keeps torch's own
    calls (`_skip_on_builders`)."""
    import torch

    if torch.accelerator.is_available():
        yield
        return
    _skip_on_builders()
    thread = threading.get_ident()
    _BUILDERS.add(thread)
    try:
        yield
    finally:
        _BUILDERS.discard(thread)


@functools.cache
def _skip_on_builders() -> None:
    """Wrap ``torch.accelerator.empty_cache`` and ``synchronize`` once, so they do nothing
    on a thread in `_BUILDERS` and what torch does on any other."""
    import torch

    def skipped(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() in _BUILDERS:
                return None
            return call(*args, **kwargs)

        return wrapper

    torch.accelerator.empty_cache = skipped(torch.accelerator.empty_cache)
    torch.accelerator.synchronize = skipped(torch.accelerator.synchronize)
