"""Corpus throughput: `collect` and `lens_corpus` against plain vLLM prefill, nnsight +
transformers and plain transformers, on the same token stream, side by side in one run.

The stream: ``--docs`` windows of ``--tokens`` token ids cut from Python's own documentation
(``pydoc_data.topics``), the same ids for every method. Per TP size, on one engine:
  * plain vLLM prefill: ``generate`` with ``max_tokens=1`` (the engine's own vLLM, no trace);
  * ``collect`` of the residual stream at 2 layers, and at every layer (bfloat16 store): the
    engine's first all-layer collect alone, with the peak resident memory of this process
    and of every engine process while it runs, then the median of the repeats after it;
  * ``lens_corpus`` at ``--lens-layers`` layers (top-1), against its floor: the prefill plus
    the head's GEMM over the same rows (``[rows, d] x [d, vocab]`` in float32, in this
    process on the same cores, with the kernel vLLM gives the head on the CPU: its oneDNN
    matmul where vLLM has one; the lens cannot do less arithmetic).
Then, once: nnsight's ``LanguageModel`` over transformers and plain transformers (forward
hooks) collecting the same 2 layers, ``--batch`` documents per forward, float32.

With ``--vllm-lens``, vllm-lens (PyPI) is installed without its dependencies into a
throwaway directory beside this machine's vLLM and captures the same 2 layers of the same
stream at every TP size of ``--tp`` (`bench/vllm_lens_capture.py`, its own engine, bound as
envoykit binds its ranks), against plain vLLM there.

Each figure is the median of ``--repeats`` runs after a warm-up on a few documents.

    python bench/dataset.py --docs 256 --tokens 128 --tp 1 3 --vllm-lens
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the ranks do (envoykit/runtime/platform.py)

import torch

import envoykit as ek


def median_of(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (warm-ups are explicit, on a few
    documents: a whole extra run of the corpus would double the benchmark)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def token_stream(tokenizer, docs: int, tokens: int) -> list[list[int]]:
    """``docs`` consecutive windows of ``tokens`` ids of Python's documentation."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < docs * tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {docs} x {tokens}")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(docs)]


