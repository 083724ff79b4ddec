"""``envoykit steer``: a prompt's generation steered by one direction, at several strengths."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envoykit.cli.options import engine_options

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface
    from envoykit.results.steering import SteeringVector


def add_steer(commands: Any) -> None:
    steer = commands.add_parser(
        "steer",
        help="steer a prompt's generation with a contrastive direction, at several strengths",
        description="Build a steering vector from --positive and --negative prompts (or load "
        "one with --vector), then continue PROMPT greedily at scale 0 and each --scales, in "
        "one trace, printing every continuation and the targets' probability at the last layer.",
    )
    steer.add_argument("prompt")
    engine_options(steer)
    steer.add_argument("--positive", action="append", default=[], help="prompt (repeatable)")
    steer.add_argument("--negative", action="append", default=[], help="prompt (repeatable)")
    steer.add_argument("--vector", type=Path, help="a steering vector saved by --save-vector")
    steer.add_argument("--layer", type=int, help="decoder layer to steer after (1 = first)")
    steer.add_argument(
        "--scales", default="-4,4", help="comma-separated strengths (default -4,4; 0 is added)"
    )
    steer.add_argument("--norm-match", action="store_true", help="keep each row's norm")
    steer.add_argument("--max-tokens", type=int, default=16)
    steer.add_argument("--target", action="append", default=[], help="target token (repeatable)")
    steer.add_argument("--save-vector", type=Path, help="write the vector built (safetensors)")
    steer.add_argument("--out", type=Path, default=Path("steering.png"), help="with --target")
    steer.add_argument("--json", type=Path, help="also write the SteerSweepResult as JSON")


def print_steering(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import Steer, plot

    vector = _vector(engine, args)
    layer = vector.layer if args.layer is None else args.layer
    scales = _scales(args.scales)
    steer = Steer(vector, layer, norm_match=args.norm_match)
    res = engine.steer_sweep(
        args.prompt, steer, scales=scales, max_tokens=args.max_tokens, targets=args.target
    )
    print(f"steering {args.prompt!r} on {engine.info.name}, {engine.info.tp} rank(s):")
    print(f"  vector: {vector.label}, norm {vector.norm:.4g}; added after layer {layer}")
    for i, scale in enumerate(res.scales.tolist()):
        probs = "".join(
            f"   p({t!r})={res.target_probs[i, -1, n]:.3f}" for n, t in enumerate(res.target_tokens)
        )
        print(f"  scale {scale:>+7g}: {res.texts[i]!r}{probs}")
    if args.save_vector:
        print(f"vector written to {vector.save(args.save_vector)}")
    if res.target_labels:
        plot.steering(res, 0).savefig(args.out, dpi=120)
        print(f"figure written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")


def _vector(engine: EngineSurface, args: argparse.Namespace) -> SteeringVector:
    """The direction to steer along: loaded by --vector, or built from the contrast of the
    --positive and --negative prompts at --layer; either, never both."""
    from envoykit import InvalidRequest, SteeringVector

    if args.vector is not None:
        if args.positive or args.negative:
            raise InvalidRequest("give --vector or --positive/--negative prompts, not both")
        return SteeringVector.load(args.vector)
    if args.layer is None or not (args.positive and args.negative):
        raise InvalidRequest(
            "a steering vector needs --layer and at least one --positive and one --negative "
            "prompt (or --vector PATH)"
        )
    return engine.steering_vector(args.positive, args.negative, args.layer)


def _scales(text: str) -> list[float]:
    """The strengths of a --scales option, sorted, with 0 (the unsteered baseline) added."""
    from envoykit import InvalidRequest

    try:
        return sorted({0.0, *(float(x) for x in text.split(",") if x.strip())})
    except ValueError as error:
        raise InvalidRequest(f"--scales takes comma-separated numbers, not {text!r}") from error
