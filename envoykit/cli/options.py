"""What the commands share: the options that choose an engine, the engine they choose, and
the reading of comma-separated options."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from envoykit.engine import Engine
    from envoykit.serve.client import Connection


def engine_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that runs on an engine: a new one's, or ``--server``'s."""
    parser.add_argument("--model", default="demo", help="built-in name, local dir or hub id")
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size (default: the largest that gives every rank a core or GPU)",
    )
    parser.add_argument("--dtype", default="auto")
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

    return Engine(args.model, args.tp, dtype=args.dtype)


def split(text: str) -> list[str]:
    """The pieces of a comma-separated option, blanks dropped."""
    return [piece.strip() for piece in text.split(",") if piece.strip()]
