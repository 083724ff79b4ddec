"""`TrainingPanel`: train a tuned lens from the explorer, within a time budget, with a bar
in seconds, the time left, and a Cancel that keeps the best translators so far.

`TunedLens.train` runs on a thread of its own (`Background`), so the notebook stays usable
(a Run meanwhile waits for the step in flight). The budget typed in is its ``max_seconds``
(the first step learns the pace on one piece of text, and each later step takes what the
time left holds), and Cancel sets its ``stop``, which training looks at before each piece of
text and each layer's backward: it ends within one of them, the step in flight dropped, with
the translators best on held-out text so far.
When it ends, the explorer offers the tuned lens beside the logit lens (``on_trained``) and
the header says how it did: the steps, the time, and at how many layers it is closer to the
final distribution than the logit lens on held-out text. Every text it shows passes
through ``html.escape``.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets

from envoykit.analyses.tuned import TunedLens, offline_texts
from envoykit.explorer import interrupt
from envoykit.explorer.interrupt import StopFlag
from envoykit.explorer.outputs import ENGINE_ERRORS, message_html
from envoykit.explorer.work import Background, Ticker, duration

TITLE = "Tuned lens"
HINT = (
    "trains translators for this model on the shipped English texts within the seconds "
    "given; Cancel keeps the best so far"
)


class TrainingPanel(widgets.VBox):
    """A Train button, its budget in seconds, a bar and a Cancel.

    ``tuned`` is the last `TunedLens` trained here, None before one is.
    """

    def __init__(
        self,
        engine: Any,
        on_trained: Callable[[TunedLens], None],
        *,
        seconds: int = 60,
        texts: Sequence[str] | None = None,
    ) -> None:
        self.engine, self._on_trained, self._texts = engine, on_trained, texts
        self.seconds = widgets.BoundedIntText(
            value=seconds, min=1, max=24 * 3600, description="seconds", layout={"width": "180px"}
        )
        self.button = widgets.Button(description="Train", icon="play")
        self.cancel_button = widgets.Button(
            description="Cancel",
            icon="stop",
            disabled=True,
            tooltip="stop now, dropping the step in flight and keeping the best translators",
        )
        self._stop = StopFlag()
        self.cancel_button.on_click(lambda _: self._stop.set())
        interrupt.listen(self)
        self.progress = widgets.IntProgress(
            value=0, min=0, max=1, description="seconds", layout={"width": "320px"}
        )
        self.header = widgets.HTML()
        self.tuned: TunedLens | None = None
        self.work = Background(
            "envoykit-train",
            lambda why, details: self.say(f"training failed: {why}", error=True, details=details),
        )
        self.button.on_click(lambda _: self.start())
        row = [self.seconds, self.button, self.cancel_button, self.progress]
        super().__init__([self.header, widgets.HBox(row, layout={"flex_flow": "row wrap"})])
        self.add_class("ek-training")
        self.say(HINT)

    def start(self) -> bool:
        """`run` on the panel's own thread; False while one is running."""
        return self.work.start(self.run)

    def wait(self, timeout: float | None = None) -> bool:
        return self.work.wait(timeout)

    def interrupt(self) -> bool:
        """The kernel's stop button (`envoykit.explorer.interrupt`): stop the work in flight
        as Cancel does; whether there was any."""
        return interrupt.stop_in_flight(self.work.busy, lambda: self._stop.set(interrupt=True))

    def run(self) -> TunedLens | None:
        """Train within the seconds shown; the tuned lens, or None when refused (the reason
        is shown). A Cancel still returns the best translators so far."""
        budget = self.seconds.value
        texts = offline_texts()[0] if self._texts is None else list(self._texts)
        self._stop.clear()
        self.button.disabled, self.cancel_button.disabled = True, False
        self.progress.max, self.progress.value = budget, 0

        def say(elapsed: float) -> None:
            self.progress.value = min(budget, round(elapsed))
            if self._stop.is_set():
                self._head(
                    f"{self._stop.doing}: training stops within its piece of work in flight…"
                )
                return
            left = max(0.0, budget - elapsed)
            self._head(f"training: {duration(elapsed)} so far, at most {duration(left)} left")

        began = time.monotonic()
        try:
            with Ticker(say):
                tuned = TunedLens.train(
                    self.engine,
                    texts,
                    max_seconds=budget,
                    stop=self._stop,
                    progress=False,
                    warn=False,
                )
        except ENGINE_ERRORS as err:
            self.say(str(err), error=True)
            return None
        finally:
            self.button.disabled, self.cancel_button.disabled = False, True
            word = self._stop.word
            self._stop.clear()  # a Cancel is for the training it stopped
        self.progress.value = self.progress.max
        self.tuned = tuned
        self._on_trained(tuned)
        assert tuned.quality is not None  # `TunedLens.train` measures it on held-out text
        self.say(describe(tuned, time.monotonic() - began, word), error=tuned.quality.better < 0.5)
        return tuned

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        self._head(text, error=error, details=details)

    def _head(self, text: str, *, error: bool = False, details: str = "") -> None:
        self.header.value = (
            f"<b>{html.escape(TITLE)}</b>{message_html(text, error=error, details=details)}"
        )


def describe(tuned: TunedLens, took: float, stopped_by: str = "cancelled") -> str:
    """What a training gave, in one line: steps, time, a Cancel or an interrupt
    (``stopped_by``), and where it beats the logit lens on held-out text."""
    quality = tuned.quality
    assert quality is not None  # `TunedLens.train` measures it on held-out text
    n = len(quality.layers)
    better = round(quality.better * n)
    stopped = f"{stopped_by} after " if tuned.model.get("stopped") else ""
    return (
        f"{stopped}{tuned.model['steps']} steps in {duration(took)}: closer to the final "
        f"distribution than the logit lens at {better} of {n} layers on held-out text"
        + ("" if better * 2 >= n else "; train for longer for a lens to trust")
        + "; the lens menu offers it"
    )
