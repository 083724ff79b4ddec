"""The anywidget views: `Heatmap`, `LayerPicker`, `AttentionView` and `FeatureChips`.

Each is a Python class of synced traitlets plus one framework-free ES module in ``widgets/``;
state crosses between kernel and browser only through these traitlets, so every interaction
can be driven and checked from Python. The module sources are class attributes, read once
(`assets.asset`) and shared by every instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import anywidget
import traitlets

from envoykit.analyses.request import Row
from envoykit.explorer.assets import asset, module
from envoykit.explorer.payload import heatmap_data
from envoykit.explorer.rows import RESID, SUBLAYER_SITES, ordered, picked
from envoykit.results.lens import LensResult

# "": no dragging; "source": cells can be dragged out; "target": takes drops of its group.
DRAG_ROLES = ("", "source", "target")

# The List and Dict traits below made with ``allow_none=True``, typed as what they hold:
# traitlets types a List or a Dict as never None (their constructors lack the ``allow_none``
# overloads of its other traits), hence the ignore where each is made.
_CellTrait = traitlets.TraitType[list[int] | None, list[int] | None]
_DictTrait = traitlets.TraitType[dict[str, Any] | None, dict[str, Any] | None]


def _is_cell(cell: Any) -> bool:
    """Whether ``cell`` is ``[layer_index, position_index]``: two non-negative integers."""
    return (
        isinstance(cell, (list, tuple))
        and len(cell) == 2
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in cell)
    )


class Heatmap(anywidget.AnyWidget):
    """Layers x positions of a `LensResult` on a canvas; hover, select a cell, pin tokens,
    drag a cell onto another heatmap.

    ``data`` is what the canvas draws (`heatmap_data`, or `compare_data` for a diff),
    ``metric`` the grid it colours by, ``selected`` a ``[layer_index, position_index]`` or
    None, ``pinned`` the token ids clicked in a tooltip.

    Dragging crosses widgets in the page, not the kernel: a heatmap whose ``drag_role`` is
    ``"source"`` lets its cells be dragged, and one whose role is ``"target"`` and whose
    ``drag_group`` is the same takes the drop and sets its ``drop`` to ``{"source": cell
    dragged, "target": cell dropped on}`` (cells as ``[layer_index, position_index]``). The
    group keeps two explorers on one page apart. ``drop`` is an event: whoever handles it
    sets it back to None, so the same drop made again is seen again.
    """

    _esm = module("heatmap.js")
    _css = asset("explorer.css")
    data = traitlets.Dict().tag(sync=True)
    metric = traitlets.Unicode("prob").tag(sync=True)
    selected: _CellTrait = traitlets.List(default_value=None, allow_none=True).tag(sync=True)  # type: ignore[assignment]
    pinned = traitlets.List(traitlets.Int()).tag(sync=True)
    drag_role = traitlets.Enum(DRAG_ROLES, default_value="").tag(sync=True)
    drag_group = traitlets.Unicode("").tag(sync=True)
    drop: _DictTrait = traitlets.Dict(default_value=None, allow_none=True).tag(sync=True)  # type: ignore[assignment]
    # The colour scale's limits as set by a person ({"vmin", "vmax": a number or None for
    # the metric's own, "log": bool}); {} draws with the metric's.
    limits = traitlets.Dict().tag(sync=True)
    # Whether what is drawn is a run older than the one last asked for (it was refused):
    # the page dims it. A trait, not a DOM class: a class added after the first render did
    # not reach the page.
    stale = traitlets.Bool(False).tag(sync=True)

    def __init__(self, result: LensResult | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if result is not None:
            self.data = heatmap_data(result)

    @traitlets.validate("limits")
    def _check_limits(self, proposal: dict[str, Any]) -> dict[str, Any]:
        limits = dict(proposal["value"])
        unknown = set(limits) - {"vmin", "vmax", "log"}
        bounds = [limits.get(key) for key in ("vmin", "vmax")]
        numbers = all(
            b is None or (isinstance(b, (int, float)) and not isinstance(b, bool)) for b in bounds
        )
        if unknown or not numbers or not isinstance(limits.get("log", False), bool):
            raise traitlets.TraitError(
                f"limits are {{'vmin': number or None, 'vmax': number or None, 'log': bool}}, "
                f"not {proposal['value']!r}"
            )
        low, high = bounds
        if low is not None and high is not None and low >= high:
            raise traitlets.TraitError(f"the colour minimum {low} is not below the maximum {high}")
        return limits

    @traitlets.validate("drop")
    def _check_drop(self, proposal: dict[str, Any]) -> dict[str, list[int]] | None:
        drop = proposal["value"]
        if drop is None:
            return None
        cells = [drop.get(key) for key in ("source", "target")]
        if set(drop) != {"source", "target"} or not all(map(_is_cell, cells)):
            raise traitlets.TraitError(
                f"a drop is {{'source': [layer_index, position_index], 'target': [...]}}, "
                f"not {drop!r}"
            )
        return {"source": list(cells[0]), "target": list(cells[1])}


class LayerPicker(anywidget.AnyWidget):
    """A grid of lens rows — a column per layer, a line per site — to click or drag through.

    ``layers`` holds one column per lens layer (`picker_layers`). The picked rows are two
    lists: ``selected``, the layer numbers whose stream after the layer (site ``"resid"``)
    is picked — what the picker held before it offered sites, so scripts that set it keep
    working — and ``selected_sites``, the picked sub-layer rows as ``[layer, site]`` pairs
    (site ``"attn"``, ``"resid_mid"`` or ``"mlp"``), kept in the model's order. ``rows``
    joins the two.
    """

    _esm = module("layer_picker.js")
    _css = asset("explorer.css")
    layers = traitlets.List(traitlets.Dict()).tag(sync=True)
    selected = traitlets.List(traitlets.Int()).tag(sync=True)
    selected_sites = traitlets.List(traitlets.List()).tag(sync=True)

    def __init__(self, layers: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if layers is not None:
            self.layers = layers
            self.selected = [item["layer"] for item in layers if item.get("resid", True)]

    @property
    def rows(self) -> list[Row]:
        """The picked ``(layer, site)`` rows, in the model's order."""
        return picked(self.selected, self.selected_sites)

    @rows.setter
    def rows(self, rows: Iterable[Sequence]) -> None:
        rows = ordered(rows)
        with self.hold_sync():
            self.selected = [layer for layer, site in rows if site == RESID]
            self.selected_sites = [[layer, site] for layer, site in rows if site != RESID]

    @traitlets.validate("selected_sites")
    def _check_sites(self, proposal: dict[str, Any]) -> list[list]:
        for row in proposal["value"]:
            layer, site = row if len(row) == 2 else (None, None)
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
                raise traitlets.TraitError(f"a picked site is [layer >= 1, site], not {row!r}")
            if site not in SUBLAYER_SITES:
                raise traitlets.TraitError(f"site {site!r} is not one of {SUBLAYER_SITES}")
        return [list(row) for row in ordered(proposal["value"])]


class AttentionView(anywidget.AnyWidget):
    """A layers x heads grid of what one query attends to, one head's whole pattern, and
    each head's contribution to a target's logit (``data``: `attention_data`).

    A click on a grid cell sets ``selected`` to ``[layer, head]``; whoever owns the view
    answers with that head's pattern in ``data``.
    """

    _esm = module("attention.js")
    _css = asset("explorer.css")
    data = traitlets.Dict().tag(sync=True)
    selected: _CellTrait = traitlets.List(default_value=None, allow_none=True).tag(sync=True)  # type: ignore[assignment]


class FeatureChips(anywidget.AnyWidget):
    """A prompt's tokens, each with its most active SAE features as chips shaded by
    activation (``data``: `chips_data`).

    A click on a chip sets ``selected`` to its feature id, and every chip of that feature is
    marked; whoever owns the view answers with what it shows of the feature.
    """

    _esm = module("features.js")
    _css = asset("explorer.css")
    data = traitlets.Dict().tag(sync=True)
    selected = traitlets.Int(default_value=None, allow_none=True).tag(sync=True)
