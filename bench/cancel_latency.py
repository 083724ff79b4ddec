"""How soon each Cancel of the explorer acts: the seconds from the press to the end of the
work, for a Run of a long prompt, a sweep, the corpus lens, a tuned lens's training and
steering's Generate of 256 tokens, each pressed ``--after`` seconds into its work (the
goal: within 3 s). The panels are driven as their buttons drive them, on their own threads.

    python bench/cancel_latency.py --model demo --tp 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import envoykit as ek
from envoykit.explorer import LensExplorer

PROMPT = "The capital of France is"
OTHER = "The capital of Italy is"


def acted(
    start: Callable[[], Any], cancel: Callable[[], Any], wait: Callable[..., bool], after: float
) -> float:
    """Start the work, press Cancel ``after`` seconds in; the seconds until it ended
    (``wait(timeout)``: whether it has)."""
    start()
    time.sleep(after)
    if wait(0):
        raise SystemExit(f"{start} ended before its Cancel: press sooner (--after)")
    pressed = time.monotonic()
    cancel()
    wait()
    return time.monotonic() - pressed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--after", type=float, default=4.0)
    args = parser.parse_args()
    with ek.Engine(args.model, tensor_parallel_size=args.tp, progress=False) as engine:
        explorer = LensExplorer(engine, prompt=PROMPT, targets=[" Paris"], compare_with=OTHER)
        explorer.run()
        rows = []

        def long_run() -> None:
            explorer.compare.value = False
            explorer.prompt.value = " ".join(["The history of the city is long."] * 120)
            explorer.work.submit(explorer.run)

        rows.append(
            ("Run (960 tokens)", acted(long_run, explorer.cancel, explorer.wait, args.after))
        )
        explorer.prompt.value, explorer.compare.value = PROMPT, True
        explorer.run()
        sweep = explorer.sweep_panel
        rows.append(
            (
                "sweep",
                acted(
                    lambda: sweep.start(explorer.run_sweep),
                    sweep.cancel_button.click,
                    sweep.wait,
                    min(args.after, 1.0),
                ),
            )
        )
        corpus = explorer.corpus_panel
        corpus.texts.value = "\n".join(
            f"Document {i}: " + "words and more words " * 40 for i in range(400)
        )
        rows.append(
            (
                "corpus lens",
                acted(corpus.start, corpus.cancel_button.click, corpus.wait, args.after),
            )
        )
        training = explorer.training_panel
        training.seconds.value = 600
        rows.append(
            (
                "tuned lens training",
                acted(training.start, training.cancel_button.click, training.wait, args.after),
            )
        )
        steering = explorer.steering_panel
        steering.positive.value, steering.negative.value = "Love\nJoy", "Hate\nGrief"
        steering.max_tokens.value = 256
        rows.append(
            (
                "steering Generate (256 tokens)",
                acted(
                    steering.button.click,
                    steering.cancel_button.click,
                    steering.work.wait,
                    args.after,
                ),
            )
        )
    print(f"{args.model}, TP={args.tp}: Cancel pressed {args.after:g} s in (the sweep's 1 s in)")
    print("| work | seconds from Cancel to its end |")
    print("| --- | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
