"""Direct logit attribution: attention and MLP contributions per layer, and their running
sum."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from envoykit.results.attribution import AttributionResult


def attribution(
    res: AttributionResult,
    target: str | int | tuple[str | int, str | int],
    *,
    position: int = -1,
    ax: Any = None,
) -> Any:
    """Each layer's attention and MLP contribution to a target's logit, side by side, with
    the running sum (embedding first) reaching the logit.

    ``target`` is one target, or a pair ``(a, b)`` for the logit difference ``a - b``.
    ``position`` indexes the result's positions (-1: the last).
    """
    import matplotlib.pyplot as plt

    if isinstance(target, tuple):
        values, name = (
            res.diff(*target)[:, position],
            "logit({!r}) - logit({!r})".format(
                *(res.target_tokens[res.target_index(t)] for t in target)
            ),
        )
    else:
        values = res.of(target)[:, position]
        name = f"logit({res.target_tokens[res.target_index(target)]!r})"
    kinds, layers = np.array(res.component_kinds), res.component_layers
    n_layers = int(layers[kinds != "bias"].max())
    if ax is None:
        _, ax = plt.subplots(figsize=(min(4.0 + 0.32 * n_layers, 16), 4.0))
    width = 0.4
    ax.bar([0], values[kinds == "embed"], width, color="0.6", label="embedding")
    for kind, shift, colour in (("attn", -width / 2, "C0"), ("mlp", width / 2, "C1")):
        picked = kinds == kind
        ax.bar(layers[picked] + shift, values[picked], width, color=colour, label=kind)
    if (kinds == "bias").any():
        ax.bar([n_layers + 1], values[kinds == "bias"], width, color="0.3", label="bias")
    # The running sum in the order the stream is built: embed, attn 1, mlp 1, attn 2, ...
    x = layers + np.select([kinds == "attn", kinds == "mlp"], [-width / 2, width / 2], 0.0)
    ax.plot(x, np.cumsum(values), color="k", marker=".", linewidth=1, label="running sum")
    ax.axhline(float(values.sum()), color="k", linestyle=":", linewidth=1)
    ax.axhline(0.0, color="0.5", linewidth=0.5)
    ticks = ["embed", *map(str, range(1, n_layers + 1))] + ["bias"] * int((kinds == "bias").any())
    ax.set_xticks(range(len(ticks)), ticks, fontsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"contribution to {name}")
    ax.set_title(
        f"direct logit attribution at position {res.tokens[position]!r} "
        f"(final norm scale frozen; total {values.sum():.2f})",
        fontsize=10,
    )
    ax.legend(loc="upper left", fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def head_attribution(
    res: AttributionResult, target: str | int, *, position: int = -1, ax: Any = None
) -> Any:
    """Every head's contribution to a target's logit, layers down and heads across (an
    ``attribute(..., heads=True)`` result), on a colour scale centred on zero.

    ``position`` indexes the result's positions (-1: the last).
    """
    import matplotlib.pyplot as plt

    if res.head_values is None:
        raise ValueError("no per-head values: use engine.attribute(..., heads=True)")
    n = res.target_index(target)
    values = res.head_values[:, :, position, n]
    if ax is None:
        _, ax = plt.subplots(
            figsize=(min(3.0 + 0.45 * values.shape[1], 14), 1.5 + 0.22 * len(values))
        )
    limit = float(np.abs(values).max()) or 1.0
    image = ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(len(values)), [str(i + 1) for i in range(len(values))], fontsize=7)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    token = res.target_tokens[n]
    ax.set_title(
        f"each head's contribution to logit({token!r}) at {res.tokens[position]!r}", fontsize=10
    )
    ax.figure.colorbar(image, ax=ax, label="contribution")
    ax.figure.tight_layout()
    return ax.figure
