"""The architecture matrix in numbers: every architecture envoykit reads, at each TP size,
against plain transformers in float32, in one run.

    python bench/architectures.py                  # every tiny-<architecture>, TP=1 and TP=2
    python bench/architectures.py --names llama,gpt2 --tps 1 --demo

For each (architecture, TP): the engine's start, the self-check at load (timed on its own,
on the started engine), and the largest probability difference from transformers of the lens
at every layer, of each sub-layer site, and of a mid-layer patch; and the largest gap between
the attribution's sum and the model's logit. ``--demo`` adds the self-check's cost on
``demo``. The reference is ``tests/arch_reference.py``, the one the tests use.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPT = "The capital of France is"
OTHER = "The capital of Italy is"


def largest_gap(res, logits: torch.Tensor) -> float:
    probs = torch.softmax(logits.double(), -1).numpy()
    return float(np.abs(res.top_probs - np.take_along_axis(probs, res.top_ids, -1)).max())


def measure(name: str, tp: int) -> dict:
    import arch_reference as ref

    import envoykit as ek
    from envoykit.analyses import selfcheck
    from envoykit.model.families import family_of
    from envoykit.runtime import architectures

    arch = architectures.ARCHITECTURES[name]
    family = family_of(arch.model_class, dict(arch.overrides))
    started = time.perf_counter()
    with ek.Engine(f"tiny-{name}", tensor_parallel_size=tp, progress=False, validate=False) as e:
        start = time.perf_counter() - started
        checked = time.perf_counter()
        failed = [k for k, why in selfcheck.run(e).items() if why is not None]
        check = time.perf_counter() - checked
        want = ref.reference(e.info.path, PROMPT, OTHER, family.parallel)
        lens = largest_gap(e.lens(PROMPT, layers=("embed", "all"), top_k=5), want["lens"])
        sites = tuple(want["sites"])
        res = e.lens(PROMPT, sites=sites, top_k=5)
        site = max(largest_gap(res.select(sites=s), want["sites"][s]) for s in sites)
        patch = ek.Patch(PROMPT, layer=2, source_position=-1, target_position=-1)
        patched = largest_gap(
            e.lens(OTHER, layers=[-1], top_k=5, patch=patch), want["patched"][None]
        )
        att = e.attribute(PROMPT, [261, 271])
        total = float(np.abs(att.values.sum(0) - att.logits).max())
    return {
        "name": name,
        "family": family.name,
        "tp": tp,
        "start": start,
        "check": check,
        "failed": failed,
        "lens": lens,
        "sites": site,
        "patch": patched,
        "attribution": total,
    }


def main() -> None:
    from envoykit.model.families import family_of
    from envoykit.runtime import architectures

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", help="comma-separated tiny architectures (default: all read)")
    parser.add_argument("--tps", default="1,2")
    parser.add_argument("--demo", action="store_true", help="also time the self-check on demo")
    args = parser.parse_args()
    read = [
        n
        for n, a in architectures.ARCHITECTURES.items()
        if family_of(a.model_class, dict(a.overrides))
    ]
    names = args.names.split(",") if args.names else read
    print(
        f"{'architecture':12} {'family':16} tp  start s  check s  lens |dp|  sites |dp|  "
        "patch |dp|  sum-logit"
    )
    for name in names:
        for tp in map(int, args.tps.split(",")):
            m = measure(name, tp)
            flag = f"  FAILED {m['failed']}" if m["failed"] else ""
            print(
                f"{m['name']:12} {m['family']:16} {tp:2} {m['start']:8.1f} {m['check']:8.2f} "
                f"{m['lens']:10.1e} {m['sites']:11.1e} {m['patch']:11.1e} "
                f"{m['attribution']:10.1e}{flag}",
                flush=True,
            )
    if args.demo:
        import envoykit as ek
        from envoykit.analyses import selfcheck

        with ek.Engine("demo", progress=False, validate=False) as engine:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                selfcheck.run(engine)
                times.append(time.perf_counter() - t)
            print(f"self-check on demo (TP={engine.info.tp}): {sorted(times)} s")


if __name__ == "__main__":
    main()
