"""`Pins`, a part of `LensExplorer`: the tokens pinned in a heatmap tooltip, shown as chips
and followed by the lens, and the tokens each panel may measure (`TargetChoice`).

A pin is for display: it adds the token's trace to the trajectory. It changes no panel's
measured token; the attribution and the sweep each offer the pins beside the targets, and
measure what is picked there (the first target until another is picked).

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

from envoykit.explorer.state import ExplorerState


class Pins(ExplorerState):
    """Mixed into `LensExplorer`: what a change of ``heatmap.pinned`` does, the chips that
    unpin, and the targets and pins offered to the panels that measure one."""

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
        run = self.current
        if run is None or run.request is None:
            return False
        pinned = set(self.heatmap.pinned)
        asked = {t for t in run.request["targets"] if not isinstance(t, str)}
        return bool(pinned - set(run.result.target_ids.tolist()) or asked - pinned)

    def _follow_pins(self) -> None:
        """The lens shown again with the pins as they are now (on the lens's thread)."""
        run = self.current
        if run is not None and run.request is not None and self._pins_need_a_lens():
            typed = [t for t in run.request["targets"] if isinstance(t, str)]
            request = {**run.request, "targets": self._targets_with_pins(typed)}
            self._lens(request, list(run.rows), run.other)
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
        """A chip per pinned token (a click unpins it), and the targets and pins offered to
        the panels that measure one token."""
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
        self.pins.children = tuple(chips)
        choices = self._measurable()
        self.attribution_panel.target.offer(choices)
        self.sweep_panel.target.offer(choices)

    def _measurable(self) -> list[tuple[str, int]]:
        """(label, token id) of each target of the lens shown, then of each pinned token the
        lens has not measured; a pin is labelled so (the lens measures one as its id)."""
        shown = self._shown()
        pinned = set(self.heatmap.pinned)
        choices: list[tuple[str, int]] = []
        if shown is not None:
            for label, token, token_id in zip(
                shown.target_labels, shown.target_tokens, shown.target_ids.tolist()
            ):
                pin = label == str(token_id) and token_id in pinned
                choices.append((repr(token) + (" (pinned)" if pin else ""), int(token_id)))
        offered = {token_id for _, token_id in choices}
        choices += [
            (f"{self._token_text(token_id)!r} (pinned)", int(token_id))
            for token_id in self.heatmap.pinned
            if token_id not in offered
        ]
        return choices

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
