"""SAE features on the ranks: reading features and a splice lens against a plain lens, the
memory each rank holds of the SAE, and TP=1 against TP=N, side by side in one run.

On each engine (``--model`` at TP=1 and at ``--tp``), with a random 16x TopK SAE (k=32) of
the stream after layer ``--layer`` (its arithmetic costs what a trained one's does), medians
of ``--repeats`` runs on a ``--tokens``-token prompt:
  * ``engine.lens`` of every layer (top-10), the reference;
  * ``engine.features`` (top-16 per token, L0, errors);
  * ``engine.lens(splice=sae)`` (its plain run and the spliced lens);
  * each rank's bytes of the SAE against the whole SAE's.

    python bench/features.py --model demo --tp 3 --repeats 3
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

import torch
from timing import median_seconds

import envoykit as ek

TEXT = (
    "The history of the city begins with a small settlement on the river, where traders "
    "met to exchange salt, grain and cloth. Over the centuries it grew into a capital"
)


def random_sae(d_model: int, layer: int, expansion: int = 16, k: int = 32) -> ek.SAE:
    generator = torch.Generator().manual_seed(0)
    d_sae = expansion * d_model
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, d_model, generator=generator), dim=-1)
    b_enc = torch.randn(d_sae, generator=generator) * 0.1
    return ek.SAE("topk", W_dec.T.clone(), b_enc, W_dec, torch.zeros(d_model), layer=layer, k=k)


def measure(engine: ek.Engine, prompt: str, sae: ek.SAE, repeats: int) -> dict[str, float]:
    lens = median_seconds(lambda: engine.lens(prompt, top_k=10), repeats)
    features = median_seconds(lambda: engine.features(prompt, sae, top_k=16), repeats)
    splice = median_seconds(lambda: engine.lens(prompt, top_k=10, splice=sae), repeats)
    held = engine.sae_bytes(sae)
    tensors = (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec)
    whole = sum(t.numel() * t.element_size() for t in tensors)
    return {"lens": lens, "features": features, "splice": splice, "rank": max(held), "whole": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    rows = {}
    for tp in (1, args.tp):
        with ek.Engine(args.model, tp, progress=False) as engine:
            ids = engine.tokenizer(TEXT * 8)["input_ids"][: args.tokens]
            prompt = engine.tokenizer.decode(ids)
            sae = random_sae(engine.info.d_model, args.layer)
            rows[tp] = measure(engine, prompt, sae, args.repeats)
    print(
        f"{args.model}, {args.tokens} tokens, SAE of {sae.d_sae} features (16x), k=32, "
        f"layer {args.layer}"
    )
    print(
        "| TP | lens s | features s | features / lens | splice lens s | splice / lens "
        "| rank MiB | whole MiB | rank / whole |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tp, row in rows.items():
        print(
            f"| {tp} | {row['lens']:.3f} | {row['features']:.3f} "
            f"| {row['features'] / row['lens']:.2f}x | {row['splice']:.3f} "
            f"| {row['splice'] / row['lens']:.2f}x | {row['rank'] / 2**20:.1f} "
            f"| {row['whole'] / 2**20:.1f} | {row['rank'] / row['whole']:.3f} |"
        )
    one, many = rows[1], rows[args.tp]
    print(f"features TP={args.tp} / TP=1: {many['features'] / one['features']:.2f}x")


if __name__ == "__main__":
    main()
