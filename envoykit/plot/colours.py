"""Colours both heatmaps share: a colour map's stops for the browser, and a cell's text colour.

The browser heatmap interpolates between the stops sampled here from matplotlib's own map,
and ``widgets/heatmap.js`` picks a cell's text colour by the same rule as `text_colour`, so
the matplotlib and browser pictures agree.

>>> colour_stops("Blues", 3)
('#f7fbff', '#6aaed6', '#08306b')
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

# Colour-map samples sent to the browser, which interpolates linearly between them: with 16
# the largest difference from matplotlib's own 256-entry maps is a few levels out of 255.
STOPS = 16

# WCAG relative luminance at which black and white text contrast equally with the cell.
_EVEN_CONTRAST = 0.179


@functools.cache
def colour_stops(cmap: str, n: int = STOPS) -> tuple[str, ...]:
    """``n`` colours (``"#rrggbb"``) sampled evenly along matplotlib's colour map ``cmap``."""
    import matplotlib
    from matplotlib.colors import to_hex

    colours = matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, n))
    return tuple(to_hex(colour) for colour in colours)


def text_colour(rgba: Sequence[float]) -> str:
    """Near-black or white, whichever reads better on a cell of colour ``rgba`` (0–1 floats).

    A transparent cell shows the white page under it. ``widgets/heatmap.js`` applies the same
    rule to the cells it draws.
    """
    red, green, blue, *alpha = rgba
    opacity = alpha[0] if alpha else 1.0
    channels = [opacity * c + (1.0 - opacity) for c in (red, green, blue)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    return "#111111" if luminance > _EVEN_CONTRAST else "#ffffff"
