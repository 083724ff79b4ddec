"""Attention patterns: one head's token-by-token pattern, or a grid of every head shown."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envoykit.plot.text import clip, short, visible

if TYPE_CHECKING:
    from envoykit.results.attention import AttentionResult


def attention(
    res: AttentionResult, layer: int | None = None, head: int | None = None, *, ax: Any = None
) -> Any:
    """The pattern of ``head`` at decoder layer ``layer``: queries down, keys across, the
    tokens on both axes. Without both, a grid of small patterns, one per layer (rows) and
    head (columns) in ``res``."""
    import matplotlib.pyplot as plt

    if layer is not None and head is not None:
        if ax is None:
            size = min(9.0, 2.0 + 0.35 * len(res.token_ids))
            _, ax = plt.subplots(figsize=(size, size))
        _draw(ax, res, layer, head, labels=True)
        ax.figure.tight_layout()
        return ax.figure
    rows, cols = len(res.layers), len(res.heads)
    figure, axes = plt.subplots(
        rows, cols, figsize=(1.3 * cols + 1, 1.3 * rows + 0.6), squeeze=False
    )
    for i, row_layer in enumerate(res.layers.tolist()):
        for j, column_head in enumerate(res.heads.tolist()):
            _draw(axes[i][j], res, row_layer, column_head, labels=False)
            if j == 0:
                axes[i][j].set_ylabel(f"layer {row_layer}", fontsize=8)
            if i == 0:
                axes[i][j].set_title(f"head {column_head}", fontsize=8)
    figure.suptitle(f"attention of {clip(visible(res.prompt), 40)!r}", fontsize=10)
    figure.tight_layout()
    return figure


def _draw(ax: Any, res: AttentionResult, layer: int, head: int, labels: bool) -> None:
    pattern = res.pattern(layer, head)
    image = ax.imshow(pattern, cmap="Blues", vmin=0, vmax=1, aspect="auto", interpolation="none")
    if not labels:
        ax.set_xticks([])
        ax.set_yticks([])
        return
    tokens = [short(t) for t in res.tokens]
    ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=8)
    ax.set_yticks(range(len(res.queries)), [tokens[q] for q in res.queries.tolist()], fontsize=8)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(f"layer {layer}, head {head}", fontsize=10)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="weight")
