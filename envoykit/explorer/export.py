"""Saving what the explorer shows: a figure, the result itself, or a standalone page.

The standalone page carries every panel the explorer showed: the interactive heatmap, then
each other panel (the diff, the trajectory, the attribution, the sweep) as a figure under its
title. It is a file people share, so nothing from the result is ever parsed as HTML: the
figures are PNG images (one per colour scheme), their titles, the prompt and the model name
are escaped, and the state travels as JSON inside ``<script type="application/json">`` with
``<``, ``>`` and ``&`` written as ``\\u`` escapes, so no token can close the element or
open a comment in it. The page's own code (``widgets/standalone.js``) arrives as a ``data:``
URL and renders the same ``heatmap.js`` the widget runs, which builds every node from text.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envoykit.errors import InvalidRequest
from envoykit.explorer.assets import asset, module
from envoykit.explorer.outputs import figure_html, themed_pngs
from envoykit.explorer.payload import heatmap_data
from envoykit.results.lens import LensResult

SUFFIXES = (".png", ".svg", ".json", ".html")


def save(
    res: LensResult,
    metric: str,
    path: str | Path,
    panels: Sequence[tuple[str, Any]] = (),
    limits: dict[str, Any] | None = None,
) -> Path:
    """Save ``res`` by the suffix of ``path``: ``.png``/``.svg`` (the matplotlib heatmap of
    ``metric``), ``.json`` (`LensResult.to_json`) or ``.html`` (`standalone_html`, with the
    ``panels``: ``(title, matplotlib figure)`` pairs). ``limits``: the colour scale set by
    hand (`Heatmap.limits`), in the figure and the page alike."""
    limits = dict(limits or {})
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".png", ".svg"):
        import matplotlib.pyplot as plt

        from envoykit import plot

        figure = plot.heatmap(res, metric, **limits)
        figure.savefig(path)
        plt.close(figure)
    elif suffix == ".json":
        res.to_json(str(path))
    elif suffix == ".html":
        path.write_text(standalone_html(res, metric, panels, limits), encoding="utf-8")
    else:
        raise InvalidRequest(f"cannot export to {suffix!r}: use {', '.join(SUFFIXES)}")
    return path


def standalone_html(
    res: LensResult,
    metric: str = "prob",
    panels: Sequence[tuple[str, Any]] = (),
    limits: dict[str, Any] | None = None,
) -> str:
    """A self-contained page drawing the interactive heatmap of ``res``, then each of
    ``panels`` (``(title, matplotlib figure)``) as an image under its title: no kernel, no
    network.

    The same ``heatmap.js`` runs against a stand-in for the anywidget model that keeps the
    state in the page (``widgets/standalone.js``); a metric menu replaces the explorer's
    dropdown. The page follows the reader's light or dark colour scheme.
    """
    state: dict[str, Any] = {
        "data": heatmap_data(res),
        "metric": metric,
        "selected": None,
        "pinned": [],
        "limits": dict(limits or {}),
    }
    model = str(res.meta.get("model", "stored result"))
    script = base64.b64encode(asset("standalone.js").encode()).decode()
    what, prompt = html.escape(res.run_label), html.escape(repr(res.prompt))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{what}: {html.escape(res.prompt[:60])}</title>
<style>{asset("explorer.css")}</style></head>
<body class="ek-page"><h3>{what.capitalize()} of <code>{prompt}</code></h3>
<p>{html.escape(model)} · metric <select id="ek-metric"></select> ·
hover a cell for its top-{res.top_ids.shape[-1]}, click it to keep the tooltip open
(Esc closes it)</p>
<div id="ek-root"></div>
{"".join(_panel_html(title, figure) for title, figure in panels)}
<script type="application/json" id="ek-state">{_script_json(state)}</script>
<script type="application/json" id="ek-heatmap-js">{_script_json(module("heatmap.js"))}</script>
<script type="module" src="data:text/javascript;base64,{script}"></script>
</body></html>
"""


def _script_json(value: Any) -> str:
    """JSON that is inert inside a ``<script>`` element, whatever text it carries."""
    text = json.dumps(value, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _panel_html(title: str, figure: Any) -> str:
    """A panel of the page: its title (escaped) over its figure, in the ink of the reader's
    colour scheme (`outputs.figure_html`)."""
    return (
        f'<section class="ek-panel"><h4>{html.escape(title)}</h4>'
        f"{figure_html(*themed_pngs(figure), title)}</section>\n"
    )
