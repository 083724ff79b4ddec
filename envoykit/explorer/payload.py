"""What the browser views receive: a `LensResult` and an engine's locations shaped as JSON.

``heatmap_data`` is the heatmap's ``data`` traitlet (its layout is the ``Payload`` typedef at
the top of ``widgets/heatmap.js``); ``picker_layers`` and ``result_layers`` are the layer
picker's ``layers``. Every metric's colouring comes from `envoykit.metrics`, the definition
the matplotlib heatmap uses too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envoykit.metrics import metric_grid, metric_keys
from envoykit.result import LensResult

# Digits kept in the JSON: a tooltip shows four, and fewer digits are fewer bytes.
PROB_DECIMALS = 6


def json_grid(values: np.ndarray) -> list:
    """Nested lists for JSON, rounded to what a tooltip can show; NaN becomes None."""
    values = np.asarray(values, dtype=np.float64)
    out = np.round(values, PROB_DECIMALS).astype(object)
    out[~np.isfinite(values)] = None
    return out.tolist()


def heatmap_data(res: LensResult) -> dict[str, Any]:
    """What the heatmap view draws: labels, the top-k ids of every cell (their text in
    ``vocab``) and one grid per metric with its colour scale.

    Every metric's grid is sent at once, so switching the metric needs no round trip.
    """
    grids = {}
    for key in metric_keys(res):
        values, metric = metric_grid(res, key)
        grids[key] = {**metric.scale(values), "values": json_grid(values)}
    return {
        "prompt": res.prompt,
        "layer_labels": res.layer_labels,
        "tokens": list(res.tokens),
        "top_ids": res.top_ids.tolist(),
        # Each distinct token once (by id), not once per cell: a tenth of the bytes at k=10.
        "vocab": {str(int(i)): str(t) for i, t in zip(res.top_ids.flat, res.top_tokens.flat)},
        "top_probs": json_grid(res.top_probs),
        "grids": grids,
    }


def picker_layers(locations: list[Any]) -> list[dict[str, Any]]:
    """Lens layers from an engine's whole-valued locations (`Engine.locations`).

    Layer 0 is the embedding, layer ``i`` the output of decoder layer ``i - 1`` (0-based);
    each carries its attention- and MLP-output locations.
    """
    items: dict[int, dict[str, Any]] = {}
    for loc in locations:
        if loc.kind == "embed":
            items[0] = {"layer": 0, "label": "embed", "path": loc.path, "subs": []}
        elif loc.kind == "layer":
            n = loc.layer + 1
            items.setdefault(n, {"layer": n, "label": str(n), "subs": []})["path"] = loc.path
        elif loc.kind in ("attn", "mlp") and loc.layer is not None:
            n = loc.layer + 1
            item = items.setdefault(n, {"layer": n, "label": str(n), "path": "", "subs": []})
            item["subs"].append({"kind": loc.kind, "path": loc.path})
    return [items[n] for n in sorted(items)]


def result_layers(res: LensResult) -> list[dict[str, Any]]:
    """Picker items for a stored result: its layers, with no locations to name."""
    return [
        {"layer": int(n), "label": label, "path": "", "subs": []}
        for n, label in zip(res.layers, res.layer_labels)
    ]
