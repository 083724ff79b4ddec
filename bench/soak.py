"""A long mixed workload on one engine; prints what was served, refused and leaked.

Many lenses of varying size (layers, positions, top-k, targets, generation, several prompts),
bad requests sprinkled in (each must raise `InvalidRequest`), one rank killed mid-run (the
next request must raise `EngineDead`, then `restart()`), then open/close cycles; at the end,
processes and /dev/shm segments left behind are counted.

    python bench/soak.py --requests 200 --cycles 20
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import threading
import time

import psutil

import envoykit as ek

PROMPTS = [
    "The capital of France is",
    "One two three four five six seven",
    "The quick brown fox jumps over the lazy dog and",
    "Water boils at",
]
BAD = [
    dict(prompt=""),
    dict(prompt=PROMPTS[0], layers=[99]),
    dict(prompt=PROMPTS[0], top_k=0),
    dict(prompt=PROMPTS[0], targets=[""]),
    dict(prompt=PROMPTS[0], positions=[50]),
    dict(prompt=PROMPTS[0], generate=-2),
]


def random_request(rng: random.Random, n_layers: int) -> dict:
    return dict(
        prompt=rng.choice(PROMPTS) if rng.random() < 0.8 else rng.sample(PROMPTS, 2),
        layers=sorted(rng.sample(range(n_layers + 1), rng.randint(1, n_layers + 1))),
        top_k=rng.randint(1, 20),
        targets=rng.sample([" Paris", " the", 5, 17], rng.randint(0, 2)),
        generate=rng.choice([0, 0, 0, 2, 5]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    counts = dict(served=0, refused_as_expected=0, engine_dead_as_expected=0, unexpected=0)
    shm_before = set(os.listdir("/dev/shm"))
    me = psutil.Process()
    threads_before = threading.active_count()
    kill_at = args.requests // 2
    started = time.perf_counter()
    with ek.Engine(args.model, args.tp, progress=False) as engine:
        for i in range(args.requests):
            if i == kill_at:
                rank = next(p for p in engine.processes if "Worker_TP" in p.name())
                rank.send_signal(signal.SIGKILL)
                killed = time.perf_counter()
                try:
                    engine.lens(PROMPTS[0])
                    counts["unexpected"] += 1
                except ek.EngineDead:
                    counts["engine_dead_as_expected"] += 1
                    print(f"rank killed: EngineDead after {time.perf_counter() - killed:.1f} s")
                engine.restart()
            bad = rng.random() < 0.1
            request = rng.choice(BAD) if bad else random_request(rng, engine.info.n_layers)
            try:
                engine.lens(**request)
                counts["unexpected" if bad else "served"] += 1
            except ek.InvalidRequest:
                counts["refused_as_expected" if bad else "unexpected"] += 1
            except Exception as error:  # counted, and shown
                counts["unexpected"] += 1
                print(f"unexpected {type(error).__name__}: {error}")
    rss, closes = [], []
    for _ in range(args.cycles):
        engine = ek.Engine(args.model, args.tp, progress=False)
        engine.lens(PROMPTS[0], top_k=3)
        began = time.perf_counter()
        engine.close()
        closes.append(time.perf_counter() - began)
        rss.append(me.memory_info().rss)
    leaked = [
        p for p in me.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())
    ]
    print(
        f"{args.requests} requests on {args.model} TP={args.tp}, "
        f"{time.perf_counter() - started:.0f} s in all:"
    )
    for name, value in counts.items():
        print(f"  {name:<26} {value}")
    print(
        f"  open/close cycles          {args.cycles}, "
        f"RSS {rss[0] / 2**20:.0f} -> {rss[-1] / 2**20:.0f} MiB, close "
        f"{statistics.median(closes):.1f} s median, {max(closes):.1f} s at most"
    )
    print(f"  leaked processes           {len(leaked)}")
    print(f"  leaked threads             {threading.active_count() - threads_before}")
    print(f"  leaked /dev/shm segments   {len(set(os.listdir('/dev/shm')) - shm_before)}")


if __name__ == "__main__":
    main()
