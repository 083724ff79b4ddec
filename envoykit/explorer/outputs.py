"""What the explorer's plain ipywidgets show: a figure or a line of text in an ``Output``,
a message in an ``HTML`` widget. A figure comes in both JupyterLab themes' inks (`figure_output`).

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
import traceback
from typing import Any

from envoykit.errors import EnvoykitError

# What the explorer shows as a one-line message: envoykit's own refusals (a bad request, a
# dead engine, a cancel). Anything else is a bug, shown with its traceback (`failure`).
ENGINE_ERRORS = (EnvoykitError,)


def failure(err: BaseException) -> tuple[str, str]:
    """What to say of ``err``: its line, and for an error envoykit did not mean to raise
    (a bug, or a library's error it let through) the traceback, to show under a collapsed
    "details" (`message_html`) where a one-line message would hide where it came from."""
    if isinstance(err, ENGINE_ERRORS):
        return str(err), ""
    return f"{type(err).__name__}: {err}", "".join(traceback.format_exception(err))


# The ink of a panel figure's default-coloured text, ticks, spines and legend frame on each
# JupyterLab theme (near its --jp-ui-font-color1).
INK = {"light": "#212121", "dark": "#dedede"}
# The mark of a text `themed_pngs` inked: it no longer has the default colour.
_INKED = "_envoykit_inked"


def figure_output(figure: Any, text: str) -> dict[str, Any]:
    """``figure`` drawn in both themes' inks (`themed_pngs`), as HTML that shows the one of
    the page's theme (`figure_html`); ``image/png`` (the light one) and ``text`` for a
    front end without HTML."""
    light, dark = themed_pngs(figure)
    return {
        "output_type": "display_data",
        "data": {
            "text/html": figure_html(light, dark, text),
            "image/png": light,
            "text/plain": text,
        },
        "metadata": {},
    }


def figure_html(light: str, dark: str, alt: str) -> str:
    """Two images of one figure (base64 PNGs); ``explorer.css`` shows the dark one under
    JupyterLab's dark theme (``body[data-jp-theme-light="false"]``) or, on the standalone
    page, a dark colour scheme. Without that style sheet the light one shows alone."""
    alt = html.escape(alt, quote=True)
    return (
        f'<div class="ek-figure"><img class="ek-figure-light" alt="{alt}" '
        f'src="data:image/png;base64,{light}"><img class="ek-figure-dark" alt="{alt}" '
        f'style="display:none" src="data:image/png;base64,{dark}"></div>'
    )


def themed_pngs(figure: Any) -> tuple[str, str]:
    """``figure`` as two base64 PNGs with no background, for the light and the dark theme.

    What is drawn in the default ink (black) is inked `INK` of each theme: titles, labels,
    tick labels, legend text, ticks, spines, legend frames and black lines (a running sum, a
    total). Text placed in the data (``ax.text``: a token written on a heatmap cell) keeps
    its colour, since the cell under it does not change with the theme, and so does
    anything given a colour of its own. The kernel does not know which theme the page
    shows, and the page may switch at any time, so both travel."""
    from matplotlib.lines import Line2D
    from matplotlib.text import Text

    placed = {id(text) for ax in figure.axes for text in ax.texts}
    texts = [item for item in figure.findobj(Text) if id(item) not in placed and _default_ink(item)]
    lines = [item for item in figure.findobj(Line2D) if _default_ink(item)]
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    for ax in figure.axes:
        ax.set_facecolor("none")
    for legend in legends:
        legend.get_frame().set_facecolor("none")
    for item in (*texts, *lines):
        setattr(item, _INKED, True)  # drawn again (the export), it is inked again
    pngs = []
    for colour in (INK["light"], INK["dark"]):
        for item in (*texts, *lines):
            item.set_color(colour)  # a line's markers follow it unless coloured apart
        for ax in figure.axes:
            ax.tick_params(colors=colour, which="both")
            for spine in ax.spines.values():
                spine.set_edgecolor(colour)
        for legend in legends:
            legend.get_frame().set_edgecolor(colour)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", transparent=True)
        pngs.append(base64.b64encode(buffer.getvalue()).decode())
    return pngs[0], pngs[1]


def _default_ink(item: Any) -> bool:
    """Whether ``item`` (a text or a line) is drawn in the default ink, or was inked by
    `themed_pngs`."""
    import matplotlib
    from matplotlib.colors import same_color

    default = matplotlib.rcParams["text.color"]
    return getattr(item, _INKED, False) or same_color(item.get_color(), default)


def text_output(text: str) -> dict[str, Any]:
    """``text`` as one line of standard output (an ``Output`` shows it as plain text)."""
    return {"output_type": "stream", "name": "stdout", "text": text + "\n"}


# Colours of messages: the theme's, with the light theme's as fallback.
ERROR = "var(--jp-error-color1, #c92a2a)"
WARNING = "var(--jp-warn-color1, #e67700)"
TEXT = "var(--jp-ui-font-color1, #333)"


def message_html(text: str, *, error: bool = False, details: str = "") -> str:
    """``text`` (escaped: it may quote model text) for an ipywidgets ``HTML``; "" for none.
    ``details`` (a traceback) goes under a collapsed "details" below it."""
    if not text:
        return ""
    colour = ERROR if error else TEXT
    folded = (
        f'<details class="ek-details"><summary>details</summary>'
        f'<pre style="white-space:pre-wrap">{html.escape(details)}</pre></details>'
        if details
        else ""
    )
    return f'<div style="color:{colour};white-space:pre-wrap">{html.escape(text)}</div>{folded}'
