"""The teardown of a process vLLM started, which exits right after it."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def no_collections() -> Iterator[None]:
    """Explicit collections (``gc.collect()``) do nothing inside this block.

    vLLM's teardown unfreezes the heap and collects it whole, in the rank (its runner's
    shutdown) and in the engine core (``cleanup_dist_env_and_memory``), so that an engine
    closed inside a longer-lived process gives its memory back. A rank or an engine core
    exits right after, and each collection cost 0.35-0.4 s of ``close()`` at TP=1. The
    engine core still collects once as it leaves (``envoykit.runtime.forkserver``), for the
    shared memory that reference cycles hold. Process-wide, so only for a teardown, when
    nothing else in the process runs.
    """
    collect = gc.collect
    gc.collect = _skipped
    try:
        yield
    finally:
        gc.collect = collect


def _skipped(generation: int = 2) -> int:
    return 0
