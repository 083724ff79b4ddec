"""The engine core's niceness where the ranks own their cores: lens and close, on a quiet
machine and beside busy processes.

Two measurements, each niceness side by side in one run:

* quiet: one engine, its core's main thread set to each niceness in turn before each lens
  (``os.setpriority``; lowering it again needs root), medians per prompt length;
* busy: an engine per niceness, in a fresh process each, its lens with ``--hogs`` processes
  that spin beside it, then its ``close()`` with them still spinning.

    python bench/core_priority.py --levels 0 5 10 19 --lengths 15 64 256 --hogs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT_WORDS = "The history of the city is long and full of events that shaped the region " * 40


def prompt(tokens: int) -> str:
    """The first ``tokens`` words of a plain English text (also `bench/quiet_waits.py`'s)."""
    return " ".join(PROMPT_WORDS.split()[:tokens])


def _core(engine) -> int:
    return next(p.pid for p in engine.processes if p.name() == "VLLM::EngineCore")


def quiet(levels: list[int], lengths: list[int], repeats: int) -> None:
    import envoykit as ek

    with ek.Engine("demo", 1, progress=False) as engine:
        core = _core(engine)
        print(f"quiet machine, lens ms (median of {repeats}), niceness {levels}")
        for tokens in lengths:
            text = prompt(tokens)
            engine.lens(text)
            times: dict[int, list[float]] = {level: [] for level in levels}
            for _ in range(repeats):
                for level in levels:
                    os.setpriority(os.PRIO_PROCESS, core, level)
                    started = time.perf_counter()
                    engine.lens(text)
                    times[level].append(time.perf_counter() - started)
            row = "  ".join(f"{statistics.median(t) * 1000:6.0f}" for t in times.values())
            print(f"  {tokens:4d} tokens: {row}")


def busy_one(level: int, hogs: int, repeats: int) -> dict:
    """One engine at ``level``, with ``hogs`` spinning processes beside it."""
    import envoykit as ek

    engine = ek.Engine("demo", 1, progress=False)
    os.setpriority(os.PRIO_PROCESS, _core(engine), level)
    text = prompt(15)
    engine.lens(text)
    spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        time.sleep(0.3)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.lens(text)
            times.append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.close()
        closed = time.perf_counter() - started
    finally:
        for process in spinning:
            process.kill()
    return {"median": statistics.median(times), "max": max(times), "close": closed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 5, 10, 19])
    parser.add_argument("--lengths", type=int, nargs="+", default=[15, 64, 256])
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy-one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.busy_one is not None:
        print(json.dumps(busy_one(args.busy_one, args.hogs, args.repeats)), flush=True)
        return
    quiet(args.levels, args.lengths, args.repeats)
    print(f"beside {args.hogs} busy processes: lens of 15 tokens (median, max), close")
    for level in args.levels:
        command = [sys.executable, __file__, "--busy-one", str(level), "--hogs", str(args.hogs)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        found = json.loads(out.strip().splitlines()[-1])
        print(
            f"  nice {level:2d}: lens {found['median'] * 1000:5.0f} ms (max "
            f"{found['max'] * 1000:5.0f}), close {found['close']:.2f} s"
        )


if __name__ == "__main__":
    main()
