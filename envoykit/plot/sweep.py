"""The causal-tracing map of a patch sweep."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.plot.text import short

if TYPE_CHECKING:
    from envoykit.results.sweep import SweepResult


SCALES = ("fitted", "absolute")


def sweep(res: SweepResult, *, effect: bool = False, scale: str = "fitted", ax: Any = None) -> Any:
    """The causal-tracing map: layers (rows, last on top) x positions (x heads, for a head
    sweep), coloured by the target's metric after patching each cell (``effect=True``: by
    its normalised effect, 0 = the clean target run, 1 = the source run).

    ``scale="fitted"`` (the default) spans the colours over the map's own range, so effects
    of a few hundredths are not one pale colour; ``"absolute"`` spans a probability or an
    effect over 0..1. The colour bar and the title state the range."""
    import matplotlib.pyplot as plt

    if scale not in SCALES:
        raise ValueError(f"scale is one of {SCALES}, not {scale!r}")
    grid = res.effect() if effect else res.values
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.5 + 0.9 * n_pos, 20), min(1.5 + 0.25 * n_layers, 20)))
    vmin, vmax = _limits(grid, scale == "absolute" and (effect or res.metric == "prob"))
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap="Purples", vmin=vmin, vmax=vmax)
    if res.heads is None:
        labels = [
            f"{t!r}" if t == s else f"{s!r}→{t!r}" for s, t in zip(res.source_tokens, res.tokens)
        ]
        ax.set_xticks(range(n_pos), [short(label, 16) for label in labels], rotation=45, ha="right")
        ax.set_xlabel("position patched (source → target token)")
    else:
        ax.set_xticks(range(n_pos), [str(h) for h in res.heads.tolist()], fontsize=8)
        ax.set_xlabel("head patched (its output at every position)")
    step = max(1, n_layers // 15)
    ax.set_yticks(range(0, n_layers, step), res.layer_labels[::step], fontsize=8)
    ax.set_ylabel(f"layer ({res.site})")
    what = "effect" if effect else res.label
    ax.set_title(
        f"patching {res.source!r} into {res.target!r}: {what} "
        f"(clean {res.clean:.3g}, source {res.source_value:.3g}; "
        f"colours {scale} to {vmin:.3g}..{vmax:.3g})",
        fontsize=9,
    )
    ax.figure.colorbar(image, ax=ax, label=what, fraction=0.04)
    ax.figure.tight_layout()
    return ax.figure


def _limits(grid: np.ndarray, unit: bool) -> tuple[float, float]:
    """0..1 for ``unit``; else the finite values' range, widened where the map is flat."""
    if unit:
        return 0.0, 1.0
    finite = grid[np.isfinite(grid)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if high - low < 1e-12:
        low, high = low - 0.5e-3, high + 0.5e-3
    return low, high
