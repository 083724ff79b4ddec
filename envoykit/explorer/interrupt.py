"""The kernel's stop button for the explorer's background work.

A button's long work (a Run, a sweep, a corpus lens, a tuned lens's training) runs on a
thread while the kernel is idle, and an idle IPython kernel ignores SIGINT: the stop button,
the researcher's first reflex, would reach nothing. `listen` hands such a panel to one
SIGINT handler for the kernel's idle time (`envoykit._compat.hear_idle_interrupts`) that
stops, as Cancel does, the work in flight of every panel listening, which then says
"interrupted". With no work in flight the kernel's own handler acts; while a cell runs, the
interrupt is that cell's, as always.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from envoykit import _compat as compat


class Interruptible(Protocol):
    def interrupt(self) -> bool:
        """Stop the work in flight as Cancel does; whether there was any."""
        ...


_LISTENING: weakref.WeakSet[Interruptible] = weakref.WeakSet()


def listen(panel: Interruptible) -> None:
    """Let the kernel's stop button stop ``panel``'s work in flight (in an IPython kernel,
    from the main thread; elsewhere nothing is installed, and Cancel is the way)."""
    _LISTENING.add(panel)
    compat.hear_idle_interrupts(_interrupt_all)


def _interrupt_all() -> bool:
    """Every listening panel's work in flight stopped; whether there was any. Runs in the
    signal handler, on the kernel's main thread: it only sets flags (each panel's Cancel),
    never waits."""
    return any([panel.interrupt() for panel in list(_LISTENING)])


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

    @property
    def doing(self) -> str:
        """What the panel says while the stop acts."""
        return "interrupting" if self.by_interrupt else "cancelling"


def stop_in_flight(busy: bool, stop: Callable[[], object]) -> bool:
    """A panel's answer to the kernel's stop button: ``stop()`` (its Cancel, told it is an
    interrupt) when its work is ``busy``; whether it was."""
    if busy:
        stop()
    return busy
