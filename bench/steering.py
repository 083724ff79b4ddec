"""Steering: a steered generation against a plain one, and a sweep of strengths against
separate runs, side by side in one run.

On one engine, medians of ``--repeats`` runs:
  * greedy generation of ``--tokens`` tokens: plain vLLM (``engine.generate``), the same
    through an unsteered nnsight trace (``steer=`` with scale 0, every step walked), and
    steered at every position of every step;
  * ``steer_sweep`` of 8 scales (one trace, one invoke per scale) against 8 separate
    steered generations and lenses of the same scales.

    python bench/steering.py --model demo --repeats 3
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

from timing import median_seconds

import envoykit as ek

PROMPT = "I watched the movie last night. It was really"
POSITIVE = ["I love it. It is wonderful", "This is great, I am so happy"]
NEGATIVE = ["I hate it. It is terrible", "This is awful, I am so sad"]
SCALES = [-2.0, -1.0, -0.5, -0.25, 0.25, 0.5, 1.0, 2.0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--layer", type=int, default=10)
    args = parser.parse_args()

    with ek.Engine(args.model, args.tp) as engine:
        info = engine.info
        vector = engine.steering_vector(POSITIVE, NEGATIVE, args.layer, progress=False)
        steer = ek.Steer(vector, args.layer, scale=1.0)
        n = args.tokens
        t_plain = median_seconds(lambda: engine.generate(PROMPT, n), args.repeats)
        t_zero = median_seconds(
            lambda: engine.generate(PROMPT, n, steer=steer.scaled(0.0)), args.repeats
        )
        t_steered = median_seconds(lambda: engine.generate(PROMPT, n, steer=steer), args.repeats)

        def separate() -> None:
            for scale in SCALES:
                engine.generate(PROMPT, n, steer=steer.scaled(scale))
                engine.lens(PROMPT, targets=[" good"], steer=steer.scaled(scale), top_k=1)

        t_separate = median_seconds(separate, 1)
        t_sweep = median_seconds(
            lambda: engine.steer_sweep(
                PROMPT, steer, scales=SCALES, max_tokens=n, targets=[" good"], progress=False
            ),
            args.repeats,
        )

    print(
        f"{info.name}, TP={info.tp}, {info.dtype}, {n} generated tokens, "
        f"steer after layer {args.layer}"
    )
    print(f"{'':<44}{'ms':>10}")
    print(f"{'plain generation (vLLM)':<44}{t_plain * 1e3:>10.1f}")
    print(f"{'generation through a trace, scale 0':<44}{t_zero * 1e3:>10.1f}")
    print(f"{'steered generation':<44}{t_steered * 1e3:>10.1f}")
    print(f"{f'{len(SCALES)} separate steered generations + lenses':<44}{t_separate * 1e3:>10.1f}")
    print(f"{f'steer_sweep of {len(SCALES)} scales (one trace)':<44}{t_sweep * 1e3:>10.1f}")
    print(f"steered / plain generation:      {t_steered / t_plain:.2f}x (goal <= 1.1x)")
    print(f"steered / scale-0 trace:         {t_steered / t_zero:.2f}x")
    print(f"separate / sweep:                {t_separate / t_sweep:.2f}x faster (goal >= 3x)")


if __name__ == "__main__":
    main()
