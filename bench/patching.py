"""Activation patching, causal-tracing sweeps and run comparison: cost, side by side in one run.

On one engine, medians of ``--repeats`` runs:
  * a patched lens (all layers) against the plain lens of the same prompt;
  * a sweep of L x P cells (``patch_sweep``, several invokes per trace, one number per cell
    reduced on the ranks) at several batch sizes, against L x P separate patched lenses;
  * a comparison of two prompts (``compare=True``) against one lens.

    python bench/patching.py --model demo --repeats 3
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

from timing import median_seconds

import envoykit as ek

SOURCE = "The capital of France is"
TARGET = "The capital of Italy is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", default=" Paris")
    parser.add_argument("--layers", type=int, default=10, help="layers in the sweep")
    args = parser.parse_args()

    with ek.Engine(args.model, args.tp) as engine:
        info = engine.info
        step = max(1, info.n_layers // args.layers)
        layers = list(range(step, info.n_layers + 1, step))[: args.layers]
        n_pos = len(engine.tokenizer(TARGET)["input_ids"])
        patch = ek.Patch(SOURCE, layer=layers[len(layers) // 2])
        t_plain = median_seconds(lambda: engine.lens(TARGET, targets=[args.target]), args.repeats)
        t_patched = median_seconds(
            lambda: engine.lens(TARGET, targets=[args.target], patch=patch), args.repeats
        )

        def separate() -> None:
            for layer in layers:
                for position in range(n_pos):
                    cell = ek.Patch(SOURCE, layer, position, position)
                    engine.lens(TARGET, layers=[-1], targets=[args.target], patch=cell)

        t_separate = median_seconds(separate, 1)
        t_sweep = {
            batch: median_seconds(
                lambda batch=batch: engine.patch_sweep(
                    SOURCE,
                    TARGET,
                    layers=layers,
                    target_token=args.target,
                    batch=batch,
                    progress=False,
                ),
                args.repeats,
            )
            for batch in (1, 4, 8, 16, 32)
        }
        t_compare = median_seconds(
            lambda: engine.lens([SOURCE, TARGET], compare=True, targets=[args.target]),
            args.repeats,
        )

    cells = len(layers) * n_pos
    print(
        f"{info.name}, TP={info.tp}, {info.dtype}, {n_pos}-token prompts, {info.n_layers} "
        f"layers; sweep of {len(layers)} layers x {n_pos} positions = {cells} cells"
    )
    print(f"{'':<36}{'ms':>10}")
    print(f"{'lens, all layers':<36}{t_plain * 1e3:>10.1f}")
    print(f"{'patched lens, all layers':<36}{t_patched * 1e3:>10.1f}")
    print(f"{'compare two prompts, all layers':<36}{t_compare * 1e3:>10.1f}")
    print(f"{f'{cells} separate patched lenses':<36}{t_separate * 1e3:>10.1f}")
    for batch, seconds in t_sweep.items():
        print(f"{f'sweep, batch {batch}':<36}{seconds * 1e3:>10.1f}")
    best = min(t_sweep, key=t_sweep.get)
    print(f"patched lens / lens:            {t_patched / t_plain:.2f}x (goal <= 2.2x)")
    print(f"compare / lens:                 {t_compare / t_plain:.2f}x")
    print(
        f"separate / sweep (batch {best}):   {t_separate / t_sweep[best]:.2f}x faster (goal >= 3x)"
    )


if __name__ == "__main__":
    main()
