"""`AttributionPanel`: the direct logit attribution at the selected heatmap cell's position.

A lens cell says what the model would predict at a position if it stopped at that row; the
attribution says who wrote the prediction it does make there: how much the embedding and
each layer's attention and MLP add to one target's final logit (`Engine.attribute`, drawn
by `plot.attribution`). The panel only draws, and offers the token it measures (``target``, a
`TargetChoice` beside its title); the controller takes the position from the selected cell
and calls the engine. Its header is an ipywidgets ``HTML``, so its text is escaped.
"""

from __future__ import annotations

import textwrap
from typing import Any

import ipywidgets as widgets

from envoykit import plot
from envoykit.explorer.outputs import PANEL_FIGURE, figure_output, message_html
from envoykit.explorer.target_choice import TargetChoice
from envoykit.results.attribution import AttributionResult

TITLE = "Direct logit attribution"


class AttributionPanel(widgets.VBox):
    """A header — what is drawn, or why nothing is — over the attribution figure.

    ``result`` is the `AttributionResult` drawn and ``figure`` its matplotlib figure; both
    are None while the panel shows a message instead.
    """

    def __init__(self) -> None:
        self.target = TargetChoice[int]("the token whose logit is attributed")
        self.header = widgets.HTML()
        self.view = widgets.Output()
        self.result: AttributionResult | None = None
        self.figure: Any = None
        title = widgets.HTML(f"<b>{TITLE}</b>")
        super().__init__([widgets.HBox([title, self.target]), self.header, self.view])
        self.add_class("ek-attribution")

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in place of a figure."""
        self.result, self.figure = None, None
        self.view.outputs = ()
        self._head(text, error=error, details=details)

    def busy(self, text: str) -> None:
        """Say what is being computed; the figure drawn so far stays until the new one lands."""
        self._head(f"{text}…")

    def show(self, att: AttributionResult, target: int, *, layer: int, row: str) -> None:
        """Draw ``target`` at ``att``'s one position, with layer ``layer`` (heatmap row
        ``row``, the cell clicked) shaded."""
        from matplotlib.figure import Figure

        n_layers = int(att.component_layers.max())
        # A panel's width with a few layers, wider (the panel scrolls) for many.
        width = min(max(PANEL_FIGURE[0], 3.0 + 0.22 * n_layers), 10.0)
        figure = Figure(figsize=(width, PANEL_FIGURE[1] - 0.2))
        ax = figure.subplots()
        plot.attribution(att, target, position=0, ax=ax)
        ax.set_title(textwrap.fill(ax.get_title(), 46), fontsize=9)  # the panel's width
        ax.axvspan(layer - 0.5, layer + 0.5, color="C3", alpha=0.12, label=f"row {row}")
        ax.legend(loc="best", fontsize=8)
        figure.tight_layout()
        token = att.target_tokens[att.target_index(target)]
        what = f"logit({token!r}) at position {int(att.positions[0])} ({att.tokens[0]!r})"
        self.result, self.figure = att, figure
        self.view.outputs = (figure_output(figure, f"direct logit attribution of {what}"),)
        self._head(f"{what}; row {row} shaded")

    def _head(self, text: str, *, error: bool = False, details: str = "") -> None:
        self.header.value = message_html(text, error=error, details=details)
