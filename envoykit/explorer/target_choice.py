"""`TargetChoice`: the token a panel measures, picked in that panel.

A pinned token adds its trace to the trajectory and nothing else. What the attribution, the
sweep and the steering diff measure is chosen in each of them, among the lens's targets and
the pinned tokens, and shown there: one click in a tooltip never changes what a panel
answers behind the researcher's back. A choice stays while it is offered (a new Run with the
same targets keeps it); one no longer offered falls back to the first target.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import ipywidgets as widgets

Choice = TypeVar("Choice", bound=Hashable)  # a token id, or a target's label


class TargetChoice(widgets.Dropdown, Generic[Choice]):
    """A "measures" menu of (label, value) choices; `offer` replaces them, `chosen` is the
    value picked, and `on_choice` hears the researcher's picks only."""

    def __init__(self, tooltip: str) -> None:
        super().__init__(
            options=[],
            description="measures",
            tooltip=tooltip,
            layout=widgets.Layout(width="auto", min_width="180px"),
            style={"description_width": "initial"},
        )
        self.add_class("ek-target-choice")
        self._offering = False

    def offer(self, choices: Sequence[tuple[str, Choice]]) -> None:
        """Offer ``choices``, keeping the one measured if it is among them, else the first."""
        kept = self.chosen()
        values = [value for _, value in choices]
        self._offering = True
        try:
            self.options = list(choices)
            self.value = kept if kept in values else (values[0] if values else None)
        finally:
            self._offering = False

    def chosen(self) -> Choice | None:
        """The value picked; None while nothing is offered."""
        return self.value

    def on_choice(self, callback: Callable[[], Any]) -> None:
        """Call ``callback`` when the researcher picks another token; a change made by
        `offer` (a new Run, a pin) is no pick."""

        def changed(change: dict[str, Any]) -> None:
            if not self._offering and change["new"] is not None and change["new"] != change["old"]:
                callback()

        self.observe(changed, "value")
