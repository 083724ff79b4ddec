"""`SteeringPanel`: build a direction from two prompt lists, steer a prompt with it, and see
what changes.

Generate builds the vector (`Engine.steering_vector`: the mean difference of the two lists'
streams after the picked layer, at each prompt's last token; kept while the lists and the
layer stay the same), then shows the prompt's plain and steered greedy continuations side by
side, and under them the diff of the unsteered and the steered run (`ek.compare`, drawn by
the compare heatmap): per layer and position the change of the first target's probability,
or the JS divergence when no target is given. The panel runs on its own (``SteeringPanel(
engine, prompt=...)``) or inside a `LensExplorer`, which links its prompt and targets to the
panel's. Generate runs on a thread of its own (`Background`), so the notebook stays usable;
``generate()`` from code runs on the caller's. Every text it shows passes through
``html.escape`` or a text node.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets

from envoykit.analyses.compare import Run, compare
from envoykit.analyses.steering import Steer
from envoykit.errors import Cancelled
from envoykit.explorer import interrupt
from envoykit.explorer.compare_panel import diff_scale
from envoykit.explorer.interrupt import StopFlag
from envoykit.explorer.layout import typed_targets
from envoykit.explorer.outputs import ENGINE_ERRORS, message_html
from envoykit.explorer.payload import compare_data
from envoykit.explorer.target_choice import TargetChoice
from envoykit.explorer.views import Heatmap
from envoykit.explorer.work import Background
from envoykit.results.compare import CompareResult
from envoykit.results.steering import Generation, SteeringVector

TITLE = "Steering"
HINT = (
    "one prompt per line in each list; Generate builds their mean difference after the "
    "layer picked and adds it, times the strength, at every position of the prompt and of "
    "each generated token"
)


def prompt_lines(text: str) -> list[str]:
    """The prompts of a list box: its non-blank lines, as written."""
    return [line for line in text.splitlines() if line.strip()]


class SteeringPanel(widgets.VBox):
    """Two prompt lists, a layer and a strength in; two continuations and a diff out.

    ``vector`` is the last `SteeringVector` built, ``plain`` and ``steered`` the last two
    `Generation`\\ s, ``comparison`` the `CompareResult` in the diff heatmap (None while the
    panel shows a message instead).
    """

    def __init__(
        self,
        engine: Any,
        *,
        prompt: str = "",
        positive: Sequence[str] = (),
        negative: Sequence[str] = (),
        layer: int | None = None,
        scale: float = 1.0,
        max_tokens: int = 16,
        targets: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.prompt = widgets.Textarea(
            value=prompt, placeholder="prompt to steer", layout={"width": "auto", "height": "50px"}
        )
        self.targets = widgets.Text(
            value=",".join(targets), description="targets", placeholder="' good, bad'"
        )
        self.positive = _list_box("positive prompts, one per line", positive)
        self.negative = _list_box("negative prompts, one per line", negative)
        self._build_controls(layer, scale, max_tokens)
        self.header = widgets.HTML()
        self.plain_view = widgets.HTML(layout={"width": "50%"})
        self.steered_view = widgets.HTML(layout={"width": "50%"})
        self.diff_header = widgets.HTML()
        self.measure = TargetChoice[str]("the target whose change of probability the diff shows")
        self.measure.on_choice(self._show_measure)
        self.diff = Heatmap(metric="js")
        self.diff.add_class("ek-steer-diff")
        self.diff_scale = diff_scale(self.diff)
        self.vector: SteeringVector | None = None
        self.plain: Generation | None = None
        self.steered: Generation | None = None
        self.comparison: CompareResult | None = None
        super().__init__(
            [
                self.header,
                self.prompt,
                widgets.HBox([self.positive, self.negative]),
                widgets.HBox([self.layer, self.scale, self.norm_match]),
                widgets.HBox([self.max_tokens, self.targets, self.button, self.cancel_button]),
                widgets.HBox([self.plain_view, self.steered_view], layout={"width": "100%"}),
                widgets.HBox([self.diff_header, self.measure, self.diff_scale]),
                self.diff,
            ]
        )
        self.add_class("ek-steering")
        # Generate on a thread of its own: the notebook stays usable meanwhile.
        self.work = Background(
            "envoykit-steer",
            lambda why, details: self.say(f"generation failed: {why}", error=True, details=details),
        )
        self.button.on_click(lambda _: self.work.start(self.generate))
        self._cancel = StopFlag()
        self._at = "the vector"  # the stage of Generate that a Cancel would stop now
        self.cancel_button.on_click(lambda _: self._stop())
        interrupt.listen(self)
        self.say(HINT)

    def interrupt(self) -> bool:
        """The kernel's stop button (`envoykit.explorer.interrupt`): stop Generate as Cancel
        does; whether it was running."""
        return interrupt.stop_in_flight(self.work.busy, lambda: self._stop(interrupt=True))

    def _stop(self, *, interrupt: bool = False) -> None:
        """Cancel: Generate stops before its next stage (the vector, the plain continuation,
        the steered one, the diff); a continuation being generated stops on the ranks
        after its step in flight, and the diff's lens after its chunk in flight."""
        self._cancel.set(interrupt=interrupt)
        self.engine.cancel(self.work.thread)

    def _build_controls(self, layer: int | None, scale: float, max_tokens: int) -> None:
        """Where and how hard to steer, how far to generate, and the Generate button."""
        n_layers = self.engine.info.n_layers
        self.layer = widgets.BoundedIntText(
            value=max(1, n_layers // 3) if layer is None else layer,
            min=0,
            max=n_layers,
            description="layer",
            layout={"width": "160px"},
        )
        self.scale = widgets.FloatSlider(
            value=scale, min=-8.0, max=8.0, step=0.25, description="strength", readout_format=".2f"
        )
        self.norm_match = widgets.Checkbox(value=False, description="keep norms", indent=False)
        self.max_tokens = widgets.BoundedIntText(
            value=max_tokens, min=1, max=256, description="tokens", layout={"width": "160px"}
        )
        self.button = widgets.Button(description="Generate", icon="play", button_style="primary")
        self.cancel_button = widgets.Button(
            description="Cancel",
            icon="stop",
            disabled=True,
            tooltip="stop the vector, a continuation or the diff in flight",
        )

    def generate(self) -> Generation | None:
        """Build (or reuse) the vector, generate plain and steered, draw their diff; the
        steered continuation, or None when the engine refused (the reason is shown)."""
        self.button.disabled, self.cancel_button.disabled = True, False
        self._cancel.clear()
        try:
            self.say("building the vector and generating…")
            return self._generate()
        except (_Stopped, Cancelled) as stopped:
            where = "before" if isinstance(stopped, _Stopped) else "during"
            self.say(f"{self._cancel.word} {where} {self._at}; the engine is free", error=True)
            return None
        except ENGINE_ERRORS as err:
            self.say(str(err), error=True)
            return None
        finally:
            self.button.disabled, self.cancel_button.disabled = False, True
            self._cancel.clear()  # a Cancel is for the Generate it stopped

    def _stage(self, stage: str) -> None:
        """Before ``stage``: `_Stopped` once Cancel (or an interrupt) came; else ``stage``
        is what a Cancel from now on stops."""
        self._at = stage
        if self._cancel.is_set():
            raise _Stopped()

    def _generate(self) -> Generation:
        engine, prompt = self.engine, self.prompt.value
        self._stage("the vector")
        vector = self._vector()
        steer = Steer(
            vector, vector.layer, scale=self.scale.value, norm_match=self.norm_match.value
        )
        tokens = self.max_tokens.value
        self._stage("the plain continuation")
        plain = engine.generate(prompt, tokens, cancellable=True)
        self._stage("the steered continuation")
        steered = engine.generate(prompt, tokens, steer=steer)
        targets = measured_targets(engine.tokenizer, typed_targets(self.targets.value))
        self._stage("the diff")
        comparison = compare((engine, prompt), Run(engine, prompt, steer=steer), targets=targets)
        self.plain, self.steered, self.comparison = plain, steered, comparison
        self.plain_view.value = _continuation("plain", prompt, plain)
        self.steered_view.value = _continuation(
            f"steered: layer {vector.layer}, strength {steer.scale:+g}", prompt, steered
        )
        self.diff.data = compare_data(comparison, ("plain", "steered"))
        self.measure.offer(
            [
                (repr(token), label)
                for label, token in zip(comparison.target_labels, comparison.target_tokens)
            ]
        )
        self._show_measure()
        self._head(
            f"vector: {vector.label}, norm {vector.norm:.4g}; rows before layer "
            f"{vector.layer} are unchanged by construction"
        )
        return steered

    def _show_measure(self) -> None:
        """The diff of the target picked in ``measure``, or the JS divergence without one."""
        label = self.measure.chosen()
        self.diff.metric = "js" if label is None else label
        what = (
            "JS divergence of the plain and steered next-token distributions"
            if label is None
            else f"Δ p({label!r}), steered minus plain"
        )
        self.diff_header.value = f"<b>diff</b>{message_html(what + ', per layer and position')}"

    def _vector(self) -> SteeringVector:
        """The vector of the lists and layer shown, built once for each."""
        positive, negative = (prompt_lines(box.value) for box in (self.positive, self.negative))
        vector = self.vector
        wanted = (tuple(positive), tuple(negative), self.layer.value)
        if vector is None or (vector.positive, vector.negative, vector.layer) != wanted:
            vector = self.engine.steering_vector(
                positive, negative, self.layer.value, progress=False
            )
            self.vector = vector
        return vector

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in the header; an error also clears the results shown."""
        if error:
            self.plain = self.steered = self.comparison = None
            self.plain_view.value = self.steered_view.value = ""
            self.diff.data = {}
            self.diff_header.value = ""
            self.measure.offer([])
        self._head(text, error=error, details=details)

    def _head(self, text: str, *, error: bool = False, details: str = "") -> None:
        self.header.value = (
            f"<b>{html.escape(TITLE)}</b>{message_html(text, error=error, details=details)}"
        )


class _Stopped(Exception):
    """Generate stopped by Cancel before its next stage."""


def measured_targets(tokenizer: Any, typed: Sequence[str]) -> list[str | int]:
    """The tokens the diff measures for the targets typed in the explorer: a target of one
    token as typed, and of several its first token's id, the token the explorer's lens
    measures and says it measures (the diff itself takes single tokens only). A target
    that tokenizes to nothing is left out (the explorer says so), and a token is measured
    once."""
    measured: list[str | int] = []
    seen: set[int] = set()
    for text in typed:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids and ids[0] not in seen:
            seen.add(ids[0])
            measured.append(text if len(ids) == 1 else ids[0])
    return measured


def _list_box(placeholder: str, prompts: Sequence[str]) -> widgets.Textarea:
    return widgets.Textarea(
        value="\n".join(prompts), placeholder=placeholder, layout={"width": "50%", "height": "90px"}
    )


def _continuation(title: str, prompt: str, generation: Generation) -> str:
    """A continuation under its title, after its prompt in a fainter colour; all escaped."""
    return (
        f'<div class="ek-continuation"><b>{html.escape(title)}</b><div>'
        f'<span class="ek-continuation-prompt">{html.escape(prompt)}</span>'
        f'<span class="ek-continuation-text">{html.escape(str(generation))}</span></div></div>'
    )
