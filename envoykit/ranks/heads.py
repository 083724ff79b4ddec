"""Attention patterns and writes of one rank's heads.

Rank-side code: it runs inside a trace on every rank, on that rank's slice of the heads, and
reproduces the model's own attention weights from what vLLM's kernel was given (queries and
keys after rotary embedding and q/k norms): the kernel's scale, the causal mask, the layer's
sliding window, the logit soft-cap (Gemma 2) and attention sinks (GPT-OSS: one learned logit
per head that takes part in the softmax and attends to nothing, so a row sums to less than
one), with grouped-query attention's shared keys, replicated on every rank when there are
more ranks than KV heads. A head's write into the stream is its slice of the output
projection's input through its slice of the projection's weight (`head_writes`). Nothing
here moves a tensor off the device it is on.
"""

from __future__ import annotations

from typing import Any

import torch


def query_key(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries and keys of an attention kernel's call ``(args, kwargs)``."""
    values = list(args) + [kwargs[name] for name in ("query", "key") if name in kwargs]
    return values[0], values[1]


def head_writes(projection: Any, heads_in: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[local heads, T, d_model]`` float32: what each of this rank's heads writes through
    the output projection ``projection`` (its slice of the weight, no bias, no reduction
    over the ranks), from the projection's input ``heads_in`` ``[T, width]``: this rank's
    columns, or every column (of which this rank's are taken).

    The projection is applied the way the model applies it (its quant method: the CPU
    backend keeps the weight prepacked for its GEMM and drops the plain one), once per head
    on the input with every other head's columns zeroed.
    """
    local = projection.input_size_per_partition
    if heads_in.shape[-1] != local:
        start = projection.tp_rank * local
        heads_in = heads_in[..., start : start + local]
    z = heads_in.unflatten(-1, (-1, head_size))
    heads = z.shape[1]
    alone = torch.eye(heads, dtype=z.dtype, device=z.device)[:, None, :, None]
    masked = (z[None] * alone).flatten(-2)  # [heads, T, local]
    out = projection.quant_method.apply(projection, masked.flatten(0, 1), bias=None)
    return out.float().unflatten(0, (heads, -1))


def local_patterns(
    kernel: Any, query: torch.Tensor, key: torch.Tensor, queries: torch.Tensor
) -> torch.Tensor:
    """``[local heads, len(queries), tokens]`` float32 attention weights of this rank's heads
    at the query positions ``queries``, for vLLM attention module ``kernel`` called on
    ``query`` ``[tokens, local heads * head_size]`` and ``key``
    ``[tokens, local KV heads * head_size]``."""
    size = kernel.head_size
    tokens = key.shape[0]
    q = query.reshape(tokens, -1, size)[queries].float()
    k = key.reshape(tokens, -1, size).float()
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * kernel.impl.scale
    cap = kernel.impl.logits_soft_cap
    if cap:
        scores = cap * torch.tanh(scores / cap)
    keys = torch.arange(tokens, device=scores.device)
    behind = queries.to(scores.device)[:, None] - keys[None, :]  # [queries, tokens]
    hidden = behind < 0
    if kernel.sliding_window is not None:
        hidden = hidden | (behind >= kernel.sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    sinks = getattr(kernel.impl, "sinks", None)
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().to(scores.device)[:, None, None].expand(heads, len(queries), 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def picked_on_ranks(
    heads: list[int], n_heads: int, ranks: int
) -> tuple[list[list[int]], list[int]]:
    """Which of ``heads`` (whole-model numbers) each of ``ranks`` ranks holds, as indices into
    its own slice, padded with 0 to one width so every rank sends as much; and where each of
    ``heads`` then lands in the flattened gather ``[ranks * width]``, so the picked heads
    come back in their own order. Heads are split in order: rank r holds
    ``r * n_heads / ranks`` onwards."""
    local = n_heads // ranks
    mine: list[list[int]] = [[] for _ in range(ranks)]
    places = []
    for head in heads:
        rank = head // local
        places.append((rank, len(mine[rank])))
        mine[rank].append(head - rank * local)
    width = max(1, max(len(m) for m in mine))
    padded = [m + [0] * (width - len(m)) for m in mine]
    return padded, [rank * width + i for rank, i in places]
