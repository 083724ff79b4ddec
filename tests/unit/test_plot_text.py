"""Token text in figures: whitespace is marked and control characters are written as
escapes, not dropped; prose keeps its spaces."""

from __future__ import annotations

import warnings

from matplotlib.figure import Figure

from envoykit.plot.text import short, token_text, visible


def test_control_characters_are_escaped_and_the_rest_kept():
    assert visible("a\bb\nc\td\x00é€ ") == "a\\x08b\\nc\\td\\x00é€ "
    assert short("\b\b\b\b\b", 8) == "\\x08\\x0…"


def test_a_tokens_whitespace_is_marked():
    assert token_text(" Paris\n\t\r\x7f") == "␣Paris↵⇥\\x0d\\x7f"
    assert token_text("  ") == "␣␣" and token_text("") == ""
    assert short(" Paris") == "␣Paris"
    assert short(" strugglers", 8) == "␣strugg…"  # cut text ends in an ellipsis


def test_a_figure_of_a_backspace_token_draws_without_a_glyph_warning():
    ax = Figure().subplots()
    ax.text(0, 0, short("\x08 \n\t"))  # an escape and the three marks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ax.figure.canvas.draw()
