"""The ``envoykit`` command: ``models``, ``info``, ``lens``, ``tune``, ``attribute``,
``attention``, ``steer``, ``features``, ``collect``, ``lens-corpus``, ``feature-stats``,
``train-sae``, ``serve`` and ``lab``.

Engines need the ``if __name__ == "__main__"`` guard vLLM's spawned ranks expect; a console
script's entry point provides it. Every command but ``models``, ``train-sae``, ``serve`` and
``lab`` starts an engine of its own, or with ``--server [URL]`` uses a running ``envoykit serve``.

One module per command group declares its commands' options and runs them; this one puts
them in one parser, in the order ``--help`` lists them, and hands each command to its module.
"""

from __future__ import annotations

import argparse
import sys

from envoykit.cli import attribution, corpus, info, lab, lens, sae, serve, steer
from envoykit.cli.options import open_engine

# The commands that run on an engine, by name: each takes the engine and its arguments.
ENGINE_COMMANDS = {
    "info": info.print_info,
    "lens": lens.print_lens,
    "tune": lens.tune,
    "attribute": attribution.print_attribution,
    "attention": attribution.print_attention,
    "steer": steer.print_steering,
    "features": sae.print_features,
    "feature-stats": sae.print_feature_stats,
    "collect": corpus.collect,
    "lens-corpus": corpus.print_lens_corpus,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, passed_on = parser.parse_known_args(argv)
    if passed_on and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    if args.command == "models":
        print(info.models_table())
        return 0
    if args.command == "lab":
        return lab.run_lab(args)
    if args.command == "serve":
        return serve.run_serve(args, passed_on)
    if args.command == "train-sae":
        return sae.run_train_sae(args)
    from envoykit import EnvoykitError

    try:
        with open_engine(args) as engine:
            ENGINE_COMMANDS[args.command](engine, args)
    except EnvoykitError as error:
        print(f"envoykit: {error}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every command and its options; `serve` passes the options it does not know to vLLM."""
    parser = argparse.ArgumentParser(prog="envoykit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (
        info.add_models,
        info.add_info,
        lens.add_lens,
        lens.add_tune,
        attribution.add_attribute,
        attribution.add_attention,
        sae.add_features,
        steer.add_steer,
        corpus.add_collect,
        sae.add_feature_stats,
        corpus.add_lens_corpus,
        sae.add_train_sae,
        serve.add_serve,
        lab.add_lab,
    ):
        add(commands)
    return parser
