"""`collect` against plain vLLM prefill on one engine, in turn, repeated: a quicker look than
`bench/dataset.py` at what a collection costs over the prefill it rides on.

Each repeat times, one after the other on the same engine: the plain prefill of the token
stream (vLLM's ``generate``, ``max_tokens=1``), `collect` of 2 layers and `collect` of every
layer (bfloat16 store, rewritten each time). Prints every repeat's seconds and ratios.

    python bench/collect.py --model demo --tp 3 --docs 64 --repeats 2
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from dataset import plain_prefill, token_stream

import envoykit as ek


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-collect-"))
    try:
        with ek.Engine(args.model, args.tp, progress=False) as engine:
            docs = token_stream(engine.tokenizer, args.docs, args.tokens)
            n = engine.info.n_layers

            def plain() -> None:
                plain_prefill(engine, docs)

            def collect(layers) -> None:
                shutil.rmtree(scratch / "store", ignore_errors=True)
                engine.collect(docs, out=scratch / "store", layers=layers, progress=False)

            collect([n // 3, 2 * n // 3])  # warm-up
            plain()
            print(f"{args.model} TP={args.tp}: {args.docs} documents x {args.tokens} tokens")
            for repeat in range(args.repeats):
                seconds = {}
                for name, run in [
                    ("plain", plain),
                    ("2 layers", lambda: collect([n // 3, 2 * n // 3])),
                    ("all layers", lambda: collect("all")),
                ]:
                    began = time.perf_counter()
                    run()
                    seconds[name] = time.perf_counter() - began
                base = seconds["plain"]
                print(
                    f"  repeat {repeat + 1}: "
                    + ", ".join(f"{k} {v:.2f} s ({v / base:.2f}x)" for k, v in seconds.items()),
                    flush=True,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
