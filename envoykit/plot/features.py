"""SAE features: which fire on which token of a prompt, one feature's activation over a
prompt, and one feature's dashboard over a corpus (histogram, logit effects, contexts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.plot.text import clip, short, visible

if TYPE_CHECKING:
    from envoykit.results.feature_stats import FeatureStats
    from envoykit.results.features import FeatureLogitsResult, FeatureResult


def features(res: FeatureResult, n: int = 12, *, ax: Any = None) -> Any:
    """The ``n`` features most active anywhere in the prompt (rows) against its tokens
    (columns), coloured by activation as the top-k lists report it (blank where a feature is
    not among a token's top features); the title gives the SAE's site, mean L0 and variance
    explained."""
    import matplotlib.pyplot as plt

    fired = res.top_ids >= 0
    ids, acts = res.top_ids[fired], res.top_acts[fired]
    best: dict[int, float] = {}
    for feature, act in zip(ids.tolist(), acts.tolist()):
        best[feature] = max(best.get(feature, 0.0), act)
    shown = sorted(best, key=lambda f: -best[f])[:n]
    grid = np.full((len(shown), len(res.tokens)), np.nan)
    for row, feature in enumerate(shown):
        values = res.activation(feature)
        grid[row] = np.where(values > 0, values, np.nan)
    if ax is None:
        width = min(16.0, 2.5 + 0.45 * len(res.tokens))
        _, ax = plt.subplots(figsize=(width, 1.2 + 0.3 * max(1, len(shown))))
    image = ax.imshow(grid, cmap="viridis", aspect="auto", interpolation="none")
    ax.set_xticks(range(len(res.tokens)), [short(t) for t in res.tokens], rotation=90, fontsize=8)
    ax.set_yticks(range(len(shown)), [f"feature {f}" for f in shown], fontsize=8)
    sae = dict(res.meta.get("sae", {}))
    ax.set_title(
        f"SAE features at layer {sae.get('layer')} {sae.get('site')!r}: mean L0 "
        f"{res.l0.mean():.1f}, variance explained {res.variance_explained():.3f}",
        fontsize=10,
    )
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.02, label="activation")
    ax.figure.tight_layout()
    return ax.figure


def feature(
    res: FeatureResult | FeatureStats,
    feature_id: int,
    *,
    logits: FeatureLogitsResult | None = None,
    contexts: int = 8,
    ax: Any = None,
) -> Any:
    """One feature: over a prompt (a `FeatureResult`), its activation at each token as bars;
    over a corpus (a `FeatureStats`), its dashboard: the histogram of its activations, its
    logit effects (where ``logits``, from ``engine.feature_logits``, is given) and its
    ``contexts`` best contexts, each token shaded by the feature's activation there."""
    from envoykit.results.feature_stats import FeatureStats

    if isinstance(res, FeatureStats):
        return _dashboard(res, feature_id, logits, contexts)
    import matplotlib.pyplot as plt

    values = res.activation(feature_id)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16.0, 2.5 + 0.45 * len(res.tokens)), 3.0))
    ax.bar(range(len(values)), values, color="tab:orange")
    ax.set_xticks(range(len(res.tokens)), [short(t) for t in res.tokens], rotation=90, fontsize=8)
    ax.set_ylabel("activation")
    ax.set_title(f"feature {feature_id} over {clip(visible(res.prompt), 40)!r}", fontsize=10)
    ax.figure.tight_layout()
    return ax.figure


def _dashboard(stats: FeatureStats, f: int, logits: FeatureLogitsResult | None, n: int) -> Any:
    import matplotlib.pyplot as plt

    shown = stats.contexts(f)[:n]
    width = max([len(c.tokens) for c in shown] or [1])
    fig = plt.figure(figsize=(max(10.0, 1.0 + 0.8 * width), 3.2 + 0.42 * max(1, len(shown))))
    grid = fig.add_gridspec(2, 2, height_ratios=[2.2, 0.42 * max(1, len(shown))])
    _histogram(fig.add_subplot(grid[0, 0]), stats, f)
    _logit_effects(fig.add_subplot(grid[0, 1]), logits, f)
    _contexts(fig.add_subplot(grid[1, :]), shown, width)
    fig.suptitle(
        f"feature {f}: fires on {stats.frequency[f]:.2%} of {stats.n_tokens} tokens, mean "
        f"{stats.mean_when_active[f]:.3g} when on, max {stats.max[f]:.3g}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def _histogram(ax: Any, stats: FeatureStats, f: int) -> None:
    edges, counts = stats.histogram(f)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="tab:orange")
    ax.set_xscale("log")
    occupied = np.flatnonzero(counts)
    if occupied.size:  # the bins it falls in, and one either side
        ax.set_xlim(edges[max(occupied[0] - 1, 0)], edges[min(occupied[-1] + 2, len(edges) - 1)])
    ax.set_xlabel("activation (log bins; the end bins take what lies past them)")
    ax.set_ylabel("tokens")
    ax.set_title("activations when on", fontsize=10)


def _logit_effects(ax: Any, logits: FeatureLogitsResult | None, f: int) -> None:
    if logits is None:
        ax.axis("off")
        ax.text(
            0.5,
            0.5,
            "logit effects: pass logits=engine.feature_logits(sae, f)",
            ha="center",
            va="center",
            fontsize=9,
            transform=ax.transAxes,
        )
        return
    effects = logits.of(f)
    pairs = effects["down"][::-1] + effects["up"][::-1]
    values = [value for _, value in pairs]
    ax.barh(range(len(pairs)), values, color=["tab:blue" if v < 0 else "tab:red" for v in values])
    ax.set_yticks(range(len(pairs)), [short(token, 12) for token, _ in pairs], fontsize=8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("logit of the decoder direction alone")
    ax.set_title("tokens it raises (red) and lowers (blue)", fontsize=10)


def _contexts(ax: Any, shown: list, width: int) -> None:
    """Each context a row of cells, one per token, shaded by the feature's activation
    (scaled to the best context's), the focus token outlined."""
    import matplotlib
    from matplotlib.patches import Rectangle

    top = max([c.activation for c in shown] or [1.0]) or 1.0
    colours = matplotlib.colormaps["Oranges"]
    for row, context in enumerate(shown):
        for col, (token, act) in enumerate(zip(context.tokens, context.activations)):
            cell = Rectangle((col, row), 1, 1, facecolor=colours(max(act, 0) / top), lw=0)
            ax.add_patch(cell)
            ink = "white" if max(act, 0) / top > 0.6 else "black"
            ax.text(
                col + 0.5,
                row + 0.5,
                short(token, 9),
                ha="center",
                va="center",
                fontsize=7.5,
                color=ink,
            )
        ax.add_patch(Rectangle((context.focus, row), 1, 1, fill=False, lw=1.5, ec="black"))
    ax.set_xlim(0, width)
    ax.set_ylim(max(1, len(shown)), 0)
    ax.set_yticks(
        [r + 0.5 for r in range(len(shown))],
        [f"doc {c.document} @{c.position}: {c.activation:.3g}" for c in shown],
        fontsize=8,
    )
    ax.set_xticks([])
    ax.set_title("max-activating contexts" if shown else "it never fired", fontsize=10)
