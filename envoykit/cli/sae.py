"""``envoykit features``, ``envoykit feature-stats`` and ``envoykit train-sae``: an SAE's
features of a prompt, its features' statistics over a corpus, and an SAE trained on a store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.cli.corpus import CORPUS_HELP, read_corpus
from envoykit.cli.options import engine_options

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface


def add_features(commands: Any) -> None:
    features = commands.add_parser(
        "features", help="SAE features of a prompt, each rank encoding its slice of them"
    )
    features.add_argument("prompt")
    engine_options(features)
    features.add_argument("--sae", type=Path, required=True, help="SAELens/sparsify/Gemma Scope")
    features.add_argument("--layer", type=int, help="where the SAE reads, if its files say not")
    features.add_argument("--site", help="resid, resid_mid, attn or mlp (with --layer)")
    features.add_argument("--top-k", type=int, default=8)
    features.add_argument("--splice", action="store_true", help="also the spliced model's CE")
    features.add_argument("--out", type=Path, default=Path("features.png"))
    features.add_argument("--json", type=Path, help="also write the FeatureResult")


def add_feature_stats(commands: Any) -> None:
    stats = commands.add_parser(
        "feature-stats",
        help="every SAE feature over a corpus: frequency, histogram, max-activating contexts",
        description="Run a corpus through the engine with an SAE read on the ranks, and keep "
        "each feature's statistics and best contexts in OUT (resumable: run it again to "
        "continue); print the most frequent features and draw one feature's dashboard.",
    )
    stats.add_argument("corpus", help=CORPUS_HELP)
    engine_options(stats)
    stats.add_argument("--sae", type=Path, required=True, help="SAELens/sparsify/Gemma Scope")
    stats.add_argument("--layer", type=int, help="where the SAE reads, if its files say not")
    stats.add_argument("--site", help="resid, resid_mid, attn or mlp (with --layer)")
    stats.add_argument("--out", type=Path, required=True, help="the statistics' directory")
    stats.add_argument("--contexts", type=int, default=20, help="contexts kept per feature")
    stats.add_argument("--window", type=int, default=16, help="tokens per context")
    stats.add_argument("--max-length", type=int, help="piece length (default: the context)")
    stats.add_argument("--feature", type=int, help="the feature to draw (default: most frequent)")
    stats.add_argument("--figure", type=Path, default=Path("feature.png"))


def add_train_sae(commands: Any) -> None:
    train = commands.add_parser(
        "train-sae",
        help="train a sparse autoencoder on a store written by `envoykit collect`",
        description="Train a TopK (or ReLU) SAE of one (layer, site) of STORE on this "
        "machine's CPU, no engine started, and save it to OUT in SAELens's format with "
        "training_log.json beside it. Without --max-tokens or --max-seconds: one pass.",
    )
    train.add_argument("store", type=Path, help="a store written by `envoykit collect`")
    train.add_argument("--layer", type=int, required=True, help="the store's layer to train on")
    train.add_argument("--site", default="resid", help="resid, resid_mid, attn or mlp")
    train.add_argument("--out", type=Path, required=True, help="the SAE's directory")
    train.add_argument("--architecture", choices=("topk", "relu"), default="topk")
    train.add_argument("--d-sae", type=int, help="latents (default: --expansion x d_model)")
    train.add_argument("--expansion", type=float, default=16)
    train.add_argument("--k", type=int, help="TopK's active latents per token (default 32)")
    train.add_argument("--l1-coefficient", type=float, help="ReLU's L1 penalty (default 1.0)")
    train.add_argument("--max-tokens", type=int, help="training tokens (passes repeat)")
    train.add_argument("--max-seconds", type=float, help="a time budget")
    train.add_argument("--batch-size", type=int, default=4096, help="tokens per step")
    train.add_argument("--lr", type=float, help="default: 2e-4 / sqrt(d_sae / 2**14) for TopK")
    train.add_argument("--seed", type=int, default=0)


def print_features(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import SAE, plot

    sae = SAE.load(args.sae, layer=args.layer, site=args.site)
    res = engine.features(args.prompt, sae, top_k=args.top_k)
    print(
        f"SAE features of {args.prompt!r} on {engine.info.name}, {engine.info.tp} rank(s): "
        f"{sae.d_sae} features at layer {sae.layer} {sae.site!r}, mean L0 {res.l0.mean():.1f}, "
        f"variance explained {res.variance_explained():.3f}"
    )
    for position, token in enumerate(res.tokens):
        top = ", ".join(
            f"{f} {a:.2f}"
            for f, a in zip(res.top_ids[position, :3], res.top_acts[position, :3])
            if f >= 0
        )
        print(f"  {position:>4} {token!r:<14} {top or '(none)'}")
    if args.splice:
        spliced = engine.lens(args.prompt, layers=[-1], top_k=1, splice=sae)
        increase = spliced.meta["splice"]["ce_increase"]
        print(f"spliced model: cross-entropy increase {increase:+.4f} nats")
    plot.features(res).savefig(args.out, dpi=120)
    print(f"figure written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")


def print_feature_stats(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import SAE, plot

    sae = SAE.load(args.sae, layer=args.layer, site=args.site)
    stats = engine.feature_stats(
        read_corpus(args.corpus),
        sae,
        contexts=args.contexts,
        window=args.window,
        out=args.out,
        max_length=args.max_length,
    )
    print(stats)
    print(f"statistics written to {args.out} (ek.FeatureStats.open reads them)")
    for f in np.argsort(-stats.frequency, kind="stable")[:10].tolist():
        best = stats.contexts(f)[:1]
        where = "".join(best[0].tokens) if best else ""
        print(
            f"  feature {f:>6}: {stats.frequency[f]:7.2%} of tokens, max {stats.max[f]:8.3g}"
            f"  {where!r}"
        )
    f = int(np.argmax(stats.frequency)) if args.feature is None else args.feature
    figure = plot.feature(stats, f, logits=engine.feature_logits(sae, f))
    figure.savefig(args.figure, dpi=120)
    print(f"feature {f}'s dashboard written to {args.figure}")


def run_train_sae(args: argparse.Namespace) -> int:
    """Train on a store: no engine starts, the store's rows are all it reads."""
    import json

    from envoykit import EnvoykitError, train_sae

    try:
        sae = train_sae(
            args.store,
            layer=args.layer,
            site=args.site,
            architecture=args.architecture,
            d_sae=args.d_sae,
            expansion=args.expansion,
            k=args.k,
            l1_coefficient=args.l1_coefficient,
            max_tokens=args.max_tokens,
            max_seconds=args.max_seconds,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            out=args.out,
        )
    except EnvoykitError as error:
        print(f"envoykit train-sae: {error}", file=sys.stderr)
        return 2
    best = json.loads((args.out / "training_log.json").read_text())["best"]
    print(sae)
    print(
        f"held-out variance explained {best['held_out_variance_explained']:.4f} after "
        f"{best['tokens']} tokens (L0 {best['l0']}, dead {best['dead_fraction']:.1%}); "
        f"saved to {args.out}"
    )
    return 0
