"""`LensRuns`, a part of `LensExplorer`: the lens a Run, a pin or a drop asks for, run off
the kernel's thread, its elapsed time and the time left at the last Run's pace, and Cancel.

A lens on a large model can take minutes, so a widget event never runs one on the kernel's
thread: the lens thread (``work``, a `Background`) runs it while the notebook stays usable,
keeping only the latest request that arrives meanwhile. The status line counts the seconds
(`Ticker`) and, once one Run has taken its time, says how long this one should take: the
last Run's seconds per row × position times this Run's rows × positions. Cancel stops the
lens on the ranks (`Engine.cancel`) and drops the clicks waiting behind it. `run` and
`patch_cell` called from code run on the caller's thread and return the result; code that
clicks (sets ``heatmap.selected`` or ``pinned``) waits with `wait` before it reads one.

With a second prompt, a Run lenses it too, unpatched and with the same rows, and reuses its
lens while its request is unchanged: a drop patches only the first prompt's run.
"""

from __future__ import annotations

import html
import threading
import time
from typing import TYPE_CHECKING, Any

from envoykit.analyses.request import Row, token_ids
from envoykit.errors import Cancelled
from envoykit.explorer import rows
from envoykit.explorer.current_run import CurrentRun
from envoykit.explorer.layout import typed_targets
from envoykit.explorer.outputs import ENGINE_ERRORS
from envoykit.explorer.state import ExplorerState
from envoykit.explorer.work import Ticker, duration
from envoykit.results.lens import LensResult

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface


