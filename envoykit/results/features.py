"""`FeatureResult`: which SAE features fire on each token of a prompt, and how well the SAE
reconstructs the stream there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.results.base import Result, freeze_json, frozen_array


@dataclass(frozen=True)
class FeatureResult(Result):
    """One SAE read on one prompt: per token position, its ``top_ids``/``top_acts``
    ``[positions, k]`` (the most active features, largest first; id -1 and activation 0
    past the features that fired), ``l0`` ``[positions]`` (features on), ``sq_error`` (``||x -
    x_hat||^2``) and ``sq_centered`` (``||x - mean_t x||^2``, the prompt's mean over its
    positions) ``[positions]``. ``tracked`` ``[features]`` and ``tracked_acts``
    ``[features, positions]``: the activations of features asked for by id. ``meta["sae"]``
    describes the SAE (`envoykit.analyses.sae.SAE.describe`).
    """

    prompt: str
    tokens: tuple[str, ...]
    token_ids: np.ndarray
    top_ids: np.ndarray
    top_acts: np.ndarray
    l0: np.ndarray
    sq_error: np.ndarray
    sq_centered: np.ndarray
    d_model: int
    tracked: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tracked_acts: np.ndarray | None = None
    meta: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        owner = "FeatureResult"
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(
            self, "token_ids", frozen_array(owner, "token_ids", self.token_ids, np.int64, (n,))
        )
        top_ids = np.asarray(self.top_ids)
        k = top_ids.shape[1] if top_ids.ndim == 2 else -1
        for name, dtype, shape in (
            ("top_ids", np.int64, (n, k)),
            ("top_acts", np.float32, (n, k)),
            ("l0", np.int64, (n,)),
            ("sq_error", np.float32, (n,)),
            ("sq_centered", np.float32, (n,)),
        ):
            object.__setattr__(
                self, name, frozen_array(owner, name, getattr(self, name), dtype, shape)
            )
        tracked = frozen_array(owner, "tracked", self.tracked, np.int64)
        object.__setattr__(self, "tracked", tracked)
        acts = np.zeros((0, n)) if self.tracked_acts is None else self.tracked_acts
        object.__setattr__(
            self,
            "tracked_acts",
            frozen_array(owner, "tracked_acts", acts, np.float32, (len(tracked), n)),
        )
        object.__setattr__(self, "d_model", int(self.d_model))
        object.__setattr__(self, "meta", freeze_json(dict(self.meta), "FeatureResult.meta"))
        if (self.top_acts < 0).any() or (self.l0 < 0).any() or (self.sq_error < 0).any():
            raise ValueError("FeatureResult: activations, L0 and errors are never negative")

    @property
    def mse(self) -> np.ndarray:
        """The reconstruction's mean squared error per position (over the ``d_model``
        numbers of the stream)."""
        return self.sq_error / self.d_model

    def variance_explained(self, skip_first: bool = False) -> float:
        """``1 - sum ||x - x_hat||^2 / sum ||x - mean x||^2`` over the prompt's positions
        (``skip_first``: without the first, whose stream is often an outlier: a BOS token's
        norm is many times the others')."""
        start = 1 if skip_first else 0
        total = float(self.sq_centered[start:].astype(np.float64).sum())
        if total == 0.0:
            return float("nan")
        return 1.0 - float(self.sq_error[start:].astype(np.float64).sum()) / total

    def activation(self, feature: int) -> np.ndarray:
        """The activation of ``feature`` at every position: exact where it was tracked
        (``features=[...]`` in `engine.features`), else read off the top-k lists (0 where
        it is not among a position's top features)."""
        hits = np.flatnonzero(self.tracked == int(feature))
        if hits.size:
            assert self.tracked_acts is not None  # __post_init__ gives an array, [0, n] if None
            return self.tracked_acts[hits[0]].copy()
        return np.where(self.top_ids == int(feature), self.top_acts, 0.0).max(axis=1)

    def to_pandas(self) -> Any:
        """One row per (position, rank among the top features): position, token, rank,
        feature, activation, and the position's L0 and MSE."""
        import pandas as pd

        n, k = self.top_ids.shape
        positions = np.repeat(np.arange(n), k)
        return pd.DataFrame(
            {
                "position": positions,
                "token": [self.tokens[p] for p in positions],
                "rank": np.tile(np.arange(k), n),
                "feature": self.top_ids.reshape(-1),
                "activation": self.top_acts.reshape(-1),
                "l0": self.l0[positions],
                "mse": self.mse[positions],
            }
        )

    def __repr__(self) -> str:
        sae = dict(self.meta.get("sae", {}))
        return (
            f"FeatureResult({len(self.tokens)} tokens, SAE {sae.get('key')} at layer "
            f"{sae.get('layer')} {sae.get('site')!r}, mean L0 {self.l0.mean():.1f}, "
            f"variance explained {self.variance_explained():.3f})"
        )


@dataclass(frozen=True)
class FeatureAttributionResult(Result):
    """SAE features' direct effects on target logits (the final norm's scale frozen, as in
    `AttributionResult`), per picked position and target: ``feature_ids`` and ``effects``
    ``[positions, targets, k]`` (the k largest by absolute effect), and ``features`` (all
    features together), ``error`` (the SAE's error ``x - x_hat``), ``bias`` (its decoder
    bias) and ``site`` (the stream at the SAE's site itself) ``[positions, targets]``.
    ``features + error + bias == site``: checked on construction (to 1e-4 of the largest
    effect there)."""

    prompt: str
    tokens: tuple[str, ...]
    positions: np.ndarray
    target_ids: np.ndarray
    target_labels: tuple[str, ...]
    feature_ids: np.ndarray
    effects: np.ndarray
    features: np.ndarray
    error: np.ndarray
    bias: np.ndarray
    site: np.ndarray
    meta: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        owner = "FeatureAttributionResult"
        p, n = len(self.tokens), len(self.target_labels)
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "target_labels", tuple(self.target_labels))
        ids = np.asarray(self.feature_ids)
        k = ids.shape[-1] if ids.ndim == 3 else -1
        for name, dtype, shape in (
            ("positions", np.int64, (p,)),
            ("target_ids", np.int64, (n,)),
            ("feature_ids", np.int64, (p, n, k)),
            ("effects", np.float32, (p, n, k)),
            ("features", np.float32, (p, n)),
            ("error", np.float32, (p, n)),
            ("bias", np.float32, (p, n)),
            ("site", np.float32, (p, n)),
        ):
            object.__setattr__(
                self, name, frozen_array(owner, name, getattr(self, name), dtype, shape)
            )
        object.__setattr__(self, "meta", freeze_json(dict(self.meta), f"{owner}.meta"))
        total = self.features.astype(np.float64) + self.error + self.bias
        scale = max(1.0, float(np.abs(self.site).max(initial=0.0)))
        gap = float(np.abs(total - self.site).max(initial=0.0))
        if gap > 1e-4 * scale:
            raise ValueError(
                f"{owner}: features + error + bias differ from the site's effect by {gap:.3g}"
            )

    def target(self, which: str | int) -> int:
        """The index of a target by its label or token id."""
        for i, (label, token) in enumerate(zip(self.target_labels, self.target_ids)):
            if which == label or which == int(token):
                return i
        raise KeyError(f"no target {which!r}: the targets are {list(self.target_labels)}")

    def to_pandas(self) -> Any:
        """One row per (position, target, rank among the features): the feature and its
        effect on that target's logit."""
        import pandas as pd

        p, n, k = self.feature_ids.shape
        index = np.indices((p, n, k)).reshape(3, -1)
        return pd.DataFrame(
            {
                "position": self.positions[index[0]],
                "token": [self.tokens[i] for i in index[0]],
                "target": [self.target_labels[j] for j in index[1]],
                "rank": index[2],
                "feature": self.feature_ids.reshape(-1),
                "effect": self.effects.reshape(-1),
            }
        )


