"""Feature statistics against collecting the same layer, side by side in one run.

On one engine (``--model`` at ``--tp``), the shipped corpus repeated ``--copies`` times,
medians of ``--repeats`` runs of each:
  * ``engine.collect`` of the stream after layer ``--layer`` to a store (bfloat16), the
    reference: the pass a researcher runs to get the activations an SAE reads;
  * ``engine.feature_stats`` of a random 16x TopK SAE (k=32) of that stream (its arithmetic
    costs what a trained one's does), 20 contexts of 16 tokens per feature, in memory.

    python bench/feature_stats.py --model demo --tp 1 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

from features import random_sae
from timing import median_seconds

import envoykit as ek


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    corpus = ek.shipped_corpus() * args.copies
    with ek.Engine(args.model, args.tp, progress=False) as engine:
        sae = random_sae(engine.info.d_model, args.layer)
        tokens = sum(len(engine.tokenizer(text)["input_ids"]) for text in corpus)
        scratch = tempfile.mkdtemp(prefix="bench-feature-stats-")

        def collect() -> None:
            shutil.rmtree(scratch, ignore_errors=True)
            engine.collect(corpus, out=scratch, layers=[args.layer], progress=False)

        def stats() -> None:
            engine.feature_stats(corpus, sae, progress=False)

        stats()  # the SAE installed, the ranks warm
        collected = median_seconds(collect, args.repeats)
        tallied = median_seconds(stats, args.repeats)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.model} TP={args.tp}, {tokens} tokens, SAE {sae.d_sae} features (k={sae.k})")
    print(f"  collect layer {args.layer}: {collected:7.2f} s  {tokens / collected:8.0f} tok/s")
    print(f"  feature_stats:     {tallied:7.2f} s  {tokens / tallied:8.0f} tok/s")
    print(f"  feature_stats / collect: {tallied / collected:.2f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
