"""A steering sweep: what each strength does to a target's probability, layer by layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envoykit.plot.text import clip, visible

if TYPE_CHECKING:
    from envoykit.results.steering import SteerSweepResult


def steering(res: SteerSweepResult, target: str | int = 0, *, axes: Any = None) -> Any:
    """``target``'s lens probability at the prompt's last position after steering at each
    scale: on the left every layer (rows, last on top) x scale (columns, each headed by the
    start of that scale's continuation), coloured from 0 to the largest probability shown;
    on the right the last layer's, the model's own prediction, against the scale.
    ``axes``: two matplotlib axes to draw in."""
    import matplotlib.pyplot as plt

    grid = res.target(target).T  # [L, S]
    n_layers, n_scales = grid.shape
    if axes is None:
        _, axes = plt.subplots(
            1,
            2,
            figsize=(min(6.0 + 1.1 * n_scales, 22), min(2.2 + 0.22 * n_layers, 16)),
            gridspec_kw={"width_ratios": [max(2, n_scales), 3]},
        )
    left, right = axes
    label = target if isinstance(target, str) else res.target_labels[target]
    top = max(float(grid.max()), 1e-6)
    image = left.imshow(grid, aspect="auto", origin="lower", cmap="Purples", vmin=0.0, vmax=top)
    ticks = [
        f"{scale:g}\n{clip(visible(text.strip()), 12)}"
        for scale, text in zip(res.scales, res.texts)
    ]
    left.set_xticks(range(n_scales), ticks, fontsize=8)
    left.set_xlabel("steering scale (and the start of its continuation)")
    step = max(1, n_layers // 15)
    left.set_yticks(range(0, n_layers, step), res.layer_labels[::step], fontsize=8)
    left.set_ylabel("layer")
    left.figure.colorbar(image, ax=left, label=f"p({label!r})", fraction=0.05)
    right.plot(res.scales, grid[-1], marker="o", color="indigo")
    right.set_xlabel("steering scale")
    right.set_ylabel(f"p({label!r}) at layer {res.layer_labels[-1]}")
    right.set_ylim(bottom=0.0)
    right.grid(alpha=0.3)
    steer = (res.meta.get("steer") or [{}])[0]
    where = f"layer {steer.get('layer')} {steer.get('site')}" if steer else "a layer"
    left.figure.suptitle(f"steering at {where}: {res.prompt!r}", fontsize=9)
    left.figure.tight_layout()
    return left.figure
