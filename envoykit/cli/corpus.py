"""``envoykit collect`` and ``envoykit lens-corpus``: a corpus's activations saved to a store,
and the logit lens's statistics over a corpus; and how every corpus command reads its
corpus."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envoykit.cli.options import engine_options, split

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface

CORPUS_HELP = (
    'a text file (one document per line), a .jsonl file (one {"text": ...} per line), or '
    "'shipped' for the short corpus in the package"
)


def add_collect(commands: Any) -> None:
    collect = commands.add_parser(
        "collect",
        help="save whole activations of a corpus to a store of safetensors shards",
        description="Run a corpus through the engine, many documents per step, and save the "
        "activations at --layers and --sites to OUT (resumable: run it again to continue).",
    )
    collect.add_argument("corpus", help=CORPUS_HELP)
    engine_options(collect)
    collect.add_argument("--out", type=Path, required=True, help="the store's directory")
    collect.add_argument("--layers", default="all", help="comma-separated, 'embed', 'all'")
    collect.add_argument("--sites", default="resid", help="comma-separated sites")
    collect.add_argument("--dtype-stored", default="bfloat16", dest="stored")
    collect.add_argument("--max-length", type=int, help="piece length (default: the context)")


def add_lens_corpus(commands: Any) -> None:
    lens = commands.add_parser(
        "lens-corpus",
        help="the logit lens over a corpus: per-layer KL, entropy, agreement and accuracy",
    )
    lens.add_argument("corpus", help=CORPUS_HELP)
    engine_options(lens)
    lens.add_argument("--layers", default="embed,all", help="comma-separated, 'embed', 'all'")
    lens.add_argument("--top-k", type=int, default=1)
    lens.add_argument("--translator", type=Path, help="a tuned lens saved by `envoykit tune`")
    lens.add_argument("--out", type=Path, default=Path("lens_corpus.png"), help="figure")
    lens.add_argument("--json", type=Path, help="also write the CorpusLensResult as JSON")
    lens.add_argument("--csv", type=Path, help="also write the per-layer table as CSV")


def read_corpus(source: str) -> Iterator[str]:
    """The documents of a corpus argument (`CORPUS_HELP`), read lazily."""
    import json

    if source == "shipped":
        from envoykit import shipped_corpus

        yield from shipped_corpus()
        return
    from envoykit import InvalidRequest

    path = Path(source)
    if not path.is_file():
        raise InvalidRequest(f"no corpus file {source!r}: {CORPUS_HELP}")
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                yield line.rstrip("\n")
                continue
            try:
                yield json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise InvalidRequest(
                    f'{source} line {number} is not a JSON object with a "text" field'
                ) from None


def collect(engine: EngineSurface, args: argparse.Namespace) -> None:
    store = engine.collect(
        read_corpus(args.corpus),
        out=args.out,
        layers=_layers(args.layers),
        sites=split(args.sites),
        dtype=args.stored,
        max_length=args.max_length,
    )
    print(store)


def print_lens_corpus(engine: EngineSurface, args: argparse.Namespace) -> None:
    from envoykit import plot
    from envoykit.results.corpus import STATISTICS

    translator = None
    if args.translator is not None:
        from envoykit import TunedLens

        translator = TunedLens.load(args.translator)
    res = engine.lens_corpus(
        read_corpus(args.corpus),
        layers=_layers(args.layers),
        top_k=args.top_k,
        translator=translator,
    )
    print(
        f"{res.meta['lens']} lens over {res.n_documents} documents, {res.n_tokens} tokens "
        f"(top-{res.top_k}; {res.confidence:.0%} intervals over documents):"
    )
    print(f"{'layer':>6}" + "".join(f"{name:>24}" for name in STATISTICS))
    for row in res.table():
        cells = "".join(
            f"{row[name]:>9.4f} [{row[name + '_low']:.3f}, {row[name + '_high']:.3f}]"
            for name in STATISTICS
        )
        print(f"{row['layer']:>6}{cells}")
    settled = res.settles_at()
    print(f"top-1 settles {'nowhere' if settled is None else f'at layer {settled}'}")
    plot.lens_corpus(res).savefig(args.out, dpi=120)
    print(f"figure written to {args.out}")
    if args.json is not None:
        res.to_json(str(args.json))
    if args.csv is not None:
        res.to_csv(str(args.csv))


def _layers(text: str) -> list:
    """A --layers option: numbers, 'embed' and 'all'."""
    from envoykit import InvalidRequest

    try:
        return [part if part in ("embed", "all") else int(part) for part in split(text)]
    except ValueError:
        raise InvalidRequest(
            f"--layers takes comma-separated layer numbers, 'embed' and 'all', not {text!r}"
        ) from None
