"""`CorpusPanel`: the lens over a corpus as a summary beside the one-prompt views.

Documents go in one per line (the shipped corpus by default); Run computes
`Engine.lens_corpus` on a thread of its own (`Background`), moving a progress bar in tokens
after each batch, and Cancel stops it between two batches (the engine is free then). The
result is drawn as ``plot.lens_corpus`` draws it, with one line of summary: how many
documents and tokens, where the top-1 settles, and the last layer's accuracy. With a tuned
lens offered (``translator``), the tuned lens's statistics are drawn beside the logit lens's.
Every text it shows passes through ``html.escape``.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets

from envoykit import plot
from envoykit.analyses.corpus import shipped_corpus
from envoykit.analyses.request import token_ids
from envoykit.errors import Cancelled as EngineCancelled
from envoykit.explorer import interrupt
from envoykit.explorer.interrupt import StopFlag
from envoykit.explorer.outputs import ENGINE_ERRORS, figure_output, message_html
from envoykit.explorer.work import Background
from envoykit.results.corpus import CorpusLensResult

TITLE = "Corpus lens"


# Tokens per trace from the panel: a Cancel waits for the forward pass in flight (the ranks
# stop the reduction after it at its next chunk), about a second for 1024 tokens of a
# 135M-parameter model on two cores, where the default 4096 made it wait five.
PANEL_BATCH_TOKENS = 1024


class Cancelled(Exception):
    """Raised from the panel's progress bar between two batches when Cancel was pressed."""


class _Bar:
    """A tqdm-like bar (``update``, ``set_postfix``) that moves the panel's progress widget
    and stops the work when Cancel was pressed."""

    def __init__(self, panel: CorpusPanel, began: float) -> None:
        self.panel, self.began = panel, began

    def update(self, n: int) -> None:
        progress = self.panel.progress
        progress.value = min(progress.max, progress.value + n)
        if self.panel._cancel.is_set():
            raise Cancelled
        elapsed = time.monotonic() - self.began
        rate = progress.value / max(elapsed, 1e-9)
        left = (progress.max - progress.value) / max(rate, 1e-9)
        self.panel._head(
            f"{progress.value} of {progress.max} tokens, {rate:.0f} tokens/s, about "
            f"{left:.0f} s left"
        )

    def set_postfix(self, **_: Any) -> None:
        """The documents done, which the header does not show."""


