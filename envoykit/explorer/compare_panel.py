"""`ComparePanel`: the second prompt's lens (cells to drag) and the diff of two runs.

In compare mode the explorer lenses a second prompt beside the first. Its heatmap is the
*source* of patches: a cell dragged from it onto the first prompt's heatmap copies that
cell into the first prompt's run (`drop_patch` says which `Patch` a drop means). Under it, a
diff heatmap draws a `CompareResult`: the two prompts, or, once a cell is patched in, the
first prompt's run against its patched run. The panel only draws; the controller runs the
engine. Its headers are ipywidgets ``HTML``, so their text is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets

from envoykit.analyses.patching import Patch
from envoykit.errors import InvalidRequest
from envoykit.explorer.outputs import message_html
from envoykit.explorer.payload import compare_data, heatmap_data
from envoykit.explorer.views import Heatmap
from envoykit.results.compare import CompareResult
from envoykit.results.lens import LensResult

# What a drop does, said where the cells are dragged from.
DRAG_HINT = (
    "drag a cell onto the first prompt's heatmap to patch it in, or click it and press "
    "Patch it in (the first heatmap's selected column, else the same position): the patch "
    "copies this cell's row (its layer and site) at this position into the same row at the "
    "position you drop on; the row you drop on does not matter, only its column"
)


def drop_patch(
    source: LensResult, source_cell: Sequence[int], target: LensResult, target_cell: Sequence[int]
) -> Patch:
    """The patch a drop means: ``source``'s row at ``source_cell`` (its layer and site) and
    position, written at the position of ``target_cell``'s column in ``target``'s prompt.

    Cells are ``[layer_index, position_index]`` of each heatmap. The target's row is not
    used: `Patch` copies a cell into the same layer and site of the other run.
    """
    row, column = _cell(source, source_cell, "dragged")
    _, target_column = _cell(target, target_cell, "dropped on")
    return Patch(
        source=source.prompt,
        layer=int(source.layers[row]),
        site=source.sites[row],
        source_position=int(source.positions[column]),
        target_position=int(target.positions[target_column]),
    )


def patched_cell(res: LensResult, patch: Patch) -> list[int] | None:
    """``[layer_index, position_index]`` of the cell ``patch`` wrote in ``res``, when shown."""
    rows = list(zip(res.layers.tolist(), res.sites))
    columns = res.positions.tolist()
    if (patch.layer, patch.site) not in rows or patch.target_position not in columns:
        return None
    return [rows.index((patch.layer, patch.site)), columns.index(patch.target_position)]


def describe_patch(source: LensResult, patch: Patch, target: LensResult) -> str:
    """The patch in words, with the tokens at both positions."""
    row = source.layer_labels[
        list(zip(source.layers.tolist(), source.sites)).index((patch.layer, patch.site))
    ]
    there = source.tokens[source.positions.tolist().index(patch.source_position)]
    here = target.tokens[target.positions.tolist().index(patch.target_position)]
    return (
        f"patched: row {row} of {source.prompt!r} at position {patch.source_position} "
        f"({there!r}) → position {patch.target_position} ({here!r}); Run shows the lens "
        "unpatched"
    )


def _cell(res: LensResult, cell: Sequence[int], what: str) -> tuple[int, int]:
    row, column = (int(i) for i in cell)
    if not (0 <= row < len(res.layers) and 0 <= column < len(res.positions)):
        raise InvalidRequest(
            f"the cell {what}, {list(cell)}, is outside its heatmap of {len(res.layers)} rows "
            f"x {len(res.positions)} positions"
        )
    return row, column


def diff_scale(diff: Heatmap) -> widgets.ToggleButtons:
    """A fitted / ±1 toggle for a diff heatmap's colours: a change of a target's probability
    is coloured fitted to the largest change (the metric's own scale, centred at no change)
    or over the whole -1..1; the JS divergence keeps its own 0..ln 2 either way."""
    toggle = widgets.ToggleButtons(
        options=[("fitted", "fitted"), ("±1", "absolute")],
        value="fitted",
        tooltip="Δp coloured to the largest change shown, or over the whole -1..1",
        style={"button_width": "56px"},
    )

    def apply(_: Any = None) -> None:
        absolute = toggle.value == "absolute" and diff.metric != "js"
        diff.limits = {"vmin": -1.0, "vmax": 1.0, "log": False} if absolute else {}

    toggle.observe(apply, "value")
    diff.observe(apply, "metric")
    return toggle


class ComparePanel(widgets.VBox):
    """The second prompt's heatmap (a drag source of ``group``) over the diff heatmap.

    ``source`` and ``diff`` are the two `Heatmap` views; ``result`` is the `CompareResult`
    drawn in ``diff``, None while it shows a message instead.
    """

    def __init__(self, group: str) -> None:
        self.source_header = widgets.HTML()
        self.source = Heatmap(drag_role="source", drag_group=group)
        self.source.add_class("ek-source-heatmap")
        # Click-to-patch, for a first heatmap scrolled out of reach of a drag.
        self.patch_button = widgets.Button(
            description="Patch it in",
            icon="arrow-up",
            disabled=True,
            tooltip="patch the cell selected here into the first prompt's run",
        )
        self.source.observe(
            lambda change: setattr(self.patch_button, "disabled", change["new"] is None),
            "selected",
        )
        self.diff_header = widgets.HTML()
        self.diff = Heatmap(metric="js")
        self.diff.add_class("ek-diff-heatmap")
        self.diff_scale = diff_scale(self.diff)
        self.result: CompareResult | None = None
        diff_title = widgets.HBox([self.diff_header, self.diff_scale])
        super().__init__(
            [self.source_header, self.source, self.patch_button, diff_title, self.diff]
        )
        self.add_class("ek-compare")

    def show_source(self, res: LensResult) -> None:
        """Draw the second prompt's lens, its cells ready to drag."""
        self.source.data = heatmap_data(res)
        self.source_header.value = _head(f"second prompt: {res.prompt!r}", DRAG_HINT)

    def show_diff(self, res: CompareResult, names: Sequence[str], about: str) -> None:
        """Draw ``res``, its runs named ``names`` in tooltips and legends; ``about`` says
        which two runs they are."""
        self.result = res
        self.diff.data = compare_data(res, names)
        self.diff_header.value = _head(
            f"diff: {about}",
            "JS divergence of the two next-token distributions per cell (or Δ p of the "
            f"target the metric names), the top-1 token as {names[0]}→{names[1]} where they "
            "differ; rows are each picked layer's residual stream",
        )

    def clear(self) -> None:
        """Show nothing: the last Run compared nothing."""
        self.source.data = {}
        self.source_header.value = ""
        self.say_diff("")

    def say_diff(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in place of the diff (``details``: a traceback, folded)."""
        self.result = None
        self.diff.data = {}
        self.diff_header.value = _head("diff", text, error=error, details=details)


def _head(title: str, text: str, *, error: bool = False, details: str = "") -> str:
    """A bold title over a line of text, both escaped (they quote prompts)."""
    return f"<b>{html.escape(title)}</b>{message_html(text, error=error, details=details)}"
