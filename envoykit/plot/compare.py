"""The diff heatmap of two runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envoykit.plot.text import short
from envoykit.results.metrics import JS, delta_metric

if TYPE_CHECKING:
    from envoykit.results.compare import CompareResult


def compare(res: CompareResult, metric: str = "js", *, ax: Any = None) -> Any:
    """The diff heatmap of two runs: layers x aligned positions, coloured by the JS
    divergence of their next-token distributions (``metric="js"``) or by the change in a
    target's probability (``metric=`` the target, b minus a); each cell shows the top-1
    token, as ``a→b`` where the two runs disagree."""
    import matplotlib.pyplot as plt

    shown = JS if metric == "js" else delta_metric(metric, metric)
    grid = res.js if metric == "js" else res.delta(metric)
    cmap, limits, label = shown.cmap, shown.range(grid), shown.title
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.5 + 1.2 * n_pos, 30), min(1.5 + 0.32 * n_layers, 30)))
    image = ax.imshow(
        grid, aspect="auto", origin="lower", cmap=cmap, vmin=limits[0], vmax=limits[1]
    )
    for li in range(n_layers):
        for pi in range(n_pos):
            top_a, top_b = res.top_token("a", li, pi), res.top_token("b", li, pi)
            text = short(top_a) if top_a == top_b else f"{short(top_a, 5)}→{short(top_b, 5)}"
            ax.text(pi, li, text, ha="center", va="center", fontsize=6)
    columns = [a if a == b else f"{a}|{b}" for a, b in zip(res.tokens_a, res.tokens_b)]
    ax.set_xticks(
        range(n_pos), [short(c, 14) for c in columns], rotation=45, ha="right", fontsize=8
    )
    ax.set_yticks(range(n_layers), res.layer_labels, fontsize=7)
    ax.set_xlabel("position (token a|b)")
    ax.set_ylabel("layer")
    ax.set_title(f"a: {res.a}\nb: {res.b}", fontsize=8)
    ax.figure.colorbar(image, ax=ax, label=label, fraction=0.04)
    ax.figure.tight_layout()
    return ax.figure
