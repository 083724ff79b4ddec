"""How well a tuned lens does against the logit lens on held-out text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envoykit.results.base import Result, frozen_array


@dataclass(frozen=True)
class LensQuality(Result):
    """Per lens layer, the mean KL(final || layer) in nats of the logit and the tuned lens on
    held-out text (the tuned-lens paper's headline figure)."""

    layers: np.ndarray
    logit_kl: np.ndarray
    tuned_kl: np.ndarray
    tokens: int

    def __post_init__(self) -> None:
        n = len(np.asarray(self.layers))
        for name, dtype in (
            ("layers", np.int64),
            ("logit_kl", np.float64),
            ("tuned_kl", np.float64),
        ):
            value = frozen_array("LensQuality", name, getattr(self, name), dtype, (n,))
            object.__setattr__(self, name, value)
        object.__setattr__(self, "tokens", int(self.tokens))

    def to_pandas(self) -> Any:
        import pandas as pd

        return pd.DataFrame(
            {"layer": self.layers, "logit_kl": self.logit_kl, "tuned_kl": self.tuned_kl}
        )

    @property
    def better(self) -> float:
        """The share of layers where the tuned lens is closer to the final distribution."""
        return float(np.mean(self.tuned_kl < self.logit_kl))
