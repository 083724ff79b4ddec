"""Statistics of a distribution whose vocabulary is split across ranks, from small messages.

At TP=N the unembedding's weight is split by vocabulary, so each rank computes the logits of
its own slice of tokens. Gathering the whole ``[cells, vocab]`` logits onto every rank (what
the model's logits processor does for sampling) and reducing them there makes every rank
repeat the whole reduction, N times the work, after moving N-1 slices of full-vocabulary
logits between them; on ranks that share cores that was most of a lens's time. Here each
rank summarises its own slice per cell (its log-normaliser, its shares of the entropy and of
KL against the final layer, its top-k, the targets it holds) and the ranks exchange those
summaries (a few numbers per cell); a lens with targets then counts the tokens above each
target's logit in a second exchange. Every rank ends with the same statistics of the whole
vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import fused, messages


def whole(head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> VocabShard:
    """One rank holding the whole vocabulary of ``head``."""
    return VocabShard(
        logits=head, start=0, size=vocab, gather=lambda t: t.unsqueeze(0), largest=vocab
    )


class Summaries(NamedTuple):
    """Per cell ``[...]`` of the whole vocabulary, from one exchange (`summaries`)."""

    largest: torch.Tensor  # the largest logit
    log_sum: torch.Tensor  # log-sum-exp relative to it: logp = (logit - largest) - log_sum
    top_logp: torch.Tensor  # [..., k] the top-k's log-probs
    top_ids: torch.Tensor  # [..., k] and their token ids
    target_logp: torch.Tensor  # [..., targets] the targets' log-probs
    entropy: torch.Tensor  # in nats
    target_logits: torch.Tensor  # [..., targets] the targets' logits (`target_ranks`)
    kl: torch.Tensor | None  # KL(final || cell) in nats, from `lens_summaries` alone


class Final(NamedTuple):
    """What every layer's KL(final || layer) needs of the final layer (`lens_summaries`)."""

    exp: torch.Tensor  # [positions, size] this slice's exp(logit - its largest logit)
    every: torch.Tensor  # [ranks, positions, columns] the ranks' messages for it
    largest: torch.Tensor  # [positions] its largest logit over the whole vocabulary
    log_sum: torch.Tensor  # [positions] and its log-sum-exp relative to it


def compiled_on(device: torch.device) -> fused.Reductions | None:
    """The compiled reductions (`envoykit.ranks.fused`) for logits on ``device``, or None: on
    the CPU, where compiling works."""
    return fused.compiled() if device.type == "cpu" else None


def summaries(
    shard: VocabShard, logits: torch.Tensor, top_k: int, targets: Sequence[int]
) -> Summaries:
    """`Summaries` of the whole vocabulary from this slice's ``logits`` ``[..., size]`` and
    one exchange (``kl`` None: `lens_summaries` adds it).

    Each rank sends its slice's largest logit ``m``, with ``d = logit - m`` (all ``<= 0``)
    the sums of ``exp(d)`` and of ``exp(d) * d``, its own top-k (values and ids, so the whole
    top-k is among the ranks' candidates) and the logits of the targets it holds (zero for
    the others: each token is held by exactly one rank).

    Normalising as ``(logit - largest) - log_sum``, like ``log_softmax``, keeps a
    near-certain token's probability within float32 rounding of 1; a difference of the logit
    and a log-sum-exp near it is off by the rounding of numbers that large (1.00001 summed
    over the top-k, seen on a tuned lens's first layer).

    The entropy comes from the exponentials the log-sum-exp needs anyway, instead of a
    second pass of exponentials over the log-probs: ``H = log S - sum(exp(d) * d) / S`` with
    ``S = sum(exp(d))``, shifted to the whole vocabulary's largest logit. Both terms are
    sums of terms of one sign, so nothing cancels, even for a near-certain cell.
    """
    grid = logits.reshape(1, -1, logits.shape[-1])
    local = messages.message(shard, grid, top_k, targets, None, None, None)
    return _combined(shard.gather(local.view(*logits.shape[:-1], local.shape[-1])), top_k)


