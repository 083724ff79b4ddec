"""The ``envoykit`` command: ``models``, ``info``, ``lens``, ``tune``, ``attribute``,
``attention``, ``steer``, ``features``, ``collect``, ``lens-corpus``, ``feature-stats``,
``train-sae``, ``serve`` and ``lab``.

Engines need the ``if __name__ == "__main__"`` guard vLLM's spawned ranks expect; a console
script's entry point provides it. Every command but ``models``, ``train-sae``, ``serve`` and
``lab`` starts an engine of its own, or with ``--server [URL]`` uses a running ``envoykit serve``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, passed_on = parser.parse_known_args(argv)
    if passed_on and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    if args.command == "models":
        print(models_table())
        return 0
    if args.command == "lab":
        return _lab(args)
    if args.command == "serve":
        return _serve(args, passed_on)
    if args.command == "train-sae":
        return _train_sae(args)
    from envoykit import EnvoykitError

    try:
        with _engine(args) as engine:
            if args.command == "info":
                _print_info(engine, args.prompt)
            elif args.command == "tune":
                _tune(engine, args)
            elif args.command == "attribute":
                _print_attribution(engine, args)
            elif args.command == "attention":
                _print_attention(engine, args)
            elif args.command == "steer":
                _print_steering(engine, args)
            elif args.command == "features":
                _print_features(engine, args)
            elif args.command == "feature-stats":
                _print_feature_stats(engine, args)
            elif args.command == "collect":
                _collect(engine, args)
            elif args.command == "lens-corpus":
                _print_lens_corpus(engine, args)
            else:
                _print_lens(engine, args)
    except EnvoykitError as error:
        print(f"envoykit: {error}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    """Every command and its options; `serve` passes the options it does not know to vLLM."""
    parser = argparse.ArgumentParser(prog="envoykit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("models", help="the architecture matrix: what envoykit reads, and how")
    info = commands.add_parser("info", help="start an engine, print ModelInfo and a generation")
    _engine_options(info)
    info.add_argument("--prompt", default="The capital of France is")

    lens = commands.add_parser("lens", help="logit lens of a prompt: top-1 per layer and a PNG")
    lens.add_argument("prompt")
    _engine_options(lens)
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

    tune = commands.add_parser("tune", help="train a tuned lens on text shipped offline")
    _engine_options(tune)
    tune.add_argument("--minutes", type=float, default=5.0, help="training budget")
    tune.add_argument("--out", type=Path, help="where to save (default: the cache directory)")

    attribute = commands.add_parser(
        "attribute", help="direct logit attribution of a target at the last position"
    )
    attribute.add_argument("prompt")
    _engine_options(attribute)
    attribute.add_argument("--target", action="append", required=True, help="one token")
    attribute.add_argument("--out", type=Path, default=Path("attribution.png"))
    attribute.add_argument("--json", type=Path, help="also write the AttributionResult")

    attention = commands.add_parser(
        "attention", help="attention pattern of one head, computed on the rank that holds it"
    )
    attention.add_argument("prompt")
    _engine_options(attention)
    attention.add_argument("--layer", type=int, required=True, help="decoder layer (1 = first)")
    attention.add_argument("--head", type=int, required=True, help="head (0-based)")
    attention.add_argument("--out", type=Path, default=Path("attention.png"))
    attention.add_argument("--json", type=Path, help="also write the AttentionResult")

    features = commands.add_parser(
        "features", help="SAE features of a prompt, each rank encoding its slice of them"
    )
    features.add_argument("prompt")
    _engine_options(features)
    features.add_argument("--sae", type=Path, required=True, help="SAELens/sparsify/Gemma Scope")
    features.add_argument("--layer", type=int, help="where the SAE reads, if its files say not")
    features.add_argument("--site", help="resid, resid_mid, attn or mlp (with --layer)")
    features.add_argument("--top-k", type=int, default=8)
    features.add_argument("--splice", action="store_true", help="also the spliced model's CE")
    features.add_argument("--out", type=Path, default=Path("features.png"))
    features.add_argument("--json", type=Path, help="also write the FeatureResult")

    _steer_options(commands)
    _corpus_options(commands)
    _train_sae_options(commands)
    _serve_options(commands)
    lab = commands.add_parser("lab", help="JupyterLab on notebooks/, bound to 127.0.0.1")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--dir", type=Path, default=Path("notebooks"))
    return parser


def _steer_options(commands: Any) -> None:
    steer = commands.add_parser(
        "steer",
        help="steer a prompt's generation with a contrastive direction, at several strengths",
        description="Build a steering vector from --positive and --negative prompts (or load "
        "one with --vector), then continue PROMPT greedily at scale 0 and each --scales, in "
        "one trace, printing every continuation and the targets' probability at the last layer.",
    )
    steer.add_argument("prompt")
    _engine_options(steer)
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


CORPUS_HELP = (
    'a text file (one document per line), a .jsonl file (one {"text": ...} per line), or '
    "'shipped' for the short corpus in the package"
)


def _corpus_options(commands: Any) -> None:
    collect = commands.add_parser(
        "collect",
        help="save whole activations of a corpus to a store of safetensors shards",
        description="Run a corpus through the engine, many documents per step, and save the "
        "activations at --layers and --sites to OUT (resumable: run it again to continue).",
    )
    collect.add_argument("corpus", help=CORPUS_HELP)
    _engine_options(collect)
    collect.add_argument("--out", type=Path, required=True, help="the store's directory")
    collect.add_argument("--layers", default="all", help="comma-separated, 'embed', 'all'")
    collect.add_argument("--sites", default="resid", help="comma-separated sites")
    collect.add_argument("--dtype-stored", default="bfloat16", dest="stored")
    collect.add_argument("--max-length", type=int, help="piece length (default: the context)")
    stats = commands.add_parser(
        "feature-stats",
        help="every SAE feature over a corpus: frequency, histogram, max-activating contexts",
        description="Run a corpus through the engine with an SAE read on the ranks, and keep "
        "each feature's statistics and best contexts in OUT (resumable: run it again to "
        "continue); print the most frequent features and draw one feature's dashboard.",
    )
    stats.add_argument("corpus", help=CORPUS_HELP)
    _engine_options(stats)
    stats.add_argument("--sae", type=Path, required=True, help="SAELens/sparsify/Gemma Scope")
    stats.add_argument("--layer", type=int, help="where the SAE reads, if its files say not")
    stats.add_argument("--site", help="resid, resid_mid, attn or mlp (with --layer)")
    stats.add_argument("--out", type=Path, required=True, help="the statistics' directory")
    stats.add_argument("--contexts", type=int, default=20, help="contexts kept per feature")
    stats.add_argument("--window", type=int, default=16, help="tokens per context")
    stats.add_argument("--max-length", type=int, help="piece length (default: the context)")
    stats.add_argument("--feature", type=int, help="the feature to draw (default: most frequent)")
    stats.add_argument("--figure", type=Path, default=Path("feature.png"))
    lens = commands.add_parser(
        "lens-corpus",
        help="the logit lens over a corpus: per-layer KL, entropy, agreement and accuracy",
    )
    lens.add_argument("corpus", help=CORPUS_HELP)
    _engine_options(lens)
    lens.add_argument("--layers", default="embed,all", help="comma-separated, 'embed', 'all'")
    lens.add_argument("--top-k", type=int, default=1)
    lens.add_argument("--translator", type=Path, help="a tuned lens saved by `envoykit tune`")
    lens.add_argument("--out", type=Path, default=Path("lens_corpus.png"), help="figure")
    lens.add_argument("--json", type=Path, help="also write the CorpusLensResult as JSON")
    lens.add_argument("--csv", type=Path, help="also write the per-layer table as CSV")


def _train_sae_options(commands: Any) -> None:
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


def _train_sae(args: argparse.Namespace) -> int:
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


def _serve_options(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an engine to notebooks (ek.connect()); vLLM options pass through",
        description="Start an engine and serve it over HTTP to ek.connect() and --server. It "
        "runs the code its clients send: it listens on 127.0.0.1 and every request needs the "
        "token it writes under the cache directory. Options it does not know "
        "(--distributed-executor-backend ray, ...) go to vLLM unchanged.",
    )
    serve.add_argument("--model", default="demo", help="built-in name, local dir or hub id")
    serve.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size (default: the largest that gives every rank a core or GPU)",
    )
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--host", default="127.0.0.1", help="other than loopback: --token-file")
    serve.add_argument("--port", type=int, default=6677, help="0 picks a free port")
    serve.add_argument("--token-file", type=Path, help="use this token (file of mode 600)")
    serve.add_argument("--restart", action="store_true", help="restart an engine that dies")
    serve.add_argument("--log-level", default="ERROR", help="vLLM's screen log level")


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


def _engine_options(parser: argparse.ArgumentParser) -> None:
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


def _engine(args: argparse.Namespace):
    """The engine a command runs on: a server's when --server is given, else a new one."""
    if args.server is not None:
        from envoykit import connect

        return connect(args.server or None)
    from envoykit import Engine

    return Engine(args.model, args.tp, dtype=args.dtype)


