"""What the commands share: the options that choose an engine, the engine they choose, and
the reading of comma-separated options."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from envoykit.engine import Engine
    from envoykit.serve.client import Connection


def engine_arguments(parser: argparse.ArgumentParser, keywords: tuple[str, ...]) -> None:
    """The options of ``keywords`` that choose an engine, as declared once for `Engine`, the
    server and the command line (`envoykit.runtime.info.ENGINE_OPTIONS`)."""
    from envoykit.runtime.info import ENGINE_OPTIONS

    for keyword in keywords:
        option = ENGINE_OPTIONS[keyword]
        parser.add_argument(
            option.flag, dest=keyword, type=option.type, default=option.default, help=option.help
        )


def engine_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that runs on an engine: a new one's, or ``--server``'s."""
    engine_arguments(parser, ("model", "tensor_parallel_size", "dtype"))
    parser.add_argument(
        "--server",
        nargs="?",
        const="",
        metavar="URL",
        help="use a running `envoykit serve` (no URL: $ENVOYKIT_SERVER or the newest local one)",
    )


def open_engine(args: argparse.Namespace) -> Engine | Connection:
    """The engine a command runs on: a server's when --server is given, else a new one."""
    if args.server is not None:
        from envoykit import connect

        return connect(args.server or None)
    from envoykit import Engine

    return Engine(args.model, args.tensor_parallel_size, dtype=args.dtype)


def split(text: str) -> list[str]:
    """The pieces of a comma-separated option, blanks dropped."""
    return [piece.strip() for piece in text.split(",") if piece.strip()]
