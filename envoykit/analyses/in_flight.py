"""`LensesInFlight`: which lens a cancel is for.

An engine serves several threads (a notebook cell, the explorer's worker, a server's
requests), and their lenses wait for one guard. A cancel must stop the lens its caller
means, not whichever lens last wrote a shared "in flight" field: each lens gets its own key
when it starts, registered under the thread that runs it, and the key of the lens that
holds the guard is recorded inside the guard, so it is never another lens's key.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager


class LensesInFlight:
    """The cancel keys of the lenses started and not ended, by thread, and the one on the
    ranks now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, str] = {}
        self._on_ranks: str | None = None

    @contextlib.contextmanager
    def lens(self) -> Iterator[str]:
        """A new cancel key for the lens the calling thread runs inside this block."""
        key, thread = uuid.uuid4().hex, threading.get_ident()
        with self._lock:
            self._by_thread[thread] = key
        try:
            yield key
        finally:
            with self._lock:
                if self._by_thread.get(thread) == key:
                    del self._by_thread[thread]

    def guard(
        self, key: str, exclusive: Callable[[], AbstractContextManager]
    ) -> Callable[[], AbstractContextManager]:
        """``exclusive`` (the engine's guard) that records ``key`` as the lens on the ranks
        while it is held."""

        @contextlib.contextmanager
        def held() -> Iterator[None]:
            with exclusive():
                with self._lock:
                    self._on_ranks = key
                try:
                    yield
                finally:
                    with self._lock:
                        if self._on_ranks == key:
                            self._on_ranks = None

        return held

    def key(self, thread: threading.Thread | None = None) -> str | None:
        """The key a cancel is for: that of the lens ``thread`` runs; without ``thread``, the
        lens on the ranks now, else the one lens waiting for them; None when there is none
        (or several wait and none runs: which one is meant, only a thread can say)."""
        with self._lock:
            if thread is not None:
                return self._by_thread.get(thread.ident) if thread.ident is not None else None
            if self._on_ranks is not None:
                return self._on_ranks
            waiting = list(self._by_thread.values())
            return waiting[0] if len(waiting) == 1 else None
