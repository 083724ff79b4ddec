"""Token text as a figure shows it."""

from __future__ import annotations

import unicodedata
from typing import Any

# How a figure writes the control characters it has no glyph for (a tokenizer's byte-level
# pieces hold them: a backspace token printed as nothing, with a warning from matplotlib).
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(text: Any) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x08``)."""
    return "".join(
        _NAMED.get(char, f"\\x{ord(char):02x}") if unicodedata.category(char) == "Cc" else char
        for char in str(text)
    )


def short(text: Any, width: int = 8) -> str:
    """``text`` on one line, its control characters visible, cut to ``width`` characters
    with an ellipsis."""
    text = visible(text)
    return text if len(text) <= width else text[: width - 1] + "…"
