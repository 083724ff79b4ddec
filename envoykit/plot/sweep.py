"""The causal-tracing map of a patch sweep."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envoykit.plot.text import short

if TYPE_CHECKING:
    from envoykit.results.sweep import SweepResult


def sweep(res: SweepResult, *, effect: bool = False, ax: Any = None) -> Any:
    """The causal-tracing map: layers (rows, last on top) x positions (x heads, for a head
    sweep), coloured by the target's metric after patching each cell (``effect=True``: by
    its normalised effect, 0 = the clean target run, 1 = the source run)."""
    import matplotlib.pyplot as plt

    grid = res.effect() if effect else res.values
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.5 + 0.9 * n_pos, 20), min(1.5 + 0.25 * n_layers, 20)))
    limits = (0.0, 1.0) if effect or res.metric == "prob" else (None, None)
    image = ax.imshow(
        grid, aspect="auto", origin="lower", cmap="Purples", vmin=limits[0], vmax=limits[1]
    )
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
        f"(clean {res.clean:.3g}, source {res.source_value:.3g})",
        fontsize=9,
    )
    ax.figure.colorbar(image, ax=ax, label=what, fraction=0.04)
    ax.figure.tight_layout()
    return ax.figure