def _serve(args: argparse.Namespace, passed_on: list[str]) -> int:
    from nnsight.modeling.vllm.serve.cli import _parse_vllm_args

    from envoykit import EnvoykitError
    from envoykit.serve.server import serve

    try:
        status = serve(
            args.model,
            tensor_parallel_size=args.tp,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            host=args.host,
            port=args.port,
            token_file=args.token_file,
            restart=args.restart,
            log_level=args.log_level,
            # nnsight-serve's own spelling: --flag value becomes flag=value, coerced.
            engine_kwargs=_parse_vllm_args(passed_on),
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


def _print_info(engine, prompt: str) -> None:
    for key, value in vars(engine.info).items():
        print(f"{key:>14}: {value}")
    print(f"\n{prompt!r} -> {engine.generate(prompt, max_tokens=12)!r}")


def _print_lens(engine, args: argparse.Namespace) -> None:
    from envoykit import TunedLens

    sites = _split(args.sites)
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


def read_corpus(source: str):
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


def _split(text: str) -> list[str]:
    """The pieces of a comma-separated option, blanks dropped."""
    return [piece.strip() for piece in text.split(",") if piece.strip()]


def _layers(text: str) -> list:
    """A --layers option: numbers, 'embed' and 'all'."""
    from envoykit import InvalidRequest

    try:
        return [part if part in ("embed", "all") else int(part) for part in _split(text)]
    except ValueError:
        raise InvalidRequest(
            f"--layers takes comma-separated layer numbers, 'embed' and 'all', not {text!r}"
        ) from None


def _collect(engine, args: argparse.Namespace) -> None:
    store = engine.collect(
        read_corpus(args.corpus),
        out=args.out,
        layers=_layers(args.layers),
        sites=_split(args.sites),
        dtype=args.stored,
        max_length=args.max_length,
    )
    print(store)


def _print_lens_corpus(engine, args: argparse.Namespace) -> None:
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


def _tune(engine, args: argparse.Namespace) -> None:
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


def _print_attribution(engine, args: argparse.Namespace) -> None:
    from envoykit import plot

    res = engine.attribute(args.prompt, args.target, positions=[-1])
    info = engine.info
    print(f"direct logit attribution of {args.prompt!r} on {info.name}, {info.tp} rank(s)")
    for n, token in enumerate(res.target_tokens):
        values = res.values[:, 0, n]
        order = np.argsort(-np.abs(values))[:5]
        top = ", ".join(f"{res.components[i]} {values[i]:+.2f}" for i in order)
        print(f"  logit({token!r}) = {res.logits[0, n]:.2f}; largest: {top}")
    figure = plot.attribution(res, res.target_labels[0])
    figure.savefig(args.out, dpi=120)
    print(f"figure written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")


def _print_features(engine, args: argparse.Namespace) -> None:
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


def _print_feature_stats(engine, args: argparse.Namespace) -> None:
    import numpy as np

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


def _print_attention(engine, args: argparse.Namespace) -> None:
    from envoykit import plot

    res = engine.attention(args.prompt, layers=[args.layer], heads=[args.head])
    info = engine.info
    layer, head = int(res.layers[0]), int(res.heads[0])
    print(f"attention of {args.prompt!r} on {info.name}, layer {layer}, head {head}:")
    print("most attended key per query:")
    for row, query in enumerate(res.queries.tolist()):
        weights = res.weights[0, 0, row]
        key = int(res.keys[0, 0, row, weights.argmax()])
        print(
            f"  {query:>4} {res.tokens[query]!r:<14} -> {key:>4} {res.tokens[key]!r:<14} "
            f"{weights.max():.3f}"
        )
    plot.attention(res, layer, head).savefig(args.out, dpi=120)
    print(f"figure written to {args.out}")
    if args.json:
        res.to_json(str(args.json))
        print(f"result written to {args.json}")


def _print_steering(engine, args: argparse.Namespace) -> None:
    from envoykit import InvalidRequest, Steer, SteeringVector, plot

    if args.vector is not None:
        if args.positive or args.negative:
            raise InvalidRequest("give --vector or --positive/--negative prompts, not both")
        vector = SteeringVector.load(args.vector)
    elif args.layer is None or not (args.positive and args.negative):
        raise InvalidRequest(
            "a steering vector needs --layer and at least one --positive and one --negative "
            "prompt (or --vector PATH)"
        )
    else:
        vector = engine.steering_vector(args.positive, args.negative, args.layer)
    layer = vector.layer if args.layer is None else args.layer
    try:
        scales = sorted({0.0, *(float(x) for x in args.scales.split(",") if x.strip())})
    except ValueError as error:
        raise InvalidRequest(
            f"--scales takes comma-separated numbers, not {args.scales!r}"
        ) from error
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


def _lab(args: argparse.Namespace) -> int:
    """JupyterLab on ``args.dir``, bound to 127.0.0.1, with a fresh token.

    The token goes to JupyterLab in its environment (``JUPYTER_TOKEN``), not on its command
    line, where every user of the machine could read it in ``ps``. SIGTERM and SIGINT reach
    JupyterLab as SIGTERM (a clean stop: a SIGINT alone would have it ask for confirmation)
    and are waited for, so stopping this command stops JupyterLab and its kernels rather than
    leaving them running as orphans.
    """
    import secrets
    import signal
    import subprocess

    token = secrets.token_hex(16)
    print(f"JupyterLab: http://127.0.0.1:{args.port}/lab?token={token}", flush=True)
    command = [
        sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={args.dir}", "--ip=127.0.0.1",
        f"--port={args.port}", "--no-browser",
    ]  # fmt: skip
    if os.geteuid() == 0:  # containers often run as root; JupyterLab refuses without this
        command.append("--allow-root")
    lab = subprocess.Popen(command, env={**os.environ, "JUPYTER_TOKEN": token})

    def stop(_signum: int, _frame: Any) -> None:
        lab.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return lab.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
