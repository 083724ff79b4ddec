"""The lens over a corpus, layer by layer, with the bootstrap intervals as bands."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from envoykit.results.corpus import CorpusLensResult


def lens_corpus(
    results: CorpusLensResult | Sequence[CorpusLensResult],
    *,
    labels: Sequence[str] | None = None,
    figure: Any = None,
) -> Any:
    """Two panels per layer: mean KL(final ‖ layer) and mean entropy (nats, log scale), and
    top-k agreement with the final layer and top-k accuracy against the next token, each
    with its interval as a band. Several results (the logit and the tuned lens, two
    checkpoints) share the axes, labelled by ``labels`` (default: the lens and the model).
    ``figure``: a matplotlib Figure to draw on (default: a new pyplot figure)."""
    from envoykit.results.corpus import CorpusLensResult

    runs = [results] if isinstance(results, CorpusLensResult) else list(results)
    if not runs:
        raise ValueError("lens_corpus plots at least one CorpusLensResult")
    names = list(labels) if labels is not None else [_label(run) for run in runs]
    if figure is None:
        import matplotlib.pyplot as plt

        figure = plt.figure(figsize=(10, 3.6))
    left, right = figure.subplots(1, 2)
    labels_shown = runs[0].layer_labels
    for i, (run, name) in enumerate(zip(runs, names)):
        x = np.arange(len(run.layers))
        for ax, statistic, style in (
            (left, "kl", "-"),
            (left, "entropy", ":"),
            (right, "agreement", "-"),
            (right, "accuracy", ":"),
        ):
            value = getattr(run, statistic)
            low, high = getattr(run, f"{statistic}_ci").T
            if ax is left:  # a log axis has no zero (the final layer's KL to itself)
                value, low = _positive(value), _positive(low)
            colour = f"C{i}"
            ax.plot(x, value, style, marker=".", color=colour, label=f"{name}: {statistic}")
            ax.fill_between(x, low, high, color=colour, alpha=0.15, linewidth=0)
    left.set_yscale("log")
    left.set_ylabel("nats")
    left.set_title("KL(final ‖ layer) and entropy", fontsize=10)
    right.set_ylim(-0.02, 1.02)
    right.set_ylabel("fraction of tokens")
    k = runs[0].top_k
    right.set_title(f"top-{k} agreement with the final layer, top-{k} accuracy", fontsize=10)
    step = max(1, len(labels_shown) // 12)
    for ax in (left, right):
        ticks = np.arange(len(labels_shown))[::step]
        ax.set_xticks(ticks, [labels_shown[i] for i in ticks], fontsize=8)
        ax.set_xlabel("layer")
        ax.legend(fontsize=8)
    first = runs[0]
    figure.suptitle(
        f"lens over {first.n_documents} documents, {first.n_tokens} tokens "
        f"({first.confidence:.0%} bootstrap intervals over documents)",
        fontsize=10,
    )
    figure.tight_layout()
    return figure


def _positive(values: np.ndarray) -> np.ndarray:
    return np.where(values > 0, values, np.nan)


def _label(result: CorpusLensResult) -> str:
    return f"{result.meta.get('lens', 'logit')} lens, {result.meta.get('model', 'model')}"
