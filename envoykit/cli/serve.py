"""``envoykit serve``: one engine served over HTTP to ``ek.connect()`` and ``--server``."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

from envoykit.cli.options import engine_arguments


def add_serve(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an engine to notebooks (ek.connect()); vLLM options pass through",
        description="Start an engine and serve it over HTTP to ek.connect() and --server. It "
        "runs the code its clients send: it listens on 127.0.0.1 and every request needs the "
        "token it writes under the cache directory. Options it does not know "
        "(--distributed-executor-backend ray, ...) go to vLLM unchanged.",
    )
    engine_arguments(serve, ("model", "tensor_parallel_size", "dtype", "max_model_len"))
    serve.add_argument("--host", default="127.0.0.1", help="other than loopback: --token-file")
    serve.add_argument("--port", type=int, default=6677, help="0 picks a free port")
    serve.add_argument("--token-file", type=Path, help="use this token (file of mode 600)")
    serve.add_argument("--restart", action="store_true", help="restart an engine that dies")
    engine_arguments(serve, ("log_level",))


def run_serve(args: argparse.Namespace, passed_on: list[str]) -> int:
    """Serve until stopped; ``passed_on``, the options argparse did not know, go to vLLM."""
    from envoykit import EnvoykitError, _compat
    from envoykit.serve.server import serve

    try:
        status = serve(
            args.model,
            tensor_parallel_size=args.tensor_parallel_size,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            restart=args.restart,
            log_level=args.log_level,
            # nnsight-serve's own spelling: --flag value becomes flag=value, coerced.
            engine_kwargs=_compat.parse_vllm_args(passed_on),
        )
    except EnvoykitError as error:
        print(f"envoykit serve: {error}", file=sys.stderr)
        return 2
    # The engine is closed (its segments unlinked) and the process exits next: skip the
    # interpreter's last garbage collections of a heap holding torch, vLLM and the model's
    # tree (tens of seconds on two busy cores).
    gc.freeze()
    if status == 0:
        print("envoykit serve: stopped; the engine is closed", file=sys.stderr)
    return status
