"""Logit lens speed and traffic, measured side by side in one run.

Compares, on the same model and prompt:
  * envoykit's lens at TP=1 and TP=N (one forward, one stacked unembedding, reduced on ranks);
  * the same lens written with nnsight's LanguageModel on plain transformers (float32, all
    cores), the tool a researcher would otherwise use — written carefully: autograd off, one
    forward with hooks, every layer through lm_head in one GEMM, and the same statistics
    (top-k, entropy, KL to the final layer, the target's probability and rank) reduced
    inside the trace;
  * plain greedy generation of one token on the same engine, and one stand-alone matmul of
    the lens's size on the cores a TP=1 rank is bound to, as the floor the lens is held to;
  * bytes the lens returns vs the full-vocab logits it would otherwise ship.

``--sweep`` measures how both lenses grow with the prompt instead: prompts of exactly T
tokens (16, 64, 256, 768 by default) at every TP size of ``--tps``, with the peak resident
memory of every rank during the lens calls at each T, to show whether the lens's chunked
unembedding keeps memory flat in T. Each engine starts once per TP size and the transformers
model loads once; the transformers lens runs first, with no engine alive (see `sweep`).

The ranks allocate large tensors on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, see
``envoykit/runtime/platform.py``); this process sets the same before torch loads, so the
transformers lens and the matmul get the same allocator.

    python bench/lens.py --model demo --tp 3 --repeats 5
    python bench/lens.py --sweep --tps 1,3 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything
# A lens runs inside one of vLLM's execute_model calls, which vLLM gives 300 s before it
# declares the engine dead: a 768-token lens on two cores others were loading (load ~15)
# passed that, and the sweep lost its engine. The engine processes inherit this.
os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1800")

import torch
from timing import median_seconds

import envoykit as ek
from envoykit.runtime.platform import usable_cpus

TARGET = " Paris"
PROMPT = "The capital of France is a city with a long history, and its name is"


def nnsight_transformers_lens(path: str, top_k: int, target: str):
    """The same lens with nnsight's LanguageModel on plain transformers."""
    model = load_transformers(path)
    target_id = model.tokenizer(target, add_special_tokens=False).input_ids[0]
    return transformers_lens(model, PROMPT, top_k, target_id)


def load_transformers(path: str):
    """The model for the transformers lens, with autograd off.

    Its parameters load with ``requires_grad=True``, so every trace would record a graph
    that keeps each full-vocab temporary of the lens alive until the saved statistics die;
    a careful researcher reading activations switches that off.
    """
    from nnsight import LanguageModel

    model = LanguageModel(path, device_map="cpu", dtype=torch.float32, dispatch=True)
    model.requires_grad_(False)
    return model


def transformers_lens(model, prompt: str, top_k: int, target_id: int, layers_per_call=None):
    """The lens of ``prompt`` on plain transformers; ``run()`` returns its saved statistics.

    ``layers_per_call=None`` puts every layer through lm_head in one GEMM, as a careful
    researcher would for a short prompt. At long prompts that one call's full-vocab tensors
    do not fit the machine (about 17 GiB for 768 tokens of demo), so a number chunks the
    layers the way envoykit does: the final layer's chunk first, its distribution kept for
    every chunk's KL.
    """

    def whole():
        with model.trace(prompt):
            outputs = [layer.output for layer in model.model.layers]
            stacked = torch.stack([o[0] if isinstance(o, tuple) else o for o in outputs])
            logits = model.lm_head(model.model.norm(stacked)).float()
            logp = torch.log_softmax(logits, dim=-1)
            top = logp.topk(top_k, dim=-1)
            probs = top.values.exp().save()
            entropy = (-(logp.exp() * logp).sum(-1)).save()
            final = logp[-1]
            kl = (final.exp() * (final - logp)).sum(-1).save()
            target_logp = logp[..., target_id : target_id + 1]
            target_prob = target_logp.exp().save()
            target_rank = (logp > target_logp).sum(-1).save()
        return probs, entropy, kl, target_prob, target_rank

    def chunked():
        with model.trace(prompt):
            outputs = [layer.output for layer in model.model.layers]
            stacked = torch.stack([o[0] if isinstance(o, tuple) else o for o in outputs])
            normed = model.model.norm(stacked)
            n_layers = normed.shape[0]
            final = None
            pieces = []
            for end in range(n_layers, 0, -layers_per_call):
                chunk = normed[max(0, end - layers_per_call) : end]
                logp = torch.log_softmax(model.lm_head(chunk).float(), dim=-1)
                if final is None:
                    final = logp[-1].clone()  # a view would keep the whole chunk alive
                pieces.append(chunk_statistics(logp, final, top_k, target_id))
                logp = None
            pieces.reverse()
            probs, entropy, kl, target_prob, target_rank = (
                torch.cat(parts).save() for parts in zip(*pieces)
            )
        return probs, entropy, kl, target_prob, target_rank

    return whole if layers_per_call is None else chunked


