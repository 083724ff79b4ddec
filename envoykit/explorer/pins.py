"""`Pins`, a part of `LensExplorer`: the tokens pinned in a heatmap tooltip, shown as chips,
followed by the lens, and the token attribution and the sweep measure.

With an engine, pinning a token that is not yet a target re-runs the lens with it added (as
a token id, after the typed targets), so its trajectory is exact; unpinning one the lens
measured only for the pin runs it again without. With a stored `LensResult` (read-only)
nothing can be recomputed: a pinned token that is not a target is drawn from the top-k lists
only (`TrajectoryView`). A pin in the second prompt's heatmap or the diff pins the token in
the first, since the first prompt is the run studied.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import numpy as np

from envoykit.explorer.outputs import message_html
from envoykit.explorer.state import ExplorerState
from envoykit.results.lens import LensResult


class Pins(ExplorerState):
    """Mixed into `LensExplorer`: what a change of ``heatmap.pinned`` does, the chips that
    unpin, and `_focus_target`, the token the attribution and the sweep follow."""

    def _on_pinned(self, _: Any = None) -> None:
        """Pins the lens shown lacks (or an unpinned one it measured) ask for the lens
        again, after a Run in flight (whose request is then the one to follow); any other
        change of pins is drawn at once. The chips follow a click at once either way."""
        if self.result is not None:
            self._show_pins()
        if self.engine is not None and (self.work.busy or self._pins_need_a_lens()):
            self.work.submit(self._follow_pins)
        elif self.result is not None:
            self._draw_trajectory()
            self._draw_cell()

    def _on_other_pinned(self, change: dict[str, Any]) -> None:
        """A token pinned in the second heatmap or the diff is pinned in the first."""
        new = [i for i in change["new"] if i not in self.heatmap.pinned]
        if new:
            self.heatmap.pinned = [*self.heatmap.pinned, *new]

    def _pins_need_a_lens(self) -> bool:
        """Whether the lens shown lacks a pinned token, or measured one no longer pinned
        (a pin is added to the lens's targets as an id, not as a typed target)."""
        if self.result is None or self._request is None:
            return False
        pinned = set(self.heatmap.pinned)
        asked = {t for t in self._request["targets"] if not isinstance(t, str)}
        return bool(pinned - set(self.result.target_ids.tolist()) or asked - pinned)

    def _follow_pins(self) -> None:
        """The lens shown again with the pins as they are now (on the lens's thread)."""
        asked = self._request
        if asked is not None and self._pins_need_a_lens():
            typed = [t for t in asked["targets"] if isinstance(t, str)]
            request = {**asked, "targets": self._targets_with_pins(typed)}
            self._lens(request, self._rows, self._other)
        elif self.result is not None:
            self._show_pins()
            self._draw_trajectory()
            self._draw_cell()

    def _targets_with_pins(self, typed: list[str]) -> list[str | int]:
        """Typed targets, then the pinned token ids that are not already one of them."""
        assert self.engine is not None  # targets are tokenized only to ask the engine
        tokenizer = self.engine.tokenizer
        typed_ids = {
            ids[0]
            for piece in typed
            if (ids := tokenizer(piece, add_special_tokens=False)["input_ids"])
        }
        return [*typed, *(i for i in self.heatmap.pinned if i not in typed_ids)]

    def _show_pins(self) -> None:
        """A chip per pinned token (a click unpins it), then what attribution and the sweep
        measure: the token pinned last, else the first target."""
        shown = self._shown()
        chips: list[widgets.Widget] = []
        for token_id in self.heatmap.pinned:
            chip = widgets.Button(
                description=f"{self._token_text(token_id)!r} ×",
                tooltip="unpin this token",
                layout={"width": "auto"},
            )
            chip.add_class("ek-pin")
            chip.on_click(lambda _, token_id=token_id: self._unpin(token_id))
            chips.append(chip)
        focus = None if shown is None else self._focus_target(shown)
        if focus is not None:
            why = "pinned last" if self.heatmap.pinned else "the first target"
            text = f"attribution and the sweep measure {self._token_text(focus)!r} ({why})"
            chips.append(widgets.HTML(message_html(text)))
        self.pins.children = tuple(chips)

    def _unpin(self, token_id: int) -> None:
        self.heatmap.pinned = [i for i in self.heatmap.pinned if i != token_id]

    def _token_text(self, token_id: int) -> str:
        """A token's text: decoded by the engine's tokenizer, or (read-only) found in the
        result."""
        if self.engine is not None:
            return self.engine.tokenizer.decode([int(token_id)])
        res = self.result
        assert res is not None  # read-only, the stored result is always there
        for ids, tokens in ((res.target_ids, res.target_tokens), (res.top_ids, res.top_tokens)):
            found = np.flatnonzero(np.asarray(ids).ravel() == token_id)
            if len(found):
                return str(np.asarray(tokens, dtype=object).ravel()[found[0]])
        return str(token_id)

    def _focus_target(self, shown: LensResult) -> int | None:
        """The token the attribution and the sweep follow: pinned last, else the first target."""
        if self.heatmap.pinned:
            return int(self.heatmap.pinned[-1])
        return int(shown.target_ids[0]) if len(shown.target_ids) else None
