"""A tuned lens against the logit lens, layer by layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from envoykit.results.tuned import LensQuality


def lens_quality(quality: LensQuality, *, ax: Any = None) -> Any:
    """Mean KL(final || layer) per layer for the logit lens and the tuned lens on held-out
    text (log scale): the tuned-lens paper's headline figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    labels = ["embed" if layer == 0 else str(int(layer)) for layer in quality.layers]
    x = np.arange(len(labels))
    ax.plot(x, quality.logit_kl, marker="o", label="logit lens")
    ax.plot(x, quality.tuned_kl, marker="o", label="tuned lens")
    ax.set_yscale("log")
    step = max(1, len(labels) // 15)
    ax.set_xticks(x[::step], labels[::step], fontsize=8)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean KL(final || layer) (nats)")
    ax.set_title(
        f"lens quality on {quality.tokens} held-out tokens: tuned lens closer at "
        f"{quality.better:.0%} of layers",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure
