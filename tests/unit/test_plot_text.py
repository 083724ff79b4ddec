"""Token text in figures: control characters are written as escapes, not dropped."""

from __future__ import annotations

import warnings

from matplotlib.figure import Figure

from envoykit.plot.text import short, visible


def test_control_characters_are_escaped_and_the_rest_kept():
    assert visible("a\bb\nc\td\x00é€ ") == "a\\x08b\\nc\\td\\x00é€ "
    assert short("\b\b\b\b\b", 8) == "\\x08\\x0…"
    assert short(" Paris") == " Paris"


def test_a_figure_of_a_backspace_token_draws_without_a_glyph_warning():
    ax = Figure().subplots()
    ax.text(0, 0, short("\x08"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ax.figure.canvas.draw()
