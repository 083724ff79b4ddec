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
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

_GRACE_SECONDS = 15.0


class Janitor:
    """The owner's end of a janitor process watching ``pids``; it removes ``paths`` (files,
    or directories with their contents) once they are gone."""

    def __init__(self, pids: list[int], paths: list[str]) -> None:
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


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def main(argv: list[str]) -> None:
    split = argv.index("--")
    pids, paths = [int(pid) for pid in argv[:split]], argv[split + 1 :]
    started = {pid: _start_time(pid) for pid in pids}  # a reused pid is someone else's

    def alive() -> list[int]:
        return [pid for pid in pids if started[pid] and _start_time(pid) == started[pid]]

    sys.stdin.buffer.read()  # returns at end of file: the owner closed the engine, or died
    deadline = time.monotonic() + _GRACE_SECONDS
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive():
        os.kill(pid, signal.SIGKILL)
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


if __name__ == "__main__":
    main(sys.argv[1:])
