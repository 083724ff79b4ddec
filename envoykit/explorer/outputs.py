"""What the explorer's plain ipywidgets show: a figure or a line of text in an ``Output``,
a message in an ``HTML`` widget. A figure is drawn for either JupyterLab theme (`neutral`).

ipywidgets' ``HTML`` renders its value as markup, so a message is escaped: it may quote a
token or a prompt. The explorer sets ``Output.outputs`` directly instead of printing inside
``with output:``, so a panel shows exactly one thing, and draws on a bare matplotlib
``Figure``, never through pyplot (whose figures a notebook would also show under the cell,
and keep alive).
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from envoykit.errors import EnvoykitError

# What the explorer shows as a message instead of a traceback: envoykit's own refusals, and
# what nnsight raises for an error on the ranks (a RuntimeError naming the rank's error).
ENGINE_ERRORS = (EnvoykitError, RuntimeError)


# The grey of a panel figure's text, axes and legend: legible on the light and the dark
# theme alike, since the kernel does not know which one the page shows.
NEUTRAL = "#8c8c8c"


def figure_output(figure: Any, text: str) -> dict[str, Any]:
    """``figure`` as a PNG for either theme (`neutral`); ``text`` is its plain-text
    stand-in."""
    neutral(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", transparent=True)
    return {
        "output_type": "display_data",
        "data": {"image/png": base64.b64encode(buffer.getvalue()).decode(), "text/plain": text},
        "metadata": {},
    }


def neutral(figure: Any) -> None:
    """Make ``figure`` readable on a light or a dark page: no background, and every piece
    of text, tick, spine and legend frame drawn in the default colour turned `NEUTRAL`
    (text given a colour of its own, such as a cell's contrast colour, is left alone)."""
    import matplotlib
    from matplotlib.colors import same_color
    from matplotlib.text import Text

    default = matplotlib.rcParams["text.color"]
    for item in figure.findobj(Text):
        if same_color(item.get_color(), default):
            item.set_color(NEUTRAL)
    for ax in figure.axes:
        ax.set_facecolor("none")
        ax.tick_params(colors=NEUTRAL, which="both")
        for spine in ax.spines.values():
            spine.set_edgecolor(NEUTRAL)
        legend = ax.get_legend()
        if legend is not None:
            legend.get_frame().set_facecolor("none")
            legend.get_frame().set_edgecolor(NEUTRAL)


def text_output(text: str) -> dict[str, Any]:
    """``text`` as one line of standard output (an ``Output`` shows it as plain text)."""
    return {"output_type": "stream", "name": "stdout", "text": text + "\n"}


# Colours of messages: the theme's, with the light theme's as fallback.
ERROR = "var(--jp-error-color1, #c92a2a)"
WARNING = "var(--jp-warn-color1, #e67700)"
TEXT = "var(--jp-ui-font-color1, #333)"


def message_html(text: str, *, error: bool = False) -> str:
    """``text`` (escaped: it may quote model text) for an ipywidgets ``HTML``; "" for none."""
    if not text:
        return ""
    colour = ERROR if error else TEXT
    return f'<div style="color:{colour};white-space:pre-wrap">{html.escape(text)}</div>'
