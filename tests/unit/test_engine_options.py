"""An engine's options are declared once (`envoykit.runtime.info.ENGINE_OPTIONS`): `Engine`,
`envoykit serve` and the command line give the same defaults, so the three start the same
engine when nothing is asked."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from envoykit.cli import build_parser
from envoykit.engine import EngineLifetime
from envoykit.runtime.info import ENGINE_OPTIONS
from envoykit.serve.server import serve


def defaults(function: Callable) -> dict[str, object]:
    parameters = inspect.signature(function).parameters
    return {name: p.default for name, p in parameters.items() if name in ENGINE_OPTIONS}


def test_engine_and_serve_default_to_the_declared_options():
    declared = {keyword: option.default for keyword, option in ENGINE_OPTIONS.items()}
    assert defaults(EngineLifetime.__init__) == declared
    assert defaults(serve) == declared


def test_the_command_line_defaults_to_the_declared_options():
    parser = build_parser()
    lens = vars(parser.parse_args(["lens", "a prompt"]))
    served = vars(parser.parse_args(["serve"]))
    for keyword, option in ENGINE_OPTIONS.items():
        assert served[keyword] == option.default, keyword
        if keyword in ("model", "tensor_parallel_size", "dtype"):
            assert lens[keyword] == option.default, keyword


def test_a_flag_is_read_with_its_declared_type():
    args = build_parser().parse_args(["serve", "--tp", "2", "--max-model-len", "512"])
    assert (args.tensor_parallel_size, args.max_model_len) == (2, 512)
