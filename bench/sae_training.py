"""SAE training from a store on disk against the same training from its rows in memory,
side by side in one run: tokens/s of each and their ratio (the goal: at least 0.8x).

The store: ``--store PATH``; or, without it, one collected here from ``--docs`` documents
of Python's documentation (``pydoc_data.topics``) on ``--model`` at ``--tp`` (bfloat16, the
store's default dtype); or, with ``--synthetic D``, ``--rows`` random rows of width D written
by hand in the same layout (no engine). The rows in memory are ``store.load(layer, site)``.
Each figure is the median of ``--repeats`` whole ``train_sae`` calls (its read of every row
that checks and measures them, then ``--tokens`` training tokens), the two sources taking
turns (each first every other time), after one warm-up call of each; the two SAEs are also
checked to be equal bit for bit.

    python bench/sae_training.py --model demo --layer 10 --docs 512
    python bench/sae_training.py --synthetic 576 --rows 200000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import envoykit as ek
from envoykit.results.activations import StoreWriter, as_rows, row_key, text_chain


def collected(args, folder: Path) -> ek.Activations:
    """A store of ``args.docs`` documents collected on ``args.model``."""
    from envoykit.analyses.tuned import offline_texts

    texts = offline_texts()[0]
    docs = [texts[i % len(texts)] for i in range(args.docs)]
    with ek.Engine(args.model, tensor_parallel_size=args.tp, progress=False) as engine:
        return engine.collect(docs, out=folder / "store", layers=[args.layer], progress=False)


def synthetic(args, folder: Path) -> ek.Activations:
    """``args.rows`` random bfloat16 rows of width ``args.synthetic`` in shards of 4096 (what
    ``collect`` writes by default), with a few directions much more common than the rest."""
    generator = torch.Generator().manual_seed(0)
    d = args.synthetic
    settings = {
        "model": {"name": "synthetic", "d_model": d},
        "rows": as_rows([(args.layer, "resid")]),
        "positions": None,
        "dtype": "bfloat16",
        "max_length": 4096,
    }
    writer = StoreWriter.open(folder / "store", settings)
    atoms = torch.nn.functional.normalize(torch.randn(8 * d, d, generator=generator), dim=-1)
    chain = ""
    for shard, start in enumerate(range(0, args.rows, 4096)):
        size = min(4096, args.rows - start)
        codes = torch.rand(size, len(atoms), generator=generator).pow(32)
        rows = codes @ atoms + 0.05 * torch.randn(size, d, generator=generator)
        chain = text_chain(chain, str(shard))
        tensors = {
            row_key(args.layer, "resid"): rows.bfloat16(),
            "token_ids": torch.zeros(size, dtype=torch.int64),
            "document": torch.full((size,), shard, dtype=torch.int64),
            "position": torch.arange(size, dtype=torch.int64),
        }
        writer.add_shard(tensors, shard + 1, chain)
    writer.finish(shard + 1, chain)
    return ek.Activations.open(folder / "store")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, help="an existing store (else one is made)")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--synthetic", type=int, metavar="D", help="d_model of random rows")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--site", default="resid")
    parser.add_argument("--expansion", type=float, default=8)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=200_000, help="training tokens per run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="envoykit-bench-") as scratch:
        if args.store:
            store = ek.Activations.open(args.store)
        elif args.synthetic:
            store = synthetic(args, Path(scratch))
        else:
            store = collected(args, Path(scratch))
        rows = store.load(args.layer, args.site)
        run = {
            "layer": args.layer,
            "site": args.site,
            "expansion": args.expansion,
            "k": args.k,
            "batch_size": args.batch_size,
            "max_tokens": args.tokens,
            "progress": False,
        }
        sources = {"store": store, "memory": rows}
        times: dict[str, list[float]] = {name: [] for name in sources}
        trained = {name: ek.train_sae(source, **run) for name, source in sources.items()}
        for repeat in range(args.repeats):
            # Each source goes first every other time: neither gains from running second.
            for name, source in list(sources.items())[:: 1 if repeat % 2 else -1]:
                began = time.perf_counter()
                ek.train_sae(source, **run)
                times[name].append(time.perf_counter() - began)

    d_sae = trained["store"].d_sae
    equal = all(
        torch.equal(getattr(trained["store"], n), getattr(trained["memory"], n))
        for n in ("W_enc", "b_enc", "W_dec", "b_dec")
    )
    print(
        f"{len(store)} tokens of d_model {rows.shape[1]} ({store.dtype}, "
        f"{len(store.shard_files)} shards); TopK d_sae {d_sae}, k {args.k}, batch "
        f"{args.batch_size}, {args.tokens} training tokens; torch threads "
        f"{torch.get_num_threads()}"
    )
    speed = {name: args.tokens / statistics.median(t) for name, t in times.items()}
    for name in sources:
        seconds = statistics.median(times[name])
        print(f"  from {name:6s}  {seconds:7.2f} s  {speed[name]:9,.0f} tok/s")
    print(f"  store / memory: {speed['store'] / speed['memory']:.2f}x (goal >= 0.8x)")
    print(f"  the two SAEs are equal bit for bit: {equal}")


if __name__ == "__main__":
    main()
