"""The lens figures: the layers x positions heatmap (top-1 token in each cell, coloured by a
metric) and a target's trajectory across layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.plot.colours import text_colour
from envoykit.plot.text import short
from envoykit.results.metrics import metric_grid

if TYPE_CHECKING:
    from envoykit.results.lens import LensResult


def heatmap(
    res: LensResult,
    metric: str = "prob",
    *,
    ax: Any = None,
    title: str | None = None,
    vmin: float | None = None,
    vmax: float | None = None,
    log: bool = False,
) -> Any:
    """Layers (rows, last on top) x positions (columns), top-1 token in each cell.

    ``vmin``/``vmax`` set the colour limits (None: the metric's own, `Metric.range`);
    ``log`` draws the colours on a log scale (a limit at or below zero becomes a millionth
    of the top one), as the widget's colour controls do."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm, Normalize

    grid, definition = metric_grid(res, metric)
    label = definition.title
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.0 + 1.1 * n_pos, 30), min(1.5 + 0.32 * n_layers, 30)))
    low, high = definition.range(grid)
    low, high = (low if vmin is None else vmin), (high if vmax is None else vmax)
    norm: Normalize
    if log:
        low = low if low > 0 else (high if high > 0 else 1.0) * 1e-6
        norm = LogNorm(vmin=low, vmax=max(high, low * 10))
    else:
        norm = Normalize(vmin=low, vmax=high)
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap=definition.cmap, norm=norm)
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
    robust = definition.scale(grid)["robust"] or vmin is not None or vmax is not None
    ax.figure.colorbar(
        image, ax=ax, label=label, fraction=0.04, extend="both" if robust else "neither"
    )
    ax.figure.tight_layout()
    return ax.figure


# Where a sub-layer row sits on the layer axis of a trajectory (layer L's rows between L - 1
# and L, in the model's order) and the marker it is drawn with; the stream after the layer
# ("resid") is the line itself.
_SITE_PLACES = {"attn": (-0.75, "^"), "resid_mid": (-0.5, "s"), "mlp": (-0.25, "v")}
_MAX_TICKS = 16


def trajectory(
    res: LensResult,
    targets: str | int | Sequence[str | int],
    *,
    position: int = -1,
    from_top_k: Sequence[int] = (),
    ax: Any = None,
) -> Any:
    """Probability (left axis) and rank (right axis, log scale, dashed) of targets across
    layers, on an axis of layer numbers.

    The stream after each layer ("resid") is drawn as the line; sub-layer rows (attention,
    the stream between the blocks, MLP) are markers between the layer before and theirs, in
    the model's order, so a result with sites does not zigzag between kinds of row.
    ``from_top_k`` adds tokens that are not targets, read from the top-k lists
    (`LensResult.top_k_trace`): a dotted line with gaps where a token was not among the top k,
    and no rank. ``position`` indexes ``res.positions``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    targets = [targets] if isinstance(targets, (str, int)) else list(targets)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    layers = res.layers.astype(float)
    places = layers + np.array([_SITE_PLACES.get(site, (0.0, ""))[0] for site in res.sites])
    handles = _target_lines(ax, res, targets, position, places)
    for token_id in from_top_k:
        token, probs = res.top_k_trace(token_id, position)
        (line,) = ax.plot(
            places, probs, marker="x", linestyle=":", label=f"p({token!r}) where in top-k"
        )
        handles.append(line)
    for site, (_, marker) in _SITE_PLACES.items():
        if site in res.sites:
            handles.append(
                Line2D([], [], marker=marker, linestyle="", color="grey", label=f"{site} rows")
            )
    ax.set_ylim(0, 1)
    ax.set_ylabel("probability")
    shown = sorted(set(res.layers.tolist()))
    step = max(1, -(-len(shown) // _MAX_TICKS))
    ticks = shown[::step]
    ax.set_xticks(ticks, ["embed" if t == 0 else str(t) for t in ticks], fontsize=8)
    ax.set_xlabel("layer")
    ax.set_title(f"{res.run_label}: targets at position {res.tokens[position]!r}", fontsize=10)
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def _target_lines(
    ax: Any, res: LensResult, targets: list[str | int], position: int, places: np.ndarray
) -> list[Any]:
    """Each target's probability (a line through the "resid" rows, markers at the sub-layer
    rows' ``places``) on ``ax``, and its rank on a log-scale right axis; the lines drawn."""
    layers = res.layers.astype(float)
    stream = np.array([site == "resid" for site in res.sites])
    handles = []
    ranks = ax.twinx() if targets else None
    for target in targets:
        trace = res.target(target)
        probs = trace.prob[:, position]
        (line,) = ax.plot(
            layers[stream], probs[stream], marker="o", markersize=4, label=f"p({trace.token!r})"
        )
        handles.append(line)
        for site, (_, marker) in _SITE_PLACES.items():
            rows = np.array([s == site for s in res.sites])
            if rows.any():
                ax.plot(places[rows], probs[rows], marker, color=line.get_color(), markersize=5)
        assert ranks is not None  # made whenever there are targets
        (rank,) = ranks.plot(
            layers[stream],
            trace.rank[stream, position] + 1,
            linestyle="--",
            color=line.get_color(),
            alpha=0.6,
            label=f"rank({trace.token!r}), right axis",
        )
        handles.append(rank)
    if ranks is not None:
        ranks.set_yscale("log")
        ranks.invert_yaxis()
        ranks.set_ylabel("rank (1 = top)")
    return handles