def lens_summaries(
    shard: VocabShard,
    logits: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    final: Final | None,
    compiled: fused.Reductions | None = None,
) -> tuple[Summaries, Final, bool]:
    """`summaries` of ``logits`` ``[layers, positions, size]`` with KL(final || layer) per
    cell, in the same single exchange. ``final``: the final layer's part, from the call that
    had the final layer; None, the last layer of ``logits`` is the final layer. Returns it
    for the calls that follow.

    Also returns whether any rank's ``flag`` was up, sent in the same exchange (one more
    number per row): a lens's cancel flag (`envoykit.ranks.cancel`) costs no collective of
    its own, where ranks sharing cores each wait for the one descheduled. ``None``: no flag
    (every rank passes None alike), so none is read back (a device sync).

    With ``d`` and ``m`` a cell's as in `summaries`, ``d_f``, ``m_f`` and ``e_f =
    exp(d_f)`` the final layer's at the same position on the same rank, the final layer's
    probabilities are ``e_f * w`` with ``w = exp(m_f - M_f) / S_f`` per rank, and
    ``log p_f - log p = (d_f - d) + Δ`` with ``Δ = (m_f - M_f - log S_f) - (m - M - log S)``
    per rank. So KL is, over the ranks, ``w * (N_f - B + S_f,rank * Δ)``: ``N_f =
    sum(e_f * d_f)`` and ``S_f,rank = sum(e_f)`` are the final layer's own sums and each
    rank sends ``B = sum(e_f * d)`` beside the rest, summed in float64. No pass normalises
    the logits, and a lens without targets makes one exchange per chunk where KL used to
    need a second. The final layer's own KL is 0 exactly (``B = N_f``, ``Δ = 0``).

    ``compiled``: the exponentials and every sum in one compiled loop (`compiled_on`).
    """
    final_exp = None if final is None else final.exp
    local, final_exp = lens_message(shard, logits, top_k, targets, flag, final_exp, compiled)
    every = shard.gather(local)
    found = lens_combined(every, top_k, final)
    if final is None:
        final = Final(final_exp, every[:, -1], found.largest[-1], found.log_sum[-1])
    return found, final, flag is not None and flag_up(every)


def flag_up(every: torch.Tensor) -> bool:
    """Whether any rank's message in ``every`` carries a raised flag."""
    return bool(every[..., -1].amax() > 0)


