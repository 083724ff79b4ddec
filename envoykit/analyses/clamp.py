"""`Clamp`: SAE features set to chosen values in the stream, a steer that names features
instead of a vector (`envoykit.ranks.sae` applies it on the ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envoykit.analyses.sae import SAE
from envoykit.errors import InvalidRequest


@dataclass(frozen=True, eq=False)
class Clamp:
    """Set SAE features to values in the stream at the SAE's site: the stream ``x`` becomes
    ``x + (value - a_f) * W_dec[f]`` for each feature ``f`` (``a_f`` its activation there),
    so everything the SAE does not reconstruct stays. ``value=0`` ablates the feature.

    ``feature``: an id or a list of them; ``value``: one number for all, or one per feature.
    ``positions``: token positions of the prompt, or None for every position, generated
    tokens included. Accepted wherever a steer is (``steer=`` of `lens`, `generate`,
    `trace`) and as a ``patch=`` of `lens`.
    """

    sae: SAE
    feature: Any
    value: Any = 0.0
    positions: Any = None

    @property
    def layer(self) -> int:
        return self.sae.layer

    @property
    def site(self) -> str:
        return self.sae.site

    def pairs(self) -> tuple[tuple[int, float], ...]:
        """(feature, value) of each clamped feature, checked."""
        import math

        import numpy as np

        if not isinstance(self.sae, SAE):
            raise InvalidRequest(f"ek.Clamp takes an ek.SAE, not {type(self.sae).__name__}")
        many = isinstance(self.feature, (list, tuple, np.ndarray))
        features = [self.sae.check_feature(f) for f in (self.feature if many else [self.feature])]
        if not features:
            raise InvalidRequest("ek.Clamp names no feature")
        values = (
            list(self.value)
            if isinstance(self.value, (list, tuple, np.ndarray))
            else [self.value] * len(features)
        )
        if len(values) != len(features):
            raise InvalidRequest(
                f"ek.Clamp has {len(features)} features but {len(values)} values: give one "
                "value, or one per feature"
            )
        for value in values:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, np.number))
                or not math.isfinite(value)
            ):
                raise InvalidRequest(f"a clamp's value is a finite number, not {value!r}")
        return tuple((f, float(v)) for f, v in zip(features, values))

    def describe(self) -> dict[str, Any]:
        """What a result's ``meta["steer"]`` records of this clamp."""
        positions = self.positions
        return {
            "clamp": [[f, v] for f, v in self.pairs()],
            "sae": self.sae.key,
            "layer": self.layer,
            "site": self.site,
            "positions": positions
            if positions is None or isinstance(positions, int)
            else [int(p) for p in positions],
        }
