"""Clean up after an engine whose owner was killed outright, from a process that survives it.

A Jupyter kernel killed by its manager gets SIGKILL sent to its whole process group: the
kernel, and with it Python's resource tracker, the process that would otherwise unlink the
shared memory of processes that die without doing so. The engine's own processes leave the
group (`envoykit.runtime.lifeline`) and exit on their parent's death, but the engine core does not
unlink the broadcast queue its ranks read. This janitor, started in a session of its own,
waits on a pipe from the owner; when the pipe closes (``close()``, or the owner's death) it
waits for the engine's processes to exit, kills what outlives the grace period, and removes
the segments they had mapped and the engine's temporary directory. It runs as a plain
script (no package import) so it costs a Python start-up and nothing more.

It starts before the engine's processes do: an owner killed while its engine starts (a
kernel restarted during a slow start) leaves as much behind as one killed later. Until the
owner names the engine's processes (`Janitor.watch`), it adopts every new descendant of the
owner. Every second, and once more when the pipe closes, it looks at the segments its
processes have mapped, so a segment made after the start and left by a process that exits
without finalizing it (see `envoykit.runtime.lifeline`) is removed too.
"""

from __future__ import annotations

import contextlib
import json
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
    """The owner's end of a janitor process; it removes ``paths`` (files, or directories
    with their contents) once the processes it watches are gone.

    ``existing``: the owner's descendants that are not the engine's (another engine's
    processes, Python's resource tracker), never adopted.
    """

    def __init__(self, paths: list[str], existing: list[int]) -> None:
        self.paths = list(paths)
        read, write = os.pipe()
        self._write: int | None = write
        self._process = subprocess.Popen(
            [sys.executable, "-I", __file__, str(os.getpid()), *map(str, existing), "--", *paths],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of reach of a signal to the owner's group
        )
        os.close(read)
        self.pid = self._process.pid

    def watch(self, pids: list[int], paths: list[str]) -> None:
        """The engine has started: watch exactly ``pids`` from now on (no more adopting; a
        later engine of the same owner is not this one), and remove ``paths`` too."""
        assert self._write is not None, "watch() after release()"
        self.paths += paths
        os.write(self._write, (json.dumps({"pids": pids, "paths": paths}) + "\n").encode())

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
    return {path for path in mapped_shm(pids) if not os.path.basename(path).startswith("sem.")}


def mapped_shm(pids: list[int], unlinked: bool = False) -> dict[str, int]:
    """Files in /dev/shm the processes ``pids`` have mapped, path to inode; with
    ``unlinked``, also those already unlinked (their paths end in `` (deleted)``)."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[-1].strip()
                gone = path.endswith(" (deleted)")
                if len(fields) == 6 and path.startswith(f"{SHM}/") and (unlinked or not gone):
                    found[path] = int(fields[4])
    return found


def _stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of /proc/PID/stat (state, ppid, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), None if it is gone or a zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def start_times(pids: list[int]) -> dict[int, str | None]:
    """Each process's start time now: a pid seen later with another start time (or none) is
    someone else's, or no one's."""
    return {pid: _start_time(pid) for pid in pids}


def descendants(owner: int) -> set[int]:
    """The live descendants of ``owner``, from /proc (this script imports nothing else)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, frontier = set(), [owner]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


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


class Watch:
    """What the janitor watches: the engine's processes (adopted while the engine starts,
    then named by the owner) and every segment they have been seen to map."""

    def __init__(self, owner: int, existing: set[int]) -> None:
        self.owner = owner
        self.ignored = existing | {os.getpid()}
        self.adopting = True
        self.started: dict[int, str | None] = {}
        self.paths: set[str] = set()
        self.seen: dict[int, set[str]] = {}  # pid -> the segments it has been seen to map

    def look(self) -> None:
        if self.adopting:
            new = descendants(self.owner) - self.ignored - set(self.started)
            for pid in new:
                if _is_engine_process(pid):
                    self.started[pid] = _start_time(pid)
                else:
                    self.ignored.add(pid)
        for pid in self.started:
            self.seen.setdefault(pid, set()).update(mapped_segments([pid]))

    def named(self, message: dict) -> None:
        """The owner named its engine's processes: what the others were seen to map is not
        this janitor's to remove. (A janitor started while another engine of the owner runs,
        for a token record, adopted that engine's processes until named, and removed their
        segments while that engine was still shutting down.)"""
        self.adopting = False
        self.started = start_times(message["pids"])
        self.seen = {pid: self.seen.get(pid, set()) for pid in self.started}
        self.paths |= set(message["paths"])

    def segments(self) -> set[str]:
        """Every segment the watched processes have been seen to map."""
        return set().union(*self.seen.values())


def _is_engine_process(pid: int) -> bool:
    """Not Python's resource tracker nor another engine's janitor, which the owner may start
    meanwhile and which must outlive it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    tracker = any(arg.startswith("from multiprocessing.resource_tracker import") for arg in args)
    janitor = any(arg.endswith(os.path.join("envoykit", "janitor.py")) for arg in args)
    return not tracker and not janitor


def watch_until_released(pipe: int, watch: Watch) -> None:
    """Look every second until end of file on ``pipe`` (the owner closed the engine, or
    died), taking the owner's naming of the engine's processes on the way; look once more
    at the end."""
    pending = b""
    while True:
        watch.look()
        readable, _, _ = select.select([pipe], [], [], _LOOK_EVERY_SECONDS)
        if not readable:
            continue
        data = os.read(pipe, 65536)
        if not data:
            watch.look()
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            watch.named(json.loads(line))


def main(argv: list[str]) -> None:
    split = argv.index("--")
    owner, existing, paths = int(argv[0]), {int(p) for p in argv[1:split]}, argv[split + 1 :]
    # Only the pipe ends this process: a signal meant for the engine or its owner (an
    # interrupt, a terminate, a hang-up) arriving here too would end it before it cleans up.
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    watch = Watch(owner, existing)
    watch_until_released(sys.stdin.fileno(), watch)
    found = (watch.paths | watch.segments()) - set(paths)
    clean_up(watch.started, [*paths, *sorted(found)], _GRACE_SECONDS)


if __name__ == "__main__":
    main(sys.argv[1:])