class CorpusPanel(widgets.VBox):
    """Documents in; per-layer KL, entropy, agreement and accuracy over them out.

    ``result`` is the last `CorpusLensResult` (``tuned_result`` the tuned lens's, when one
    is offered), ``figure`` its matplotlib figure; None while a message is shown.
    """

    def __init__(
        self,
        engine: Any,
        *,
        texts: Sequence[str] | None = None,
        top_k: int = 1,
        translator: Any = None,
    ) -> None:
        self.engine, self.translator = engine, translator
        self.texts = widgets.Textarea(
            value="\n".join(shipped_corpus() if texts is None else texts),
            placeholder="documents, one per line",
            layout={"width": "auto", "height": "90px"},
        )
        self.top_k = widgets.BoundedIntText(
            value=top_k, min=1, max=100, description="top-k", layout={"width": "160px"}
        )
        self.button = widgets.Button(description="Run corpus", icon="play")
        self.cancel_button = widgets.Button(description="Cancel", icon="stop", disabled=True)
        self._cancel = StopFlag()
        self.cancel_button.on_click(lambda _: self._stop())
        interrupt.listen(self)
        self.progress = widgets.IntProgress(
            value=0, min=0, max=1, description="tokens", layout={"width": "320px"}
        )
        self.header = widgets.HTML()
        self.view = widgets.Output()
        self.result: CorpusLensResult | None = None
        self.tuned_result: CorpusLensResult | None = None
        self.figure: Any = None
        self.work = Background(
            "envoykit-corpus",
            lambda why, details: self.say(
                f"the corpus lens failed: {why}", error=True, details=details
            ),
        )
        self.button.on_click(lambda _: self.start())
        super().__init__(
            [
                self.header,
                self.texts,
                widgets.HBox([self.top_k, self.button, self.cancel_button, self.progress]),
                self.view,
            ]
        )
        self.add_class("ek-corpus")
        self.say("documents one per line; Run lenses them all, many per batch, on the ranks")

    def start(self) -> bool:
        """`run` on the panel's own thread; False while one is running."""
        return self.work.start(self.run)

    def wait(self, timeout: float | None = None) -> bool:
        return self.work.wait(timeout)

    def interrupt(self) -> bool:
        """The kernel's stop button (`envoykit.explorer.interrupt`): stop the work in flight
        as Cancel does; whether there was any."""
        return interrupt.stop_in_flight(self.work.busy, lambda: self._stop(interrupt=True))

    def _stop(self, *, interrupt: bool = False) -> None:
        """Cancel (or an interrupt): the batch in flight stops on the ranks at its next chunk
        (`engine.cancel`: a batch of a large model takes a minute), and no batch follows."""
        self._cancel.set(interrupt=interrupt)
        self.engine.cancel(self.work.thread)

    def run(self) -> CorpusLensResult | None:
        """Lens the documents shown; the result, or None when refused or cancelled (the
        reason is shown)."""
        documents = [line for line in self.texts.value.splitlines() if line.strip()]
        if not documents:
            self.say("no documents: write one per line", error=True)
            return None
        tokenizer = self.engine.tokenizer
        total = sum(len(token_ids(tokenizer, doc)) for doc in documents)
        runs = [None] if self.translator is None else [None, self.translator]
        self.button.disabled, self.cancel_button.disabled = True, False
        self._cancel.clear()
        self.progress.max, self.progress.value = max(1, total * len(runs)), 0
        began = time.monotonic()
        try:
            found = [
                self.engine.lens_corpus(
                    documents,
                    layers=["embed", "all"],
                    top_k=self.top_k.value,
                    translator=translator,
                    batch_tokens=PANEL_BATCH_TOKENS,
                    progress=_Bar(self, began),
                )
                for translator in runs
            ]
        except (Cancelled, EngineCancelled):
            self.say(
                f"{self._cancel.word} after {self.progress.value} of {self.progress.max} "
                "tokens; the engine is free",
                error=True,
            )
            return None
        except ENGINE_ERRORS as err:
            self.say(str(err), error=True)
            return None
        finally:
            self.button.disabled, self.cancel_button.disabled = False, True
        result, tuned = found[0], (found[1] if len(found) > 1 else None)
        self.show(result, tuned, took=time.monotonic() - began)
        return result

    def show(
        self,
        result: CorpusLensResult,
        tuned: CorpusLensResult | None = None,
        took: float | None = None,
    ) -> None:
        """Draw ``result`` (and ``tuned`` beside it) as ``plot.lens_corpus`` does."""
        from matplotlib.figure import Figure

        shown = [result] if tuned is None else [result, tuned]
        figure = plot.lens_corpus(shown, figure=Figure(figsize=(10, 3.6)))
        self.result, self.tuned_result, self.figure = result, tuned, figure
        self.view.outputs = (figure_output(figure, repr(result)),)
        settled = result.settles_at()
        self._head(
            f"{result.n_documents} documents, {result.n_tokens} tokens: the top-1 settles "
            f"{'nowhere' if settled is None else f'at layer {settled}'}; the last layer "
            f"predicts the next token {result.accuracy[-1]:.0%} of the time (top-"
            f"{result.top_k})" + ("" if took is None else f"; took {took:.1f} s")
        )

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in place of a figure; an error also clears the result."""
        if error:
            self.result = self.tuned_result = self.figure = None
            self.view.outputs = ()
        self._head(text, error=error, details=details)

    def _head(self, text: str, *, error: bool = False, details: str = "") -> None:
        self.header.value = (
            f"<b>{html.escape(TITLE)}</b>{message_html(text, error=error, details=details)}"
        )
