"""Steering results: a steering vector, a (steered) generation, and a sweep of strengths.

Immutable and validated like every result; plots read only these. A `SteeringVector` is
saved as safetensors whose metadata carry the model's fingerprint (name, shape and a hash of
its unembedding), so a vector is never silently added to another model's stream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envoykit.errors import InvalidRequest
from envoykit.results import safetensors_file
from envoykit.results.base import Result, freeze_json, frozen_array, thaw


@dataclass(frozen=True, eq=False)
class SteeringVector(Result):
    """A direction in one model's residual stream: ``mean(positive) - mean(negative)`` of
    the stream at (``layer``, ``site``), at token ``position`` of each prompt (None: the
    mean over its positions).

    ``model`` is the model's fingerprint (`EngineBase.fingerprint`); a `Steer`
    built on this vector is refused by an engine of another model. ``vector`` is float32
    ``[d_model]``.
    """

    vector: np.ndarray
    layer: int
    site: str
    position: int | None
    positive: tuple[str, ...]
    negative: tuple[str, ...]
    model: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        vector = frozen_array("SteeringVector", "vector", self.vector, np.float32)
        if vector.ndim != 1 or not np.isfinite(vector).all():
            raise ValueError("SteeringVector.vector is one finite [d_model] row")
        object.__setattr__(self, "vector", vector)
        object.__setattr__(self, "layer", int(self.layer))
        for name in ("positive", "negative"):
            object.__setattr__(self, name, tuple(str(p) for p in getattr(self, name)))
        object.__setattr__(self, "model", freeze_json(self.model, "SteeringVector.model"))
        object.__setattr__(self, "meta", freeze_json(self.meta, "SteeringVector.meta"))

    @property
    def norm(self) -> float:
        return float(np.linalg.norm(self.vector.astype(np.float64)))

    @property
    def label(self) -> str:
        """How results name this vector: its prompt counts, layer and site."""
        return (
            f"{len(self.positive)} vs {len(self.negative)} prompts at layer {self.layer} "
            f"{self.site}"
        )

    def __repr__(self) -> str:
        return f"SteeringVector({self.model.get('name')!r}, {self.label}, norm {self.norm:.4g})"

    def save(self, path: str | Path) -> Path:
        """``path`` (safetensors): the vector, and in its metadata everything else."""
        import torch
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = self.to_dict()
        del fields["vector"]
        save_file(
            {"vector": torch.from_numpy(np.array(self.vector))},
            str(path),
            metadata={"envoykit.steering": json.dumps(fields)},
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> SteeringVector:
        """Read what `save` wrote (an engine checks the model when the vector is used)."""
        path = Path(path)
        if not path.is_file():
            raise InvalidRequest(
                f"no steering vector at {path}: build one with engine.steering_vector"
            )
        tensors, fields = safetensors_file.read(
            path, "envoykit.steering", "a steering vector saved by envoykit"
        )
        return cls(vector=tensors["vector"].numpy(), **fields)


class Generation(str):
    """A greedy continuation: the text itself (a ``str``), with its ``token_ids`` (the stop
    token included, as vLLM gives them) and ``meta`` (``meta["steer"]``: the steers it ran
    under, if any)."""

    token_ids: tuple[int, ...]
    meta: Mapping[str, Any]

    def __new__(
        cls, text: str, token_ids: Any = (), meta: Mapping[str, Any] | None = None
    ) -> Generation:
        generation = super().__new__(cls, text)
        generation.token_ids = tuple(int(i) for i in token_ids)
        generation.meta = freeze_json(dict(meta or {}), "Generation.meta")
        return generation

    def __reduce__(self) -> tuple:
        return (Generation, (str(self), self.token_ids, thaw(self.meta)))

    def to_dict(self) -> dict[str, Any]:
        return {"text": str(self), "token_ids": list(self.token_ids), "meta": thaw(self.meta)}


@dataclass(frozen=True, eq=False)
class SteerSweepResult(Result):
    """One steer at several strengths: per scale the greedy continuation, and the lens at
    the prompt's last position at every layer, after steering.

    Shapes: ``S`` scales, ``L`` layers (0 = embedding), ``N`` targets.

    Attributes:
        prompt: the prompt; scales: ``[S]``.
        texts, token_ids: ``[S]`` each scale's continuation and its token ids.
        layers: ``[L]``; target_labels: ``[N]`` as given; target_tokens: ``[N]`` decoded.
        target_probs: ``[S, L, N]`` each target's lens probability at the last position.
        top_tokens: ``[S, L]`` the lens's most likely token there.
        meta: model, TP size, dtype, and ``steer`` (the steer at scale 1).

    >>> res = SteerSweepResult.example()
    >>> res.target_probs.shape, res.text(0.0)
    ((3, 2, 1), ' okay')
    """

    prompt: str
    scales: np.ndarray
    texts: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    layers: np.ndarray
    target_labels: tuple[str, ...]
    target_tokens: tuple[str, ...]
    target_probs: np.ndarray
    top_tokens: np.ndarray
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        scales = frozen_array("SteerSweepResult", "scales", self.scales, np.float64)
        layers = frozen_array("SteerSweepResult", "layers", self.layers, np.int64)
        s, n_layers = len(scales), len(layers)
        labels, tokens = tuple(self.target_labels), tuple(self.target_tokens)
        if s == 0 or n_layers == 0 or len(labels) != len(tokens):
            raise ValueError("SteerSweepResult needs scales, layers and one token per target")
        probs = frozen_array(
            "SteerSweepResult",
            "target_probs",
            self.target_probs,
            np.float32,
            (s, n_layers, len(labels)),
        )
        if not np.all((probs >= -1e-5) & (probs <= 1 + 1e-5)):
            raise ValueError("SteerSweepResult: probabilities must lie in [0, 1]")
        top = frozen_array("SteerSweepResult", "top_tokens", self.top_tokens, object, (s, n_layers))
        if len(tuple(self.texts)) != s or len(tuple(self.token_ids)) != s:
            raise ValueError("SteerSweepResult has one text and one id list per scale")
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "target_probs", probs)
        object.__setattr__(self, "top_tokens", top)
        object.__setattr__(self, "texts", tuple(str(t) for t in self.texts))
        object.__setattr__(
            self, "token_ids", tuple(tuple(int(i) for i in ids) for ids in self.token_ids)
        )
        object.__setattr__(self, "target_labels", labels)
        object.__setattr__(self, "target_tokens", tokens)
        object.__setattr__(self, "meta", freeze_json(self.meta, "SteerSweepResult.meta"))

    @property
    def layer_labels(self) -> list[str]:
        return ["embed" if layer == 0 else str(int(layer)) for layer in self.layers]

    def _scale_index(self, scale: float) -> int:
        found = np.flatnonzero(np.isclose(self.scales, scale))
        if not len(found):
            raise KeyError(f"scale {scale} was not swept (scales: {self.scales.tolist()})")
        return int(found[0])

    def text(self, scale: float) -> str:
        """The continuation at ``scale``."""
        return self.texts[self._scale_index(scale)]

    def target(self, label: str | int) -> np.ndarray:
        """``[S, L]`` one target's probability (by its label, token or index)."""
        if isinstance(label, int):
            return self.target_probs[:, :, label]
        for names in (self.target_labels, self.target_tokens):
            if label in names:
                return self.target_probs[:, :, names.index(label)]
        raise KeyError(f"{label!r} is not a target of this sweep: {list(self.target_labels)}")

    def to_pandas(self) -> Any:
        """One row per (scale, layer, target): the probability, the layer's top token, and
        the scale's continuation."""
        import pandas as pd

        si, li, ti = (i.ravel() for i in np.indices(self.target_probs.shape))
        return pd.DataFrame(
            {
                "scale": self.scales[si],
                "layer": self.layers[li],
                "target": [self.target_labels[t] for t in ti],
                "prob": self.target_probs[si, li, ti],
                "top_token": self.top_tokens[si, li],
                "text": [self.texts[s] for s in si],
            }
        )

    @classmethod
    def example(cls) -> SteerSweepResult:
        """A small valid sweep, for docs and tests of code that only reads results."""
        return cls(
            prompt="I think this movie is",
            scales=np.array([-4.0, 0.0, 4.0]),
            texts=(" awful", " okay", " great"),
            token_ids=((1,), (2,), (3,)),
            layers=np.array([1, 2]),
            target_labels=(" great",),
            target_tokens=(" great",),
            target_probs=np.array([[[0.01], [0.02]], [[0.05], [0.1]], [[0.2], [0.6]]]),
            top_tokens=np.array(
                [[" bad", " awful"], [" a", " okay"], [" a", " great"]], dtype=object
            ),
            meta={"model": "demo", "tp": 1},
        )
