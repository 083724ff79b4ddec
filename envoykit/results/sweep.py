"""`SweepResult`: a causal-tracing map — a metric after patching each (layer, position).

Immutable and validated like `LensResult`; plots read only this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.results.base import Result, freeze_json

METRICS = {"prob": "p({target})", "logit_diff": "logit({target}) - logit({other})"}


@dataclass(frozen=True, eq=False)
class SweepResult(Result):
    """The target's next-token metric after copying the source's stream at each cell.

    Shapes: ``L`` layers, ``P`` positions (the same in both prompts, which tokenize to the
    same length).

    Attributes:
        source, target: the two prompts.
        tokens, source_tokens: ``[P]`` the target's and the source's tokens at each position.
        layers: ``[L]`` layer numbers (0 = embedding) as in `Engine.lens`; site: where in
            the layer the stream was copied.
        positions: ``[P]`` token positions.
        metric: "prob" (the target token's probability at the last position) or
            "logit_diff" (its logit minus the other token's).
        target_token, other_token: decoded tokens the metric is about (other: or None).
        values: ``[L, P]`` the metric of the target run patched at each cell; ``[L, H]`` for
            a head sweep (``site == "head"``), each head patched at every position.
        clean: the metric of the target run unpatched; source_value: of the source run.
        meta: model name, TP size, dtype, batch size.
        heads: ``[H]`` the heads of a head sweep (None otherwise).

    >>> res = SweepResult.example()
    >>> res.values.shape, bool(res.effect().max() <= 1.0)
    ((2, 3), True)
    """

    source: str
    target: str
    tokens: tuple[str, ...]
    source_tokens: tuple[str, ...]
    layers: np.ndarray
    positions: np.ndarray
    site: str
    metric: str
    target_token: str
    other_token: str | None
    values: np.ndarray
    clean: float
    source_value: float
    meta: Mapping[str, Any] = field(default_factory=dict)
    heads: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"SweepResult.metric is one of {list(METRICS)}, not {self.metric!r}")
        if (self.metric == "logit_diff") != (self.other_token is not None):
            raise ValueError("SweepResult.other_token is given exactly for the logit_diff metric")
        layers = np.array(self.layers, dtype=np.int64)
        positions = np.array(self.positions, dtype=np.int64)
        values = np.array(self.values, dtype=np.float32)
        if (self.site == "head") != (self.heads is not None):
            raise ValueError("SweepResult.heads is given exactly for a head sweep")
        columns = len(positions) if self.heads is None else len(self.heads)
        if values.shape != (len(layers), columns) or values.size == 0:
            raise ValueError(
                f"SweepResult.values has shape {values.shape}, not ({len(layers)}, "
                f"{columns}) (and a sweep has at least one cell)"
            )
        if self.heads is not None:
            heads = np.array(self.heads, dtype=np.int64)
            heads.flags.writeable = False
            object.__setattr__(self, "heads", heads)
        if layers.min() < 0 or positions.min() < 0:
            raise ValueError("SweepResult layers and positions are >= 0")
        if self.metric == "prob" and not (
            np.all((values >= -1e-5) & (values <= 1 + 1e-5))
            and all(-1e-5 <= v <= 1 + 1e-5 for v in (self.clean, self.source_value))
        ):
            raise ValueError("SweepResult: probabilities must lie in [0, 1]")
        for name, value in (("tokens", self.tokens), ("source_tokens", self.source_tokens)):
            if len(tuple(value)) != len(positions):
                raise ValueError(f"SweepResult.{name} has {len(tuple(value))} entries")
            object.__setattr__(self, name, tuple(value))
        for name, array in (("layers", layers), ("positions", positions), ("values", values)):
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        object.__setattr__(self, "clean", float(self.clean))
        object.__setattr__(self, "source_value", float(self.source_value))
        object.__setattr__(self, "meta", freeze_json(self.meta, "SweepResult.meta"))

    @property
    def layer_labels(self) -> list[str]:
        return ["embed" if layer == 0 else str(int(layer)) for layer in self.layers]

    @property
    def label(self) -> str:
        """The metric in words: ``p(' Paris')`` or ``logit(' Paris') - logit(' Rome')``."""
        return METRICS[self.metric].format(
            target=repr(self.target_token), other=repr(self.other_token)
        )

    def effect(self) -> np.ndarray:
        """``[L, P]`` each cell's share of the way from the clean target run to the source
        run: 0 = no effect, 1 = the patch alone restores the source's metric."""
        gap = self.source_value - self.clean
        if gap == 0:
            return np.full(self.values.shape, np.nan, dtype=np.float32)
        return ((self.values - self.clean) / gap).astype(np.float32)

    def to_pandas(self) -> Any:
        """One row per cell: layer, position, tokens, the metric and its normalised effect
        (a head sweep: layer, head, the metric and its effect)."""
        import pandas as pd

        if self.heads is not None:
            li, hi = (i.ravel() for i in np.indices(self.values.shape))
            return pd.DataFrame(
                {
                    "layer": self.layers[li],
                    "site": self.site,
                    "head": self.heads[hi],
                    "metric": self.metric,
                    "value": self.values[li, hi],
                    "effect": self.effect()[li, hi],
                }
            )
        li, pi = np.meshgrid(
            np.arange(len(self.layers)), np.arange(len(self.positions)), indexing="ij"
        )
        li, pi = li.ravel(), pi.ravel()
        return pd.DataFrame(
            {
                "layer": self.layers[li],
                "site": self.site,
                "position": self.positions[pi],
                "target_token": np.array(self.tokens, dtype=object)[pi],
                "source_token": np.array(self.source_tokens, dtype=object)[pi],
                "metric": self.metric,
                "value": self.values[li, pi],
                "effect": self.effect()[li, pi],
            }
        )

    def __repr__(self) -> str:
        return (
            f"SweepResult({self.label} of {self.target!r} patched from {self.source!r}: "
            f"{len(self.layers)} layers x "
            + (
                f"{len(self.positions)} positions)"
                if self.heads is None
                else f"{len(self.heads)} heads)"
            )
        )

    @classmethod
    def example(cls) -> SweepResult:
        """A small hand-made result (2 layers, 3 positions) for docs and tests."""
        return cls(
            source="a b c",
            target="a d c",
            tokens=("a", " d", " c"),
            source_tokens=("a", " b", " c"),
            layers=np.array([1, 2]),
            positions=np.array([0, 1, 2]),
            site="resid",
            metric="prob",
            target_token=" x",
            other_token=None,
            values=np.array([[0.1, 0.7, 0.1], [0.1, 0.2, 0.6]], dtype=np.float32),
            clean=0.1,
            source_value=0.7,
        )
