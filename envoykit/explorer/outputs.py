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
# A panel figure's size in inches (100 pixels each): as wide as the narrowest panel beside
# the heatmap (360 pixels), which shows it unscaled, so that its 8-point legends read at 11
# pixels.
PANEL_FIGURE = (3.4, 2.4)
# What a panel figure is drawn on in each theme (--jp-layout-color1, a tab's background).
PAPER = {"light": "#ffffff", "dark": "#212121"}
# The least contrast a line of a panel figure has against `PAPER` (WCAG's ratio for text).
LEGIBLE = 4.5
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
    # A line of its own colour (a target's trajectory, its dashed rank) keeps its hue, moved
    # towards each theme's ink until it reads at `LEGIBLE` on that theme's paper.
    coloured = [item for item in figure.findobj(Line2D) if not _default_ink(item)]
    hues = [item.get_color() for item in coloured]
    legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
    for ax in figure.axes:
        ax.set_facecolor("none")
    for legend in legends:
        legend.get_frame().set_facecolor("none")
    for item in (*texts, *lines):
        setattr(item, _INKED, True)  # drawn again (the export), it is inked again
    pngs = []
    for theme in ("light", "dark"):
        colour = INK[theme]
        for item in (*texts, *lines):
            item.set_color(colour)  # a line's markers follow it unless coloured apart
        for item, hue in zip(coloured, hues):
            legible = _legible(hue, PAPER[theme], colour)
            item.set_color(legible)
            item.set_markerfacecolor(legible)
            item.set_markeredgecolor(legible)
        for ax in figure.axes:
            ax.tick_params(colors=colour, which="both")
            for spine in ax.spines.values():
                spine.set_edgecolor(colour)
        for legend in legends:
            legend.get_frame().set_edgecolor(colour)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", transparent=True)
        pngs.append(base64.b64encode(buffer.getvalue()).decode())
    for item, hue in zip(coloured, hues):  # the figure as it was, for pyplot or an export
        item.set_color(hue)
        item.set_markerfacecolor(hue)
        item.set_markeredgecolor(hue)
    return pngs[0], pngs[1]


def contrast(colour: Any, background: Any) -> float:
    """WCAG's contrast ratio of two matplotlib colours, from 1 (same) to 21 (black on
    white)."""
    from matplotlib.colors import to_rgb

    def luminance(rgb: tuple[float, ...]) -> float:
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    a, b = luminance(to_rgb(colour)), luminance(to_rgb(background))
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


def _legible(colour: Any, paper: str, ink: str) -> tuple[float, float, float]:
    """``colour`` mixed with ``ink`` in tenths, the least that reads at `LEGIBLE` on
    ``paper`` (the ink itself at worst)."""
    import numpy as np
    from matplotlib.colors import to_rgb

    hue, towards = np.array(to_rgb(colour)), np.array(to_rgb(ink))
    for share in np.linspace(0, 1, 11):
        r, g, b = ((1 - share) * hue + share * towards).tolist()
        if contrast((r, g, b), paper) >= LEGIBLE:
            return r, g, b
    return to_rgb(ink)


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
# The theme's error and warning hues mixed with its strongest text colour (black in a light
# theme, white in a dark one): the bare hues read at under 4.5:1 against the page in one
# theme or the other (orange on white: 2.7).
ERROR = "color-mix(in srgb, var(--jp-error-color1, #c92a2a) 75%, var(--jp-ui-font-color0, #000))"
WARNING = "color-mix(in srgb, var(--jp-warn-color1, #e67700) 60%, var(--jp-ui-font-color0, #000))"
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
