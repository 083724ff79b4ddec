"""The two anywidget views: `Heatmap` and `LayerPicker`.

Each is a Python class of synced traitlets plus one framework-free ES module in ``widgets/``;
state crosses between kernel and browser only through these traitlets, so every interaction
can be driven and checked from Python. The module sources are class attributes, read once
(`assets.asset`) and shared by every instance.
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from envoykit.explorer.assets import asset
from envoykit.explorer.payload import heatmap_data
from envoykit.result import LensResult


class Heatmap(anywidget.AnyWidget):
    """Layers x positions of a `LensResult` on a canvas; hover, select a cell, pin tokens.

    ``data`` is what the canvas draws (`heatmap_data`), ``metric`` the grid it colours by,
    ``selected`` a ``[layer_index, position_index]`` or None, ``pinned`` the token ids
    clicked in a tooltip.
    """

    _esm = asset("heatmap.js")
    _css = asset("explorer.css")
    data = traitlets.Dict().tag(sync=True)
    metric = traitlets.Unicode("prob").tag(sync=True)
    selected = traitlets.List(default_value=None, allow_none=True).tag(sync=True)
    pinned = traitlets.List(traitlets.Int()).tag(sync=True)

    def __init__(self, result: LensResult | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if result is not None:
            self.data = heatmap_data(result)


class LayerPicker(anywidget.AnyWidget):
    """A strip of lens layers (with their whole-valued sub-locations); click or drag to pick.

    ``layers`` holds one item per lens layer (`picker_layers`), ``selected`` the picked layer
    numbers.
    """

    _esm = asset("layer_picker.js")
    _css = asset("explorer.css")
    layers = traitlets.List(traitlets.Dict()).tag(sync=True)
    selected = traitlets.List(traitlets.Int()).tag(sync=True)

    def __init__(self, layers: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if layers is not None:
            self.layers = layers
            self.selected = [item["layer"] for item in layers]
