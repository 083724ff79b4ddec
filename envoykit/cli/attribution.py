"""``envoykit attribute`` and ``envoykit attention``: which components write a prediction,
and where one head looks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.cli.options import engine_options

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface


def add_attribute(commands: Any) -> None:
    attribute = commands.add_parser(
        "attribute", help="direct logit attribution of a target at the last position"
    )
    attribute.add_argument("prompt")
    engine_options(attribute)
    attribute.add_argument("--target", action="append", required=True, help="one token")
    attribute.add_argument("--out", type=Path, default=Path("attribution.png"))
    attribute.add_argument("--json", type=Path, help="also write the AttributionResult")


def add_attention(commands: Any) -> None:
    attention = commands.add_parser(
        "attention", help="attention pattern of one head, computed on the rank that holds it"
    )
    attention.add_argument("prompt")
    engine_options(attention)
    attention.add_argument("--layer", type=int, required=True, help="decoder layer (1 = first)")
    attention.add_argument("--head", type=int, required=True, help="head (0-based)")
    attention.add_argument("--out", type=Path, default=Path("attention.png"))
    attention.add_argument("--json", type=Path, help="also write the AttentionResult")


def print_attribution(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import plot

    res = engine.attribute(args.prompt, args.target, positions=[-1])
    info = engine.info
    print(f"direct logit attribution of {args.prompt!r} on {info.name}, {info.tp} rank(s)")
    for n, token in enumerate(res.target_tokens):
        values = res.values[:, 0, n]
        order = np.argsort(-np.abs(values))[:5]
        top = ", ".join(f"{res.components[i]} {values[i]:+.2f}" for i in order)
        print(f"  logit({token!r}) = {res.logits[0, n]:.2f}; largest: {top}")
    figure = plot.attribution(res, res.target_labels[0])
    figure.savefig(args.out, dpi=120)
    print(f"figure written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")


def print_attention(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import plot

    res = engine.attention(args.prompt, layers=[args.layer], heads=[args.head])
    info = engine.info
    layer, head = int(res.layers[0]), int(res.heads[0])
    print(f"attention of {args.prompt!r} on {info.name}, layer {layer}, head {head}:")
    print("most attended key per query:")
    for row, query in enumerate(res.queries.tolist()):
        weights = res.weights[0, 0, row]
        key = int(res.keys[0, 0, row, weights.argmax()])
        print(
            f"  {query:>4} {res.tokens[query]!r:<14} -> {key:>4} {res.tokens[key]!r:<14} "
            f"{weights.max():.3f}"
        )
    plot.attention(res, layer, head).savefig(args.out, dpi=120)
    print(f"figure written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")
