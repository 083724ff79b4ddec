"""Statistics of a distribution whose vocabulary is split across ranks, from small messages.

At TP=N the unembedding's weight is split by vocabulary, so each rank computes the logits of
its own slice of tokens. Gathering the whole ``[cells, vocab]`` logits onto every rank (what
the model's logits processor does for sampling) and reducing them there makes every rank
repeat the whole reduction, N times the work, after moving N-1 slices of full-vocabulary
logits between them; on ranks that share cores that was most of a lens's time. Here each
rank summarises its own slice per cell (its log-normaliser and its share of the entropy, its
top-k, the targets it holds), the ranks exchange those summaries (a few numbers per cell),
and each rank then sums its slice's share of KL and the targets' ranks, exchanged the same
way. Every rank ends with the same statistics of the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import fused


def whole(head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> VocabShard:
    """One rank holding the whole vocabulary of ``head``."""
    return VocabShard(
        logits=head, start=0, size=vocab, gather=lambda t: t.unsqueeze(0), largest=vocab
    )


# Rows of a slice reduced at once. Each reduction makes several passes over the logits (top-k,
# exponentials; then normalising, entropy, KL, ranks); over blocks of a few MiB those passes
# read the core's cache instead of memory: the reductions of a 16-token demo lens (480 rows of
# 49,152 logits) took 65 ms, about 100 ms over the whole chunk. Smaller blocks pay Python's
# cost per block.
BLOCK_BYTES = 2 * 2**20


def row_blocks(n_rows: int, size: int, element_size: int) -> list[slice]:
    """Consecutive slices of ``n_rows`` rows of ``size`` elements, each about `BLOCK_BYTES`."""
    per_block = max(1, BLOCK_BYTES // max(1, size * element_size))
    return [slice(start, start + per_block) for start in range(0, n_rows, per_block)]


# A rank's message per row (`_message`): its largest logit, the two sums, its k candidates'
# values then ids, the targets it holds, the flag.
_CANDIDATES_AT = 3


class Summaries(NamedTuple):
    """Per cell ``[...]`` of the whole vocabulary, from one exchange (`flagged_summaries`)."""

    largest: torch.Tensor  # the largest logit
    log_sum: torch.Tensor  # log-sum-exp relative to it: logp = (logit - largest) - log_sum
    top_logp: torch.Tensor  # [..., k] the top-k's log-probs
    top_ids: torch.Tensor  # [..., k] and their token ids
    target_logp: torch.Tensor  # [..., targets] the targets' log-probs
    entropy: torch.Tensor  # in nats


def summaries(
    shard: VocabShard, logits: torch.Tensor, top_k: int, targets: Sequence[int]
) -> Summaries:
    """`flagged_summaries` with no flag: the summaries alone."""
    return flagged_summaries(shard, logits, top_k, targets, None)[0]


def compiled_on(device: torch.device) -> fused.Reductions | None:
    """The compiled reductions (`envoykit.ranks.fused`) for logits on ``device``, or None: on
    the CPU, where compiling works."""
    return fused.compiled() if device.type == "cpu" else None


def flagged_summaries(
    shard: VocabShard,
    logits: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    compiled: fused.Reductions | None = None,
) -> tuple[Summaries, bool]:
    """`Summaries` of the whole vocabulary from this slice's ``logits`` ``[..., size]`` and
    one exchange.

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

    Also returns whether any rank's ``flag`` was up, sent in the same exchange (one more
    number per row): a lens's cancel flag (`envoykit.ranks.cancel`) costs no collective of
    its own, where ranks sharing cores each wait for the one descheduled. ``None``: no flag
    (every rank passes None alike), so none is read back (a device sync).

    ``compiled``: the exponentials and their sums in one compiled loop (`compiled_on`).
    """
    rows = logits.reshape(-1, logits.shape[-1])
    local = _message(shard, rows, top_k, targets, flag, compiled)
    ids_at = _CANDIDATES_AT + top_k
    targets_at = ids_at + top_k
    every = shard.gather(local.view(*logits.shape[:-1], local.shape[-1]))
    whole_largest = every[..., 0].amax(dim=0)
    # Each rank's sums rescaled from its largest logit to the whole vocabulary's.
    offset = every[..., 0] - whole_largest
    scale = offset.exp()
    total = (every[..., 1] * scale).sum(0)
    log_sum = total.log()
    entropy = log_sum - ((every[..., 2] + offset * every[..., 1]) * scale).sum(0) / total
    candidates = every[..., _CANDIDATES_AT:ids_at].movedim(0, -2).flatten(-2)
    candidate_ids = every[..., ids_at:targets_at].movedim(0, -2).flatten(-2)
    top_values, picked = candidates.topk(top_k, dim=-1)
    top_ids = candidate_ids.gather(-1, picked).long()
    target_logits = every[..., targets_at:-1].sum(0)
    flagged = flag is not None and bool(every[..., -1].amax() > 0)

    def logp(x: torch.Tensor) -> torch.Tensor:
        return (x - whole_largest.unsqueeze(-1)) - log_sum.unsqueeze(-1)

    found = Summaries(
        whole_largest, log_sum, logp(top_values), top_ids, logp(target_logits), entropy
    )
    return found, flagged


def _message(
    shard: VocabShard,
    rows: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    compiled: fused.Reductions | None,
) -> torch.Tensor:
    """This rank's part of `flagged_summaries`' exchange, from its slice's ``rows`` of
    logits ``[rows, size]``. A slice smaller than k sends -inf candidates (id 0), so every
    rank sends k."""
    k = min(top_k, shard.size)
    ids_at = _CANDIDATES_AT + top_k
    targets_at = ids_at + top_k
    local = rows.new_zeros(rows.shape[0], targets_at + len(targets) + 1)
    local[:, _CANDIDATES_AT + k : ids_at] = -torch.inf
    local[:, -1] = float(bool(flag))
    blocks = row_blocks(rows.shape[0], rows.shape[1], rows.element_size())
    scratch = [rows.new_empty(rows[blocks[0]].shape) for _ in range(2)]
    for block in blocks:
        values, ids, exp_sum, weighted = _block_summary(rows[block], k, compiled, scratch)
        local[block, 0] = values[:, 0]
        local[block, 1], local[block, 2] = exp_sum, weighted
        local[block, _CANDIDATES_AT : _CANDIDATES_AT + k] = values
        local[block, ids_at : ids_at + k] = ids + shard.start  # exact: ids < 2**24
    for i, token in enumerate(targets):
        if shard.start <= token < shard.start + shard.size:
            local[:, targets_at + i] = rows[:, token - shard.start]
    return local


def _block_summary(
    part: torch.Tensor,
    k: int,
    compiled: fused.Reductions | None,
    scratch: list[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """A block of rows' top-k values and ids ``[rows, k]``, and with ``d`` each logit less
    the row's largest, the sums of ``exp(d)`` and of ``exp(d) * d`` ``[rows]``; torch's
    passes write ``d`` and ``exp(d)`` into ``scratch``."""
    if compiled is not None and k == 1:
        # The largest value alone is one fast pass (finding its index too took 4x as
        # long); its first index comes from the compiled loop of the sums.
        largest = part.amax(-1, keepdim=True)
        first, exp_sum, weighted = compiled.exp_sums(part, largest)
        return largest, first.unsqueeze(-1), exp_sum, weighted
    # One pass for a top-1 where topk makes two.
    values, ids = part.max(-1, keepdim=True) if k == 1 else part.topk(k, dim=-1)
    largest = values[:, :1].contiguous()
    if compiled is not None:
        return values, ids, *compiled.exp_sums(part, largest)[1:]
    d, e = (buffer[: part.shape[0]] for buffer in scratch)
    torch.sub(part, largest, out=d)
    torch.exp(d, out=e)
    return values, ids, e.sum(-1), e.mul_(d).sum(-1)


def normalized(logits: torch.Tensor, largest: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """This slice's log-probs from its ``logits`` and `summaries`' ``largest`` and ``log_sum``,
    in a new tensor: ``(logit - largest) - log_sum``, as `sums` computes them in place."""
    return torch.sub(logits, largest.unsqueeze(-1)).sub_(log_sum.unsqueeze(-1))


def sums(
    shard: VocabShard,
    logits: torch.Tensor,
    normalizer: tuple[torch.Tensor, torch.Tensor],
    final: tuple[torch.Tensor, torch.Tensor],
    target_logp: torch.Tensor,
    compiled: fused.Reductions | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(final || layer) ``[...]`` and the targets' ranks ``[..., targets]`` (the tokens
    strictly more likely, 0 = the most likely) over the whole vocabulary, from this slice's
    ``logits`` ``[..., positions, size]``, normalised as `normalized` does with `summaries`'
    ``(largest, log_sum)`` as ``normalizer`` (in place, unless ``compiled``), the final
    layer's log-probs and probabilities ``final`` ``[positions, size]`` (computed once by the
    caller, for every chunk of layers) and one exchange.

    KL in its elementwise form, summed by torch's cascade sum (a BLAS dot product over 49k
    terms lost 6e-4 nats; a difference of two dot products would also cancel when a layer is
    close to the final one), block by block of rows (`row_blocks`), so the passes over a
    block read the cache; or, ``compiled``, in one compiled loop over every row.
    """
    final_logp, final_probs = final
    n_pos, size = logits.shape[-2:]
    grid = logits.view(-1, n_pos, size)
    largest, log_sum = (part.view(grid.shape[:2]) for part in normalizer)
    found = logits.new_empty(grid.shape[0], n_pos, 1 + target_logp.shape[-1])
    thresholds = target_logp.reshape(grid.shape[0], n_pos, target_logp.shape[-1])
    if compiled is not None:
        found[..., 0], found[..., 1:] = compiled.kl_and_ranks(
            grid, largest[..., None], log_sum[..., None], final_logp, final_probs, thresholds
        )
    else:
        _eager_sums(grid, largest, log_sum, final, thresholds, found)
    total = shard.gather(found.view(*logits.shape[:-1], found.shape[-1])).sum(0)
    return total[..., 0].clamp_min(0.0), total[..., 1:]


