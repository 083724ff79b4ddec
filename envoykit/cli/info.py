"""``envoykit models`` and ``envoykit info``: what envoykit reads, and what one engine is."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from envoykit.cli.options import engine_options

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface


def add_models(commands: Any) -> None:
    commands.add_parser("models", help="the architecture matrix: what envoykit reads, and how")


def add_info(commands: Any) -> None:
    info = commands.add_parser("info", help="start an engine, print ModelInfo and a generation")
    engine_options(info)
    info.add_argument("--prompt", default="The capital of France is")


def models_table() -> str:
    """The architecture matrix as text: every architecture envoykit reads, with its layer
    family, its sites and the built-in tiny checkpoint the tests run it on; then the ones
    it refuses, and why. From the tables the tests use."""
    from envoykit.model.families import ARCHITECTURES, REFUSED, sites_of
    from envoykit.runtime.architectures import ARCHITECTURES as CHECKPOINTS

    tiny = {arch.model_class: f"tiny-{name}" for name, arch in CHECKPOINTS.items()}
    lines = [f"{'architecture':22} {'family':16} {'sites':27} {'checkpoint':17} notes"]
    for name, arch in ARCHITECTURES.items():
        sites = ",".join(sites_of(arch.family))
        lines.append(
            f"{name:22} {arch.family.name:16} {sites:27} {tiny.get(name, '-'):17} {arch.notes}"
        )
    lines += [
        "",
        "Every architecture above: lens, sites, attribute, patch, patch_sweep, compare,",
        "generate= and the tuned lens, at any TP size. Any other architecture starts with",
        "every analysis refused; plain traces (engine.trace) still work.",
    ]
    lines += [f"refused: {name}: {why}" for name, why in REFUSED.items()]
    return "\n".join(lines)


def print_info(engine: EngineSurface, args: argparse.Namespace) -> None:
    for key, value in vars(engine.info).items():
        print(f"{key:>14}: {value}")
    print(f"\n{args.prompt!r} -> {engine.generate(args.prompt, max_tokens=12)!r}")
