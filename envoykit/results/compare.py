"""`CompareResult`: two lens runs side by side, cell by cell — labelled, validated, immutable.

Plots read only this. Rows are layers, columns aligned positions (index ``i`` of both runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.results.base import Result, freeze_json

_ARRAYS = {
    "layers": np.int64,
    "positions": np.int64,
    "js": np.float64,
    "top_ids_a": np.int64,
    "top_ids_b": np.int64,
    "top_probs_a": np.float32,
    "top_probs_b": np.float32,
    "target_ids": np.int64,
    "target_probs_a": np.float32,
    "target_probs_b": np.float32,
}
_TEXTS = ("tokens_a", "tokens_b", "top_tokens_a", "top_tokens_b", "target_labels", "target_tokens")


@dataclass(frozen=True, eq=False)
class CompareResult(Result):
    """Run ``a`` against run ``b``: ``L`` layers, ``P`` aligned positions, ``N`` targets.

    Attributes:
        a, b: what each run was (engine, TP size, dtype, prompt, patches), in words.
        tokens_a, tokens_b: ``[P]`` each run's input token at each compared position.
        layers: ``[L]`` layer numbers (0 = embedding); positions: ``[P]`` token indices.
        js: ``[L, P]`` Jensen-Shannon divergence between the two runs' full next-token
            distributions, in nats (0 = identical, at most ln 2), computed on the ranks in
            float64.
        top_ids_a/b, top_tokens_a/b, top_probs_a/b: ``[L, P]`` each run's top-1 token.
        target_ids, target_labels, target_tokens: ``[N]``; target_probs_a/b: ``[L, P, N]``.
        meta: how it was computed.

    >>> res = CompareResult.example()
    >>> res.delta(" z").tolist()
    [[0.25, 0.0]]
    """

    a: str
    b: str
    tokens_a: tuple[str, ...]
    tokens_b: tuple[str, ...]
    layers: np.ndarray
    positions: np.ndarray
    js: np.ndarray
    top_ids_a: np.ndarray
    top_ids_b: np.ndarray
    top_tokens_a: tuple[str, ...]
    top_tokens_b: tuple[str, ...]
    top_probs_a: np.ndarray
    top_probs_b: np.ndarray
    target_ids: np.ndarray
    target_labels: tuple[str, ...]
    target_tokens: tuple[str, ...]
    target_probs_a: np.ndarray
    target_probs_b: np.ndarray
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, dtype in _ARRAYS.items():
            array = np.array(getattr(self, name), dtype=dtype)
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        for name in _TEXTS:
            object.__setattr__(self, name, tuple(str(item) for item in _flat(getattr(self, name))))
        n_l, n_p, n_t = len(self.layers), len(self.positions), len(self.target_ids)
        if n_l == 0 or n_p == 0:
            raise ValueError("a CompareResult needs at least one layer and one position")
        shapes = {
            "js": (n_l, n_p),
            "top_ids_a": (n_l, n_p),
            "top_ids_b": (n_l, n_p),
            "top_probs_a": (n_l, n_p),
            "top_probs_b": (n_l, n_p),
            "target_probs_a": (n_l, n_p, n_t),
            "target_probs_b": (n_l, n_p, n_t),
        }
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"CompareResult.{name} has shape {getattr(self, name).shape}")
        sizes = {
            "tokens_a": n_p,
            "tokens_b": n_p,
            "top_tokens_a": n_l * n_p,
            "top_tokens_b": n_l * n_p,
            "target_labels": n_t,
            "target_tokens": n_t,
        }
        for name, size in sizes.items():
            if len(getattr(self, name)) != size:
                raise ValueError(f"CompareResult.{name} has {len(getattr(self, name))} entries")
        if np.any(self.js < -1e-9) or np.any(self.js > np.log(2) + 1e-6):
            raise ValueError("CompareResult.js must lie in [0, ln 2]")
        object.__setattr__(self, "meta", freeze_json(self.meta, "CompareResult.meta"))

    @property
    def layer_labels(self) -> list[str]:
        return ["embed" if layer == 0 else str(int(layer)) for layer in self.layers]

    def top_token(self, run: str, layer_index: int, position_index: int) -> str:
        """Run ``"a"`` or ``"b"``'s top-1 token at a cell (by index)."""
        tokens = self.top_tokens_a if run == "a" else self.top_tokens_b
        return tokens[layer_index * len(self.positions) + position_index]

    def delta(self, target: str | int) -> np.ndarray:
        """``[L, P]`` change in a target's probability, b minus a."""
        for i, (label, token, tid) in enumerate(
            zip(self.target_labels, self.target_tokens, self.target_ids)
        ):
            if target in (label, token) or (isinstance(target, int) and target == int(tid)):
                return self.target_probs_b[..., i] - self.target_probs_a[..., i]
        raise KeyError(f"{target!r} is not a target here: targets are {self.target_labels}")

    def to_pandas(self) -> Any:
        """One row per (layer, position): JS, both top-1 tokens, each target's change."""
        import pandas as pd

        li, pi = np.meshgrid(
            np.arange(len(self.layers)), np.arange(len(self.positions)), indexing="ij"
        )
        li, pi = li.ravel(), pi.ravel()
        frame = pd.DataFrame(
            {
                "layer": self.layers[li],
                "position": self.positions[pi],
                "token_a": np.array(self.tokens_a, dtype=object)[pi],
                "token_b": np.array(self.tokens_b, dtype=object)[pi],
                "js": self.js[li, pi],
                "top_a": np.array(self.top_tokens_a, dtype=object),
                "top_b": np.array(self.top_tokens_b, dtype=object),
                "top_prob_a": self.top_probs_a[li, pi],
                "top_prob_b": self.top_probs_b[li, pi],
            }
        )
        for i, label in enumerate(self.target_labels):
            frame[f"delta_prob[{label}]"] = (self.target_probs_b - self.target_probs_a)[li, pi, i]
        return frame

    def __repr__(self) -> str:
        return (
            f"CompareResult(a={self.a!r}, b={self.b!r}, layers={len(self.layers)}, "
            f"positions={len(self.positions)}, max JS={float(self.js.max()):.3g})"
        )

    @classmethod
    def example(cls) -> CompareResult:
        """A small hand-made result (one layer, two positions, one target)."""
        return cls(
            a="run a",
            b="run b",
            tokens_a=("a", " b"),
            tokens_b=("a", " c"),
            layers=np.array([1]),
            positions=np.array([0, 1]),
            js=np.array([[0.1, 0.0]]),
            top_ids_a=np.array([[3, 4]]),
            top_ids_b=np.array([[3, 4]]),
            top_tokens_a=(" z", " w"),
            top_tokens_b=(" z", " w"),
            top_probs_a=np.array([[0.5, 0.5]]),
            top_probs_b=np.array([[0.75, 0.5]]),
            target_ids=np.array([3]),
            target_labels=(" z",),
            target_tokens=(" z",),
            target_probs_a=np.array([[[0.5], [0.25]]]),
            target_probs_b=np.array([[[0.75], [0.25]]]),
        )


def _flat(value: Any) -> list:
    return (
        np.asarray(value, dtype=object).ravel().tolist() if not isinstance(value, str) else [value]
    )