def lens_message(
    shard: VocabShard,
    logits: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    final_exp: torch.Tensor | None,
    compiled: fused.Reductions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of `lens_summaries`, with no exchange: its message
    ``[layers, positions, columns]`` and the final layer's exponentials (``final_exp``, or
    the last layer's of ``logits`` where it is None). It needs nothing of the other ranks,
    so a caller may send the messages of many calls in one exchange (`lens_combined`)."""
    if final_exp is not None:
        return messages.message(shard, logits, top_k, targets, flag, compiled, final_exp), final_exp
    local, final_exp = messages.final_message(shard, logits[-1:], top_k, targets, flag, compiled)
    if logits.shape[0] > 1:
        others = messages.message(shard, logits[:-1], top_k, targets, flag, compiled, final_exp)
        local = torch.cat([others, local])
    return local, final_exp


def lens_combined(every: torch.Tensor, top_k: int, final: Final | None) -> Summaries:
    """The other half: `Summaries` with KL from every rank's messages ``every``
    ``[ranks, layers, positions, columns]`` (`lens_message`), whose last layer is the final
    layer where ``final`` is None."""
    found = _combined(every, top_k)
    if final is None:
        at_final = (every[:, -1], found.largest[-1], found.log_sum[-1])
    else:
        at_final = (final.every, final.largest, final.log_sum)
    return found._replace(kl=_kl(every, found, *at_final))


def normalized(logits: torch.Tensor, largest: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """This slice's log-probs from its ``logits`` and `summaries`' ``largest`` and ``log_sum``,
    in a new tensor: ``(logit - largest) - log_sum``."""
    return torch.sub(logits, largest.unsqueeze(-1)).sub_(log_sum.unsqueeze(-1))


def _kl(
    every: torch.Tensor,
    found: Summaries,
    final_every: torch.Tensor,
    final_largest: torch.Tensor,
    final_log_sum: torch.Tensor,
) -> torch.Tensor:
    """KL(final || cell) ``[layers, positions]`` from every rank's messages ``every``
    ``[ranks, layers, positions, columns]``, summed as `lens_summaries` says, with the final
    layer's messages ``final_every`` ``[ranks, positions, columns]``, largest logit and
    log-sum-exp. The final layer's cell gets 0 exactly: its ``delta`` is the same numbers'
    difference."""
    at_final = final_every.unsqueeze(1)  # [ranks, 1, positions, columns]: for every layer
    final_offset = at_final[..., 0] - final_largest
    final_sum, final_weighted = at_final[..., 1], at_final[..., 2]
    weight = final_offset.exp() / final_sum.mul(final_offset.exp()).sum(0)
    offset = every[..., 0] - found.largest
    delta = (final_offset - final_log_sum) - (offset - found.log_sum)
    kl = (weight * (final_weighted - every[..., 3] + final_sum * delta)).sum(0)
    return kl.clamp_min(0.0)


def _combined(every: torch.Tensor, top_k: int) -> Summaries:
    """The whole vocabulary's `Summaries` (``kl`` None) from every rank's messages ``every``
    ``[ranks, ..., columns]`` (`messages.message`)."""
    ids_at = messages.CANDIDATES_AT + top_k
    targets_at = ids_at + top_k
    whole_largest = every[..., 0].amax(dim=0)
    # Each rank's sums rescaled from its largest logit to the whole vocabulary's.
    offset = every[..., 0] - whole_largest
    scale = offset.exp()
    total = (every[..., 1] * scale).sum(0)
    log_sum = total.log()
    entropy = log_sum - ((every[..., 2] + offset * every[..., 1]) * scale).sum(0) / total
    candidates = every[..., messages.CANDIDATES_AT : ids_at].movedim(0, -2).flatten(-2)
    candidate_ids = every[..., ids_at:targets_at].movedim(0, -2).flatten(-2)
    top_values, picked = candidates.topk(top_k, dim=-1)
    top_ids = candidate_ids.gather(-1, picked).long()
    target_logits = every[..., targets_at:-1].sum(0)

    def logp(x: torch.Tensor) -> torch.Tensor:
        return (x - whole_largest.unsqueeze(-1)) - log_sum.unsqueeze(-1)

    return Summaries(
        whole_largest,
        log_sum,
        logp(top_values),
        top_ids,
        logp(target_logits),
        entropy,
        target_logits,
        None,
    )


def target_ranks(
    shard: VocabShard, logits: torch.Tensor, target_logits: torch.Tensor
) -> torch.Tensor:
    """The targets' ranks ``[layers, positions, targets]`` over the whole vocabulary (the
    tokens with a larger logit; 0 = the most likely), from this slice's ``logits``
    ``[layers, positions, size]``, `Summaries`' ``target_logits`` and one exchange (none
    without targets: every rank has the same). Counted on the logits themselves: a
    token's rank is the same over its logits as over its log-probs, without rounding them."""
    n_targets = target_logits.shape[-1]
    counts = logits.new_zeros(*logits.shape[:-1], n_targets)
    if not n_targets:
        return counts
    thresholds = target_logits.to(logits.dtype)  # exact: they are these logits' values
    for layer in range(logits.shape[0]):
        for i in range(n_targets):
            # Counted in int32 (the default, int64, took 1.6x as long); exact as floats:
            # counts < 2**24.
            above = logits[layer] > thresholds[layer, :, i, None]
            counts[layer, :, i] = above.sum(-1, dtype=torch.int32)
    return shard.gather(counts).sum(0)
