"""What the explorer's plain ipywidgets show: a figure or a line of text in an ``Output``,
a message in an ``HTML`` widget.

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


def figure_output(figure: Any, text: str) -> dict[str, Any]:
    """``figure`` as a PNG; ``text`` is its plain-text stand-in."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return {
        "output_type": "display_data",
        "data": {"image/png": base64.b64encode(buffer.getvalue()).decode(), "text/plain": text},
        "metadata": {},
    }


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
