"""A steering sweep: what each strength does to a target's probability, layer by layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envoykit.plot.text import short

if TYPE_CHECKING:
    from envoykit.results.steering import SteerSweepResult


def steering(res: SteerSweepResult, target: str | int = 0, *, ax: Any = None) -> Any:
    """``target``'s lens probability at the prompt's last position: layers (rows, last on
    top) x steering scales (columns), each column headed by the start of that scale's
    continuation."""
    import matplotlib.pyplot as plt

    grid = res.target(target).T  # [L, S]
    n_layers, n_scales = grid.shape
    if ax is None:
        _, ax = plt.subplots(
            figsize=(min(3.0 + 1.1 * n_scales, 20), min(1.8 + 0.22 * n_layers, 16))
        )
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap="Purples", vmin=0.0, vmax=1.0)
    labels = [f"{scale:g}\n{short(text.strip(), 12)}" for scale, text in zip(res.scales, res.texts)]
    ax.set_xticks(range(n_scales), labels, fontsize=8)
    ax.set_xlabel("steering scale (and the start of its continuation)")
    step = max(1, n_layers // 15)
    ax.set_yticks(range(0, n_layers, step), res.layer_labels[::step], fontsize=8)
    ax.set_ylabel("layer")
    label = target if isinstance(target, str) else res.target_labels[target]
    steer = (res.meta.get("steer") or [{}])[0]
    where = f"layer {steer.get('layer')} {steer.get('site')}" if steer else "a steer"
    ax.set_title(f"p({label!r}) after steering at {where}: {res.prompt!r}", fontsize=9)
    ax.figure.colorbar(image, ax=ax, label=f"p({label!r})", fraction=0.04)
    ax.figure.tight_layout()
    return ax.figure