@dataclass(frozen=True)
class FeatureLogitsResult(Result):
    """The tokens SAE features' decoder directions push up (``top_*``, largest first) and
    down (``bottom_*``, smallest first), ``[features, k]``: each direction alone through the
    final norm and the unembedding."""

    features: np.ndarray
    top_ids: np.ndarray
    top_tokens: Any
    top_logits: np.ndarray
    bottom_ids: np.ndarray
    bottom_tokens: Any
    bottom_logits: np.ndarray
    meta: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        owner = "FeatureLogitsResult"
        ids = np.asarray(self.top_ids)
        shape = ids.shape if ids.ndim == 2 else (-1, -1)
        object.__setattr__(
            self, "features", frozen_array(owner, "features", self.features, np.int64, shape[:1])
        )
        for name, dtype in (
            ("top_ids", np.int64),
            ("top_logits", np.float32),
            ("bottom_ids", np.int64),
            ("bottom_logits", np.float32),
        ):
            object.__setattr__(
                self, name, frozen_array(owner, name, getattr(self, name), dtype, shape)
            )
        for name in ("top_tokens", "bottom_tokens"):
            table = tuple(tuple(str(t) for t in row) for row in getattr(self, name))
            if tuple(len(row) for row in table) != (shape[1],) * shape[0]:
                raise ValueError(f"{owner}.{name} must be {shape[0]} rows of {shape[1]} tokens")
            object.__setattr__(self, name, table)
        object.__setattr__(self, "meta", freeze_json(dict(self.meta), f"{owner}.meta"))
        if (np.diff(self.top_logits, axis=1) > 0).any() or (
            np.diff(self.bottom_logits, axis=1) < 0
        ).any():
            raise ValueError(f"{owner}: top logits fall and bottom logits rise along k")

    def of(self, feature: int) -> dict[str, list]:
        """One feature's tokens and logits, up and down."""
        hits = np.flatnonzero(self.features == int(feature))
        if not hits.size:
            raise KeyError(f"feature {feature} was not asked for: {self.features.tolist()}")
        i = int(hits[0])
        return {
            "up": list(zip(self.top_tokens[i], self.top_logits[i].tolist())),
            "down": list(zip(self.bottom_tokens[i], self.bottom_logits[i].tolist())),
        }
