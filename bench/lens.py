"""Logit lens speed and traffic, measured side by side in one run.

Compares, on the same model and prompt:
  * envoykit's lens at TP=1 and TP=N (one forward, one stacked unembedding, reduced on ranks);
  * the same lens written with nnsight's LanguageModel on plain transformers (float32, all
    cores), the tool a researcher would otherwise use — written carefully: one forward with
    hooks, every layer through lm_head in one GEMM, and the same statistics (top-k, entropy,
    KL to the final layer, the target's probability and rank) reduced inside the trace;
  * plain greedy generation of one token on the same engine, and one stand-alone matmul of
    the lens's size on the cores a TP=1 rank is bound to, as the floor the lens is held to;
  * bytes the lens returns vs the full-vocab logits it would otherwise ship.

The ranks allocate large tensors on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, see
``envoykit/platform.py``); this process sets the same before torch loads, so the transformers
lens and the matmul get the same allocator.

    python bench/lens.py --model demo --tp 3 --repeats 5
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import torch
from timing import median_seconds

import envoykit as ek
from envoykit.platform import usable_cpus

TARGET = " Paris"
PROMPT = "The capital of France is a city with a long history, and its name is"


def nnsight_transformers_lens(path: str, top_k: int, target: str):
    """The same lens with nnsight's LanguageModel on plain transformers."""
    from nnsight import LanguageModel

    model = LanguageModel(path, device_map="cpu", dtype=torch.float32, dispatch=True)
    target_id = model.tokenizer(target, add_special_tokens=False).input_ids[0]

    def run():
        with model.trace(PROMPT):
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

    return run


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None, help="the N of TP=N (default: max)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=10)
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
