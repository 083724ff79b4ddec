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
from envoykit.ranks import fused

F64 = torch.float64


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


# A rank's message per row (`_message`): its largest logit, the sums of ``exp(d)``,
# ``exp(d) * d`` and ``final_exp * d``, its k candidates' values then ids, the targets it
# holds, the flag. Sent in float64: KL comes from differences of these sums.
_CANDIDATES_AT = 4


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
    local = _message(shard, grid, top_k, targets, None, None, None)
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
        return _message(shard, logits, top_k, targets, flag, compiled, final_exp), final_exp
    local, final_exp = _final_message(shard, logits[-1:], top_k, targets, flag, compiled)
    if logits.shape[0] > 1:
        others = _message(shard, logits[:-1], top_k, targets, flag, compiled, final_exp)
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
    ``[ranks, ..., columns]`` (`_message`)."""
    ids_at = _CANDIDATES_AT + top_k
    targets_at = ids_at + top_k
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


def _message(
    shard: VocabShard,
    grid: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    compiled: fused.Reductions | None,
    final_exp: torch.Tensor | None,
) -> torch.Tensor:
    """This rank's part of the exchange ``[layers, positions, columns]`` (float64), from its
    slice's logits ``grid`` ``[layers, positions, size]``; with the final layer's
    ``final_exp`` ``[positions, size]``, the sums KL needs (`lens_summaries`). A slice
    smaller than k sends -inf candidates (id 0), so every rank sends k."""
    local = _blank(shard, grid, top_k, targets, flag)
    if compiled is not None and final_exp is not None:
        _fill(local, shard, grid, top_k, *compiled.layer_sums(grid, final_exp))
    else:
        _passes(local, shard, grid, top_k, final_exp, None)
    return local


def _final_message(
    shard: VocabShard,
    grid: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    compiled: fused.Reductions | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_message` of the final layer's logits ``grid`` ``[1, positions, size]``, and its
    ``exp(d)`` ``[positions, size]`` for every layer's KL. Its own ``final_exp * d`` is its
    sum of ``exp(d) * d``."""
    local = _blank(shard, grid, top_k, targets, flag)
    rows = grid[0]
    if compiled is not None:
        largest, first, exp_sum, weighted, exp = compiled.final_sums(rows)
        _fill(local, shard, grid, top_k, largest[None], first[None], exp_sum, weighted, weighted)
        return local, exp
    exp = torch.empty_like(rows)
    _passes(local, shard, grid, top_k, None, exp)
    return local, exp


def _passes(
    local: torch.Tensor,
    shard: VocabShard,
    grid: torch.Tensor,
    top_k: int,
    final_exp: torch.Tensor | None,
    exp: torch.Tensor | None,
) -> None:
    """`_message`'s sums in torch's passes, a block of rows at a time (`row_blocks`),
    written into ``local``: with ``final_exp``, each row's sum of ``final_exp * d``; with
    ``exp`` (``grid`` is the final layer), its exponentials written there, and each row's
    own sum of ``exp(d) * d`` in their place."""
    blocks = row_blocks(grid.shape[1], grid.shape[2], grid.element_size())
    scratch = [grid.new_empty(grid[0, blocks[0]].shape) for _ in range(2)]
    for layer in range(grid.shape[0]):
        for block in blocks:
            part = grid[layer, block]
            d, e = (buffer[: part.shape[0]] for buffer in scratch)
            if exp is not None:
                e = exp[block]
            values, ids = _top(part, min(top_k, shard.size))
            exp_sum, weighted = _sums(part, values, d, e)
            _fill_block(local[layer, block], shard, top_k, values, ids, exp_sum, weighted)
            if final_exp is not None:
                local[layer, block, 3] = _dot(final_exp[block], d)
            elif exp is not None:
                local[layer, block, 3] = weighted


def _blank(
    shard: VocabShard, grid: torch.Tensor, top_k: int, targets: Sequence[int], flag: bool | None
) -> torch.Tensor:
    """A message for ``grid``'s cells with what needs no pass over them: the flag, the
    targets this rank holds, and -inf for the candidates a slice smaller than k lacks."""
    k = min(top_k, shard.size)
    ids_at = _CANDIDATES_AT + top_k
    local = grid.new_zeros(*grid.shape[:-1], ids_at + top_k + len(targets) + 1, dtype=F64)
    local[..., _CANDIDATES_AT + k : ids_at] = -torch.inf
    local[..., -1] = float(bool(flag))
    for i, token in enumerate(targets):
        if shard.start <= token < shard.start + shard.size:
            local[..., ids_at + top_k + i] = grid[..., token - shard.start]
    return local


def _fill(
    local: torch.Tensor,
    shard: VocabShard,
    grid: torch.Tensor,
    top_k: int,
    largest: torch.Tensor,
    first: torch.Tensor,
    exp_sum: torch.Tensor,
    weighted: torch.Tensor,
    final_weighted: torch.Tensor,
) -> None:
    """Write a compiled loop's sums into ``local``, with the top-k candidates: the loop's
    largest value and its first index for a top-1, ``topk`` for more."""
    k = min(top_k, shard.size)
    if k == 1:
        values, ids = largest, first.unsqueeze(-1)
    else:
        values, ids = grid.topk(k, dim=-1)
    _fill_block(local, shard, top_k, values, ids, exp_sum, weighted)
    local[..., 3] = final_weighted


def _fill_block(
    local: torch.Tensor,
    shard: VocabShard,
    top_k: int,
    values: torch.Tensor,
    ids: torch.Tensor,
    exp_sum: torch.Tensor,
    weighted: torch.Tensor,
) -> None:
    """Write cells' top-k ``values`` and ``ids`` ``[..., k]`` and their two sums into their
    messages ``local``."""
    k = values.shape[-1]
    ids_at = _CANDIDATES_AT + top_k
    local[..., 0] = values[..., 0]
    local[..., 1], local[..., 2] = exp_sum, weighted
    local[..., _CANDIDATES_AT : _CANDIDATES_AT + k] = values
    local[..., ids_at : ids_at + k] = ids + shard.start  # exact: ids < 2**24


def _top(part: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of rows' top-k values and ids ``[rows, k]``: one pass for a top-1, where
    ``topk`` makes two."""
    return part.max(-1, keepdim=True) if k == 1 else part.topk(k, dim=-1)


def _sums(
    part: torch.Tensor, values: torch.Tensor, d: torch.Tensor, e: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``d`` each logit of the block ``part`` less its row's largest (``values[:, :1]``),
    written into ``d``, and ``exp(d)`` into ``e``: the sums of ``exp(d)`` and of
    ``exp(d) * d`` ``[rows]`` in float64, as the compiled loop sums them."""
    torch.sub(part, values[:, :1], out=d)
    torch.exp(d, out=e)
    return e.sum(-1, dtype=F64), _dot(e, d)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, the sum of ``a * b`` accumulated in float64."""
    return torch.mul(a, b).sum(-1, dtype=F64)


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
