"""What the browser views receive: a `LensResult`, a `CompareResult` and an engine's
locations shaped as JSON.

``heatmap_data`` is the heatmap's ``data`` traitlet (its layout is the ``Payload`` typedef at
the top of ``widgets/heatmap.js``), and so is ``compare_data``: the same view draws the diff of
two runs, with both runs' top-1 token as the tooltip's two rows and ``a→b`` written in the
cells where they differ. ``picker_layers`` and ``result_layers`` are the layer picker's
``layers`` (the ``Item`` typedef at the top of ``widgets/layer_picker.js``): one column per
layer, with the rows it offers. Every metric is a `envoykit.results.metrics.Metric`, so the browser
colours it from the definition's own colour stops; the lens metrics are the ones the
matplotlib heatmap draws, the diff's (`JS`, `delta_metric`) those ``plot.compare`` draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from envoykit.explorer.rows import RESID, SUBLAYER_SITES, ordered
from envoykit.plot.colours import colour_stops
from envoykit.results.attention import AttentionResult
from envoykit.results.compare import CompareResult
from envoykit.results.lens import SITE_SUFFIXES, LensResult
from envoykit.results.metrics import JS, Metric, delta_metric, metric_grid, metric_keys

# Digits kept in the JSON: a tooltip shows four, and fewer digits are fewer bytes.
PROB_DECIMALS = 6


def json_grid(values: np.ndarray) -> list:
    """Nested lists for JSON, rounded to what a tooltip can show; NaN becomes None."""
    values = np.asarray(values, dtype=np.float64)
    out = np.round(values, PROB_DECIMALS).astype(object)
    out[~np.isfinite(values)] = None
    return out.tolist()


def heatmap_data(res: LensResult, marks: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
    """What the heatmap view draws: labels, the top-k ids of every cell (their text in
    ``vocab``) and one grid per metric with its colour scale; ``marks`` are cells
    (``[layer_index, position_index]``) outlined, such as the one a patch wrote.

    Every metric's grid is sent at once, so switching the metric needs no round trip.
    """
    grids = {}
    for key in metric_keys(res):
        values, metric = metric_grid(res, key)
        grids[key] = metric_payload(metric, values)
    return {
        "prompt": res.prompt,
        "run": res.run_label,  # the legend says what was run: tuned, patched, steered
        "layer_labels": res.layer_labels,
        "tokens": list(res.token_labels),  # a repeated token's columns told apart
        "top_ids": res.top_ids.tolist(),
        # Each distinct token once (by id), not once per cell: a tenth of the bytes at k=10.
        "vocab": {str(int(i)): str(t) for i, t in zip(res.top_ids.flat, res.top_tokens.flat)},
        "top_probs": json_grid(res.top_probs),
        "grids": grids,
        "marks": [[int(i) for i in cell] for cell in marks],
    }


def compare_data(res: CompareResult, names: Sequence[str] = ("a", "b")) -> dict[str, Any]:
    """The heatmap view's ``data`` for the diff of two runs named ``names``.

    Grids: ``"js"`` and, for each target (by its label in ``res``), the change of its
    probability. Each cell's tooltip lists the two runs' top-1 tokens (rows labelled by
    ``names``); the cell reads ``top_a→top_b`` where they differ, and a column whose input
    tokens differ is labelled ``a|b``.
    """
    grids = {JS.key: metric_payload(JS, res.js)}
    for label, token in zip(res.target_labels, res.target_tokens):
        grids[label] = metric_payload(delta_metric(label, token, names), res.delta(label))
    shape = res.js.shape
    top_a = np.array(res.top_tokens_a, dtype=object).reshape(shape)
    top_b = np.array(res.top_tokens_b, dtype=object).reshape(shape)
    cell_text = [
        [a if a == b else f"{a}→{b}" for a, b in zip(row_a, row_b)]
        for row_a, row_b in zip(top_a.tolist(), top_b.tolist())
    ]
    vocab = {
        str(int(i)): str(t)
        for ids, tokens in ((res.top_ids_a, top_a), (res.top_ids_b, top_b))
        for i, t in zip(ids.flat, tokens.flat)
    }
    return {
        "prompt": f"{names[0]} vs {names[1]}",
        "layer_labels": res.layer_labels,
        "tokens": [a if a == b else f"{a}|{b}" for a, b in zip(res.tokens_a, res.tokens_b)],
        "top_ids": np.stack([res.top_ids_a, res.top_ids_b], axis=-1).tolist(),
        "top_labels": [str(name) for name in names],
        "vocab": vocab,
        "top_probs": json_grid(np.stack([res.top_probs_a, res.top_probs_b], axis=-1)),
        "cell_text": cell_text,
        "cell_width": cell_width(cell_text),
        "grids": grids,
        "marks": [],
    }


# Cell widths (px) a diff heatmap may take, and what a character of its 10 px font needs.
_CELL_WIDTHS = (52, 160)
_PX_PER_CHAR = 6.2


def cell_width(cell_text: list[list[str]]) -> int:
    """The cell width that shows the longest ``a→b`` of a diff whole (within `_CELL_WIDTHS`:
    longer text is cut in the cell and whole in its tooltip)."""
    longest = max((len(text) for row in cell_text for text in row), default=0)
    low, high = _CELL_WIDTHS
    return int(min(high, max(low, round(longest * _PX_PER_CHAR + 8))))


def picker_layers(
    locations: list[Any], *, sublayers: bool | Sequence[str] = True
) -> list[dict[str, Any]]:
    """Picker items from an engine's whole-valued locations (`Engine.locations`).

    Layer 0 is the embedding, layer ``i`` the output of decoder layer ``i - 1`` (0-based).
    With ``sublayers`` (True for all sub-layer sites, or the sites the model's layers have:
    parallel blocks have no stream between them) each decoder layer also offers its
    sub-layer rows, titled with the module whose output they read where there is one.
    """
    offered = SUBLAYER_SITES if sublayers is True else tuple(sublayers or ())
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
        subs = [site for site in SUBLAYER_SITES if site in offered] if n else ()
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


def attention_data(
    res: AttentionResult,
    query: int,
    selected: Sequence[int] | None = None,
    contributions: tuple[int, str, Iterable[float]] | None = None,
    whole: AttentionResult | None = None,
) -> dict[str, Any]:
    """What the attention view draws (the ``AttentionData`` typedef at the top of
    ``widgets/attention.js``): every layer's and head's weights at query position ``query``
    as strips, the whole pattern of head ``selected`` (``[layer, head]``, read from
    ``whole``, default ``res``), and ``contributions``, ``(layer, target token, per-head
    values)``, as bars."""
    row = int(np.flatnonzero(res.queries == query)[0])
    dense = [[res.pattern(int(a), int(h))[row] for h in res.heads] for a in res.layers]
    pattern = None
    if selected is not None:
        layer, head = (int(i) for i in selected)
        source = res if whole is None else whole
        pattern = {
            "layer": layer,
            "head": head,
            "queries": source.queries.tolist(),
            "weights": json_grid(source.pattern(layer, head)),
        }
    bars = None
    if contributions is not None:
        layer, target, values = contributions
        bars = {"layer": int(layer), "target": target, "values": [float(v) for v in values]}
    return {
        "tokens": list(res.tokens),
        "layers": res.layers.tolist(),
        "heads": res.heads.tolist(),
        "query": int(query),
        "strips": json_grid(np.array(dense)),
        "pattern": pattern,
        "contributions": bars,
    }


def metric_payload(metric: Metric, values: np.ndarray) -> dict[str, Any]:
    """One grid of the heatmap's payload: ``values`` and the scale that colours them, with
    the colour map's stops the browser interpolates between."""
    return {
        **metric.scale(values),
        "stops": list(colour_stops(metric.cmap)),
        "values": json_grid(values),
    }