def chunk_statistics(logp: torch.Tensor, final: torch.Tensor, top_k: int, target_id: int):
    """The transformers lens's statistics of one chunk of layers, written as in the whole
    lens (plain tensor code: it runs inside the trace on real values)."""
    probs = logp.topk(top_k, dim=-1).values.exp()
    entropy = -(logp.exp() * logp).sum(-1)
    kl = (final.exp() * (final - logp)).sum(-1)
    target_logp = logp[..., target_id : target_id + 1]
    return probs, entropy, kl, target_logp.exp(), (logp > target_logp).sum(-1)


def numbers_per_cell(top_k: int, n_targets: int) -> int:
    """What the lens needs back per (layer, position): top-k ids and probabilities, entropy
    and KL, and each target's probability and rank."""
    return 2 * top_k + 2 + 2 * n_targets


def matmul(rows: int, d_model: int, vocab: int, threads: int):
    a, b = torch.randn(rows, d_model), torch.randn(d_model, vocab)

    def run():
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            a @ b
        finally:
            torch.set_num_threads(previous)

    return run


def compare(args: argparse.Namespace) -> None:
    """The default mode: one prompt, envoykit at TP=1 and TP=N against its references."""
    rows: dict[str, float] = {}
    targets = [TARGET]
    traffic = {}
    sizes = []
    tp_sizes = []  # as started: a requested None becomes the largest the machine hosts
    for requested in (1, args.tp):
        with ek.Engine(args.model, requested, progress=False) as engine:
            info = engine.info
            tp_sizes.append(info.tp)
            lens = lambda: engine.lens(PROMPT, top_k=args.top_k, targets=targets)  # noqa: E731
            rows[f"envoykit lens, TP={info.tp}"] = median_seconds(lens, args.repeats)
            rows[f"generate 1 token, TP={info.tp}"] = median_seconds(
                lambda: engine.generate(PROMPT, 1), args.repeats
            )
            res = lens()
            n_layers, n_pos = len(res.layers), len(res.positions)
            traffic = {
                "returned": res.meta["returned_bytes"],
                "target": n_layers * n_pos * numbers_per_cell(args.top_k, len(targets)) * 4,
                "full vocab": n_layers * n_pos * info.vocab * 4,
            }
            sizes.append((n_layers * n_pos, info.d_model, info.vocab))
        if args.tp == 1:
            break
    rank_cores = len(usable_cpus())  # a TP=1 rank is bound to every usable core
    matmul_row = f"matmul of the lens's size, {rank_cores} threads"
    rows[matmul_row] = median_seconds(matmul(*sizes[0], rank_cores), args.repeats)
    rows["nnsight + transformers lens"] = median_seconds(
        nnsight_transformers_lens(info.path, args.top_k, TARGET), args.repeats
    )

    print(
        f"model {info.name}, prompt of {sizes[0][0] // info.n_layers} tokens, "
        f"{info.n_layers} layers, vocab {info.vocab}, float32, {args.repeats} repeats (median)"
    )
    for name, seconds in rows.items():
        print(f"  {name:<40} {seconds * 1000:9.1f} ms")
    hf = rows["nnsight + transformers lens"]
    floor = rows["generate 1 token, TP=1"] + rows[matmul_row]
    print("ratios")
    for size in sorted(set(tp_sizes)):
        ours = rows[f"envoykit lens, TP={size}"]
        print(f"  envoykit TP={size} / nnsight+transformers    {ours / hf:6.2f}x  (target <= 1)")
    print(
        f"  envoykit TP=1 / (generate + matmul)      {rows['envoykit lens, TP=1'] / floor:6.2f}x"
        "  (target <= 1.5)"
    )
    print(
        f"  bytes returned {traffic['returned']:,} = {traffic['returned'] / traffic['target']:.2f}x"
        f" the k/target budget (target <= 2), {traffic['full vocab'] / traffic['returned']:.0f}x"
        " less than full-vocab logits"
    )


