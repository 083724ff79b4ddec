"""`Background`: a button's work on a thread of its own, so the kernel stays free; `Ticker`:
its status line counting the seconds meanwhile.

A widget callback runs on the kernel's main thread: while it runs, the notebook can run no
cell and the kernel hears no other click (a Cancel pressed during a sweep would wait for the
sweep). A button that starts long work hands it to a `Background` instead. The work is
serialised with every other request by the engine's own guard, so a cell that uses the
engine meanwhile waits for the trace in flight; an error the work did not expect reaches no
cell, so it is shown where the work reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from envoykit.explorer.outputs import failure


class Background:
    """One piece of work at a time, on a daemon thread named ``name``.

    `start` refuses while work runs (a button's long job: pressing it twice means nothing
    more). `submit` keeps the latest of what arrives meanwhile and runs it next, on the same
    thread, dropping what it replaced: clicks (a cell, a pin, a drop) each ask for the view
    of the state they leave, so only the last one still matters."""

    def __init__(self, name: str, on_error: Callable[[str, str], None]) -> None:
        """``on_error(line, details)`` says an error the work did not catch: its line and
        its traceback (`envoykit.explorer.outputs.failure`)."""
        self._name, self._on_error = name, on_error
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._next: Callable[[], Any] | None = None
        self._running = False  # set and cleared under the lock, so no submit is stranded

    @property
    def busy(self) -> bool:
        return self._running

    @property
    def thread(self) -> threading.Thread | None:
        """The thread of the work started last (the engine's `cancel` names it)."""
        return self._thread

    def start(self, work: Callable[[], Any]) -> bool:
        """Run ``work`` on the thread; False (and nothing started) while the last runs."""
        with self._lock:
            if self.busy:
                return False
            self._launch(work)
        return True

    def submit(self, work: Callable[[], Any]) -> None:
        """Run ``work`` now, or after the work in flight in place of any work waiting."""
        with self._lock:
            if self.busy:
                self._next = work
            else:
                self._launch(work)

    def drop_waiting(self) -> bool:
        """Forget the work waiting behind the one in flight (a Cancel); whether there was."""
        with self._lock:
            dropped, self._next = self._next is not None, None
        return dropped

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the work in flight and what waits behind it; whether all has finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (thread := self._thread) is not None and thread.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            thread.join(left)
        return True

    def _launch(self, work: Callable[[], Any]) -> None:
        """A new thread that runs ``work``, then whatever was submitted meanwhile (the lock
        is held by the caller)."""

        def run() -> None:
            job: Callable[[], Any] | None = work
            while job is not None:
                try:
                    job()
                except Exception as err:  # a thread's error reaches no cell: say it
                    self._on_error(*failure(err))
                with self._lock:
                    job, self._next = self._next, None
                    self._running = job is not None

        self._running = True
        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()


class Ticker:
    """Calls ``say(elapsed_seconds)`` now and every ``every`` seconds, on a daemon thread,
    while a ``with`` block runs: a status line that keeps counting while one request holds
    the worker thread. Nothing is said once the block has ended."""

    def __init__(self, say: Callable[[float], None], every: float = 1.0) -> None:
        self._say, self._every = say, every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        began = time.monotonic()
        self._say(0.0)

        def tick() -> None:
            while not self._stop.wait(self._every):
                self._say(time.monotonic() - began)

        self._thread = threading.Thread(target=tick, name="envoykit-ticker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def duration(seconds: float) -> str:
    """``seconds`` for people: ``"42 s"``, ``"3 min 05 s"``."""
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def time_left(elapsed: float, done: float, total: float) -> str:
    """Elapsed time, and the time left at the pace so far once some of ``total`` is done."""
    if not done:
        return f"{duration(elapsed)} so far"
    left = elapsed / done * (total - done)
    return f"{duration(elapsed)} so far, about {duration(left)} left"