def peak_rss(processes, work) -> tuple[float, list[int]]:
    """Run ``work``; its seconds and each process's peak resident bytes meanwhile."""
    peaks = [p.memory_info().rss for p in processes]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            for i, process in enumerate(processes):
                peaks[i] = max(peaks[i], process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    try:
        work()
    finally:
        elapsed = time.perf_counter() - began
        done.set()
        sampler.join()
    return elapsed, peaks


def head_gemm_seconds(engine, rows: int, repeats: int) -> float:
    """The head's GEMM over ``rows`` stream rows: float32 ``[rows, d] x [d, vocab]`` in
    chunks of 4096 rows (what the lens's budget allows per call at most)."""
    d, vocab = engine.info.d_model, engine.info.vocab
    matmul = head_matmul(torch.randn(vocab, d))
    chunk = torch.randn(min(rows, 4096), d)

    def gemm() -> None:
        for start in range(0, rows, 4096):
            matmul(chunk[: min(4096, rows - start)])

    return median_of(gemm, repeats)


def head_matmul(weight: torch.Tensor):
    """``x -> x @ weight.T`` with the kernel vLLM gives an unquantized head on the CPU
    (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`): its oneDNN matmul
    where vLLM has one, else torch's. torch's matmul is not that floor on every CPU: on an
    AMD EPYC it took 17.5 s where oneDNN took 7.4-8.0 s for the same 57,344 rows of demo."""
    from vllm import _custom_ops as ops

    if getattr(ops, "_supports_onednn", False):
        handler = ops.create_onednn_mm(weight.t(), 32)
        return lambda x: ops.onednn_mm(handler, x, None)
    return lambda x: x @ weight.t()


def plain_prefill(engine, docs: list[list[int]]) -> None:
    """vLLM's own prefill of ``docs`` (token ids) on ``engine``, one greedy token each, no
    trace: the floor a collection rides on."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=d) for d in docs]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with engine.exclusive():
        engine.model.vllm_entrypoint.generate(prompts, params, use_tqdm=False)


def bench_engine(args, tp: int, scratch: Path) -> tuple[list[tuple[str, float, str]], object]:
    import psutil

    rows: list[tuple[str, float, str]] = []
    with ek.Engine(args.model, tp, progress=False) as engine:
        docs = token_stream(engine.tokenizer, args.docs, args.tokens)
        n = engine.info.n_layers
        two = [n // 3, 2 * n // 3]
        lens_layers = sorted(
            {round(n * (i + 1) / args.lens_layers) for i in range(args.lens_layers)}
        )
        warm = docs[:8]

        def plain(batch=docs) -> None:
            plain_prefill(engine, batch)

        def collect(layers, name: str, batch=docs) -> None:
            out = scratch / f"tp{tp}-{name}"
            shutil.rmtree(out, ignore_errors=True)
            engine.collect(batch, out=out, layers=layers, progress=False)

        plain(warm)
        collect(two, "warm", warm)
        engine.lens_corpus(warm, layers=lens_layers, progress=False)
        t_plain = median_of(plain, args.repeats)
        t_two = median_of(lambda: collect(two, "two"), args.repeats)
        processes = [psutil.Process(), *engine.processes]
        # The first all-layer collect on an engine pays once for what later ones reuse; it
        # is timed alone (with the peak memory), then the median of the repeats after it.
        t_first_all, peaks = peak_rss(processes, lambda: collect("all", "all"))
        stored = sum(f.stat().st_size for f in (scratch / f"tp{tp}-all").iterdir())
        t_all = median_of(lambda: collect("all", "all"), args.repeats)
        t_lens = median_of(
            lambda: engine.lens_corpus(docs, layers=lens_layers, progress=False), args.repeats
        )
        # The final layer's row is always computed (KL is measured against it).
        lens_rows = args.docs * args.tokens * len({*lens_layers, n})
        t_floor = t_plain + head_gemm_seconds(engine, lens_rows, args.repeats)
        tokens = args.docs * args.tokens
        per = lambda t: f"{tokens / t:,.0f} tok/s"  # noqa: E731
        rows += [
            (f"TP={tp} plain vLLM prefill", t_plain, per(t_plain)),
            (f"TP={tp} collect, 2 layers ({two})", t_two, f"{t_two / t_plain:.2f}x plain"),
            (
                f"TP={tp} collect, all {n} layers, first",
                t_first_all,
                f"{t_first_all / t_plain:.2f}x plain",
            ),
            (f"TP={tp} collect, all {n} layers", t_all, f"{t_all / t_plain:.2f}x plain"),
            (
                f"TP={tp} lens_corpus, {len(lens_layers)} layers",
                t_lens,
                f"{t_lens / t_floor:.2f}x floor ({t_floor:.1f} s)",
            ),
        ]
        memory = ", ".join(f"{p / 2**20:.0f}" for p in peaks)
        rows.append(
            (f"TP={tp} collect all: peak RSS MiB (client, core, ranks): {memory}; "
             f"store {stored / 2**20:.0f} MiB", float("nan"), "")
        )  # fmt: skip
        path = engine.info.path
    return rows, (path, docs, two)


def bench_transformers(path: str, docs: list[list[int]], layers: list[int], args) -> list:
    """nnsight + transformers and plain transformers collecting the stream after ``layers``
    (1-based, as envoykit numbers them), ``args.batch`` documents per forward."""
    import nnsight
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batches = [torch.tensor(docs[i : i + args.batch]) for i in range(0, len(docs), args.batch)]

    @torch.no_grad()
    def plain() -> None:
        kept = []
        hooks = [
            model.model.layers[layer - 1].register_forward_hook(
                lambda m, a, out: kept.append(
                    (out[0] if isinstance(out, tuple) else out).bfloat16()
                )
            )
            for layer in layers
        ]
        try:
            for batch in batches:
                model(batch)
        finally:
            for hook in hooks:
                hook.remove()

    wrapped = nnsight.LanguageModel(model, tokenizer=None, dispatch=True)

    @torch.no_grad()  # as the plain one: a saved output would keep the batch's graph alive
    def through_nnsight() -> None:
        kept = []
        for batch in batches:
            with wrapped.trace(batch):
                for layer in layers:
                    out = wrapped.model.layers[layer - 1].output
                    kept.append((out[0] if isinstance(out, tuple) else out).bfloat16().save())

    small = batches
    batches = batches[:1]
    plain()
    through_nnsight()  # warm-ups on one batch
    batches = small
    t_plain = median_of(plain, args.repeats)
    t_nnsight = median_of(through_nnsight, args.repeats)
    return [
        (f"transformers, hooks, 2 layers (batch {args.batch})", t_plain, ""),
        (f"nnsight + transformers, 2 layers (batch {args.batch})", t_nnsight, ""),
    ]


VLLM_LENS = "vllm-lens==1.3.0"


def bench_vllm_lens(path: str, two: list[int], args, tp: int) -> list:
    """vllm-lens in a throwaway directory (installed once), run by `vllm_lens_capture.py`
    at TP=``tp``."""
    import json
    import subprocess
    import sys

    from envoykit.runtime import platform

    site = Path(args.vllm_lens_dir)
    if not (site / "vllm_lens").exists():
        subprocess.run(
            # Every vllm-lens release asks for Python >= 3.12; its code runs on 3.11.
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
             "--ignore-requires-python", "--target", str(site), VLLM_LENS],
            check=True,
        )  # fmt: skip
    script = Path(__file__).with_name("vllm_lens_capture.py")
    command = [sys.executable, str(script), "--path", path, "--docs", str(args.docs)]
    command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats), "--tp", str(tp)]
    command += ["--layers", ",".join(str(layer - 1) for layer in two)]
    command += ["--binding", platform.core_binding(platform.usable_cpus(), tp)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SUMMARY ")]
    if done.returncode != 0 or not lines:
        return [
            (
                f"TP={tp} vllm-lens: did not run ({done.stderr.strip().splitlines()[-1:]})",
                float("nan"),
                "",
            )
        ]
    found = json.loads(lines[0].removeprefix("SUMMARY "))
    return [
        (f"TP={tp} plain vLLM prefill (vllm-lens's engine)", found["plain_s"], ""),
        (
            f"TP={tp} vllm-lens, 2 layers ({two})",
            found["lens_s"],
            f"{found['lens_s'] / found['plain_s']:.2f}x its plain; "
            f"{found['relative_error']:.1e} from transformers",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--lens-layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--vllm-lens", action="store_true", help="also time vllm-lens")
    parser.add_argument("--vllm-lens-dir", default=str(Path(tempfile.gettempdir()) / "vllm-lens"))
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-dataset-"))
    rows = []
    try:
        for tp in args.tp:
            found, (path, docs, two) = bench_engine(args, tp, scratch)
            rows += found
            show(found, args.docs * args.tokens, found[0][1], tp)  # as measured, in case
            print(flush=True)
        rows += bench_transformers(path, docs, two, args)
        if args.vllm_lens:
            for tp in args.tp:
                rows += bench_vllm_lens(path, two, args, tp)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokens = args.docs * args.tokens
    print(f"\n{args.model}: {args.docs} documents x {args.tokens} tokens = {tokens} tokens")
    plain_one = next(t for name, t, _ in rows if "plain vLLM" in name)
    show(rows, tokens, plain_one, args.tp[0])


def show(rows: list, tokens: int, plain_one: float, tp: int) -> None:
    """The table, every time against the first TP size's plain prefill."""
    for name, seconds, note in rows:
        if seconds != seconds:  # a line of its own, not a timing
            print(f"  {name}")
            continue
        if not note:
            note = f"{tokens / seconds:,.0f} tok/s, {seconds / plain_one:.2f}x plain (TP={tp})"
        print(f"  {name:<48} {seconds:8.2f} s   {note}")


if __name__ == "__main__":
    main()
