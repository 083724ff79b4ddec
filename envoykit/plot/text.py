"""Token text as a figure shows it."""

from __future__ import annotations

from typing import Any


def short(text: Any, width: int = 8) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    text = str(text).replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"
