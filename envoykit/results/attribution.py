"""`AttributionResult`: direct logit attribution of one prompt — labelled, validated, immutable.

Plots and widgets read only this. Components are the pieces the final residual stream is the
sum of: the embedding, then each decoder layer's attention and MLP writes, numbered like the
lens's layers (``"attn 12"`` is the block whose write the lens row ``"12.attn"`` shows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.results.base import Result, freeze_json, frozen_array

# How far the contributions' sum may fall from the logit, relative to the sum of their
# magnitudes: float32 rounding of a sum of a few dozen terms, with room for bfloat16 engines.
SUM_TOLERANCE = 1e-3


@dataclass(frozen=True, eq=False)
class AttributionResult(Result):
    """How much each component writes into each target's final logit, at each position.

    Shapes: ``C`` components, ``P`` positions, ``N`` targets.

    Attributes:
        prompt: the prompt text.
        token_ids, tokens, positions: ``[P]`` input tokens (as they are) and their
            places in the sequence.
        components: ``[C]`` ``"embed"``, ``"attn 1"``, ``"mlp 1"``, …, ``"mlp n"``, and
            ``"bias"`` where the final norm (a LayerNorm) or the LM head adds a constant.
        target_ids, target_labels, target_tokens: ``[N]`` the targets.
        values: ``[C, P, N]`` each component's contribution: the component through the final
            norm with the norm's scale frozen at its value on the final stream, dotted with
            the target's unembedding row (times the logit scale).
        logits: ``[P, N]`` the logit the values add up to: the model's own, before any
            soft-cap. ``values.sum(0) == logits`` within float32 rounding.
        model_logits: ``[P, N]`` the logit the model samples from (soft-capped where the
            model caps: ``c * tanh(logits / c)`` with ``c = meta["soft_cap"]``).
        head_values: ``[n_layers, heads, P, N]`` (``attribute(..., heads=True)``; else None)
            each layer's attention contribution split into its heads: a head's slice of the
            output projection's input through its slice of the weight, on the same
            directions as ``values``.
        head_bias: ``[n_layers, P, N]`` what the output projection's bias adds (zero without
            one): ``head_values[l].sum(0) + head_bias[l]`` equals the ``"attn l"`` row of
            ``values`` within float32 rounding.
        meta: model name, TP size, dtype, soft-cap and logit scale.

    >>> res = AttributionResult.example()
    >>> bool(np.allclose(res.values.sum(0), res.logits))
    True
    """

    prompt: str
    token_ids: np.ndarray
    tokens: tuple[str, ...]
    positions: np.ndarray
    components: tuple[str, ...]
    target_ids: np.ndarray
    target_labels: tuple[str, ...]
    target_tokens: tuple[str, ...]
    values: np.ndarray
    logits: np.ndarray
    model_logits: np.ndarray
    meta: Mapping[str, Any] = field(default_factory=dict)
    head_values: np.ndarray | None = None
    head_bias: np.ndarray | None = None

    def __post_init__(self) -> None:
        n_comp, n_pos, n_targets = len(self.components), len(self.positions), len(self.target_ids)
        if n_comp == 0 or n_pos == 0 or n_targets == 0:
            raise ValueError("an AttributionResult needs components, positions and targets")
        arrays = {
            "token_ids": (self.token_ids, np.int64, (n_pos,)),
            "positions": (self.positions, np.int64, (n_pos,)),
            "target_ids": (self.target_ids, np.int64, (n_targets,)),
            "values": (self.values, np.float32, (n_comp, n_pos, n_targets)),
            "logits": (self.logits, np.float32, (n_pos, n_targets)),
            "model_logits": (self.model_logits, np.float32, (n_pos, n_targets)),
        }
        for name, (value, dtype, shape) in arrays.items():
            array = np.array(value, dtype=dtype)
            if array.shape != shape:
                raise ValueError(f"AttributionResult.{name} has shape {array.shape}, not {shape}")
            if dtype == np.int64 and array.size and array.min() < 0:
                raise ValueError(f"AttributionResult.{name} holds negative ids or positions")
            if dtype == np.float32 and not np.isfinite(array).all():
                raise ValueError(f"AttributionResult.{name} holds NaN or infinite values")
            array.flags.writeable = False
            object.__setattr__(self, name, array)
        for name, size in (
            ("tokens", n_pos),
            ("target_labels", n_targets),
            ("target_tokens", n_targets),
        ):
            entries = tuple(getattr(self, name))
            if len(entries) != size:
                raise ValueError(f"AttributionResult.{name} has {len(entries)} entries, not {size}")
            object.__setattr__(self, name, entries)
        object.__setattr__(self, "components", tuple(self.components))
        object.__setattr__(self, "meta", freeze_json(self.meta, "AttributionResult.meta"))
        self._check_sum()
        if (self.head_values is None) != (self.head_bias is None):
            raise ValueError("AttributionResult.head_values and head_bias come together")
        if self.head_values is not None:
            self._check_heads()

    def _check_heads(self) -> None:
        """The heads of a layer, with the projection's bias, add up to its attention row."""
        attn = [i for i, kind in enumerate(self.component_kinds) if kind == "attn"]
        n_layers, n_pos, n_targets = len(attn), len(self.positions), len(self.target_ids)
        heads = frozen_array("AttributionResult", "head_values", self.head_values, np.float32)
        if heads.ndim != 4 or heads.shape[0] != n_layers or heads.shape[2:] != (n_pos, n_targets):
            raise ValueError(
                f"AttributionResult.head_values has shape {heads.shape}, not "
                f"({n_layers}, heads, {n_pos}, {n_targets})"
            )
        bias = frozen_array(
            "AttributionResult",
            "head_bias",
            self.head_bias,
            np.float32,
            (n_layers, n_pos, n_targets),
        )
        summed = heads.astype(np.float64).sum(1) + bias
        layer_rows = self.values[attn].astype(np.float64)
        allowed = SUM_TOLERANCE * (np.abs(heads).astype(np.float64).sum(1) + np.abs(bias) + 1.0)
        if (np.abs(summed - layer_rows) > allowed).any():
            layer = int(np.argwhere(np.abs(summed - layer_rows) > allowed)[0][0]) + 1
            raise ValueError(
                f"AttributionResult.head_values of layer {layer} do not add up to its "
                "attention contribution"
            )
        object.__setattr__(self, "head_values", heads)
        object.__setattr__(self, "head_bias", bias)

    def head(self, layer: int, target: str | int) -> np.ndarray:
        """``[heads, P]`` the heads of decoder layer ``layer`` (1-based), for one target."""
        if self.head_values is None:
            raise KeyError("no per-head values here: attribute(..., heads=True) gives them")
        return self.head_values[layer - 1, :, :, self.target_index(target)]

    def _check_sum(self) -> None:
        """The headline invariant: the contributions add up to the logit."""
        gap = np.abs(self.values.astype(np.float64).sum(0) - self.logits)
        allowed = SUM_TOLERANCE * (np.abs(self.values).astype(np.float64).sum(0) + 1.0)
        if (gap > allowed).any():
            p, n = (int(i) for i in np.argwhere(gap > allowed)[0])
            total, logit = float(self.values[:, p, n].sum()), float(self.logits[p, n])
            raise ValueError(
                f"AttributionResult.values do not add up to the logits: at position index {p}, "
                f"target {self.target_labels[n]!r} they sum to {total:.6g}, the logit is "
                f"{logit:.6g}"
            )

    # -- reading ---------------------------------------------------------------------------

    def target_index(self, which: str | int) -> int:
        """A target's index, by the label it was asked with, its token text or its id."""
        for i, (label, token, tid) in enumerate(
            zip(self.target_labels, self.target_tokens, self.target_ids)
        ):
            if which in (label, token) or (isinstance(which, int) and which == int(tid)):
                return i
        raise KeyError(f"{which!r} is not a target here: targets are {self.target_labels}")

    def of(self, target: str | int) -> np.ndarray:
        """``[C, P]`` contributions to one target's logit."""
        return self.values[:, :, self.target_index(target)]

    def diff(self, a: str | int, b: str | int) -> np.ndarray:
        """``[C, P]`` contributions to the logit difference ``logit(a) - logit(b)``."""
        return self.of(a) - self.of(b)

    @property
    def component_layers(self) -> np.ndarray:
        """``[C]`` the lens layer of each component (0 for the embedding; the bias, added
        after the last layer, one past it)."""
        last = max((int(c.split()[1]) for c in self.components if " " in c), default=0)
        return np.array(
            [
                0 if c == "embed" else last + 1 if c == "bias" else int(c.split()[1])
                for c in self.components
            ]
        )

    @property
    def component_kinds(self) -> tuple[str, ...]:
        """``[C]`` ``"embed"``, ``"attn"``, ``"mlp"`` or ``"bias"``."""
        return tuple(c.split()[0] for c in self.components)

    # -- export ----------------------------------------------------------------------------

    def to_pandas(self) -> Any:
        """Long format: one row per (component, position, target)."""
        import pandas as pd

        c, p, n = np.meshgrid(*(np.arange(s) for s in self.values.shape), indexing="ij")
        c, p, n = c.ravel(), p.ravel(), n.ravel()
        return pd.DataFrame(
            {
                "component": np.array(self.components, dtype=object)[c],
                "kind": np.array(self.component_kinds, dtype=object)[c],
                "layer": self.component_layers[c],
                "position": self.positions[p],
                "input_token": np.array(self.tokens, dtype=object)[p],
                "target": np.array(self.target_labels, dtype=object)[n],
                "value": self.values[c, p, n],
                "logit": self.logits[p, n],
            }
        )

    def __repr__(self) -> str:
        return (
            f"AttributionResult(prompt={self.prompt!r}, components={len(self.components)}, "
            f"positions={len(self.positions)}, targets={list(self.target_labels)})"
        )

    @classmethod
    def example(cls) -> AttributionResult:
        """A small hand-made result (one layer, two positions, one target) for docs and tests."""
        values = np.array([[[0.5], [1.0]], [[2.0], [-1.0]], [[0.25], [3.0]]], dtype=np.float32)
        return cls(
            prompt="a b",
            token_ids=np.array([5, 6]),
            tokens=("a", " b"),
            positions=np.array([0, 1]),
            components=("embed", "attn 1", "mlp 1"),
            target_ids=np.array([3]),
            target_labels=(" z",),
            target_tokens=(" z",),
            values=values,
            logits=values.sum(0),
            model_logits=values.sum(0),
        )
