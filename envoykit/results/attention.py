"""`AttentionResult`: attention patterns of one prompt — labelled, validated, immutable.

Plots and widgets read only this. A pattern is what each query position attends to: for
every picked layer, head and query, the weights over the key positions, either all of them
(``keys`` is then ``0..T-1`` on every row) or the ``top_k`` largest, most attended first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.results.base import Result, freeze_json, frozen_array

# How far a row's weights may sum above one: float32 rounding over a few thousand keys.
ROW_TOLERANCE = 1e-4


@dataclass(frozen=True, eq=False)
class AttentionResult(Result):
    """The attention weights of some heads at some query positions of one prompt.

    Shapes: ``T`` prompt tokens, ``L`` layers, ``H`` heads, ``Q`` queries, ``K`` keys kept per
    query (``T``, or ``top_k``).

    Attributes:
        prompt: the prompt text.
        token_ids: ``[T]`` the prompt's tokens; tokens: ``[T]`` each decoded, as it is.
        layers: ``[L]`` decoder layer numbers (1 is the first layer's attention).
        heads: ``[H]`` head numbers, 0-based over the whole model (not a rank's slice).
        queries: ``[Q]`` the query positions, increasing.
        keys: ``[L, H, Q, K]`` the key position of each weight: ``0..T-1`` when every key
            was kept, else the ``top_k`` most attended keys, most attended first.
        weights: ``[L, H, Q, K]`` attention weights, in [0, 1]. Over all keys a row sums to
            one, or to less where the model has attention sinks (GPT-OSS), whose share is
            ``1 - row sum``.
        meta: model name, TP size, dtype; ``top_k`` (None: every key).

    >>> res = AttentionResult.example()
    >>> res.pattern(1, 0).tolist()
    [[1.0, 0.0], [0.25, 0.75]]
    """

    prompt: str
    token_ids: np.ndarray
    tokens: tuple[str, ...]
    layers: np.ndarray
    heads: np.ndarray
    queries: np.ndarray
    keys: np.ndarray
    weights: np.ndarray
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n_tokens = len(self.token_ids)
        tokens = tuple(str(t) for t in self.tokens)
        if len(tokens) != n_tokens or n_tokens == 0:
            raise ValueError(f"AttentionResult.tokens has {len(tokens)} entries, not {n_tokens}")
        object.__setattr__(self, "tokens", tokens)
        owner = "AttentionResult"
        for name in ("token_ids", "layers", "heads", "queries"):
            array = frozen_array(owner, name, getattr(self, name), np.int64)
            if array.ndim != 1 or not array.size or array.min() < 0:
                raise ValueError(f"{owner}.{name} must be a non-empty list of numbers >= 0")
            object.__setattr__(self, name, array)
        if (np.diff(self.queries) <= 0).any() or self.queries[-1] >= n_tokens:
            raise ValueError(f"{owner}.queries must increase and lie below {n_tokens}")
        keys = frozen_array(owner, "keys", self.keys, np.int64)
        if keys.ndim != 4 or keys.shape[:3] != (
            len(self.layers),
            len(self.heads),
            len(self.queries),
        ):
            raise ValueError(
                f"{owner}.keys has shape {keys.shape}, not [layers, heads, queries, K]"
            )
        shape = keys.shape
        weights = frozen_array(owner, "weights", self.weights, np.float32, shape)
        if keys.min() < 0 or keys.max() >= n_tokens:
            raise ValueError(f"{owner}.keys must be positions below {n_tokens}")
        if not np.isfinite(weights).all() or weights.min() < 0:
            raise ValueError(f"{owner}.weights must be finite and >= 0")
        if (weights.astype(np.float64).sum(-1) > 1 + ROW_TOLERANCE).any():
            raise ValueError(f"{owner}.weights: a row sums to more than one")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "meta", freeze_json(self.meta, f"{owner}.meta"))

    # -- reading ---------------------------------------------------------------------------

    @property
    def top_k(self) -> int | None:
        """How many keys each query kept; None when it kept every key."""
        return self.meta.get("top_k")

    def index(self, layer: int, head: int) -> tuple[int, int]:
        """The indices of decoder layer ``layer`` and head ``head`` in this result."""
        for name, value, held in (("layer", layer, self.layers), ("head", head, self.heads)):
            if value not in held:
                raise KeyError(f"{name} {value} is not in this result: it holds {held.tolist()}")
        return int(np.flatnonzero(self.layers == layer)[0]), int(
            np.flatnonzero(self.heads == head)[0]
        )

    def pattern(self, layer: int, head: int) -> np.ndarray:
        """``[Q, T]`` the weights of one head over every key (zero where a top-k result kept
        none)."""
        li, hi = self.index(layer, head)
        dense = np.zeros((len(self.queries), len(self.token_ids)), dtype=np.float32)
        np.put_along_axis(dense, self.keys[li, hi], self.weights[li, hi], axis=-1)
        return dense

    # -- export ----------------------------------------------------------------------------

    def to_pandas(self) -> Any:
        """Long format: one row per (layer, head, query, kept key)."""
        import pandas as pd

        grid = np.meshgrid(*(np.arange(s) for s in self.weights.shape), indexing="ij")
        layer, head, query, rank = (index.ravel() for index in grid)
        keys = self.keys.ravel()
        return pd.DataFrame(
            {
                "layer": self.layers[layer],
                "head": self.heads[head],
                "query": self.queries[query],
                "query_token": np.array(self.tokens, dtype=object)[self.queries[query]],
                "key": keys,
                "key_token": np.array(self.tokens, dtype=object)[keys],
                "rank": rank,
                "weight": self.weights.ravel(),
            }
        )

    def __repr__(self) -> str:
        kept = "every key" if self.top_k is None else f"top-{self.top_k} keys"
        return (
            f"AttentionResult(prompt={self.prompt!r}, layers={self.layers.tolist()}, "
            f"heads={len(self.heads)}, queries={len(self.queries)}, {kept})"
        )

    @classmethod
    def example(cls) -> AttentionResult:
        """A small hand-made result (one layer, one head, two tokens) for docs and tests."""
        return cls(
            prompt="a b",
            token_ids=np.array([5, 6]),
            tokens=("a", " b"),
            layers=np.array([1]),
            heads=np.array([0]),
            queries=np.array([0, 1]),
            keys=np.array([[[[0, 1], [0, 1]]]]),
            weights=np.array([[[[1.0, 0.0], [0.25, 0.75]]]], dtype=np.float32),
        )
