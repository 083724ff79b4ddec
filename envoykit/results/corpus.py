"""`CorpusLensResult`: the logit lens averaged over a corpus, per layer, with bootstrap
confidence intervals.

Tokens of one document are not independent draws, so the intervals resample *documents*
(a cluster bootstrap): each resample draws as many documents as the corpus has, with
replacement, and a statistic is the ratio of the drawn documents' sums to their token counts,
as the point estimate is. The per-document sums are kept in the result, so intervals at
another confidence level, or for a subset of documents, need no engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envoykit.results.base import Result, freeze_json, frozen_array

# The statistics, each a mean per layer; their sums are `document_sums[..., i]` in this order.
STATISTICS = ("kl", "entropy", "agreement", "accuracy")
DESCRIPTIONS = {
    "kl": "mean KL(final ‖ layer), nats",
    "entropy": "mean entropy of the layer's distribution, nats",
    "agreement": "final layer's top-1 in the layer's top-k",
    "accuracy": "actual next token in the layer's top-k",
}


class _Means:
    """What `CorpusLensResult` computes from its sums, not fields (never passed, never
    exported): per statistic its mean ``[L]`` and its interval ``[L, 2]``."""

    kl: np.ndarray
    kl_ci: np.ndarray
    entropy: np.ndarray
    entropy_ci: np.ndarray
    agreement: np.ndarray
    agreement_ci: np.ndarray
    accuracy: np.ndarray
    accuracy_ci: np.ndarray


@dataclass(frozen=True, eq=False)
class CorpusLensResult(Result, _Means):
    """Per layer, over every token of a corpus: mean KL(final ‖ layer), mean entropy, top-k
    agreement with the final layer, and top-k accuracy against the actual next token.

    Shapes: ``D`` documents (those with at least one token), ``L`` layers (0 = embedding).

    Attributes:
        layers: ``[L]``; top_k: the k of agreement and accuracy.
        document_sums: ``[D, L, 4]`` per document the sums of `STATISTICS` over its tokens.
        document_counts: ``[D, 2]`` its tokens, and those with a next token (accuracy's).
        confidence, n_boot, seed: of the intervals.
        kl, entropy, agreement, accuracy: ``[L]`` the means; each ``*_ci`` ``[L, 2]``.
        meta: model, TP size, dtype, ``lens`` ("logit" or "tuned").

    >>> res = CorpusLensResult.example()
    >>> res.layers.tolist(), res.agreement.round(2).tolist()
    ([1, 2], [0.5, 1.0])
    """

    layers: np.ndarray
    top_k: int
    document_sums: np.ndarray
    document_counts: np.ndarray
    confidence: float = 0.95
    n_boot: int = 1000
    seed: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers = frozen_array("CorpusLensResult", "layers", self.layers, np.int64)
        sums = np.array(self.document_sums, dtype=np.float64)
        counts = np.array(self.document_counts, dtype=np.int64)
        n_docs = counts.shape[0] if counts.ndim == 2 else 0
        if n_docs == 0 or counts.shape != (n_docs, 2) or (counts[:, 0] < 1).any():
            raise ValueError("CorpusLensResult needs [D, 2] counts of at least one token each")
        sums = frozen_array(
            "CorpusLensResult", "document_sums", sums, np.float64, (n_docs, len(layers), 4)
        )
        if not 0 < float(self.confidence) < 1 or int(self.n_boot) < 1:
            raise ValueError("CorpusLensResult: confidence in (0, 1) and n_boot >= 1")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "document_sums", sums)
        object.__setattr__(self, "document_counts", frozen_array("", "", counts, np.int64))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "confidence", float(self.confidence))
        object.__setattr__(self, "n_boot", int(self.n_boot))
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "meta", freeze_json(self.meta, "CorpusLensResult.meta"))
        means, intervals = bootstrap(sums, counts, self.n_boot, self.confidence, self.seed)
        for i, name in enumerate(STATISTICS):
            mean, interval = means[:, i], intervals[:, i]
            object.__setattr__(self, name, frozen_array("", "", mean, np.float64))
            object.__setattr__(self, f"{name}_ci", frozen_array("", "", interval, np.float64))

    @property
    def n_documents(self) -> int:
        return int(self.document_counts.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.document_counts[:, 0].sum())

    @property
    def layer_labels(self) -> list[str]:
        return ["embed" if layer == 0 else str(int(layer)) for layer in self.layers]

    def settles_at(self, threshold: float = 0.5) -> int | None:
        """The first layer from which top-k agreement with the final layer stays at or above
        ``threshold`` (None if it never does)."""
        above = self.agreement >= threshold
        for i in range(len(self.layers)):
            if above[i:].all():
                return int(self.layers[i])
        return None

    def table(self) -> list[dict[str, Any]]:
        """One row per layer: each statistic and its interval, for a DataFrame or a CSV."""
        rows = []
        for i, label in enumerate(self.layer_labels):
            row: dict[str, Any] = {"layer": label}
            for name in STATISTICS:
                low, high = getattr(self, f"{name}_ci")[i]
                row.update(
                    {
                        name: float(getattr(self, name)[i]),
                        f"{name}_low": float(low),
                        f"{name}_high": float(high),
                    }
                )
            rows.append(row)
        return rows

    def to_csv(self, path: str) -> None:
        """`table` as a CSV file."""
        import csv

        rows = self.table()
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    def _repr_html_(self) -> str:
        import html

        settled = self.settles_at()
        head = (
            f"<b>corpus lens</b> ({html.escape(str(self.meta.get('lens', 'logit')))}) over "
            f"{self.n_documents} documents, {self.n_tokens} tokens; top-{self.top_k}; "
            f"{self.confidence:.0%} intervals over documents; top-1 settles "
            f"{'nowhere' if settled is None else f'at layer {settled}'}"
        )
        cells = "".join(
            f"<tr><td>{html.escape(row['layer'])}</td>"
            + "".join(
                f"<td>{row[name]:.3f} [{row[name + '_low']:.3f}, {row[name + '_high']:.3f}]</td>"
                for name in STATISTICS
            )
            + "</tr>"
            for row in self.table()
        )
        titles = "".join(f"<th>{html.escape(DESCRIPTIONS[name])}</th>" for name in STATISTICS)
        return f"<div>{head}</div><table><tr><th>layer</th>{titles}</tr>{cells}</table>"

    @classmethod
    def example(cls) -> CorpusLensResult:
        """A hand-made result of two documents and two layers (for docs and tests)."""
        first = [[2.0, 4.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0]]
        second = [[2.0, 4.0, 1.0, 0.0], [0.0, 2.0, 2.0, 1.0]]
        sums = np.array([first, second])
        counts = np.array([[2, 1], [2, 1]])
        return cls(layers=np.array([1, 2]), top_k=1, document_sums=sums, document_counts=counts)


def bootstrap(
    sums: np.ndarray, counts: np.ndarray, n_boot: int, confidence: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Means ``[L, 4]`` of the per-document ``sums`` ``[D, L, 4]`` over their ``counts``
    ``[D, 2]`` (accuracy's over the second), and percentile intervals ``[L, 4, 2]`` from
    ``n_boot`` resamples of the documents."""
    n_docs = sums.shape[0]
    denominators = counts[:, [0, 0, 0, 1]].astype(np.float64)  # [D, 4]
    means = sums.sum(0) / np.maximum(denominators.sum(0), 1)
    rng = np.random.default_rng(seed)
    # How often each document is drawn in each resample: [B, D].
    weights = rng.multinomial(n_docs, np.full(n_docs, 1 / n_docs), size=n_boot).astype(np.float64)
    drawn = np.einsum("bd,dlk->blk", weights, sums) / np.maximum(weights @ denominators, 1)[:, None]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(drawn, [tail, 100 - tail], axis=0)
    return means, np.stack([low, high], axis=-1)
