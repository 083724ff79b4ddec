"""What a rank sends of its slice of the vocabulary per cell: the message that
`envoykit.ranks.vocab_parallel` exchanges between the ranks and combines into statistics of
the whole vocabulary. Built from the slice's logits alone, in one compiled loop per row
(`envoykit.ranks.fused`) or in torch's passes over blocks of rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import fused

F64 = torch.float64

# A rank's message per row (`message`): its largest logit, the sums of ``exp(d)``,
# ``exp(d) * d`` and ``final_exp * d``, its k candidates' values then ids, the targets it
# holds, the flag. Sent in float64: KL comes from differences of these sums.
CANDIDATES_AT = 4

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


# A rank's message per row (`message`): its largest logit, the sums of ``exp(d)``,
# ``exp(d) * d`` and ``final_exp * d``, its k candidates' values then ids, the targets it
# holds, the flag. Sent in float64: KL comes from differences of these sums.
CANDIDATES_AT = 4


def message(
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
    ``final_exp`` ``[positions, size]``, the sums KL needs
    (`envoykit.ranks.vocab_parallel.lens_summaries`). A slice smaller than k sends -inf
    candidates (id 0), so every rank sends k."""
    local = _blank(shard, grid, top_k, targets, flag)
    if compiled is not None and final_exp is not None:
        _fill(local, shard, grid, top_k, *compiled.layer_sums(grid, final_exp))
    else:
        _passes(local, shard, grid, top_k, final_exp, None)
    return local


def final_message(
    shard: VocabShard,
    grid: torch.Tensor,
    top_k: int,
    targets: Sequence[int],
    flag: bool | None,
    compiled: fused.Reductions | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`message` of the final layer's logits ``grid`` ``[1, positions, size]``, and its
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
    """`message`'s sums in torch's passes, a block of rows at a time (`row_blocks`),
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
    ids_at = CANDIDATES_AT + top_k
    local = grid.new_zeros(*grid.shape[:-1], ids_at + top_k + len(targets) + 1, dtype=F64)
    local[..., CANDIDATES_AT + k : ids_at] = -torch.inf
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
    ids_at = CANDIDATES_AT + top_k
    local[..., 0] = values[..., 0]
    local[..., 1], local[..., 2] = exp_sum, weighted
    local[..., CANDIDATES_AT : CANDIDATES_AT + k] = values
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
