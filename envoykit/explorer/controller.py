"""`LensExplorer`: the controller that ties the inputs, the views and the lens together.

It builds no widgets (`layout`), owns no drawing and no JSON shaping (`views`, `payload`)
and writes no files (`export`): it turns widget events into lens requests and results into
view state. Every piece of model text it puts into an HTML widget (tokenizations, error
messages, the engine's name) is escaped, since ipywidgets' HTML widget renders its value as
markup.

The layer picker picks rows — (layer, site) pairs — which need not be a cross product of
layers and sites; the lens runs on the union and keeps the picked rows (`rows`).

With an engine, pinning a token that is not yet a target re-runs the lens with it added, so
its trajectory is exact, and clicking a cell shows the direct logit attribution at its
position (`AttributionPanel`). With a stored `LensResult` (read-only) nothing can be
recomputed: a pinned token that is not a target is drawn from the top-k lists only, as a
dotted line with gaps wherever it was not among the top k, and labelled so; the attribution
panel says it needs an engine.

Compare mode adds a second prompt (`ComparePanel`): Run lenses it with the same rows and
draws the diff of the two; a cell dragged from the second prompt's heatmap onto the first's
patches it into the first prompt's run, whose lens replaces the first heatmap and whose diff
against the unpatched run replaces the diff. The first prompt is always the run studied:
what the main heatmap, trajectory, attribution and export show. The sweep (`SweepPanel`)
patches the second prompt into the first at every picked layer and position.

Nothing a click asks of the engine runs on the kernel's thread: a Run, a pin and a drop run
their lens on the lens thread (`work`), a cell's attribution and attention on the cells'
thread (`cells`), each keeping only the latest request that arrives while one runs. Code
that sets ``heatmap.selected`` or ``pinned`` waits with `wait` before it reads the result;
`run` and `patch_cell` called from code run on the caller's thread and return the result.
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import traitlets

from envoykit import plot
from envoykit.analyses.attribution import HEADS_DO_NOT_ADD_UP
from envoykit.analyses.compare import compare
from envoykit.analyses.patching import Patch
from envoykit.analyses.request import Row, describe_target
from envoykit.analyses.sae import SAE
from envoykit.analyses.tuned import TunedLens
from envoykit.errors import Cancelled, InvalidRequest
from envoykit.explorer import export, rows
from envoykit.explorer.compare_panel import (
    describe_patch,
    drop_patch,
    patched_cell,
)
from envoykit.explorer.corpus_panel import CorpusPanel
from envoykit.explorer.features_panel import FeaturesPanel
from envoykit.explorer.layout import ExplorerLayout, typed_targets
from envoykit.explorer.outputs import (
    ENGINE_ERRORS,
    ERROR,
    WARNING,
    failure,
    figure_output,
    message_html,
    text_output,
)
from envoykit.explorer.payload import heatmap_data, picker_layers, result_layers
from envoykit.explorer.steering_panel import SteeringPanel
from envoykit.explorer.training_panel import TrainingPanel
from envoykit.explorer.views import LayerPicker
from envoykit.explorer.work import Background, Ticker, duration
from envoykit.model.families import sites_of
from envoykit.results.attribution import AttributionResult
from envoykit.results.compare import CompareResult
from envoykit.results.lens import LensResult
from envoykit.results.metrics import METRICS, metric_grid, metric_keys
from envoykit.results.sweep import SweepResult


class LensExplorer(ExplorerLayout):
    """Prompt, targets, metric, top-k and lens rows in; heatmap, trajectory and attribution out.

    ``LensExplorer(engine)`` runs the lens on the engine (`run`, or the Run button);
    ``LensExplorer(result)`` shows a stored `LensResult` read-only (the layer picker then
    filters the rows shown). ``result`` is the last lens, ``attribution`` the attribution
    shown for the selected cell; ``export`` saves what is shown.

    ``compare_with`` (or the *compare* box) turns compare mode on with a second prompt:
    ``other_result`` is its lens, ``comparison`` the `CompareResult` in the diff heatmap,
    ``patch`` the `Patch` a drop applied to ``result`` (`patch_cell`), ``sweep`` the last
    `SweepResult` (`run_sweep`, or the Sweep button).

    ``translator`` (or `set_translator`) offers a tuned lens: a lens selector appears and
    Run applies the translators on the ranks when it reads "tuned lens".

    ``sae`` (an `ek.SAE`) adds the Features panel (`features_panel`) on this prompt.
    """

    def __init__(
        self,
        source: Any,
        *,
        prompt: str = "",
        targets: tuple[str, ...] | list[str] = (),
        top_k: int = 10,
        metric: str = "prob",
        compare_with: str = "",
        translator: TunedLens | None = None,
        sae: SAE | None = None,
    ) -> None:
        readonly = isinstance(source, LensResult)
        self.engine = None if readonly else source
        self.result: LensResult | None = source if readonly else None
        self.other_result: LensResult | None = None
        self.trajectory_figure: Any = None
        self.trajectory_targets: list[str] = []
        self._request: dict[str, Any] | None = None
        self._rows: list[Row] = []
        # The second prompt of what is shown, and the lens request its heatmap answers.
        self._other: str | None = None
        self._other_request: dict[str, Any] | None = None
        self._pace: float | None = None  # seconds per row x position of the last Run
        self._cancelling = threading.Event()  # Cancel was pressed during the Run in flight

        if readonly:
            picker = LayerPicker(result_layers(source))
            picker.rows = zip(source.layers.tolist(), source.sites)
        else:
            family = source.readout.family
            sublayers = () if family is None else sites_of(family)
            picker = LayerPicker(picker_layers(source.locations(), sublayers=sublayers))
        super().__init__(
            picker,
            prompt=source.prompt if readonly else prompt,
            targets=source.target_labels if readonly else targets,
            top_k=source.top_ids.shape[-1] if readonly else top_k,
            compare_with=compare_with,
            metric_options=self._metric_options(),
            readonly=readonly,
        )
        self.translator: TunedLens | None = None
        if translator is not None:
            self.set_translator(translator)

        self.targets.observe(self._on_targets, "value")
        self.metric.observe(self._on_metric, "value")
        for control in (self.colour_min, self.colour_max, self.colour_scale):
            control.observe(self._on_colour_limits, "value")
        self.picker.observe(self._on_layers, ["selected", "selected_sites"])
        self.heatmap.observe(self._on_selected, "selected")
        self.heatmap.observe(self._on_pinned, "pinned")
        self.heatmap.observe(self._on_drop, "drop")
        for view in (self.compare_panel.source, self.compare_panel.diff):
            view.observe(self._on_other_pinned, "pinned")
        self.compare.observe(self._on_compare, "value")
        # Every lens a button, a pin or a drop asks for runs on a thread of its own, the
        # latest waiting behind the one in flight: the notebook stays usable meanwhile.
        self.work = Background(
            "envoykit-lens", lambda why, details: self._refused(f"the run failed: {why}", details)
        )
        # A cell click's attribution and attention, the same way, on a second thread.
        self.cells = Background(
            "envoykit-cell",
            lambda why, details: self.attribution_panel.say(why, error=True, details=details),
        )
        self.run_button.on_click(lambda _: self.work.submit(self.run))
        self.cancel_button.on_click(lambda _: self.cancel())
        self.sweep_panel.button.on_click(lambda _: self.sweep_panel.start(self.run_sweep))
        self.compare_panel.patch_button.on_click(lambda _: self.work.submit(self._patch_selected))

        self.steering_panel = None if readonly else self._add_steering_panel()
        self.corpus_panel = None if readonly else self._add_corpus_panel()
        self.training_panel = None if readonly else self._add_training_panel()
        self.features_panel = None if readonly or sae is None else self._add_features_panel(sae)
        self._on_compare()
        self._on_targets()
        if metric in self._metric_keys():
            self.metric.value = metric
        if readonly:
            self._show()
        else:
            self._say("type a prompt and targets, pick layers, then press Run")
            self._draw_cell()

    @property
    def attribution(self) -> AttributionResult | None:
        """The attribution drawn for the selected cell; None while the panel shows a message."""
        return self.attribution_panel.result

    @property
    def attribution_figure(self) -> Any:
        """The matplotlib figure of `attribution`, or None."""
        return self.attribution_panel.figure

    @property
    def comparison(self) -> CompareResult | None:
        """The diff drawn in compare mode: the two prompts, or the run and its patched run."""
        return self.compare_panel.result

    @property
    def patch(self) -> Patch | None:
        """The patch the lens shown was run with (a drop in compare mode), or None."""
        return None if self._request is None else self._request.get("patch")

    @property
    def sweep(self) -> SweepResult | None:
        """The last patch sweep drawn; None while the sweep panel shows a message."""
        return self.sweep_panel.result

    @property
    def sweep_figure(self) -> Any:
        """The matplotlib figure of `sweep`, or None."""
        return self.sweep_panel.figure

    def _add_steering_panel(self) -> SteeringPanel:
        """The steering panel under the other views, steering this explorer's prompt for its
        targets (its own prompt and target boxes hidden and linked to the explorer's)."""
        panel = SteeringPanel(self.engine, prompt=self.prompt.value)
        for mine, theirs in ((self.prompt, panel.prompt), (self.targets, panel.targets)):
            widgets.link((mine, "value"), (theirs, "value"))
            theirs.layout.display = "none"
        self.children = (*self.children, panel)
        return panel

    def _add_corpus_panel(self) -> CorpusPanel:
        """The corpus lens under the other views: this engine's lens over many documents,
        the tuned lens beside it once one is offered."""
        panel = CorpusPanel(self.engine, translator=self.translator)
        self.children = (*self.children, panel)
        return panel

    def _add_training_panel(self) -> TrainingPanel:
        """Training a tuned lens from the page: once trained, the lens menu offers it."""
        panel = TrainingPanel(self.engine, self.set_translator)
        self.children = (*self.children, panel)
        return panel

    def _add_features_panel(self, sae: SAE) -> FeaturesPanel:
        """The Features panel under the other views, reading this explorer's prompt (its
        own prompt box hidden and linked to the explorer's)."""
        panel = FeaturesPanel(self.engine, sae, prompt=self.prompt.value)
        widgets.link((self.prompt, "value"), (panel.prompt, "value"))
        panel.prompt.layout.display = "none"
        self.children = (*self.children, panel)
        return panel

    # -- actions ---------------------------------------------------------------------------

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
        was cancelled. Whether a Run was in flight."""
        self.work.drop_waiting()
        self.cells.drop_waiting()
        run = self.work.thread
        if self.engine is None or run is None or not run.is_alive():
            return False
        self._cancelling.set()
        self.status.value = "<i>cancelling…</i>"

        # A Cancel heard before the lens is on the ranks (while its request is checked and
        # tokenized) waits for it: `engine.cancel` stops only a lens in flight. It stops
        # this Run's lens only (its thread's), and gives up once the Run has ended.
        def until_cancelled() -> None:
            while self._cancelling.is_set() and run.is_alive() and not self.engine.cancel(run):
                time.sleep(0.02)

        threading.Thread(target=until_cancelled, name="envoykit-cancel", daemon=True).start()
        return True

    def set_translator(self, translator: TunedLens) -> None:
        """Offer the tuned lens of ``translator`` beside the logit lens (the lens selector
        appears; Run uses the lens it shows)."""
        self.translator = translator
        self.lens_kind.layout.display = None
        if getattr(self, "corpus_panel", None) is not None:
            self.corpus_panel.translator = translator

    def patch_cell(self, source: Sequence[int], target: Sequence[int]) -> LensResult | None:
        """Patch cell ``source`` of the second prompt's heatmap into the first prompt's run at
        the column of cell ``target`` of the first heatmap (what a drop does); cells are
        ``[layer_index, position_index]``.

        The patch copies the source cell's row — its layer and site — at its position into
        the same row of the first run, at the target column's position; the target's row
        is not used. Returns the patched lens, or None when refused (the reason is shown).
        """
        if self.engine is None or self.result is None or self.other_result is None:
            self._say("patching needs compare mode: tick it, type a second prompt, Run", True)
            return None
        try:
            patch = drop_patch(self.other_result, source, self.result, target)
        except InvalidRequest as err:
            self._say(str(err), True)
            return None
        return self._lens({**self._request, "patch": patch}, self._rows, self._other)

    def run_sweep(self) -> SweepResult | None:
        """Patch the second prompt's residual stream into the first at every picked layer
        and every position (same as pressing Sweep), measuring the first prompt's next
        token: the token pinned last, else the first target. Returns the `SweepResult`, or
        None when refused (the reason is shown)."""
        panel = self.sweep_panel
        if self.engine is None or self.result is None or self._other is None:
            panel.say(
                "Run in compare mode first: the sweep patches the second prompt into the first",
                error=True,
            )
            return None
        target = self._focus_target(self.result)
        if target is None:
            panel.say("type or pin a target: the sweep measures its probability", error=True)
            return None
        layers = sorted(set(self.result.layers.tolist()))
        return panel.run(
            self.engine, self._other, self._request["prompt"], layers=layers, target_token=target
        )

    def export(self, path: str | Path) -> Path:
        """Save what is shown: ``.png``/``.svg`` (matplotlib heatmap of the current metric),
        ``.json`` (`LensResult.to_json`) or ``.html`` (a page that draws the interactive
        heatmap in any browser, with no kernel, and under it every other panel shown: the
        diff, the trajectory, the attribution and the sweep, as figures)."""
        shown = self._shown()
        if shown is None:
            raise InvalidRequest("nothing to export yet: run the lens first")
        return export.save(
            shown, self.heatmap.metric, path, self._panel_figures(), dict(self.heatmap.limits)
        )

    def _panel_figures(self) -> list[tuple[str, Any]]:
        """``(title, figure)`` of every panel under the heatmap that shows a figure now."""
        panels = []
        if self.comparison is not None:
            from matplotlib.figure import Figure

            # A bare Figure, never pyplot's: the notebook would show that one under the cell.
            n_layers, n_pos = self.comparison.js.shape
            ax = Figure(figsize=(min(3 + 0.9 * n_pos, 14), min(2 + 0.3 * n_layers, 10))).subplots()
            plot.compare(self.comparison, ax=ax)
            panels.append((f"diff: {self.comparison.a} → {self.comparison.b}", ax.figure))
        for title, figure in (
            ("trajectory", self.trajectory_figure),
            ("direct logit attribution", self.attribution_figure),
            ("patch sweep", self.sweep_figure),
        ):
            if figure is not None:
                panels.append((title, figure))
        return panels

    # -- internals -------------------------------------------------------------------------

    def _lens(
        self, request: dict[str, Any], picked: list[Row], other: str | None
    ) -> LensResult | None:
        """Run ``request`` (`Engine.lens`'s arguments, a patch included) and keep the
        ``picked`` rows; with a second prompt ``other``, lens it too (unpatched, reused when
        its request is unchanged) and draw the diff."""
        self.run_button.disabled, self.cancel_button.disabled = True, False
        self.run_button.description = "Running…"
        self._say("")  # the last run's message is not about this one
        cells = self._cells(request, picked, other)
        expected = None if self._pace is None else self._pace * cells
        name = html.escape(self.engine.info.name)

        def say(elapsed: float) -> None:
            if self._cancelling.is_set():
                self.status.value = "<i>cancelling…</i>"
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
                    outcome = self._lenses(request, picked, other)
                finally:
                    self._cancelling.clear()
            if isinstance(outcome, str):
                return self._refused(outcome)
            took = time.monotonic() - began
            self._pace = took / cells
            result, other_result, other_request = outcome
            self._request, self._rows, self._other = request, picked, other
            self._other_request = other_request
            self.result, self.other_result = result, other_result
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
            self._cancelling.clear()
            self.run_button.disabled, self.cancel_button.disabled = False, True
            self.run_button.description = "Run"

    def _lenses(
        self, request: dict[str, Any], picked: list[Row], other: str | None
    ) -> tuple[LensResult, LensResult | None, dict[str, Any] | None] | str:
        """The lens of ``request`` and, with a second prompt ``other``, of that one (reused
        when its request is unchanged), with the ``picked`` rows; or why not, to say."""
        try:
            result = rows.keep(self.engine.lens(**request), picked)
        except Cancelled:
            return "cancelled: the lens was stopped on the ranks"
        except ENGINE_ERRORS as err:
            return str(err)
        if result is None:
            return "the lens holds none of the picked rows"
        other_request = _other_request(request, other)
        other_result = None
        if other_request is not None:
            if other_request == self._other_request:
                other_result = self.other_result
            elif self._cancelling.is_set():
                return "cancelled before the second prompt's lens"
            else:
                try:
                    other_result = rows.keep(self.engine.lens(**other_request), picked)
                except Cancelled:
                    return "cancelled: the second prompt's lens was stopped on the ranks"
                except ENGINE_ERRORS as err:
                    return f"second prompt: {err}"
        return result, other_result, other_request

    def _cells(self, request: dict[str, Any], picked: list[Row], other: str | None) -> int:
        """How many rows × positions a Run of ``request`` reduces (the pace of the last Run,
        in seconds per cell, gives the time left of the next)."""
        prompts = [request["prompt"]] + ([other] if other else [])
        tokens = sum(len(self.engine.tokenizer(text)["input_ids"]) for text in prompts)
        return max(1, len(picked) * tokens)

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

    def _show_comparison(self) -> None:
        """The second prompt's heatmap and the diff: the two prompts, or, with a patch, the
        first prompt's run against its patched run (each picked layer's stream)."""
        panel = self.compare_panel
        if self.other_result is None:
            panel.clear()
            return
        panel.show_source(self.other_result)
        panel.source.metric = self.heatmap.metric
        panel.source.pinned = list(self.heatmap.pinned)
        prompt, patch = self._request["prompt"], self.patch
        layers = sorted(set(self.result.layers.tolist()))
        targets = self.result.target_ids.tolist()
        try:
            if patch is None:
                res = self.engine.lens(
                    [prompt, self._other], compare=True, layers=layers, targets=targets
                )
                names, about = ("first", "second"), "the first prompt → the second"
            else:
                res = compare(
                    (self.engine, prompt),
                    (self.engine, prompt, patch),
                    layers=layers,
                    targets=targets,
                )
                names, about = ("clean", "patched"), "the first prompt's run → its patched run"
        except Exception as err:  # said here: its caller draws the rest
            line, details = failure(err)
            panel.say_diff(line, error=True, details=details)
            return
        panel.show_diff(res, names, about)
        panel.diff.pinned = list(self.heatmap.pinned)
        self._sync_diff_metric()

    def _sync_diff_metric(self) -> None:
        """The diff follows the metric menu: Δ p of the target it names, else JS."""
        diff, key = self.compare_panel.diff, self.heatmap.metric
        grids = diff.data.get("grids", {})
        if self.result is not None and key in self.result.target_labels:
            key = str(self.result.target(key).token_id)
        diff.metric = key if key in grids else "js"

    def _shown(self) -> LensResult | None:
        """The result restricted, when read-only, to the rows picked in the layer picker."""
        if self.result is None or self.engine is not None:
            return self.result
        return rows.keep(self.result, self.picker.rows)

    def _show(self) -> None:
        shown = self._shown()
        if shown is None:
            self._say("no layers picked: pick at least one layer to show", True)
            return
        before = self.heatmap.data
        labels = before.get("layer_labels", [])
        # A cell of another prompt means nothing here: follow the new one's last position.
        same_prompt = before.get("prompt") == shown.prompt
        self.heatmap.selected = (
            _same_cell(self.heatmap.selected, labels, shown) if same_prompt else None
        )
        patch = self.patch
        cell = None if patch is None else patched_cell(shown, patch)
        self.heatmap.data = heatmap_data(shown, marks=[cell] if cell else [])
        self.patch_note.value = (
            "" if patch is None else message_html(describe_patch(self.other_result, patch, shown))
        )
        value = self.metric.value
        self.metric.options = self._metric_options()
        self.metric.value = value if value in self._metric_keys() else "prob"
        self._show_pins()
        self._draw_trajectory()
        self._draw_cell()

    def _metric_keys(self) -> list[str]:
        return [key for _, key in self.metric.options]

    def _metric_options(self) -> list[tuple[str, str]]:
        if self.result is None:
            return [(metric.title, key) for key, metric in METRICS.items()]
        return [(metric_grid(self.result, key)[1].title, key) for key in metric_keys(self.result)]

    def _targets_with_pins(self, typed: list[str]) -> list[str | int]:
        """Typed targets, then the pinned token ids that are not already one of them."""
        tokenizer = self.engine.tokenizer
        typed_ids = {
            ids[0]
            for piece in typed
            if (ids := tokenizer(piece, add_special_tokens=False)["input_ids"])
        }
        return [*typed, *(i for i in self.heatmap.pinned if i not in typed_ids)]

    def _say(self, text: str, error: bool = False, details: str = "") -> None:
        self.message.value = message_html(text, error=error, details=details)

    def _on_targets(self, _: Any = None) -> None:
        if self.engine is None:
            self.tokenization.value = ""
            return
        rows = []
        for piece in typed_targets(self.targets.value):
            tokens = describe_target(self.engine.tokenizer, piece)
            if not tokens:
                shown = f"<b style='color:{ERROR}'>tokenizes to nothing</b>"
            else:
                shown = " ".join(f"<code>{html.escape(repr(t))}</code>" for t in tokens)
                if len(tokens) > 1:
                    first = html.escape(repr(tokens[0]))
                    shown += (
                        f" <b style='color:{WARNING}'>{len(tokens)} tokens: the lens, the "
                        f"attribution and the sweep measure only <code>{first}</code></b>"
                    )
            rows.append(f"<code>{html.escape(repr(piece))}</code> → {shown}")
        self.tokenization.value = "<br>".join(rows)

    def _on_metric(self, change: dict[str, Any]) -> None:
        if change["new"] is not None:
            self.heatmap.metric = change["new"]
            self.compare_panel.source.metric = change["new"]
            self._sync_diff_metric()

    def _on_colour_limits(self, _: Any = None) -> None:
        """The colour controls to the heatmap's ``limits``; a limit that is not a number, or
        a minimum not below the maximum, is a message and changes nothing."""
        try:
            bounds = [_limit(box.value) for box in (self.colour_min, self.colour_max)]
            self.heatmap.limits = {
                "vmin": bounds[0],
                "vmax": bounds[1],
                "log": self.colour_scale.value == "log",
            }
        except (ValueError, traitlets.TraitError) as err:
            self._say(f"colour limits: {err}", True)
            return
        self._say("")

    def _on_compare(self, _: Any = None) -> None:
        shown = None if self.compare.value else "none"
        self.other_prompt.layout.display = shown
        self.compare_box.layout.display = shown
        if self.engine is not None and self.result is not None:
            self.status.value = "compare mode changed: press Run"

    def _on_drop(self, change: dict[str, Any]) -> None:
        drop = change["new"]
        if drop is None:
            return
        self.heatmap.drop = None  # an event: the same drop made again is seen again
        dropped_on = (self.result, self.other_result)

        def patch() -> None:
            # The cells name rows and columns of the heatmaps the drop was made on.
            if (self.result, self.other_result) != dropped_on:
                self._say("the heatmaps changed before the drop was applied: drop again", True)
                return
            self.patch_cell(drop["source"], drop["target"])

        self.work.submit(patch)

    def _patch_selected(self) -> LensResult | None:
        """Patch the second heatmap's selected cell in: at the first heatmap's selected
        column, else at the same position of the first prompt (what a drop there does)."""
        source = self.compare_panel.source.selected
        if source is None or self.result is None or self.other_result is None:
            self._say("click a cell of the second prompt's heatmap first", True)
            return None
        target = self.heatmap.selected
        if target is None:
            position = int(self.other_result.positions[source[1]])
            columns = self.result.positions.tolist()
            if position not in columns:
                self._say(
                    f"the first prompt has no position {position}: click the column of the "
                    "first heatmap to patch into",
                    True,
                )
                return None
            target = [0, columns.index(position)]
        return self.patch_cell(source, target)

    def _on_other_pinned(self, change: dict[str, Any]) -> None:
        """A token pinned in the second heatmap or the diff is pinned in the first."""
        new = [i for i in change["new"] if i not in self.heatmap.pinned]
        if new:
            self.heatmap.pinned = [*self.heatmap.pinned, *new]

    def _on_layers(self, _: Any) -> None:
        if self.engine is None:
            self._say("")
            self._show()
        else:
            self.status.value = "rows changed: press Run to lens them"

    def _on_selected(self, _: Any) -> None:
        self._draw_trajectory()
        self._draw_cell(attention=True)

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
        if self._pins_need_a_lens():
            typed = [t for t in self._request["targets"] if isinstance(t, str)]
            request = {**self._request, "targets": self._targets_with_pins(typed)}
            self._lens(request, self._rows, self._other)
        elif self.result is not None:
            self._show_pins()
            self._draw_trajectory()
            self._draw_cell()

    def _draw_cell(self, attention: bool = False) -> None:
        """The selected cell's attribution, and with ``attention`` its attention: what can be
        said at once is said here; what needs the engine runs on the cells' thread, the
        latest click's in place of any still waiting."""
        jobs = [self._draw_attribution()]
        if attention:
            jobs.append(self._draw_attention())
        todo = [job for job in jobs if job is not None]
        if todo:
            self.cells.submit(lambda: [job() for job in todo])

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
        for ids, tokens in ((res.target_ids, res.target_tokens), (res.top_ids, res.top_tokens)):
            found = np.flatnonzero(np.asarray(ids).ravel() == token_id)
            if len(found):
                return str(np.asarray(tokens, dtype=object).ravel()[found[0]])
        return str(token_id)

    def _draw_trajectory(self) -> None:
        """Every target, and (read-only) every pinned top-k token, at the selected position."""
        from matplotlib.figure import Figure

        shown = self._shown()
        if shown is None:
            return
        position = self.heatmap.selected[1] if self.heatmap.selected else -1
        known = set(shown.target_ids.tolist())
        extra = [i for i in self.heatmap.pinned if i not in known]
        if not len(shown.target_labels) and not extra:
            self.trajectory_figure, self.trajectory_targets = None, []
            self.trajectory.outputs = (
                text_output("type targets, or click a token in a heatmap tooltip to pin it"),
            )
            return
        ax = Figure(figsize=(7, 3.5)).subplots()
        labels = list(shown.target_labels)
        plot.trajectory(shown, labels, position=position, from_top_k=extra, ax=ax)
        labels += [shown.top_k_trace(token_id, position)[0] for token_id in extra]
        self.trajectory_figure, self.trajectory_targets = ax.figure, labels
        self.trajectory.outputs = (
            figure_output(ax.figure, f"trajectory of {labels} at position {position}"),
        )

    def _draw_attribution(self) -> Callable[[], None] | None:
        """The direct logit attribution at the selected cell's position, for the token pinned
        last or else the first target; the engine is asked only when either changed, by the
        job returned (None: all is said)."""
        panel = self.attribution_panel
        if self.engine is None:
            panel.say("needs an engine: this explorer shows a stored LensResult")
            return None
        shown = self._shown()
        if shown is None or self.heatmap.selected is None:
            panel.say("click a heatmap cell to see who wrote the prediction at its position")
            return None
        if self.patch is not None:
            panel.say(
                "the lens shown is of a patched run, and attribution runs on unpatched "
                "prompts only: Run to go back to the unpatched lens"
            )
            return None
        target = self._focus_target(shown)
        if target is None:
            panel.say("type or pin a target to see its attribution at the selected cell")
            return None
        row, column = self.heatmap.selected
        prompt, position = shown.prompt, int(shown.positions[column])
        layer, label = int(shown.layers[row]), shown.layer_labels[row]
        att = panel.result
        if (
            att is not None
            and att.prompt == prompt
            and att.positions.tolist() == [position]
            and att.target_ids.tolist() == [target]
        ):
            panel.show(att, target, layer=layer, row=label)
            return None
        panel.busy(f"attributing at position {position}")

        def attribute() -> None:
            try:
                fresh = self._attribute(prompt, target, position)
            except Exception as err:  # on the cells' thread: said here, or nowhere
                line, details = failure(err)
                panel.say(line, error=True, details=details)
                return
            panel.show(fresh, target, layer=layer, row=label)

        return attribute

    def _attribute(self, prompt: str, target: int, position: int) -> AttributionResult:
        """The attribution at one position, split into heads where the model allows it (the
        attention panel draws the heads); else by layer only. Only the refusals of the head
        split fall back: any other refusal is the attribution's own, and is said."""
        if isinstance(self.engine.readout.heads, str):  # no head layout here
            return self.engine.attribute(prompt, [target], positions=[position])
        try:
            return self.engine.attribute(prompt, [target], positions=[position], heads=True)
        except InvalidRequest as err:
            if HEADS_DO_NOT_ADD_UP not in str(err):
                raise
            return self.engine.attribute(prompt, [target], positions=[position])

    def _draw_attention(self) -> Callable[[], None] | None:
        """What the selected cell's position attends to at every layer and head, opened at
        the cell's layer; the heads' contributions to the attribution's target as bars. The
        engine is asked by the job returned, after the attribution's (None: all is said)."""
        panel = self.attention_panel
        shown = self._shown()
        if self.engine is None:
            panel.say("needs an engine: this explorer shows a stored LensResult")
            return None
        if shown is None or self.heatmap.selected is None:
            panel.say("click a heatmap cell to see what its position attends to")
            return None
        if self.patch is not None:
            panel.say("the lens shown is of a patched run; Run to go back to the unpatched one")
            return None
        heads = self.engine.readout.heads
        if isinstance(heads, str):
            panel.say(heads)
            return None
        row, column = self.heatmap.selected
        prompt, position = shown.prompt, int(shown.positions[column])
        if position >= len(self.engine.tokenizer(prompt)["input_ids"]):
            panel.say("a generated position: attention is drawn for the prompt's positions")
            return None
        layer = max(1, int(shown.layers[row]))
        panel.busy(f"attention at position {position}")
        engine = self.engine

        def attend() -> None:
            try:
                res = engine.attention(prompt, queries=[position])
            except Exception as err:  # on the cells' thread: said here, or nowhere
                line, details = failure(err)
                panel.say(line, error=True, details=details)
                return
            panel.fetch = lambda layer, head: engine.attention(prompt, layers=[layer], heads=[head])
            att = self.attribution_panel.result
            usable = att is not None and att.head_values is not None and att.prompt == prompt
            usable = usable and att.positions.tolist() == [position]
            panel.show(
                res,
                position,
                layer=layer,
                attribution=att if usable else None,
                target=int(att.target_ids[0]) if usable else None,
            )

        return attend

    def _focus_target(self, shown: LensResult) -> int | None:
        """The token the attribution and the sweep follow: pinned last, else the first target."""
        if self.heatmap.pinned:
            return int(self.heatmap.pinned[-1])
        return int(shown.target_ids[0]) if len(shown.target_ids) else None


def _limit(text: str) -> float | None:
    """A colour limit typed in a box: a number, or blank for the metric's own."""
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a number (leave it blank for the metric's own)"
        ) from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _same_cell(cell: list[int] | None, labels: list[str], shown: LensResult) -> list[int] | None:
    """Cell ``cell`` of rows ``labels`` in ``shown``: the same row (by label, since rows come
    and go with the picker) and column; None when it is not shown any more."""
    if cell is None or cell[0] >= len(labels) or cell[1] >= len(shown.positions):
        return None
    label = labels[cell[0]]
    return [shown.layer_labels.index(label), cell[1]] if label in shown.layer_labels else None


def _other_request(request: dict[str, Any], other: str | None) -> dict[str, Any] | None:
    """The second prompt's lens request: the first's, unpatched, on ``other``."""
    if other is None:
        return None
    return {**{k: v for k, v in request.items() if k != "patch"}, "prompt": other}
