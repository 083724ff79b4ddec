"""`SweepPanel`: a causal-tracing sweep started from the explorer, with a progress bar,
the time it has taken and the time left, and a Cancel button.

`Engine.patch_sweep` reports progress as a tqdm bar, which a button's callback has no cell
to draw in. The panel runs the sweep one layer at a time instead — one `patch_sweep` call
per row of the map — moves an ipywidgets ``IntProgress`` after each row and joins the rows
into one `SweepResult` (`join_rows`), drawn as ``plot.sweep`` draws it. The price: every
call reads the source and measures the clean and source runs again, three forward passes
per layer on top of the batched ones.

The Sweep button runs it on a thread of its own (`start`), so the notebook stays usable
while it runs (a cell that uses the engine meanwhile waits for the row in flight, not for
the sweep) and Cancel is heard: it stops the sweep after the row in flight, which leaves
the engine usable. Called from code, `run` sweeps on the caller's thread, where an interrupt
(the kernel's stop button) stops it between rows, or inside one.
"""

from __future__ import annotations

import dataclasses
import html
import time
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import numpy as np

from envoykit import plot
from envoykit.explorer import interrupt
from envoykit.explorer.interrupt import StopFlag
from envoykit.explorer.outputs import ENGINE_ERRORS, figure_output, message_html
from envoykit.explorer.target_choice import TargetChoice
from envoykit.explorer.work import Background, Ticker, duration, time_left
from envoykit.results.sweep import SweepResult

TITLE = "Patch sweep"


def join_rows(parts: Sequence[SweepResult]) -> SweepResult:
    """One sweep from sweeps of the same two prompts, target token and positions over
    different layers, their rows in the order given."""
    first = parts[0]
    return dataclasses.replace(
        first,
        layers=np.concatenate([part.layers for part in parts]),
        values=np.concatenate([part.values for part in parts]),
    )


class SweepPanel(widgets.VBox):
    """A Sweep button and its progress bar over the causal-tracing map.

    ``result`` is the `SweepResult` drawn and ``figure`` its matplotlib figure; both are
    None while the panel shows a message instead.
    """

    def __init__(self) -> None:
        self.button = widgets.Button(
            description="Sweep",
            icon="th",
            tooltip="patch the second prompt into the first at every picked layer and position",
        )
        self.cancel_button = widgets.Button(
            description="Cancel",
            icon="stop",
            disabled=True,
            tooltip="stop the sweep after the row in flight",
        )
        self._cancel = StopFlag()
        self.cancel_button.on_click(lambda _: self._cancel.set())
        interrupt.listen(self)
        self.work = Background(
            "envoykit-sweep",
            lambda why, details: self.say(f"the sweep failed: {why}", error=True, details=details),
        )
        self.progress = widgets.IntProgress(
            value=0, min=0, max=1, description="layers", layout=widgets.Layout(width="320px")
        )
        self.target = TargetChoice[int]("the token whose probability the sweep measures")
        self.scale = widgets.ToggleButtons(
            options=[("fitted", "fitted"), ("0–1", "absolute")],
            value="fitted",
            tooltip="colours over the map's own range, or over the whole 0..1",
            style={"button_width": "56px"},
        )
        self.scale.observe(self._redraw, "value")
        self.header = widgets.HTML()
        self.view = widgets.Output()
        self.result: SweepResult | None = None
        self.figure: Any = None
        controls = [self.button, self.cancel_button, self.target, self.scale, self.progress]
        super().__init__([widgets.HBox(controls), self.header, self.view])
        self.add_class("ek-sweep")

    def start(self, sweep: Callable[[], Any]) -> None:
        """Run ``sweep`` (a call of `run`) on a thread of its own (`Background`): the kernel
        stays free to hear Cancel and to run cells."""
        self._cancel.clear()
        self.button.disabled = True  # until the sweep is done: one at a time

        def work() -> None:
            try:
                sweep()
            finally:  # also when it was refused before `run` began
                self.button.disabled = False

        self.work.start(work)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a sweep `start` began; whether it has finished."""
        return self.work.wait(timeout)

    def interrupt(self) -> bool:
        """The kernel's stop button (`envoykit.explorer.interrupt`): stop the work in flight
        as Cancel does; whether there was any."""
        return interrupt.stop_in_flight(self.work.busy, lambda: self._cancel.set(interrupt=True))

    def run(
        self, engine: Any, source: str, target: str, *, layers: Sequence[int], target_token: int
    ) -> SweepResult | None:
        """Sweep ``source`` into ``target`` over ``layers`` (site "resid") and every position,
        a row at a time; the result, or None when the engine refused (the reason is shown)."""
        self.button.disabled = True
        self.cancel_button.disabled = False
        self.progress.max, self.progress.value = len(layers), 0
        parts: list[SweepResult] = []
        began = time.monotonic()
        try:
            for layer in layers:
                if self._cancel.is_set():
                    self.say(
                        f"{self._cancel.word} after {len(parts)} of {len(layers)} rows "
                        f"({duration(time.monotonic() - began)}); the engine is free",
                        error=True,
                    )
                    return None
                row, done = f"layer {layer}: row {len(parts) + 1} of {len(layers)}", len(parts)
                so_far = time.monotonic() - began

                def say(
                    elapsed: float, row: str = row, done: int = done, so_far: float = so_far
                ) -> None:
                    self._head(f"{row}; {time_left(so_far + elapsed, done, len(layers))}")

                try:
                    with Ticker(say):
                        part = engine.patch_sweep(
                            source,
                            target,
                            layers=[layer],
                            target_token=target_token,
                            progress=False,
                        )
                except ENGINE_ERRORS as err:
                    self.say(str(err), error=True)
                    return None
                parts.append(part)
                self.progress.value = len(parts)
        finally:
            self.button.disabled = False
            self.cancel_button.disabled = True
            self._cancel.clear()  # a Cancel is for the sweep it stopped, not the next one
        result = join_rows(parts)
        self.show(result, took=time.monotonic() - began)
        return result

    def show(self, res: SweepResult, took: float | None = None) -> None:
        """Draw ``res`` as ``plot.sweep`` does, on the colour scale picked (``took``: the
        seconds it took, said)."""
        self.result = res
        self._redraw()
        self._head(
            f"{res.label} at the first prompt's last position after copying the second "
            f"prompt's residual stream at each layer and position (clean {res.clean:.3g}, "
            f"second prompt {res.source_value:.3g})"
            + ("" if took is None else f"; took {duration(took)}")
        )

    def _redraw(self, _: Any = None) -> None:
        """The map of ``result`` on the colour scale picked (nothing without a result)."""
        from matplotlib.figure import Figure

        res = self.result
        if res is None:
            return
        n_layers, n_pos = res.values.shape
        size = (min(3.5 + 0.9 * n_pos, 12.0), min(2.5 + 0.25 * n_layers, 9.0))
        ax = Figure(figsize=size).subplots()
        plot.sweep(res, scale=self.scale.value, ax=ax)
        self.figure = ax.figure
        self.view.outputs = (figure_output(ax.figure, repr(res)),)

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in place of a map."""
        self.result, self.figure = None, None
        self.view.outputs = ()
        self._head(text, error=error, details=details)

    def _head(self, text: str, *, error: bool = False, details: str = "") -> None:
        self.header.value = (
            f"<b>{html.escape(TITLE)}</b>{message_html(text, error=error, details=details)}"
        )