class LensRuns(ExplorerState):
    """Mixed into `LensExplorer`: `run`, `wait` and `cancel`, and the lens they share with
    pins and drops (`_lens`). Draws what a lens returns with the explorer's `_show` and
    `_show_comparison`."""

    def run(self) -> LensResult | None:
        """Lens the prompt with the picked rows, top-k and targets (same as pressing Run).

        Returns the new result, or None when the request was refused (the reason is shown).
        """
        if self.engine is None:
            self._say("read-only: this explorer shows a stored LensResult and has no engine", True)
            return None
        picked = self.picker.rows
        if not picked:
            self._say("no layers picked: pick at least one layer or sub-layer site", True)
            return None
        offered = {item["layer"] for item in self.picker.layers}
        unknown = sorted({layer for layer, _ in picked} - offered)
        if unknown:
            self._say(
                f"layer(s) {unknown} are not rows of this model: the picker offers layers "
                f"{min(offered)} (the embedding) to {max(offered)}",
                True,
            )
            return None
        layers, sites = rows.lens_arguments(picked)
        request = {
            "prompt": self.prompt.value,
            "layers": layers,
            "sites": sites,
            "top_k": self.top_k.value,
            "targets": self._targets_with_pins(typed_targets(self.targets.value)),
        }
        if self.lens_kind.value == "tuned":
            request["translator"] = self.translator
        return self._lens(request, picked, self._second_prompt())

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until what the last clicks asked for is drawn: the lens of a Run, a pin or a
        drop, and a cell's attribution and attention (each runs on a thread of its own, so
        a cell that sets ``heatmap.selected`` or ``pinned`` from code waits here before it
        reads the result). Whether all of it finished within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        threads = (self.work, self.cells, self.attention_panel.work)
        while any(work.busy for work in threads):  # a lens drawn starts a cell's work
            for work in threads:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not work.wait(left):
                    return False
        return True

    def cancel(self) -> bool:
        """Stop the Run in flight (same as pressing Cancel): the ranks stop its lens before
        their next chunk of work (a second prompt's lens not begun does not start), the
        pins, drops and cell clicks waiting behind it are dropped, and the explorer says it
        was cancelled. Whether a Run's lens was in flight or about to start (a Cancel heard
        while a finished lens is drawn has nothing to stop, and says nothing)."""
        return self._stop_run(by_interrupt=False)

    def interrupt(self) -> bool:
        """The kernel's stop button (`envoykit.explorer.interrupt`): `cancel`, said as
        "interrupted"."""
        return self._stop_run(by_interrupt=True)

    def _stop_run(self, *, by_interrupt: bool) -> bool:
        """`cancel`, by the Cancel button or by a kernel interrupt."""
        self.work.drop_waiting()
        self.cells.drop_waiting()
        engine, run = self.engine, self.work.thread
        if engine is None or run is None or not run.is_alive() or self._drawing.is_set():
            return False
        self._cancelling.set(interrupt=by_interrupt)
        self.status.value = f"<i>{self._cancelling.doing}…</i>"

        # A Cancel heard before the lens is on the ranks (while its request is checked and
        # tokenized) waits for it: `engine.cancel` stops only a lens in flight. It stops
        # this Run's lens only (its thread's), and gives up once the Run has ended. It looks
        # every millisecond: a short lens that got the ranks between two looks 20 ms apart
        # ran to its end uncancelled (tests/test_explorer.py, one run in four).
        def until_cancelled() -> None:
            while self._cancelling.is_set() and run.is_alive() and not engine.cancel(run):
                time.sleep(0.001)

        threading.Thread(target=until_cancelled, name="envoykit-cancel", daemon=True).start()
        return True

    def _lens(
        self, request: dict[str, Any], picked: list[Row], other: str | None
    ) -> LensResult | None:
        """Run ``request`` (`Engine.lens`'s arguments, a patch included) and keep the
        ``picked`` rows; with a second prompt ``other``, lens it too (unpatched, reused when
        its request is unchanged) and draw the diff."""
        engine = self.engine
        assert engine is not None  # a Run, a pin or a drop asks for a lens only with an engine
        self.run_button.disabled, self.cancel_button.disabled = True, False
        self.run_button.description = "Running…"
        self._say("")  # the last run's message is not about this one
        cells = _cells(engine, request, picked, other)
        expected = None if self._pace is None else self._pace * cells
        name = html.escape(engine.info.name)

        def say(elapsed: float) -> None:
            if self._cancelling.is_set():
                self.status.value = f"<i>{self._cancelling.doing}…</i>"
                return
            left = ""
            if expected is not None:
                left = (
                    f", about {duration(expected - elapsed)} left at the last run's pace"
                    if elapsed < expected
                    else ", longer than the last run's pace"
                )
            self.status.value = f"<i>running the lens on {name}: {duration(elapsed)}{left}…</i>"

        # The button comes back only once everything below is drawn: enabled means done.
        try:
            began = time.monotonic()
            with Ticker(say):  # stopped before anything else is said in the status line
                try:
                    outcome = self._lenses(engine, request, picked, other)
                finally:
                    self._drawing.set()  # the lens is done: a Cancel now has nothing to stop
                    self._cancelling.clear()
            if isinstance(outcome, str):
                self._refused(outcome)
                return None
            took = time.monotonic() - began
            self._pace = took / cells
            result, other_result, other_request = outcome
            self.current = CurrentRun(
                result, request, tuple(picked), other, other_request, other_result
            )
            self.heatmap.stale = False
            self.status.value = html.escape(
                f"{result.run_label}: {len(result.layers)} rows × {len(result.positions)} "
                f"positions, top-{result.top_ids.shape[-1]}; took {duration(took)}"
            )
            self._show()
            self._show_comparison()
            return result
        finally:
            # A Cancel pressed while the result was drawn is for this Run, not the next.
            self._drawing.clear()
            self._cancelling.clear()
            self.run_button.disabled, self.cancel_button.disabled = False, True
            self.run_button.description = "Run"

    def _lenses(
        self,
        engine: EngineSurface,
        request: dict[str, Any],
        picked: list[Row],
        other: str | None,
    ) -> tuple[LensResult, LensResult | None, dict[str, Any] | None] | str:
        """The lens of ``request`` on ``engine`` and, with a second prompt ``other``, of that
        one (reused when its request is unchanged), with the ``picked`` rows; or why not, to
        say."""
        try:
            result = rows.keep(engine.lens(**request), picked)
        except Cancelled:
            return f"{self._cancelling.word}: the lens was stopped on the ranks"
        except ENGINE_ERRORS as err:
            return str(err)
        if result is None:
            return "the lens holds none of the picked rows"
        other_request = _other_request(request, other)
        other_result = None
        if other_request is not None:
            if self.current is not None and other_request == self.current.other_request:
                other_result = self.current.other_result
            elif self._cancelling.is_set():
                return f"{self._cancelling.word} before the second prompt's lens"
            else:
                try:
                    other_result = rows.keep(engine.lens(**other_request), picked)
                except Cancelled:
                    word = self._cancelling.word
                    return f"{word}: the second prompt's lens was stopped on the ranks"
                except ENGINE_ERRORS as err:
                    return f"second prompt: {err}"
        return result, other_result, other_request

    def _refused(self, text: str, details: str = "") -> None:
        """Say why the run was refused (``details``: a bug's traceback, folded); what is
        still drawn is marked as the previous run."""
        self._say(text, True, details)
        if self.result is None:
            self.status.value = ""
            return
        self.heatmap.stale = True
        shown = html.escape(repr(self.result.prompt))
        self.status.value = f"<i>the heatmap still shows the previous run, of {shown}</i>"

    def _second_prompt(self) -> str | None:
        return self.other_prompt.value if self.compare.value else None


def _other_request(request: dict[str, Any], other: str | None) -> dict[str, Any] | None:
    """The second prompt's lens request: the first's, unpatched, on ``other``."""
    if other is None:
        return None
    return {**{k: v for k, v in request.items() if k != "patch"}, "prompt": other}


def _cells(
    engine: EngineSurface, request: dict[str, Any], picked: list[Row], other: str | None
) -> int:
    """How many rows × positions a Run of ``request`` reduces (the pace of the last Run, in
    seconds per cell, gives the time left of the next)."""
    prompts = [request["prompt"]] + ([other] if other else [])
    tokens = sum(len(token_ids(engine.tokenizer, text)) for text in prompts)
    return max(1, len(picked) * tokens)
