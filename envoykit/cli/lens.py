"""``envoykit lens`` and ``envoykit tune``: the logit lens of one prompt, and the tuned lens
it can read through."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envoykit.cli.options import engine_options, split

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface


def add_lens(commands: Any) -> None:
    lens = commands.add_parser("lens", help="logit lens of a prompt: top-1 per layer and a PNG")
    lens.add_argument("prompt")
    engine_options(lens)
    lens.add_argument("--target", action="append", default=[], help="target token (repeatable)")
    lens.add_argument("--top-k", type=int, default=10)
    lens.add_argument("--out", type=Path, default=Path("lens.png"), help="figure (.png/.svg)")
    lens.add_argument("--json", type=Path, help="also write the LensResult as JSON")
    lens.add_argument(
        "--sites",
        default="resid",
        help="comma-separated lens sites: resid, resid_mid, attn, mlp (default: resid)",
    )

    lens.add_argument("--translator", type=Path, help="a tuned lens saved by `envoykit tune`")


def add_tune(commands: Any) -> None:
    tune = commands.add_parser("tune", help="train a tuned lens on text shipped offline")
    engine_options(tune)
    tune.add_argument("--minutes", type=float, default=5.0, help="training budget")
    tune.add_argument("--out", type=Path, help="where to save (default: the cache directory)")


def print_lens(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import TunedLens

    sites = split(args.sites)
    translator = None if args.translator is None else TunedLens.load(args.translator, engine)
    res = engine.lens(
        args.prompt,
        layers=["embed", "all"],
        top_k=args.top_k,
        targets=args.target,
        sites=sites,
        translator=translator,
    )
    info = engine.info
    print(f"logit lens of {args.prompt!r} on {info.name}, {info.tp} {info.platform} ranks")
    print(f"top-1 next token per layer at the last position ({res.tokens[-1]!r}):")
    traces = [res.target(t) for t in res.target_labels]
    for i, (label, (_, token, prob)) in enumerate(zip(res.layer_labels, res.top1(-1))):
        extra = "".join(
            f"   p({t.token!r})={t.prob[i, -1]:.3f} rank {t.rank[i, -1] + 1}" for t in traces
        )
        print(f"  layer {label:>7}: {token!r:<16} p={prob:.3f}{extra}")
    figure = res.plot()
    figure.savefig(args.out, dpi=120)
    print(f"heatmap written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")


def tune(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import TunedLens
    from envoykit.analyses.tuned import default_path, offline_texts

    train, held_out = offline_texts()
    tuned = TunedLens.train(engine, train, max_seconds=args.minutes * 60)
    path = tuned.save(args.out or default_path(tuned.model))
    quality = tuned.evaluate(engine, held_out[:3])
    print(f"trained {tuned.model['steps']} steps; translators written to {path}")
    print(f"mean KL(final || layer) on {quality.tokens} held-out tokens:")
    for layer, logit, tuned_kl in zip(quality.layers, quality.logit_kl, quality.tuned_kl):
        label = "embed" if layer == 0 else layer
        print(f"  layer {label:>5}: logit {logit:8.3f}  tuned {tuned_kl:8.3f}")
    print(f"tuned lens closer at {quality.better:.0%} of layers")
