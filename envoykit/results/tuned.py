"""How well a tuned lens does against the logit lens on held-out text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LensQuality:
    """Per lens layer, the mean KL(final || layer) in nats of the logit and the tuned lens on
    held-out text (the tuned-lens paper's headline figure)."""

    layers: np.ndarray
    logit_kl: np.ndarray
    tuned_kl: np.ndarray
    tokens: int

    def to_pandas(self) -> Any:
        import pandas as pd

        return pd.DataFrame(
            {"layer": self.layers, "logit_kl": self.logit_kl, "tuned_kl": self.tuned_kl}
        )

    @property
    def better(self) -> float:
        """The share of layers where the tuned lens is closer to the final distribution."""
        return float(np.mean(self.tuned_kl < self.logit_kl))
