"""The kernel's stop button for the explorer's background work.

A button's long work (a Run, a sweep, a corpus lens, a tuned lens's training, Generate) runs
on a thread while the kernel is idle, and an idle IPython kernel ignores SIGINT: the stop
button, the researcher's first reflex, would reach nothing. `listen` hands a panel's work
and its Cancel to one SIGINT handler for the kernel's idle time
(`envoykit._compat.hear_idle_interrupts`) that stops, as Cancel does, the work in flight of
every panel listening, which then says "interrupted". With no work in flight the kernel's
own handler acts; while a cell runs, the interrupt is that cell's, as always.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from envoykit import _compat as compat
from envoykit.explorer.work import Background


class Listener:
    """A panel's ``work`` and its Cancel (``stop``, told it is an interrupt), as the kernel's
    stop button reaches them. The panel keeps it: the handler holds it weakly, so a panel
    gone takes its listener with it."""

    def __init__(self, work: Background, stop: Callable[[], object]) -> None:
        self.work, self.stop = work, stop

    def interrupt(self) -> bool:
        """Stop the work in flight as Cancel does; whether there was any."""
        if not self.work.busy:
            return False
        self.stop()
        return True


_LISTENING: weakref.WeakSet[Listener] = weakref.WeakSet()


def listen(work: Background, stop: Callable[[], object]) -> Listener:
    """Let the kernel's stop button call ``stop`` while ``work`` runs (in an IPython kernel,
    from the main thread; elsewhere nothing is installed, and Cancel is the way). The
    caller keeps the `Listener` returned for as long as it listens."""
    listener = Listener(work, stop)
    _LISTENING.add(listener)
    compat.hear_idle_interrupts(_interrupt_all)
    return listener


def _interrupt_all() -> bool:
    """Every listening panel's work in flight stopped; whether there was any. Runs in the
    signal handler, on the kernel's main thread: it only sets flags (each panel's Cancel),
    never waits."""
    return any([listener.interrupt() for listener in list(_LISTENING)])


class StopFlag:
    """A Cancel's event, which also knows whether a kernel interrupt set it: the panel then
    says "interrupted" where it says "cancelled" for its Cancel button."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.by_interrupt = False

    def set(self, *, interrupt: bool = False) -> None:
        self.by_interrupt = interrupt
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self.by_interrupt = False
        self._event.clear()

    @property
    def word(self) -> str:
        """What stopped the work, as the panel says it."""
        return "interrupted" if self.by_interrupt else "cancelled"