# -- the sweep over prompt lengths ----------------------------------------------------------

FILLER = (
    "The river runs through the old town, past the market and the cathedral, and on summer "
    "evenings the bridges fill with people who have come to watch the light fade over the "
    "water. Most of them have lived here all their lives; a few arrived last year. "
)


def exact_prompt(tokenizer, n_tokens: int) -> str:
    """A text that ``tokenizer`` turns into exactly ``n_tokens`` ids (special tokens
    included, as the lens request counts them): the filler repeated, its ids cut
    and decoded.

    The repeated text is tokenized whole (ids of separate copies would not survive a
    round trip at the seams); a cut can still merge or split a word when re-tokenized, so
    neighbouring cuts are tried.
    """
    copies = n_tokens // len(tokenizer(FILLER, add_special_tokens=False)["input_ids"]) + 2
    ids = tokenizer(FILLER * copies, add_special_tokens=False)["input_ids"]
    for cut in sorted(range(max(1, n_tokens - 4), n_tokens + 5), key=lambda c: abs(c - n_tokens)):
        text = tokenizer.decode(ids[:cut])
        if len(tokenizer(text)["input_ids"]) == n_tokens:
            return text
    raise RuntimeError(f"no cut of the filler tokenizes to exactly {n_tokens} tokens")


def _status_kib(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def rss_mib(pid: int | str) -> float:
    return _status_kib(pid, "VmRSS") / 1024


def peak_mib(pid: int | str) -> float:
    """The process's peak resident memory since its last `reset_peak`."""
    return _status_kib(pid, "VmHWM") / 1024


def reset_peak(pid: int | str) -> float:
    """Restart the process's peak-RSS count from its current RSS (Linux ``clear_refs`` 5),
    so that the next `peak_mib` covers only what ran since; returns that RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return rss_mib(pid)


def rank_pids(engine) -> list[int]:
    """The engine's rank processes (vLLM titles them ``VLLM::Worker...``; the engine core,
    which holds no weights, is left out), in rank order."""
    ranks = [p for p in engine.processes if "Worker" in p.name()]
    if len(ranks) != engine.info.tp:
        names = [p.name() for p in engine.processes]
        raise RuntimeError(f"expected {engine.info.tp} rank processes, found {names}")
    return [p.pid for p in sorted(ranks, key=lambda p: p.name())]


def whole_lens_bytes(n_layers: int, n_tokens: int, vocab: int) -> int:
    """What the unchunked transformers lens holds at its peak: about four float32
    ``[layers, tokens, vocab]`` tensors (logits, log-probs, and two temporaries of the
    entropy and KL)."""
    return 4 * n_layers * n_tokens * vocab * 4


def settle() -> None:
    """Wait until the processes that ran the last measurement stop spinning: a TP=1 rank's
    OpenMP threads (bound to every core) keep busy-waiting after its last parallel region,
    measured at 0.7 CPU-seconds in the 5 s after a lens and nothing after 2 s idle; this
    process's own threads do the same after the transformers lens."""
    time.sleep(2)


