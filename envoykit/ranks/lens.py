"""What each rank reduces of a lens: its slice of the vocabulary's logits, chunked to a
memory budget, down to top-k, target probability and rank, entropy and KL per cell.

Plain torch once it is handed the streams (the lens, the corpus lens and a steer sweep all
call `lens_statistics` inside their traces); the ranks combine a few numbers per cell through
`envoykit.ranks.vocab_parallel`, so every rank ends with the statistics of the whole
vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from envoykit.model.readout import normalize
from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import fused as fused_reductions
from envoykit.ranks import vocab_parallel
from envoykit.ranks.cancel import LensCancelled, cancel_message, flag_seen

# A rank's slice of the float32 logits (and what is computed from them) per unembedding call
# stays under this.
DEFAULT_MEMORY_BUDGET = 256 * 2**20


def lens_statistics(
    norm: Any,
    shard: VocabShard,
    streams: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    positions: torch.Tensor | None,
    top_k: int,
    targets: Sequence[int],
    dtype: torch.dtype = torch.float32,
    budget: int = DEFAULT_MEMORY_BUDGET,
    cancel: str | None = None,
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """Reduce the lens of ``streams`` (one ``(hidden, residual)`` per row) on this rank.

    A row without a residual is a lone vector, normalised by itself. The last stream is the
    final layer: KL is measured against its distribution. Each rank reduces only its own
    slice of the vocabulary (``shard``, see `vocab_parallel`) and the ranks combine small
    per-cell summaries, so every rank returns the same statistics of the whole vocabulary.
    Returns tensors on the streams' device (the trace moves them to the host as it saves
    them): ``top_ids``/``top_probs`` ``[layers, positions, k]``,
    ``entropy``/``kl`` ``[layers, positions]``, ``target_probs``/``target_ranks``
    ``[layers, positions, targets]`` (rank 0 = the most likely token). ``cancel``: the
    lens's cancel key, looked for before each chunk and agreed on in its summaries'
    exchange (`envoykit.ranks.cancel`). ``fused``: the reductions compiled into fused loops
    on the CPU (`envoykit.ranks.fused`), for long work, which pays the first compile once.
    """
    rows = [normalize(norm, value, residual) for value, residual in streams]
    device = rows[0].device
    if positions is not None:
        rows = [row[positions.to(device)] for row in rows]
    compiled = vocab_parallel.compiled_on(device) if fused else None
    blocks = [
        _reduce_positions(shard, chunks, top_k, targets, dtype, cancel, compiled)
        for chunks in _chunked(rows, shard.largest, budget)
    ]
    return {key: torch.cat([block[key] for block in blocks], dim=1) for key in blocks[0]}


def _chunked(
    rows: list[torch.Tensor], largest: int, budget: int
) -> Iterator[list[list[torch.Tensor]]]:
    """Per block of positions (`positions_per_call`), the layers' rows in chunks that fit
    ``budget`` (`layers_per_call`), the final layer's chunk first: every chunk needs its
    distribution for KL. Each exchange is a collective: every rank must make the same
    calls, so chunks are sized by the largest slice (slices differ by the vocabulary's
    padding), not by this rank's."""
    span = positions_per_call(largest, budget)
    for start in range(0, rows[0].shape[0], span):
        block = [row[start : start + span] for row in rows]
        per_call = layers_per_call(block[0].shape[0], largest, budget)
        yield [block[layers] for layers in even_chunks(len(block), per_call)]


