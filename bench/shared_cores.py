"""Ranks that share cores (TP larger than the cores): bound round-robin, one core each, against
unbound with one thread each (`envoykit.runtime.lifeline.UNBOUND_RANKS`), side by side in
one run: plain vLLM prefill, `lens_corpus` against its floor (`bench/dataset.py`'s), and a
lens of a short prompt, with the corpus lens's statistics compared between the two.

    python bench/shared_cores.py --model demo --tp 3 --docs 64
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from dataset import head_gemm_seconds, median_of, plain_prefill, token_stream

import envoykit as ek
from envoykit.runtime.lifeline import UNBOUND_RANKS

PROMPT = "The capital of France is"


def measure(args, unbound: bool) -> tuple[dict[str, float], object]:
    """The figures of one binding, and its corpus lens (to compare the two's statistics)."""
    os.environ[UNBOUND_RANKS] = "1" if unbound else "0"
    try:
        with ek.Engine(args.model, args.tp, progress=False) as engine:
            docs = token_stream(engine.tokenizer, args.docs, args.tokens)
            n = engine.info.n_layers
            layers = sorted({round(n * (i + 1) / 6) for i in range(6)})

            def plain(batch=docs) -> None:
                plain_prefill(engine, batch)

            plain(docs[:4])
            engine.lens_corpus(docs[:4], layers=layers, progress=False)
            engine.lens(PROMPT, top_k=3)
            t_plain = median_of(plain, args.repeats)
            found = None

            def corpus() -> None:
                nonlocal found
                found = engine.lens_corpus(docs, layers=layers, progress=False)

            t_corpus = median_of(corpus, args.repeats)
            rows = args.docs * args.tokens * len({*layers, n})
            t_floor = t_plain + head_gemm_seconds(engine, rows, args.repeats)
            t_lens = median_of(lambda: engine.lens(PROMPT, top_k=3), 10 * args.repeats)
    finally:
        os.environ.pop(UNBOUND_RANKS, None)
    figures = {"plain": t_plain, "corpus": t_corpus, "floor": t_floor, "lens": t_lens}
    return figures, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    bound, bound_lens = measure(args, unbound=False)
    unbound, unbound_lens = measure(args, unbound=True)
    same = all(
        np.array_equal(getattr(bound_lens, name), getattr(unbound_lens, name))
        for name in ("document_sums", "document_counts")
    )
    print(f"{args.model}, TP={args.tp} on {cores} cores, {args.docs} x {args.tokens} tokens")
    print("| | bound, one core each | unbound, one thread each | unbound / bound |")
    print("| --- | ---: | ---: | ---: |")
    for name, key in [
        ("plain prefill (s)", "plain"),
        ("lens_corpus (s)", "corpus"),
        ("lens, 6 tokens (s)", "lens"),
    ]:
        ratio = unbound[key] / bound[key]
        print(f"| {name} | {bound[key]:.3f} | {unbound[key]:.3f} | {ratio:.2f} |")
    b, u = bound["corpus"] / bound["floor"], unbound["corpus"] / unbound["floor"]
    print(f"| lens_corpus / its floor | {b:.2f}x | {u:.2f}x | |")
    print(f"corpus lens statistics identical: {same}")


if __name__ == "__main__":
    main()
