"""The quality of an SAE trained by envoykit, against an untrained one of the same shape.

On ``--model`` at ``--tp``: collect the stream after ``--layer`` over the shipped corpus and
Python's own help texts (``pydoc_data``, offline; one paragraph per document) but the last
``--held-out`` paragraphs, train a TopK SAE on it for ``--seconds`` with `ek.train_sae`, and
measure on the held-out paragraphs the variance explained and the spliced cross-entropy
increase (``lens(splice=sae)``) of the trained SAE and of the untrained floor (random unit
decoder rows, the encoder their transpose).

    python bench/sae_quality.py --model demo --tp 1 --seconds 300
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch

import envoykit as ek


def quality(engine: ek.Engine, texts: list[str], sae: ek.SAE) -> tuple[float, float]:
    read = engine.features(texts, sae, top_k=1)
    explained = float(np.mean([r.variance_explained(skip_first=True) for r in read]))
    spliced = [engine.lens(text, layers=[-1], top_k=1, splice=sae) for text in texts]
    return explained, float(np.mean([s.meta["splice"]["ce_increase"] for s in spliced]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--expansion", type=float, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--held-out", type=int, default=20)
    args = parser.parse_args()

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n")]
    docs = ek.shipped_corpus() + sorted({p for p in paragraphs if len(p) > 80})
    train, held_out = docs[: -args.held_out], docs[-args.held_out :]
    work = Path(tempfile.mkdtemp(prefix="bench-sae-quality-"))
    with ek.Engine(args.model, args.tp, progress=False) as engine:
        started = time.perf_counter()
        store = engine.collect(train, out=work / "store", layers=[args.layer], progress=False)
        collected = time.perf_counter() - started
        sae = ek.train_sae(
            store,
            layer=args.layer,
            expansion=args.expansion,
            k=args.k,
            max_seconds=args.seconds,
            out=work / "sae",
            progress=False,
        )
        generator = torch.Generator().manual_seed(0)
        decoder = torch.randn(sae.d_sae, sae.d_in, generator=generator)
        decoder = torch.nn.functional.normalize(decoder, dim=-1)
        floor = ek.SAE(
            "topk", decoder.T.clone(), torch.zeros(sae.d_sae), decoder, sae.b_dec,
            layer=args.layer, k=args.k,
        )  # fmt: skip
        trained, untrained = quality(engine, held_out, sae), quality(engine, held_out, floor)
        held = sum(len(engine.tokenizer(text)["input_ids"]) for text in held_out)
    print(
        f"{args.model} TP={args.tp} layer {args.layer}: {len(store)} training tokens "
        f"({collected:.0f} s to collect), TopK {sae.d_sae} features k={args.k}, "
        f"{args.seconds:.0f} s of training; {held} held-out tokens"
    )
    print(f"{'SAE':>10}  variance explained  spliced CE increase (nats)")
    for name, (explained, increase) in (("trained", trained), ("untrained", untrained)):
        print(f"{name:>10}  {explained:18.3f}  {increase:+26.3f}")


if __name__ == "__main__":
    main()
