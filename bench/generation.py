"""The lens across generated tokens against plain generation, and where its extra time goes.

``engine.lens(prompt, generate=N)`` runs one nnsight trace of N+1 forward steps (the prompt,
then each generated token as it is fed back) and lenses every step on the ranks. Its goal is
at most twice the time of ``engine.generate(prompt, N)``. To show what the difference is made
of, the same engine also runs, each timed alone, a ladder of traces that each add one piece
of the lens to the one before:

  a. plain greedy generation of N tokens, and of N+1 (the number of steps the lens runs);
  b. an nnsight trace of N+1 steps that reads nothing (the cost of tracing at all);
  c. the same trace iterating over the steps, saving the sampled token at each (the per-step
     interleaving the lens needs: the lens saves exactly this too);
  d. + every layer's ``(hidden, residual)`` read and copied at each step, as the lens reads
     them (hooks on every decoder layer);
  e. + those rows through the final norm and the whole-vocabulary head at each step (the
     lens's unembedding GEMM and vocab all-gather), one number saved;
  f. the lens itself: final layer only, top-1, no target; all layers at top-1, at top-10,
     at top-1 with a target; all layers, top-10 and a target (the usual call). The last minus
     (e) is the log-softmax and the reductions; the lens of the prompt alone (generate=0)
     shows how much of it is the prompt's step, which lenses every prompt position.

Every row also shows the CPU time this process spent per call: the client's share (building
and pickling the trace, unpickling and assembling the result), which the ranks wait on.

The differences between neighbouring rows are printed as the split of the extra time.

    python bench/generation.py --model demo --tp 1 --steps 64 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as in bench/lens.py

import nnsight
import psutil
import torch
from timing import median_seconds

import envoykit as ek
from envoykit.model.readout import at

TARGET = " Paris"
# Greedy decoding of this continues for well over 65 tokens on demo without an end token.
PROMPT = "The capital of France is a city with a long history, and its name is"


def traced_steps(engine, prompt: str, steps: int, depth: str):
    """A trace of ``steps`` forward steps doing one rung of the ladder (see the module
    docstring): ``depth`` is "nothing", "iterate", "read" or "unembed". ``run()`` returns
    what was saved per step (empty for "nothing")."""
    model = engine.model
    readout = engine.readout
    layers = at(model, readout.layers)
    norm = at(model, readout.final_norm)
    head = at(model, readout.unembedding)

    def nothing():
        with model.trace(prompt, temperature=0.0, max_tokens=steps):
            saved = nnsight.save([])
        return saved

    def iterate():
        with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
            saved = nnsight.save([])
            for _ in tracer.iter[:steps]:
                saved.append(model.samples.cpu())
        return saved

    def read():
        with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
            saved = nnsight.save([])
            for _ in tracer.iter[:steps]:
                streams = []
                for i in range(readout.n_layers):
                    hidden, residual = layers[i].output[:2]
                    streams.append((hidden.clone(), residual.clone()))
                saved.append(streams[-1][0][-1, 0].cpu())
                saved.append(model.samples.cpu())
        return saved

    def unembed():
        with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
            saved = nnsight.save([])
            for _ in tracer.iter[:steps]:
                streams = []
                for i in range(readout.n_layers):
                    hidden, residual = layers[i].output[:2]
                    streams.append((hidden.clone(), residual.clone()))
                rows = [norm(h.clone(), r.clone())[0] for h, r in streams]
                logits = head(torch.cat(rows, dim=0))
                saved.append(logits[-1, 0].cpu())
                saved.append(model.samples.cpu())
        return saved

    body = {"nothing": nothing, "iterate": iterate, "read": read, "unembed": unembed}[depth]

    def run():
        with engine.exclusive():  # the engine to this benchmark alone, as the lens takes it
            return body()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--steps", type=int, default=64, help="tokens generated (N)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    n, prompt = args.steps, args.prompt

    load_before = os.getloadavg()
    with ek.Engine(args.model, args.tp, progress=False) as engine:
        info = engine.info
        n_prompt = len(engine.tokenizer(prompt)["input_ids"])
        produced = len(engine.generate_ids(prompt, n + 1))
        if produced != n + 1:
            raise SystemExit(
                f"greedy generation of this prompt ends after {produced} tokens, not {n + 1}: "
                "the rows would compare different step counts; pass another --prompt"
            )
        rows: dict[str, float] = {}
        client_cpu: dict[str, float] = {}
        me = psutil.Process()

        def timed(name, fn):
            # A TP=1 rank's OpenMP threads busy-wait for a while after the last row's work
            # (see settle in bench/lens.py): let them stop before timing the next row.
            time.sleep(2)
            before = sum(me.cpu_times()[:2])
            rows[name] = median_seconds(fn, args.repeats)
            # What this process (tokenizing, building and pickling the trace, unpickling and
            # assembling the result) spent per call, the warm-up included.
            client_cpu[name] = (sum(me.cpu_times()[:2]) - before) / (args.repeats + 1)
            print(f"  {name}: {rows[name] * 1000:.0f} ms", flush=True)

        def lens(generate=n, **kwargs):
            def run():
                res = engine.lens(prompt, generate=generate, **kwargs)
                if res.n_generated != generate:
                    raise RuntimeError(f"lens generated {res.n_generated}, not {generate}")

            return run

        def checked(depth, per_step):
            run = traced_steps(engine, prompt, n + 1, depth)

            def checked_run():
                saved = run()
                if len(saved) != per_step * (n + 1):
                    raise RuntimeError(f"{depth}: saved {len(saved)} values")

            return checked_run

        timed("a", lambda: engine.generate(prompt, n))
        timed("a+1", lambda: engine.generate(prompt, n + 1))
        timed("b", checked("nothing", 0))
        timed("c", checked("iterate", 1))
        timed("d", checked("read", 2))
        timed("e", checked("unembed", 2))
        timed("f1", lens(layers=[-1], top_k=1))
        timed("f2", lens(top_k=1))
        timed("f2k", lens(top_k=10))
        timed("f2t", lens(top_k=1, targets=[TARGET]))
        timed("f3", lens(top_k=10, targets=[TARGET]))
        timed("g0", lambda: engine.generate(prompt, 1))
        timed("g1", lens(generate=0, top_k=10, targets=[TARGET]))
    load_after = os.getloadavg()

    labels = {
        "a": f"a  generate {n} tokens (vLLM, no nnsight)",
        "a+1": f"a' generate {n + 1} tokens (the lens's step count)",
        "b": f"b  trace of {n + 1} steps, nothing read",
        "c": "c  + iterate the steps, save the sampled token",
        "d": f"d  + read and copy {info.n_layers} layers' streams per step",
        "e": "e  + final norm and whole-vocab head of them",
        "f1": f"f1 lens generate={n}, final layer only, top-1",
        "f2": f"f2 lens generate={n}, all layers, top-1",
        "f2k": f"f2k lens generate={n}, all layers, top-10",
        "f2t": f"f2t lens generate={n}, all layers, top-1 + target",
        "f3": f"f3 lens generate={n}, all layers, top-10 + target",
        "g0": "g0 generate 1 token (the prompt's step)",
        "g1": "g1 lens generate=0 (the prompt's step), top-10 + target",
    }
    base = rows["a"]
    loads = " / ".join(f"{x:.2f}" for x in load_before)
    loads_after = " / ".join(f"{x:.2f}" for x in load_after)
    print()
    print(
        f"model {info.name}, TP={info.tp}, {info.dtype}, prompt of {n_prompt} tokens, "
        f"{n} generated, median of {args.repeats} after one warm-up"
    )
    print(
        f"load average (1/5/15 min): {loads} before, {loads_after} after, on {os.cpu_count()} cores"
    )
    print(f"{'':<56} {'ms':>8} {'ms/step':>8} {f'x gen {n}':>9} {'client CPU ms':>14}")
    for key, label in labels.items():
        steps = 1 if key.startswith("g") else (n if key == "a" else n + 1)
        print(
            f"{label:<56} {rows[key] * 1000:>8.0f} {rows[key] * 1000 / steps:>8.1f} "
            f"{rows[key] / base:>9.2f} {client_cpu[key] * 1000:>14.0f}"
        )
    extra = rows["f3"] - base
    split = {
        f"one more forward step ({n + 1} vs {n})": rows["a+1"] - rows["a"],
        "tracing at all (b - a')": rows["b"] - rows["a+1"],
        "per-step interleaving, token saved (c - b)": rows["c"] - rows["b"],
        "reading every layer's stream per step (d - c)": rows["d"] - rows["c"],
        "final norm + unembedding per step (e - d)": rows["e"] - rows["d"],
        "log-softmax + reductions, top-10 + target (f3 - e)": rows["f3"] - rows["e"],
    }
    print()
    print(f"where lens(generate={n}) spends its {extra * 1000:.0f} ms over generate({n}):")
    for name, seconds in split.items():
        share = seconds / extra if extra else float("nan")
        print(f"  {name:<52} {seconds * 1000:>8.0f} ms  {share:>6.1%}")
    prompt_lens = rows["g1"] - rows["g0"]
    notes = {
        "the prompt step's whole lens (g1 - g0), within the above": prompt_lens,
        "reductions at top-1, no target (f2 - e)": rows["f2"] - rows["e"],
        "top-10 instead of top-1 (f2k - f2)": rows["f2k"] - rows["f2"],
        "a target at top-1 (f2t - f2)": rows["f2t"] - rows["f2"],
        "unembedding + reductions, final layer only (f1 - d)": rows["f1"] - rows["d"],
    }
    for name, seconds in notes.items():
        print(f"  {name:<60} {seconds * 1000:>8.0f} ms")
    print()
    print(f"lens(generate={n}) / generate({n}) = {rows['f3'] / base:.2f}x  (goal <= 2)")


if __name__ == "__main__":
    main()
