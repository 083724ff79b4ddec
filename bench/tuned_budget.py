"""Tuned-lens training against its time budget and its Cancel, on one engine: for each
budget, the whole call's time over the budget (the goal: within 1.1x) and the steps it took;
then a training with a long budget stopped after ``--cancel-after`` seconds, and how long the
stop took to act (the goal: within 3 s).

    python bench/tuned_budget.py --model demo --tp 1 --budgets 20 40
"""

from __future__ import annotations

import argparse
import threading
import time

import envoykit as ek
from envoykit.analyses.tuned import offline_texts


def budget_kept(engine: ek.Engine, texts: list[str], budget: float) -> None:
    """Train within ``budget`` seconds; print the time taken over the budget."""
    began = time.monotonic()
    tuned = ek.TunedLens.train(engine, texts, max_seconds=budget, progress=False, warn=False)
    took = time.monotonic() - began
    sizes = tuned.model["step_tokens"]
    print(
        f"budget {budget:5.1f} s: took {took:6.1f} s = {took / budget:.2f}x the budget, "
        f"{len(sizes)} steps of {sizes[:1]} then up to {max(sizes, default=0)} tokens"
    )


def cancel_acts(engine: ek.Engine, texts: list[str], after: float) -> None:
    """Train with a long budget, set the stop after ``after`` seconds; print how long the
    training took to return from then."""
    stop = threading.Event()
    done: list[float] = []

    def train() -> None:
        ek.TunedLens.train(engine, texts, max_seconds=600, progress=False, stop=stop, warn=False)
        done.append(time.monotonic())

    worker = threading.Thread(target=train)
    worker.start()
    time.sleep(after)
    stop.set()
    stopped = time.monotonic()
    worker.join()
    print(f"cancel after {after:.0f} s: acted in {done[0] - stopped:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--budgets", type=float, nargs="+", default=[20.0, 40.0])
    parser.add_argument("--cancel-after", type=float, default=10.0)
    args = parser.parse_args()
    texts = offline_texts()[0]
    with ek.Engine(args.model, tensor_parallel_size=args.tp, progress=False) as engine:
        for budget in args.budgets:
            budget_kept(engine, texts, budget)
        cancel_acts(engine, texts, args.cancel_after)


if __name__ == "__main__":
    main()
