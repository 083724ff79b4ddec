"""`LensResult`: the statistic a logit lens produces — labelled, validated, immutable.

Plots and widgets read only this; tests check this. Every transform returns a new instance
(``res.select(layers=[1, 2]).stride(2)``), and the arrays are checked against each other on
construction, so an inconsistent result cannot exist.
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.errors import InvalidRequest


@dataclass(frozen=True)
class TargetTrace:
    """One target token across the lens: ``prob`` and ``rank`` are ``[layers, positions]``.

    ``rank`` 0 means the target is the most likely token at that cell.
    """

    label: str
    token_id: int
    token: str
    prob: np.ndarray
    rank: np.ndarray


@dataclass(frozen=True, eq=False)
class LensResult:
    """A logit lens of one prompt.

    Layer 0 is the embedding output, layer ``i`` the residual stream after decoder layer
    ``i`` (so the last layer is ``n_layers``). Shapes: ``L`` layers, ``P`` positions, ``k``
    top tokens, ``N`` targets.

    Attributes:
        prompt: the prompt text.
        token_ids: ``[P]`` the input token at each position.
        tokens: ``[P]`` decoded tokens, made distinct (``"the#5"``) where one repeats.
        positions: ``[P]`` index of each position in the sequence.
        layers: ``[L]`` layer numbers (0 = embedding).
        top_ids: ``[L, P, k]`` the k most likely next tokens, most likely first.
        top_tokens: ``[L, P, k]`` those tokens, decoded.
        top_probs: ``[L, P, k]`` their probabilities.
        entropy: ``[L, P]`` entropy of the next-token distribution, in nats.
        kl: ``[L, P]`` KL(final layer || this layer), in nats.
        target_ids: ``[N]`` target token ids; target_labels: ``[N]`` as the user gave them;
        target_tokens: ``[N]`` decoded.
        target_probs, target_ranks: ``[L, P, N]``.
        n_generated: how many of the last positions are generated tokens.
        meta: model name, TP size, dtype and the like.

    >>> import numpy as np
    >>> res = LensResult.example()
    >>> res.top_probs.shape, res.stride(2).layers.tolist()
    ((3, 2, 2), [0, 2])
    """

    prompt: str
    token_ids: np.ndarray
    tokens: tuple[str, ...]
    positions: np.ndarray
    layers: np.ndarray
    top_ids: np.ndarray
    top_tokens: np.ndarray
    top_probs: np.ndarray
    entropy: np.ndarray
    kl: np.ndarray
    target_ids: np.ndarray
    target_labels: tuple[str, ...]
    target_tokens: tuple[str, ...]
    target_probs: np.ndarray
    target_ranks: np.ndarray
    n_generated: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n_layers, n_pos = len(self.layers), len(self.positions)
        k = self.top_ids.shape[-1] if self.top_ids.ndim == 3 else -1
        n_targets = len(self.target_ids)
        expected = {
            "token_ids": (n_pos,),
            "top_ids": (n_layers, n_pos, k),
            "top_tokens": (n_layers, n_pos, k),
            "top_probs": (n_layers, n_pos, k),
            "entropy": (n_layers, n_pos),
            "kl": (n_layers, n_pos),
            "target_probs": (n_layers, n_pos, n_targets),
            "target_ranks": (n_layers, n_pos, n_targets),
        }
        for name, shape in expected.items():
            actual = np.shape(getattr(self, name))
            if actual != shape:
                raise ValueError(f"LensResult.{name} has shape {actual}, expected {shape}")
        for name, size in (("tokens", n_pos), ("target_labels", n_targets)):
            if len(getattr(self, name)) != size:
                raise ValueError(f"LensResult.{name} has {len(getattr(self, name))} entries")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("LensResult.tokens must be distinct labels")
        if not 0 <= self.n_generated <= n_pos:
            raise ValueError(f"n_generated={self.n_generated} outside 0..{n_pos}")
        if n_layers == 0 or n_pos == 0:
            raise ValueError("a LensResult needs at least one layer and one position")

    # -- reading ---------------------------------------------------------------------------

    @property
    def layer_labels(self) -> list[str]:
        return ["embed" if layer == 0 else str(int(layer)) for layer in self.layers]

    def target(self, which: str | int) -> TargetTrace:
        """The trace of one target, by the label it was asked with, its token text or its id."""
        for i, (label, token, tid) in enumerate(
            zip(self.target_labels, self.target_tokens, self.target_ids)
        ):
            if which in (label, token) or (isinstance(which, int) and which == int(tid)):
                return TargetTrace(
                    label, int(tid), token, self.target_probs[..., i], self.target_ranks[..., i]
                )
        raise KeyError(f"{which!r} is not a target of this lens: targets are {self.target_labels}")

    def top1(self, position: int = -1) -> list[tuple[int, str, float]]:
        """``(layer, token, probability)`` of the most likely token per layer at a position."""
        return [
            (
                int(layer),
                str(self.top_tokens[i, position, 0]),
                float(self.top_probs[i, position, 0]),
            )
            for i, layer in enumerate(self.layers)
        ]

    # -- transforms ------------------------------------------------------------------------

    def select(
        self, layers: Sequence[int] | None = None, positions: Sequence[int] | None = None
    ) -> LensResult:
        """A result restricted to some layers (by layer number) and positions (by index)."""
        layer_idx = np.arange(len(self.layers))
        if layers is not None:
            wanted = list(layers)
            missing = [layer for layer in wanted if layer not in self.layers]
            if missing:
                raise KeyError(f"layers {missing} are not in this result: {self.layers.tolist()}")
            layer_idx = np.array([int(np.flatnonzero(self.layers == w)[0]) for w in wanted])
        pos_idx = np.arange(len(self.positions))
        if positions is not None:
            pos_idx = np.arange(len(self.positions))[list(positions)]
        n_prompt = len(self.positions) - self.n_generated
        return dataclasses.replace(
            self,
            token_ids=self.token_ids[pos_idx],
            tokens=tuple(self.tokens[i] for i in pos_idx),
            positions=self.positions[pos_idx],
            layers=self.layers[layer_idx],
            n_generated=int((pos_idx >= n_prompt).sum()),
            **{name: getattr(self, name)[np.ix_(layer_idx, pos_idx)] for name in _GRID_FIELDS},
        )

    def stride(self, n: int) -> LensResult:
        """Every ``n``-th layer, always keeping the last (where the prediction is made)."""
        if n < 1:
            raise InvalidRequest(f"stride must be at least 1, not {n}")
        keep = list(range(0, len(self.layers), n))
        if keep[-1] != len(self.layers) - 1:
            keep.append(len(self.layers) - 1)
        return self.select(layers=[int(self.layers[i]) for i in keep])

    # -- export ----------------------------------------------------------------------------

    def to_pandas(self) -> Any:
        """Long format: one row per (layer, position, rank) with that cell's statistics."""
        import pandas as pd

        n_layers, n_pos, k = self.top_ids.shape
        li, pi, ri = np.meshgrid(np.arange(n_layers), np.arange(n_pos), np.arange(k), indexing="ij")
        frame = pd.DataFrame(
            {
                "layer": self.layers[li.ravel()],
                "position": self.positions[pi.ravel()],
                "input_token": np.array(self.tokens, dtype=object)[pi.ravel()],
                "rank": ri.ravel(),
                "token_id": self.top_ids.ravel(),
                "token": self.top_tokens.ravel(),
                "prob": self.top_probs.ravel(),
                "entropy": self.entropy[li.ravel(), pi.ravel()],
                "kl": self.kl[li.ravel(), pi.ravel()],
            }
        )
        for i, label in enumerate(self.target_labels):
            frame[f"target_prob[{label}]"] = self.target_probs[li.ravel(), pi.ravel(), i]
            frame[f"target_rank[{label}]"] = self.target_ranks[li.ravel(), pi.ravel(), i]
        return frame

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
        return out

    def to_json(self, path: str | None = None) -> str:
        """The result as JSON (exact: float32 values survive the round trip bit for bit)."""
        text = json.dumps(self.to_dict())
        if path is not None:
            with open(path, "w") as handle:
                handle.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LensResult:
        kwargs = dict(data)
        for name, dtype in _ARRAY_FIELDS.items():
            kwargs[name] = np.asarray(kwargs[name], dtype=dtype)
        for name in ("tokens", "target_labels", "target_tokens"):
            kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text_or_path: str) -> LensResult:
        """Read what `to_json` wrote: the JSON text itself, or the path of a file holding it."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path) as handle:
                text = handle.read()
        return cls.from_dict(json.loads(text))

    def plot(self, metric: str = "prob", **kwargs: Any) -> Any:
        """The heatmap of this result (see `envoykit.plot.heatmap`)."""
        from envoykit import plot

        return plot.heatmap(self, metric, **kwargs)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{'embed' if layer == 0 else layer}</td><td><code>{html.escape(repr(tok))}"
            f"</code></td><td>{prob:.3f}</td></tr>"
            for layer, tok, prob in self.top1(-1)
        )
        where = html.escape(repr(self.tokens[-1]))
        return (
            f"<div><b>Logit lens</b> of {html.escape(repr(self.prompt))} — top-1 per layer at "
            f"the last position ({where})<table><tr><th>layer</th><th>top-1</th><th>p</th></tr>"
            f"{rows}</table></div>"
        )

    def __repr__(self) -> str:
        return (
            f"LensResult(prompt={self.prompt!r}, layers={len(self.layers)}, "
            f"positions={len(self.positions)}, k={self.top_ids.shape[-1]}, "
            f"targets={list(self.target_labels)})"
        )

    @classmethod
    def example(cls) -> LensResult:
        """A small hand-made result (3 layers, 2 positions, k=2) for docs and tests."""
        probs = np.array(
            [[[0.5, 0.2], [0.4, 0.3]], [[0.6, 0.1], [0.5, 0.2]], [[0.9, 0.05], [0.7, 0.1]]]
        )
        return cls(
            prompt="a b",
            token_ids=np.array([5, 6]),
            tokens=("a", " b"),
            positions=np.array([0, 1]),
            layers=np.array([0, 1, 2]),
            top_ids=np.array([[[1, 2], [3, 4]]] * 3),
            top_tokens=np.array([[["x", "y"], ["z", "w"]]] * 3, dtype=object),
            top_probs=probs.astype(np.float32),
            entropy=np.ones((3, 2), dtype=np.float32),
            kl=np.array([[0.5, 0.4], [0.2, 0.1], [0.0, 0.0]], dtype=np.float32),
            target_ids=np.array([3]),
            target_labels=(" z",),
            target_tokens=(" z",),
            target_probs=np.full((3, 2, 1), 0.1, dtype=np.float32),
            target_ranks=np.zeros((3, 2, 1), dtype=np.int64),
        )


_GRID_FIELDS = (
    "top_ids",
    "top_tokens",
    "top_probs",
    "entropy",
    "kl",
    "target_probs",
    "target_ranks",
)
_ARRAY_FIELDS = {
    "token_ids": np.int64,
    "positions": np.int64,
    "layers": np.int64,
    "top_ids": np.int64,
    "top_tokens": object,
    "top_probs": np.float32,
    "entropy": np.float32,
    "kl": np.float32,
    "target_ids": np.int64,
    "target_probs": np.float32,
    "target_ranks": np.int64,
}
