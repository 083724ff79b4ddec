"""`RankWatch`: when one rank of an engine dies, the others go at once.

vLLM's engine core notices a dead rank at once, then shuts its executor down: it waits
``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) for the surviving ranks to exit, sends them
SIGTERM, waits 4 s more, and only then SIGKILLs them and reports the engine dead. A
surviving rank is usually inside a collective with the dead one, in C++ code that no Python
signal handler interrupts, so it sits out both waits: a killed rank became `EngineDead` about
10 s later at TP=2, whatever the engine was doing. Nothing of a rank is worth waiting for
once a peer is gone (its collectives can never complete), so this watch kills the survivors
the moment one rank exits. It kills the engine core too: the core has nothing left to run,
and the close that follows an `EngineDead` waits up to 5 s more for a live core to
exit after vLLM's SIGTERM (a collect's `EngineDead` once came 4.9 s after the kill so).
The segments every process has mapped are read before the kill, since a killed process can
no longer be asked; the engine's shutdown (`envoykit.runtime.cleanup.shutdown`) unlinks them
(the CPU all-reduce buffers a rank maps after the start are among them).

The engine core's own death is worse: vLLM's client marks the engine dead but leaves a call
waiting for the core's next output waiting forever (a lens in flight when the core was
killed never returned, nor did nnsight's call to the ranks after a step, whose answer
never comes). So the watch covers the core too, and once any process has died it keeps
handing whatever call waits on the dead engine vLLM's own `EngineDeadError`
(`wake_waiting_client`), until the engine is closed.

The watch waits on Linux process file descriptors (``pidfd_open``): woken by the death
itself, with no polling, and immune to a reused PID.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from queue import Queue
from typing import Any

from envoykit import _compat as compat

# How often a dead engine's waiting calls are woken (`RankWatch`).
WAKE_EVERY = 0.1


class RankWatch:
    """Once any of ``pids`` (an engine's core and ranks) exits: records ``segments()`` (the
    shared memory they have mapped) in `left_behind`, kills every one of them, then calls
    ``on_death`` every `WAKE_EVERY` seconds (a call may start waiting after the death);
    until `stop`."""

    def __init__(
        self,
        pids: list[int],
        segments: Callable[[], set[str]],
        on_death: Callable[[], None],
    ) -> None:
        self._fds: dict[int, int] = {}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # already gone: vLLM reports it
                self._fds[pid] = os.pidfd_open(pid)
        self._segments, self._on_death = segments, on_death
        self.left_behind: set[str] = set()
        self._wake, self._woken = os.pipe()  # written once, by `stop`
        self._stopped = False
        self._thread = threading.Thread(target=self._watch, name="envoykit-rank-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        ready, _, _ = select.select([*self._fds.values(), self._wake], [], [])
        if self._wake in ready:
            return
        with contextlib.suppress(Exception):  # what cannot be read, the janitor's list covers
            self.left_behind = self._segments()
        for fd in self._fds.values():
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        while True:
            with contextlib.suppress(Exception):  # the engine may be closing meanwhile
                self._on_death()
            if select.select([self._wake], [], [], WAKE_EVERY)[0]:
                return

    def stop(self) -> None:
        """Stop watching (before a close: ranks leaving one by one are no death); after it,
        `left_behind` is final. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._woken, b"x")
        self._thread.join()
        for fd in [*self._fds.values(), self._wake, self._woken]:
            os.close(fd)


def wake_waiting_client(entry: Any) -> None:
    """Give the calls of ``entry`` (a ``vllm.LLM``) that wait on its dead engine core vLLM's
    `EngineDeadError`, which they raise (`envoykit.engine.Engine.exclusive` makes it
    `EngineDead`): one waiting for the core's next output, and those waiting for an answer
    to a utility call (nnsight's call to the ranks after each step). A served engine
    (``AsyncLLM``) has neither: its server watches the processes itself."""
    from vllm.v1.engine.exceptions import EngineDeadError

    queue, futures = compat.engine_core_waits(entry)
    if isinstance(queue, Queue) and queue.empty():
        queue.put_nowait(EngineDeadError())
    for future in futures:
        if not future.done():
            with contextlib.suppress(InvalidStateError):  # answered meanwhile
                future.set_exception(EngineDeadError())
