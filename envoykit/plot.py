"""Matplotlib figures drawn from a `LensResult`; nothing here computes a statistic.

``heatmap`` shows layers x positions with the top-1 token written in each cell; the colour is
the top-1 probability, the entropy, the KL to the final layer, or a target's probability.
``trajectory`` follows target tokens across layers at one position.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.metrics import metric_grid, text_colour

if TYPE_CHECKING:  # types only: `LensResult.plot` imports this module, not the other way
    from envoykit.attribution_result import AttributionResult
    from envoykit.compare_result import CompareResult
    from envoykit.result import LensResult
    from envoykit.sweep_result import SweepResult
    from envoykit.tuned import LensQuality

# Tokens are arbitrary text: one whose glyph the font lacks is drawn as a box, and matplotlib
# says so once per glyph and per drawing, in the middle of a notebook's output. The box is
# the honest rendering; the notice is noise.
warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")


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
                _short(res.top_tokens[li, pi, 0]),
                ha="center",
                va="center",
                fontsize=7,
                color=text_colour(cells[li, pi]),
            )
    ax.set_xticks(
        range(n_pos), [_short(t, 12) for t in res.tokens], rotation=45, ha="right", fontsize=8
    )
    ax.set_yticks(range(n_layers), res.layer_labels, fontsize=8)
    ax.set_xlabel("input token")
    ax.set_ylabel("layer")
    ax.set_title(
        title or f"{res.meta.get('lens', 'logit')} lens: {label}, top-1 token per cell", fontsize=10
    )
    ax.figure.colorbar(image, ax=ax, label=label, fraction=0.04)
    ax.figure.tight_layout()
    return ax.figure


def trajectory(
    res: LensResult, targets: str | int | Sequence[str | int], *, position: int = -1, ax: Any = None
) -> Any:
    """Probability (left axis) and rank (right axis, log scale) of targets across layers."""
    import matplotlib.pyplot as plt

    targets = [targets] if isinstance(targets, (str, int)) else list(targets)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    ranks = ax.twinx()
    x = np.arange(len(res.layers))
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
    ax.set_ylim(0, 1)
    ax.set_ylabel("probability")
    ranks.set_yscale("log")
    ranks.invert_yaxis()
    ranks.set_ylabel("rank (1 = top)")
    ax.set_xticks(x, res.layer_labels, fontsize=8)
    ax.set_xlabel("layer")
    ax.set_title(f"target tokens at position {res.tokens[position]!r}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def _short(text: Any, width: int = 8) -> str:
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


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
    n_layers = int(layers.max())
    if ax is None:
        _, ax = plt.subplots(figsize=(min(4.0 + 0.32 * n_layers, 16), 4.0))
    width = 0.4
    ax.bar([0], values[kinds == "embed"], width, color="0.6", label="embedding")
    for kind, shift, colour in (("attn", -width / 2, "C0"), ("mlp", width / 2, "C1")):
        picked = kinds == kind
        ax.bar(layers[picked] + shift, values[picked], width, color=colour, label=kind)
    # The running sum in the order the stream is built: embed, attn 1, mlp 1, attn 2, ...
    x = layers + np.select([kinds == "attn", kinds == "mlp"], [-width / 2, width / 2], 0.0)
    ax.plot(x, np.cumsum(values), color="k", marker=".", linewidth=1, label="running sum")
    ax.axhline(float(values.sum()), color="k", linestyle=":", linewidth=1)
    ax.axhline(0.0, color="0.5", linewidth=0.5)
    ax.set_xticks(range(n_layers + 1), ["embed", *map(str, range(1, n_layers + 1))], fontsize=7)
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


def sweep(res: SweepResult, *, effect: bool = False, ax: Any = None) -> Any:
    """The causal-tracing map: layers (rows, last on top) x positions, coloured by the
    target's metric after patching each cell (``effect=True``: by its normalised effect,
    0 = the clean target run, 1 = the source run)."""
    import matplotlib.pyplot as plt

    grid = res.effect() if effect else res.values
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.5 + 0.9 * n_pos, 20), min(1.5 + 0.25 * n_layers, 20)))
    limits = (0.0, 1.0) if effect or res.metric == "prob" else (None, None)
    image = ax.imshow(
        grid, aspect="auto", origin="lower", cmap="Purples", vmin=limits[0], vmax=limits[1]
    )
    labels = [f"{t!r}" if t == s else f"{s!r}→{t!r}" for s, t in zip(res.source_tokens, res.tokens)]
    ax.set_xticks(range(n_pos), [_short(label, 16) for label in labels], rotation=45, ha="right")
    step = max(1, n_layers // 15)
    ax.set_yticks(range(0, n_layers, step), res.layer_labels[::step], fontsize=8)
    ax.set_xlabel("position patched (source → target token)")
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


def compare(res: CompareResult, metric: str = "js", *, ax: Any = None) -> Any:
    """The diff heatmap of two runs: layers x aligned positions, coloured by the JS
    divergence of their next-token distributions (``metric="js"``) or by the change in a
    target's probability (``metric=`` the target, b minus a); each cell shows the top-1
    token, as ``a→b`` where the two runs disagree."""
    import matplotlib.pyplot as plt

    if metric == "js":
        grid, label, cmap, limits = res.js, "JS divergence (nats)", "Reds", (0.0, float(np.log(2)))
    else:
        grid, cmap = res.delta(metric), "RdBu_r"
        label, limits = f"Δ p({metric!r}), b − a", (-1.0, 1.0)
    n_layers, n_pos = grid.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(min(2.5 + 1.2 * n_pos, 30), min(1.5 + 0.32 * n_layers, 30)))
    image = ax.imshow(
        grid, aspect="auto", origin="lower", cmap=cmap, vmin=limits[0], vmax=limits[1]
    )
    for li in range(n_layers):
        for pi in range(n_pos):
            top_a, top_b = res.top_token("a", li, pi), res.top_token("b", li, pi)
            text = _short(top_a) if top_a == top_b else f"{_short(top_a, 5)}→{_short(top_b, 5)}"
            ax.text(pi, li, text, ha="center", va="center", fontsize=6)
    columns = [a if a == b else f"{a}|{b}" for a, b in zip(res.tokens_a, res.tokens_b)]
    ax.set_xticks(
        range(n_pos), [_short(c, 14) for c in columns], rotation=45, ha="right", fontsize=8
    )
    ax.set_yticks(range(n_layers), res.layer_labels, fontsize=7)
    ax.set_xlabel("position (token a|b)")
    ax.set_ylabel("layer")
    ax.set_title(f"a: {res.a}\nb: {res.b}", fontsize=8)
    ax.figure.colorbar(image, ax=ax, label=label, fraction=0.04)
    ax.figure.tight_layout()
    return ax.figure


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