def _logits(shard: VocabShard, chunk: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """This slice's logits ``[layers, positions, size]`` of a chunk's rows, in ``dtype``."""
    return shard.logits(torch.cat(chunk, dim=0)).to(dtype).unflatten(0, (len(chunk), -1))


def _reduce_positions(
    shard: VocabShard,
    chunks: list[list[torch.Tensor]],
    top_k: int,
    targets: Sequence[int],
    dtype: torch.dtype,
    cancel: str | None,
    compiled: fused_reductions.Reductions | None,
) -> dict[str, torch.Tensor]:
    """`lens_statistics` of one block of positions, its layers in ``chunks`` (`_chunked`)."""
    final: vocab_parallel.Final | None = None
    pieces: list[dict[str, torch.Tensor]] = []
    for chunk in chunks:
        # Looked for before the chunk, agreed on with its summaries.
        seen = None if cancel is None else flag_seen(cancel)
        logits = _logits(shard, chunk, dtype)
        summaries, final, cancelled = vocab_parallel.lens_summaries(
            shard, logits, top_k, targets, seen, final, compiled
        )
        if cancelled and cancel is not None:  # (only a lens with a key sends a flag)
            raise LensCancelled(cancel_message(cancel))
        ranks = vocab_parallel.target_ranks(shard, logits, summaries.target_logits)
        pieces.append(_piece(summaries, ranks))
        # This chunk's logits go before the next chunk's exist: held across the next head
        # call, they added a chunk to the peak (a second long demo lens at TP=3: a rank's
        # peak rose up to 169 MiB above its start with them, up to 84 MiB without).
        del logits
    pieces.reverse()
    return {key: torch.cat([piece[key] for piece in pieces]) for key in pieces[0]}


def _piece(summaries: vocab_parallel.Summaries, ranks: torch.Tensor) -> dict[str, torch.Tensor]:
    """`lens_statistics`' tensors of one chunk, 32-bit throughout: what crosses to the client
    is 4 bytes per number."""
    assert summaries.kl is not None  # (the lens's summaries always sum it)
    return {
        "top_ids": summaries.top_ids.int(),
        "top_probs": summaries.top_logp.exp().float(),
        "entropy": summaries.entropy.float(),
        "kl": summaries.kl.float(),
        "target_probs": summaries.target_logp.exp().float(),
        "target_ranks": ranks.int(),
    }


def lens_messages(
    norm: Any,
    shard: VocabShard,
    streams: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    top_k: int,
    flag: bool,
    budget: int = DEFAULT_MEMORY_BUDGET,
    fused: bool = False,
) -> torch.Tensor:
    """The first half of `lens_statistics` without targets, on this rank alone: its messages
    ``[layers, positions, columns]`` (`vocab_parallel.lens_message`), chunked to ``budget``
    as `lens_statistics` chunks, with ``flag`` sent in each. A caller that lenses many
    streams (the corpus lens's documents) sends their messages in one exchange and reduces
    them with `statistics_of`, where `lens_statistics` makes one exchange per chunk."""
    rows = [normalize(norm, value, residual) for value, residual in streams]
    compiled = vocab_parallel.compiled_on(rows[0].device) if fused else None
    blocks = []
    for chunks in _chunked(rows, shard.largest, budget):
        messages, final_exp = [], None
        for chunk in chunks:
            logits = _logits(shard, chunk, torch.float32)
            local, final_exp = vocab_parallel.lens_message(
                shard, logits, top_k, (), flag, final_exp, compiled
            )
            messages.append(local)
            del logits  # (as in `_reduce_positions`)
        blocks.append(torch.cat(messages[::-1]))
    return torch.cat(blocks, dim=1)


def statistics_of(every: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """`lens_statistics`' result from every rank's `lens_messages` ``every``
    ``[ranks, layers, positions, columns]``, positions of any number of lenses side by side."""
    summaries = vocab_parallel.lens_combined(every, top_k, None)
    return _piece(summaries, every.new_zeros(*every.shape[1:3], 0))


def layers_per_call(n_pos: int, vocab: int, budget: int) -> int:
    """Layers per unembedding call so the logits of ``vocab`` tokens (a rank's slice) fit
    ``budget`` bytes beside the final layer's exponentials, which every chunk keeps for KL
    (`vocab_parallel.Final`), with a layer's size to spare. The reductions' own temporaries
    are blocks of a few MiB (`envoykit.ranks.messages.row_blocks`)."""
    per_layer = max(1, n_pos * vocab * 4)
    return max(1, math.floor(budget / per_layer) - 2)


def even_chunks(n_layers: int, per_call: int) -> list[slice]:
    """``n_layers`` in as few chunks of at most ``per_call`` as fit, of near-equal sizes,
    the last layer's first: a small remainder chunk would run the head's GEMM on a few rows,
    where it is several times slower per row than on many."""
    n_chunks = math.ceil(n_layers / per_call)
    ends = [round(n_layers * (i + 1) / n_chunks) for i in range(n_chunks)]
    starts = [0, *ends[:-1]]
    return [slice(start, end) for start, end in zip(reversed(starts), reversed(ends))]


def positions_per_call(vocab: int, budget: int) -> int:
    """Positions per block so that one layer of them, the final layer's exponentials and a
    layer's size to spare fit ``budget`` as in `layers_per_call`: past that, a long prompt's single
    layer would outgrow the budget with its length."""
    return max(1, math.floor(budget / max(1, vocab * 4 * 3)))
