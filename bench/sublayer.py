"""Sub-layer lens sites and direct logit attribution: cost and traffic, side by side in one run.

On one engine and one prompt, medians of ``--repeats`` runs:
  * the lens over all four sites (``resid``, ``resid_mid``, ``attn``, ``mlp``: four times the
    rows, one forward) against the ``resid`` lens alone;
  * ``attribute`` (every component's contribution to the targets' logits) against one
    ``resid`` lens;
  * bytes each returns.

    python bench/sublayer.py --model demo --repeats 5
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

from timing import median_seconds

import envoykit as ek

PROMPT = "The capital of France is a city with a long history, and its name is"
SITES = ("resid", "resid_mid", "attn", "mlp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target", default=" Paris")
    args = parser.parse_args()

    with ek.Engine(args.model, args.tp) as engine:
        targets = [args.target]
        resid = engine.lens(PROMPT, targets=targets)
        every = engine.lens(PROMPT, targets=targets, sites=SITES)
        attribution = engine.attribute(PROMPT, targets)
        t_resid = median_seconds(lambda: engine.lens(PROMPT, targets=targets), args.repeats)
        t_every = median_seconds(
            lambda: engine.lens(PROMPT, targets=targets, sites=SITES), args.repeats
        )
        t_attr = median_seconds(lambda: engine.attribute(PROMPT, targets), args.repeats)
        info = engine.info

    n_tokens = len(resid.positions)
    print(
        f"{info.name}, TP={info.tp}, {info.dtype}, {n_tokens}-token prompt, {info.n_layers} "
        f"layers, median of {args.repeats}"
    )
    rows = [
        ("lens, resid only", t_resid, resid.meta["returned_bytes"], len(resid.layers)),
        ("lens, all four sites", t_every, every.meta["returned_bytes"], len(every.layers)),
        ("attribute", t_attr, attribution.meta["returned_bytes"], len(attribution.components)),
    ]
    print(f"{'':<22}{'ms':>10}{'bytes back':>12}{'rows':>6}")
    for name, seconds, returned, n_rows in rows:
        print(f"{name:<22}{seconds * 1e3:>10.1f}{returned:>12,}{n_rows:>6}")
    print(f"all four sites / resid only: {t_every / t_resid:.2f}x (goal <= 2.5x)")
    print(f"attribute / resid lens:      {t_attr / t_resid:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
