"""Statistics of a distribution whose vocabulary is split across ranks, from small messages.

At TP=N the unembedding's weight is split by vocabulary, so each rank computes the logits of
its own slice of tokens. Gathering the whole ``[cells, vocab]`` logits onto every rank (what
the model's logits processor does for sampling) and reducing them there makes every rank
repeat the whole reduction, N times the work, after moving N-1 slices of full-vocabulary
logits between them; on ranks that share cores that was most of a lens's time. Here each
rank summarises its own slice per cell (its log-normaliser, its top-k, the targets it holds),
the ranks exchange those summaries (a few numbers per cell), and each rank then sums its
slice's share of entropy, KL and the targets' ranks, exchanged the same way. Every rank ends
with the same statistics of the whole vocabulary, each computed with the elementwise formula
a single rank would use, summed over its slice and then over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from envoykit.model.vocab_shard import VocabShard


def whole(head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> VocabShard:
    """One rank holding the whole vocabulary of ``head``."""
    return VocabShard(
        logits=head, start=0, size=vocab, gather=lambda t: t.unsqueeze(0), largest=vocab
    )


def summaries(
    shard: VocabShard, logits: torch.Tensor, top_k: int, targets: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From this slice's ``logits`` ``[..., size]`` and one exchange: the whole vocabulary's
    largest logit and log-sum-exp relative to it ``[...]`` (so ``logp = logits - largest -
    log_sum``), its top-k log-probs and token ids ``[..., k]``, the targets' log-probs
    ``[..., targets]``.

    Each rank sends its slice's largest logit and its sum of ``exp(logit - largest)``, its own
    top-k (values and ids, so the whole top-k is among the ranks' candidates) and the logits
    of the targets it holds (zero for the others: each token is held by exactly one rank).
    Normalising as ``(logit - largest) - log_sum``, like ``log_softmax``, keeps a
    near-certain token's probability within float32 rounding of 1; a difference of the logit
    and a log-sum-exp near it is off by the rounding of numbers that large (1.00001 summed
    over the top-k, seen on a tuned lens's first layer).
    """
    largest = logits.amax(dim=-1, keepdim=True)
    sum_exp = (logits - largest).exp_().sum(-1, keepdim=True)
    values, ids = logits.topk(min(top_k, shard.size), dim=-1)
    if values.shape[-1] < top_k:  # a slice smaller than k: every rank sends k candidates
        short = (*values.shape[:-1], top_k - values.shape[-1])
        values = torch.cat([values, values.new_full(short, -torch.inf)], dim=-1)
        ids = torch.cat([ids, ids.new_zeros(short)], dim=-1)
    held = logits.new_zeros(*logits.shape[:-1], len(targets))
    for i, token in enumerate(targets):
        if shard.start <= token < shard.start + shard.size:
            held[..., i] = logits[..., token - shard.start]
    ids = (ids + shard.start).to(logits.dtype)  # exact: ids < 2**24
    every = shard.gather(torch.cat([largest, sum_exp, values, ids, held], dim=-1))
    whole_largest = every[..., 0].amax(dim=0)
    log_sum = (every[..., 1] * (every[..., 0] - whole_largest).exp()).sum(0).log()
    candidates = every[..., 2 : 2 + top_k].movedim(0, -2).flatten(-2)
    candidate_ids = every[..., 2 + top_k : 2 + 2 * top_k].movedim(0, -2).flatten(-2)
    top_values, picked = candidates.topk(top_k, dim=-1)
    top_ids = candidate_ids.gather(-1, picked).long()
    target_logits = every[..., 2 + 2 * top_k :].sum(0)

    def logp(x: torch.Tensor) -> torch.Tensor:
        return (x - whole_largest.unsqueeze(-1)) - log_sum.unsqueeze(-1)

    return whole_largest, log_sum, logp(top_values), top_ids, logp(target_logits)


def sums(
    shard: VocabShard,
    logp: torch.Tensor,
    final: tuple[torch.Tensor, torch.Tensor],
    target_logp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy ``[...]``, KL(final || layer) ``[...]`` and the targets' ranks
    ``[..., targets]`` (the tokens strictly more likely, 0 = the most likely) over the whole
    vocabulary, from this slice's log-probs ``logp`` ``[..., size]``, the final layer's
    log-probs and probabilities ``final`` (computed once by the caller, for every chunk of
    layers) and one exchange.

    Entropy and KL in their elementwise form, summed by torch's cascade sum (a BLAS dot
    product over 49k terms lost 6e-4 nats; a difference of two dot products would also
    cancel when a layer is close to the final one), in one reused buffer: a fresh
    full-vocab tensor costs as much to fault in as to compute.
    """
    # A second exp rather than `summaries`' exponentials rescaled: that saved 15% of these
    # reductions, but held from there to here the exponentials left the heap so fragmented
    # that a rank's peak rose 1.7-2.0 GiB above its start in a 768-token demo lens at TP=3
    # (0.6-0.7 GiB this way).
    scratch = logp.exp().mul_(logp)
    entropy = -scratch.sum(-1)
    final_logp, final_probs = final
    kl = torch.sub(final_logp, logp, out=scratch).mul_(final_probs).sum(-1)
    ranks = [
        (logp > target_logp[..., i : i + 1]).sum(-1).to(logp.dtype)  # exact: counts < 2**24
        for i in range(target_logp.shape[-1])
    ]
    total = shard.gather(torch.stack([entropy, kl, *ranks], dim=-1)).sum(0)
    return total[..., 0], total[..., 1].clamp_min(0.0), total[..., 2:]