def measure_transformers(model, prompt, n_tokens, top_k, target_id, repeats, budget):
    """The transformers lens of one prompt, in this process: seconds, peak RSS, the RSS it
    started from, and layers per lm_head call (None = all in one)."""
    n_layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    per_call = None
    if whole_lens_bytes(n_layers, n_tokens, vocab) > budget:
        per_call = max(1, budget // whole_lens_bytes(1, n_tokens, vocab))
    run = transformers_lens(model, prompt, top_k, target_id, per_call)
    gc.collect()
    settle()
    before = reset_peak("self")
    last = {}
    seconds = median_seconds(lambda: last.update(out=run()), repeats)
    probs = last["out"][0]
    if probs.shape[-2] != n_tokens or probs.shape[0] != n_layers:
        raise RuntimeError(f"transformers lens came back {tuple(probs.shape)}")
    return seconds, peak_mib("self"), before, per_call


def measure_envoykit(engine, pids, prompt, n_tokens, top_k, repeats):
    """envoykit's lens of one prompt: seconds, bytes returned, and per rank its peak RSS
    and the RSS it started from."""
    seen = len(engine.tokenizer(prompt)["input_ids"])
    if seen != n_tokens:
        raise RuntimeError(f"the engine tokenizes the {n_tokens}-token prompt to {seen}")
    last = {}

    def lens():
        last["res"] = engine.lens(prompt, top_k=top_k, targets=[TARGET])

    settle()
    before = [reset_peak(pid) for pid in pids]
    seconds = median_seconds(lens, repeats)
    peaks = [peak_mib(pid) for pid in pids]
    res = last["res"]
    if len(res.positions) != n_tokens:
        raise RuntimeError(f"lens of {len(res.positions)} positions, not {n_tokens}")
    return seconds, res.meta["returned_bytes"], list(zip(peaks, before))


def sweep(args: argparse.Namespace) -> None:
    """Prompt length T against TP size: both lenses' time, and every rank's peak memory.

    The transformers lens runs first, with no engine alive: running it back to back with
    envoykit's, under the same load, was tried, but an idle TP=1 engine alone made it 2.2x
    slower (424 -> 918-996 ms at T=16; an idle TP=3 engine: 448 ms), which biased every TP=1
    row. The 1-minute load average is printed per measurement instead, since the machine is
    shared.
    """
    import psutil
    from transformers import AutoTokenizer

    from envoykit.runtime import models

    lengths = [int(t) for t in args.lengths.split(",")]
    tps = [int(t) for t in args.tps.split(",")]
    path = models.resolve(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = {n: exact_prompt(tokenizer, n) for n in lengths}
    load_before = os.getloadavg()
    # The whole transformers lens at 768 tokens would take ~17 GiB of a machine others share.
    available = psutil.virtual_memory().available
    budget = min(int(args.hf_budget_gib * 2**30), max(2**30, available - 8 * 2**30))
    model = load_transformers(path)
    target_id = model.tokenizer(TARGET, add_special_tokens=False).input_ids[0]
    hf_loaded = rss_mib("self")

    hf = {}  # T -> (transformers measurement, load average after it)
    for n_tokens, prompt in prompts.items():
        theirs = measure_transformers(
            model, prompt, n_tokens, args.top_k, target_id, args.repeats, budget
        )
        hf[n_tokens] = (theirs, os.getloadavg()[0])
        print(
            f"  T={n_tokens} transformers {theirs[0] * 1000:.0f} ms, peak {theirs[1]:.0f} MiB;"
            f" load {hf[n_tokens][1]:.1f}",
            flush=True,
        )
    del model
    gc.collect()

    ours = {}  # (T, TP) -> (envoykit measurement, load average after it)
    baselines = {}
    for tp in tps:
        with ek.Engine(args.model, tp, progress=False) as engine:
            info = engine.info
            pids = rank_pids(engine)
            baselines[tp] = [rss_mib(pid) for pid in pids]
            for n_tokens, prompt in prompts.items():
                measured = measure_envoykit(
                    engine, pids, prompt, n_tokens, args.top_k, args.repeats
                )
                ours[n_tokens, tp] = (measured, os.getloadavg()[0])
                print(
                    f"  T={n_tokens} TP={tp}: envoykit {measured[0] * 1000:.0f} ms, peak RSS/rank "
                    + " / ".join(f"{peak:.0f}" for peak, _ in measured[2])
                    + f" MiB; load {ours[n_tokens, tp][1]:.1f}",
                    flush=True,
                )
    load_after = os.getloadavg()

    print()
    print(
        f"model {info.name}, {info.n_layers} layers, vocab {info.vocab}, float32, top-k "
        f"{args.top_k}, target {TARGET!r}, median of {args.repeats} after one warm-up"
    )
    loads = " / ".join(f"{x:.2f}" for x in load_before)
    loads_after = " / ".join(f"{x:.2f}" for x in load_after)
    print(
        f"load average (1/5/15 min): {loads} before, {loads_after} after, on {os.cpu_count()} cores"
    )
    print(
        f"transformers lens: this process, {torch.get_num_threads()} threads, RSS "
        f"{hf_loaded:.0f} MiB once loaded; chunked over layers where its whole full-vocab "
        f"tensors would pass {budget / 2**30:.2f} GiB"
    )
    for tp in tps:
        print(
            f"rank RSS before any lens, TP={tp} (MiB): "
            + " / ".join(f"{m:.0f}" for m in baselines[tp])
        )
    print("peak RSS: the most resident during that row's lens calls (its warm-up included),")
    print("          + how far above the RSS the row started from")
    print("load: 1-min load average after the envoykit / the transformers measurement")
    header = (
        f"{'T':>5} {'TP':>3} {'envoykit ms':>12} {'transformers ms':>16} {'ratio':>6} "
        f"{'load':>9} {'returned kB':>12}  {'peak RSS per rank, MiB':<42} "
        "transformers peak RSS, MiB"
    )
    print(header)
    print("-" * len(header))
    for n_tokens in lengths:
        (hf_seconds, hf_peak, hf_before, per_call), hf_load = hf[n_tokens]
        chunked = "" if per_call is None else f" ({per_call} layers/call)"
        for tp in tps:
            (seconds, returned, ranks), load = ours[n_tokens, tp]
            per_rank = " / ".join(f"{peak:.0f} (+{peak - before:.0f})" for peak, before in ranks)
            loads_row = f"{load:.1f}/{hf_load:.1f}"
            print(
                f"{n_tokens:>5} {tp:>3} {seconds * 1000:>12.0f} {hf_seconds * 1000:>16.0f} "
                f"{seconds / hf_seconds:>6.2f} {loads_row:>9} {returned / 1000:>12.0f}  "
                f"{per_rank:<42} {hf_peak:.0f} (+{hf_peak - hf_before:.0f}){chunked}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None, help="the N of TP=N (default: max)")
    parser.add_argument("--repeats", type=int, default=None, help="default 5, with --sweep 3")
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="prompt length x TP size table")
    parser.add_argument("--tps", default="1,3", help="TP sizes of the sweep")
    parser.add_argument("--lengths", default="16,64,256,768", help="prompt tokens of the sweep")
    parser.add_argument(
        "--hf-budget-gib",
        type=float,
        default=6.0,
        help="the sweep's transformers lens chunks its layers above this much full-vocab memory",
    )
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.sweep else 5
    if args.sweep:
        sweep(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
