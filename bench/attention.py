"""Attention patterns on the ranks: cost and traffic, side by side in one run.

For 16- and 64-token prompts, every head at every layer, medians of ``--repeats`` runs:
  * ``engine.attention`` against a lens of the same prompt on the same engine (goal <= 1.5x);
  * against plain transformers' eager forward with ``output_attentions=True`` on the same
    cores (goal <= 1.0x; run first, with no engine alive, so the two do not share the cores);
  * bytes each returns (the transformers forward returns every pattern whole, in process).

    python bench/attention.py --model demo --tp 3 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

import torch
from timing import median_seconds

import envoykit as ek
from envoykit.runtime import models

BASE = (
    "The capital of France is Paris, a city on the Seine with a long history of art, science "
    "and politics; its museums, bridges and cafes draw visitors from every part of the world, "
    "and its name is known to children who have never seen a map of Europe at all."
)


def prompts(tokenizer, lengths: list[int]) -> dict[int, str]:
    """Prompts of exactly ``lengths`` tokens, cut from one text."""
    ids = tokenizer(BASE)["input_ids"]
    return {n: tokenizer.decode(ids[:n]) for n in lengths}


def transformers_seconds(path: str, texts: dict[int, str], repeats: int) -> dict[int, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = {}
    with torch.no_grad():
        for n, text in texts.items():
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out[n] = median_seconds(lambda ids=ids: model(ids, output_attentions=True), repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", default="16,64")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]

    source = models.resolve(args.model)
    from transformers import AutoTokenizer

    texts = prompts(AutoTokenizer.from_pretrained(source.path), lengths)
    plain = transformers_seconds(source.path, texts, args.repeats)
    gc.collect()  # the transformers model goes before the engine starts
    rows = []
    with ek.Engine(args.model, args.tp, progress=False) as engine:
        info = engine.info
        for n, text in texts.items():
            res = engine.attention(text)
            lens_s = median_seconds(lambda text=text: engine.lens(text), args.repeats)
            attn_s = median_seconds(lambda text=text: engine.attention(text), args.repeats)
            rows.append(
                (n, attn_s, lens_s, plain[n], res.meta["returned_bytes"], res.weights.shape)
            )

    print(
        f"{info.name}, TP={info.tp}, {info.dtype}, {info.n_layers} layers x {info.n_heads} "
        f"heads, every head at every layer, median of {args.repeats}"
    )
    print(
        f"{'tokens':>6} {'attention ms':>13} {'lens ms':>8} {'/ lens':>7} "
        f"{'transformers ms':>16} {'/ transformers':>15} {'bytes back':>11}"
    )
    for n, attn_s, lens_s, hf_s, returned, _ in rows:
        print(
            f"{n:>6} {attn_s * 1e3:>13.1f} {lens_s * 1e3:>8.1f} {attn_s / lens_s:>7.2f} "
            f"{hf_s * 1e3:>16.1f} {attn_s / hf_s:>15.2f} {returned:>11,}"
        )
    print("goals: attention / lens <= 1.5x; attention / transformers <= 1.0x")


if __name__ == "__main__":
    main()
