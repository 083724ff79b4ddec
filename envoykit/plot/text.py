"""Token text as envoykit shows it, in figures and in the explorer.

A token's whitespace is part of it (``" Paris"`` is not ``"Paris"``) and a blank cell must
not read as "no value", so wherever a token is shown its space is ``␣``, its newline ``↵``
and its tab ``⇥``, and every other control character an escape (``\\x08``; a tokenizer's
byte-level pieces hold them, and a figure has no glyph for them). Prose (a prompt, a
continuation) keeps its spaces: only its control characters are escaped. The browser side
writes tokens the same way (``visibleToken`` in ``widgets/dom.js``).
"""

from __future__ import annotations

import unicodedata
from typing import Any

_MARKS = {" ": "␣", "\n": "↵", "\t": "⇥"}
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: Any) -> str:
    """Prose with every control character written as an escape (``\\n``, ``\\x08``)."""
    return "".join(
        _ESCAPES.get(char) or (_escape(char) if unicodedata.category(char) == "Cc" else char)
        for char in str(text)
    )


def token_text(token: Any) -> str:
    """A token with its space, newline and tab marked (``␣``, ``↵``, ``⇥``), and any other
    control or blank character escaped (``\\x0d``, ``\\xa0``)."""
    return "".join(
        _MARKS.get(char)
        or (_escape(char) if char.isspace() or unicodedata.category(char) == "Cc" else char)
        for char in str(token)
    )


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, with an ellipsis where it was cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def short(token: Any, width: int = 8) -> str:
    """A token as `token_text` writes it, cut to ``width`` characters with an ellipsis."""
    return clip(token_text(token), width)