def _eager_sums(
    grid: torch.Tensor,
    largest: torch.Tensor,
    log_sum: torch.Tensor,
    final: tuple[torch.Tensor, torch.Tensor],
    thresholds: torch.Tensor,
    found: torch.Tensor,
) -> None:
    """`sums`' per-rank part without a compiler, written into ``found``, ``grid``
    ``[layers, positions, size]`` normalised in place."""
    final_logp, final_probs = final
    n_pos, size = grid.shape[-2:]
    blocks = row_blocks(n_pos, size, grid.element_size())
    scratch = grid.new_empty(grid[0, blocks[0]].shape)
    for layer in range(grid.shape[0]):
        for block in blocks:
            logp = grid[layer, block]
            difference = scratch[: logp.shape[0]]
            logp.sub_(largest[layer, block, None]).sub_(log_sum[layer, block, None])
            torch.sub(final_logp[block], logp, out=difference)
            found[layer, block, 0] = difference.mul_(final_probs[block]).sum(-1)
            for i in range(thresholds.shape[-1]):
                # Counted in int32 (the default, int64, took 1.6x as long); exact as floats:
                # counts < 2**24.
                above = logp > thresholds[layer, block, i, None]
                found[layer, block, 1 + i] = above.sum(-1, dtype=torch.int32)
