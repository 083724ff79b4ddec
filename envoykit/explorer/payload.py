"""What the browser views receive: a `LensResult` and an engine's locations shaped as JSON.

``heatmap_data`` is the heatmap's ``data`` traitlet (its layout is the ``Payload`` typedef at
the top of ``widgets/heatmap.js``); ``picker_layers`` and ``result_layers`` are the layer
picker's ``layers`` (the ``Item`` typedef at the top of ``widgets/layer_picker.js``): one
column per layer, with the rows it offers. Every metric's colouring comes from
`envoykit.metrics`, the definition the matplotlib heatmap uses too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envoykit.explorer.rows import RESID, SUBLAYER_SITES, ordered
from envoykit.metrics import metric_grid, metric_keys
from envoykit.result import SITE_SUFFIXES, LensResult

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


def picker_layers(locations: list[Any], *, sublayers: bool = True) -> list[dict[str, Any]]:
    """Picker items from an engine's whole-valued locations (`Engine.locations`).

    Layer 0 is the embedding, layer ``i`` the output of decoder layer ``i - 1`` (0-based).
    With ``sublayers`` (the model's readout knows where its MLP pre-norm is, so the lens can
    read inside a layer) each decoder layer also offers its sub-layer rows, titled with the
    module whose output they read where there is one.
    """
    layer_paths: dict[int, str] = {}
    block_paths: dict[tuple[int, str], str] = {}
    for loc in locations:
        if loc.kind == "embed":
            layer_paths[0] = loc.path
        elif loc.kind == "layer":
            layer_paths[loc.layer + 1] = loc.path
        elif loc.kind in ("attn", "mlp") and loc.layer is not None:
            block_paths[(loc.layer + 1, loc.kind)] = loc.path
    items = []
    for n in sorted(layer_paths):
        subs = SUBLAYER_SITES if n and sublayers else ()
        item = _picker_item(n, layer_paths[n], resid=True)
        item["subs"] = [_picker_site(n, site, block_paths.get((n, site), "")) for site in subs]
        items.append(item)
    return items


def result_layers(res: LensResult) -> list[dict[str, Any]]:
    """Picker items for a stored result: the rows it holds, with no modules to name."""
    items: dict[int, dict[str, Any]] = {}
    for layer, site in ordered(zip(res.layers.tolist(), res.sites)):
        item = items.setdefault(layer, _picker_item(layer, "", resid=False))
        if site == RESID:
            item["resid"] = True
        else:
            item["subs"].append(_picker_site(layer, site, ""))
    return list(items.values())


# What each row of the picker reads, for its hover text.
_READS = {
    "resid": "the residual stream after layer {n}",
    "attn": "what layer {n}'s attention writes into the stream",
    "resid_mid": "the residual stream between layer {n}'s attention and MLP",
    "mlp": "what layer {n}'s MLP writes into the stream",
}


def _picker_item(layer: int, path: str, *, resid: bool) -> dict[str, Any]:
    """One column of the picker: ``resid`` says whether its stream row can be picked."""
    label = "embed" if layer == 0 else str(layer)
    reads = "the token embeddings" if layer == 0 else _READS[RESID].format(n=layer)
    return {
        "layer": layer,
        "label": label,
        "title": _title(label, reads, path),
        "path": path,
        "resid": resid,
        "subs": [],
    }


def _picker_site(layer: int, site: str, path: str) -> dict[str, Any]:
    """One sub-layer row of a picker column, labelled like its heatmap row (``12.attn``)."""
    chip = SITE_SUFFIXES[site].lstrip(".")
    title = _title(f"{layer}.{chip}", _READS[site].format(n=layer), path)
    return {"site": site, "label": chip, "title": title, "path": path}


def _title(label: str, reads: str, path: str) -> str:
    return f"{label}: {reads}" + (f" ({path})" if path else "")
