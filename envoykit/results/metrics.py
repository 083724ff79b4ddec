"""What a heatmap metric is — label, units, colour limits, colour map — defined once.

The matplotlib heatmap (`envoykit.plot`) and the browser heatmap (``widgets/heatmap.js``)
draw from the same `Metric`: the browser receives it in its payload, colour map included as a
list of colour stops sampled from matplotlib's own (`envoykit.plot.colours`), so the two
pictures agree and the JS keeps no table of its own. A target's probability is a metric like
the others (`target_metric`), keyed by the label the target was asked with.

>>> from envoykit.results.lens import LensResult
>>> values, metric = metric_grid(LensResult.example(), "entropy")
>>> values.shape, metric.title, metric.cmap
((3, 2), 'entropy (nats)', 'magma_r')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # types only: results draw through this module, so it must not import them
    from envoykit.results.lens import LensResult, TargetTrace

# Robust colour limits (`Metric.range`) from this many values up: below it, percentiles
# would only drop real cells.
_ROBUST_FROM = 20
# The smallest half-range of a centred scale: changes of float rounding stay pale.
_SMALLEST_CHANGE = 1e-3


@dataclass(frozen=True)
class Metric:
    """One quantity a heatmap colours cells by.

    ``limits`` are the values the colour map's ends stand for; None takes the data's own
    range, for unbounded quantities (entropy, KL) whose useful range depends on the model.
    ``centred``: a signed change, whose own range is ``±`` its largest size, so no change is
    the colour map's middle whatever the data.
    """

    key: str
    label: str
    units: str
    limits: tuple[float, float] | None
    cmap: str
    centred: bool = False

    @property
    def title(self) -> str:
        """The label with its units, for an axis or a legend."""
        return f"{self.label} ({self.units})" if self.units else self.label

    def range(self, values: np.ndarray) -> tuple[float, float]:
        """Colour limits for ``values``: the fixed ones, else robust ones.

        Robust limits are the finite values' 1st and 99th percentiles, so that a few cells
        far from the rest (the embedding's KL to the final layer, 0-157 nats while every
        other layer is under 10) do not squeeze every other cell into one colour; cells
        beyond them take the end colours. Fewer than `_ROBUST_FROM` values, or percentiles
        that meet, fall back to the whole range. A range never collapses to a point.
        """
        if self.limits is not None:
            return self.limits
        finite = np.asarray(values, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        if self.centred:
            size = max(float(np.abs(finite).max()) if finite.size else 0.0, _SMALLEST_CHANGE)
            return (-size, size)
        if not finite.size:
            return (0.0, 1.0)
        low, high = float(finite.min()), float(finite.max())
        if finite.size >= _ROBUST_FROM:
            robust_low, robust_high = (float(v) for v in np.percentile(finite, [1, 99]))
            if robust_high > robust_low:
                low, high = robust_low, robust_high
        return (low, high if high > low else low + 1.0)

    def scale(self, values: np.ndarray) -> dict[str, Any]:
        """The definition as the browser needs it to colour ``values`` (JSON-ready);
        ``robust`` says the limits are percentiles of the values, not their ends."""
        vmin, vmax = self.range(values)
        finite = np.asarray(values, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        robust = (
            self.limits is None
            and not self.centred
            and finite.size > 0
            and (vmin > finite.min() or vmax < finite.max())
        )
        return {
            "key": self.key,
            "label": self.label,
            "units": self.units,
            "cmap": self.cmap,
            "vmin": vmin,
            "vmax": vmax,
            "robust": bool(robust),
        }


METRICS: dict[str, Metric] = {
    metric.key: metric
    for metric in (
        Metric("prob", "top-1 probability", "", (0.0, 1.0), "Blues"),
        Metric("entropy", "entropy", "nats", None, "magma_r"),
        Metric("kl", "KL(final || layer)", "nats", None, "viridis_r"),
    )
}


def target_metric(trace: TargetTrace) -> Metric:
    """A target token's probability as a metric, keyed by the label it was asked with."""
    return Metric(trace.label, f"p({trace.token!r})", "", (0.0, 1.0), "Greens")


def metric_keys(res: LensResult) -> list[str]:
    """Every metric ``res`` can be coloured by: the built-in ones, then its targets."""
    return [*METRICS, *res.target_labels]


def metric_grid(res: LensResult, key: str) -> tuple[np.ndarray, Metric]:
    """The ``[layers, positions]`` values of metric ``key`` in ``res``, and its definition.

    ``key`` is one of `METRICS` or a target (its label, token text or id, as
    `LensResult.target` takes it).
    """
    if key in METRICS:
        values = {"prob": res.top_probs[..., 0], "entropy": res.entropy, "kl": res.kl}[key]
        return values, METRICS[key]
    try:
        trace = res.target(key)
    except KeyError:
        raise KeyError(
            f"unknown metric {key!r}: use one of {list(METRICS)} or a target "
            f"{list(res.target_labels)}"
        ) from None
    return trace.prob, target_metric(trace)


# The diff's metrics, as `plot.compare` colours them: JS divergence lies in [0, ln 2]; a
# change of probability in [-1, 1], on a diverging map centred on no change.
JS = Metric("js", "JS divergence", "nats", (0.0, float(np.log(2))), "Reds")


def delta_metric(key: str, token: str, names: Sequence[str] = ("a", "b")) -> Metric:
    """The change of ``token``'s probability from run ``names[0]`` to run ``names[1]``,
    coloured on a scale centred at no change and fitted to the largest change."""
    label = f"Δ p({token!r}), {names[1]} − {names[0]}"
    return Metric(key, label, "", None, "RdBu_r", centred=True)
