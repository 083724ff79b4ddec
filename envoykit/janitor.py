"""Clean up after an engine whose owner was killed outright, from a process that survives it.

A Jupyter kernel killed by its manager gets SIGKILL sent to its whole process group: the
kernel, and with it Python's resource tracker, the process that would otherwise unlink the
shared memory of processes that die without doing so. The engine's own processes leave the
group (`envoykit.lifeline`) and exit on their parent's death, but the engine core does not
unlink the broadcast queue its ranks read. This janitor, started in a session of its own,
waits on a pipe from the owner; when the pipe closes (``close()``, or the owner's death) it
waits for the engine's processes to exit, kills what outlives the grace period, and removes
the segments they had mapped and the engine's temporary directory. It runs as a plain
script (no package import) so it costs a Python start-up and nothing more.

While it waits it looks at the segments the processes have mapped every second, and once
more when the pipe closes: a segment made after the start (and left by a process that exits
without finalizing it, see `envoykit.lifeline`) is removed too.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time

_GRACE_SECONDS = 15.0
_LOOK_EVERY_SECONDS = 1.0
SHM = "/dev/shm"


class Janitor:
    """The owner's end of a janitor process watching ``pids``; it removes ``paths`` (files,
    or directories with their contents) once they are gone."""

    def __init__(self, pids: list[int], paths: list[str]) -> None:
        self.paths = list(paths)
        read, self._write = os.pipe()
        self._process = subprocess.Popen(
            [sys.executable, "-I", __file__, *map(str, pids), "--", *paths],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of a signal to the owner's group
        )
        os.close(read)

    def release(self) -> None:
        """Tell the janitor the engine is closed (it checks, finds nothing, exits); reap it."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
            self._process.wait(timeout=_GRACE_SECONDS + 5)


def mapped_segments(pids: list[int]) -> set[str]:
    """Shared-memory segments the processes ``pids`` have mapped, as paths.

    Asked of the processes rather than read off a before/after listing of /dev/shm, which
    would also catch the segments of an engine another kernel started at the same time.
    Semaphores (``sem.*``) are left out: a process maps those its parent made too.
    """
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith(f"{SHM}/") and not os.path.basename(path).startswith("sem."):
                    found.add(path)
    return found


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def start_times(pids: list[int]) -> dict[int, str | None]:
    """Each process's start time now: a pid seen later with another start time (or none) is
    someone else's, or no one's."""
    return {pid: _start_time(pid) for pid in pids}


def clean_up(started: dict[int, str | None], paths: list[str], grace: float) -> None:
    """Wait up to ``grace`` seconds for the processes in ``started`` (`start_times`) to exit,
    kill what is left, then remove ``paths``.

    A process may exit between the check and the kill; the kill then finds no process
    (ProcessLookupError), which is what it was for. Unhandled, that error ended the janitor
    before it removed anything, with nobody to see it (its stderr goes nowhere).
    """

    def alive() -> list[int]:
        return [pid for pid, start in started.items() if start and _start_time(pid) == start]

    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def main(argv: list[str]) -> None:
    split = argv.index("--")
    pids, paths = [int(pid) for pid in argv[:split]], argv[split + 1 :]
    started = start_times(pids)
    # Only the pipe ends this process: a signal meant for the engine or its owner (an
    # interrupt, a terminate, a hang-up) arriving here too would end it before it cleans up.
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    segments = watch_until_released(sys.stdin.fileno(), pids)
    clean_up(started, [*paths, *sorted(segments - set(paths))], _GRACE_SECONDS)


def watch_until_released(pipe: int, pids: list[int]) -> set[str]:
    """Wait for end of file on ``pipe`` (the owner closed the engine, or died), looking at
    the segments ``pids`` have mapped every second meanwhile and once more at the end; all
    those seen."""
    seen: set[str] = set()
    while True:
        seen |= mapped_segments(pids)
        readable, _, _ = select.select([pipe], [], [], _LOOK_EVERY_SECONDS)
        if readable and not os.read(pipe, 4096):
            return seen | mapped_segments(pids)


if __name__ == "__main__":
    main(sys.argv[1:])
