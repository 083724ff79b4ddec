"""The lens figures: the layers x positions heatmap (top-1 token in each cell, coloured by a
metric) and a target's trajectory across layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.plot.text import short
from envoykit.results.metrics import metric_grid, text_colour

if TYPE_CHECKING:
    from envoykit.results.lens import LensResult


def heatmap(
    res: LensResult, metric: str = "prob", *, ax: Any = None, title: str | None = None
) -> Any:
    """Layers (rows, last on top) x positions (columns), top-1 token in each cell."""
    import matplotlib.pyplot as plt

    grid, definition = metric_grid(res, metric)
    label = definition.title
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.0 + 1.1 * n_pos, 30), min(1.5 + 0.32 * n_layers, 30)))
    vmin, vmax = definition.range(grid)
    image = ax.imshow(
        grid, aspect="auto", origin="lower", cmap=definition.cmap, vmin=vmin, vmax=vmax
    )
    cells = image.to_rgba(grid)  # the colour of every cell, to write its token legibly on it
    for li in range(n_layers):
        for pi in range(n_pos):
            ax.text(
                pi,
                li,
                short(res.top_tokens[li, pi, 0]),
                ha="center",
                va="center",
                fontsize=7,
                color=text_colour(cells[li, pi]),
            )
    ax.set_xticks(
        range(n_pos), [short(t, 12) for t in res.tokens], rotation=45, ha="right", fontsize=8
    )
    ax.set_yticks(range(n_layers), res.layer_labels, fontsize=8)
    ax.set_xlabel("input token")
    ax.set_ylabel("layer")
    ax.set_title(title or f"{res.run_label}: {label}, top-1 token per cell", fontsize=10)
    # Robust limits (percentiles, `Metric.range`): the bar's ends say cells lie beyond them.
    robust = definition.scale(grid)["robust"]
    ax.figure.colorbar(
        image, ax=ax, label=label, fraction=0.04, extend="both" if robust else "neither"
    )
    ax.figure.tight_layout()
    return ax.figure


def trajectory(
    res: LensResult,
    targets: str | int | Sequence[str | int],
    *,
    position: int = -1,
    from_top_k: Sequence[int] = (),
    ax: Any = None,
) -> Any:
    """Probability (left axis) and rank (right axis, log scale) of targets across layers.

    ``from_top_k`` adds tokens that are not targets, read from the top-k lists
    (`LensResult.top_k_trace`): a dotted line with gaps where a token was not among the top k,
    and no rank. ``position`` indexes ``res.positions``.
    """
    import matplotlib.pyplot as plt

    targets = [targets] if isinstance(targets, (str, int)) else list(targets)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(res.layers))
    if targets:
        ranks = ax.twinx()
        for target in targets:
            trace = res.target(target)
            (line,) = ax.plot(x, trace.prob[:, position], marker="o", label=f"p({trace.token!r})")
            ranks.plot(
                x,
                trace.rank[:, position] + 1,
                linestyle="--",
                color=line.get_color(),
                label=f"rank({trace.token!r})",
            )
        ranks.set_yscale("log")
        ranks.invert_yaxis()
        ranks.set_ylabel("rank (1 = top)")
    for token_id in from_top_k:
        token, probs = res.top_k_trace(token_id, position)
        ax.plot(x, probs, marker="x", linestyle=":", label=f"p({token!r}) where in top-k")
    ax.set_ylim(0, 1)
    ax.set_ylabel("probability")
    ax.set_xticks(x, res.layer_labels, fontsize=8)
    ax.set_xlabel("layer")
    ax.set_title(f"target tokens at position {res.tokens[position]!r}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.figure.tight_layout()
    return ax.figure
