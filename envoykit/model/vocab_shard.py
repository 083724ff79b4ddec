"""A rank's slice of the vocabulary: what the unembedding envoy hands the per-rank reductions
(`envoykit.ranks.vocab_parallel`), so the envoys and the reductions share one small type."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary, and how to reach the other ranks' slices.

    ``logits`` maps hidden states ``[n, d_model]`` to this slice's logits ``[n, size]`` (the
    model's own soft-cap and scale applied, no padding); ``start`` is the token id of its
    first column; ``gather`` returns ``[ranks, *t.shape]``, every rank's ``t`` in rank order,
    the same on every rank (a collective: every rank must call it, in the same order).
    ``largest`` is the size of the largest slice any rank holds (slices differ by the
    vocabulary's padding): work is chunked by it, so every rank makes the same exchanges.
    """

    logits: Callable[[torch.Tensor], torch.Tensor]
    start: int
    size: int
    gather: Callable[[torch.Tensor], torch.Tensor]
    largest: int
