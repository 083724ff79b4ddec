"""`LensExplorer`: the controller that ties the inputs, the views and the lens together.

It builds no widgets (`layout`), owns no drawing and no JSON shaping (`views`, `payload`)
and writes no files (`export`): it turns widget events into lens requests and results into
view state. Every piece of model text it puts into an HTML widget (tokenizations, error
messages, the engine's name) is escaped, since ipywidgets' HTML widget renders its value as
markup.

The layer picker picks rows — (layer, site) pairs — which need not be a cross product of
layers and sites; the lens runs on the union and keeps the picked rows (`rows`). With a
stored `LensResult` (read-only) nothing can be recomputed: the picker filters the rows shown.

The explorer's jobs are parts of one class, each in a module of its own: `runner`
(`LensRuns`: Run on the lens thread, its pace, Cancel), `pins` (`Pins`), `compare_mode`
(`CompareMode`: the second prompt, drops, the sweep), `trajectory` (`TrajectoryView`) and
`cell_panels` (`CellPanels`: a cell's attribution and attention). They are mixed in rather
than held as objects because they share one state — the lens shown, the request it answers,
the second prompt's, the pins — which every one of them reads and a lens replaces at once.
This module sets that state (`state` declares it, for the parts to be checked against), wires
every event to its part (`_connect`), and draws a lens (`_show`) with the inputs that are no
part's own: targets, metric and colour limits.
"""

from __future__ import annotations

import html
import math
import threading
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import traitlets

from envoykit import plot
from envoykit.analyses.request import describe_target
from envoykit.analyses.sae import SAE
from envoykit.analyses.tuned import TunedLens
from envoykit.errors import InvalidRequest
from envoykit.explorer import export, interrupt, rows
from envoykit.explorer.cell_panels import CellPanels
from envoykit.explorer.compare_mode import CompareMode
from envoykit.explorer.compare_panel import describe_patch, patched_cell
from envoykit.explorer.corpus_panel import CorpusPanel
from envoykit.explorer.current_run import CurrentRun
from envoykit.explorer.features_panel import FeaturesPanel
from envoykit.explorer.interrupt import StopFlag
from envoykit.explorer.layout import ExplorerLayout, typed_targets
from envoykit.explorer.outputs import ERROR, WARNING, message_html
from envoykit.explorer.payload import heatmap_data, picker_layers, result_layers
from envoykit.explorer.pins import Pins
from envoykit.explorer.runner import LensRuns
from envoykit.explorer.steering_panel import SteeringPanel
from envoykit.explorer.training_panel import TrainingPanel
from envoykit.explorer.trajectory import TrajectoryView
from envoykit.explorer.views import LayerPicker
from envoykit.explorer.work import Background
from envoykit.model.families import sites_of
from envoykit.results.lens import LensResult
from envoykit.results.metrics import METRICS, metric_grid, metric_keys


class LensExplorer(LensRuns, Pins, CompareMode, TrajectoryView, CellPanels, ExplorerLayout):
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
        # The state the parts share, declared (with what each holds) in `ExplorerState`.
        self.current = CurrentRun(source) if readonly else None
        self.trajectory_figure = None
        self.trajectory_targets = []
        self._pace = None
        self._cancelling = StopFlag()
        self._drawing = threading.Event()
        super().__init__(
            _picker(source),
            prompt=source.prompt if readonly else prompt,
            targets=source.target_labels if readonly else targets,
            top_k=source.top_ids.shape[-1] if readonly else top_k,
            compare_with=compare_with,
            metric_options=self._metric_options(),
            readonly=readonly,
        )
        self.translator = None
        if translator is not None:
            self.set_translator(translator)
        self._connect()
        if not readonly:
            interrupt.listen(self)
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

    def _connect(self) -> None:
        """Every event to the part that answers it, and the two threads the engine's work
        runs on."""
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
        # A token picked in a panel re-runs that panel alone.
        self.attribution_panel.target.on_choice(lambda: self._draw_cell(attention=True))
        self.sweep_panel.target.on_choice(self._sweep_again)
        self.compare_panel.patch_button.on_click(lambda _: self.work.submit(self._patch_selected))

    def _add_steering_panel(self) -> SteeringPanel:
        """The steering panel under the other views, steering this explorer's prompt for its
        targets (its own prompt and target boxes hidden and linked to the explorer's)."""
        panel = SteeringPanel(self.engine, prompt=self.prompt.value)
        for mine, theirs in ((self.prompt, panel.prompt), (self.targets, panel.targets)):
            widgets.link((mine, "value"), (theirs, "value"))
            theirs.layout.display = "none"
        self.add_panel("Steering", panel)
        return panel

    def _add_corpus_panel(self) -> CorpusPanel:
        """The corpus lens under the other views: this engine's lens over many documents,
        the tuned lens beside it once one is offered."""
        panel = CorpusPanel(self.engine, translator=self.translator)
        self.add_panel("Corpus", panel)
        return panel

    def _add_training_panel(self) -> TrainingPanel:
        """Training a tuned lens from the page: once trained, the lens menu offers it."""
        panel = TrainingPanel(self.engine, self.set_translator)
        self.add_panel("Training", panel)
        return panel

    def _add_features_panel(self, sae: SAE) -> FeaturesPanel:
        """The Features panel under the other views, reading this explorer's prompt (its
        own prompt box hidden and linked to the explorer's)."""
        panel = FeaturesPanel(self.engine, sae, prompt=self.prompt.value)
        widgets.link((self.prompt, "value"), (panel.prompt, "value"))
        panel.prompt.layout.display = "none"
        self.add_panel("Features", panel)
        return panel

    @property
    def result(self) -> LensResult | None:
        """The lens shown (the first prompt's), or None before the first Run."""
        return None if self.current is None else self.current.result

    @property
    def other_result(self) -> LensResult | None:
        """The second prompt's lens shown in compare mode, or None."""
        return None if self.current is None else self.current.other_result

    def set_translator(self, translator: TunedLens) -> None:
        """Offer the tuned lens of ``translator`` beside the logit lens (the lens selector
        appears; Run uses the lens it shows)."""
        self.translator = translator
        self.lens_kind.layout.display = None
        # None read-only, and not made yet when __init__ offers a translator.
        corpus_panel = getattr(self, "corpus_panel", None)
        if corpus_panel is not None:
            corpus_panel.translator = translator

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

    # -- drawing a lens --------------------------------------------------------------------

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
        note = ""
        if patch is not None:
            # A patch is a cell of the second prompt's lens, which stays while the patch does.
            assert self.other_result is not None
            note = message_html(describe_patch(self.other_result, patch, shown))
        self.patch_note.value = note
        value = self.metric.value
        self.metric.options = self._metric_options()
        self.metric.value = value if value in self._metric_keys() else "prob"
        self._show_pins()
        self._draw_trajectory()
        # Every panel under the cell follows the run now shown (a patched run's notice goes
        # with it); the attention is asked of the engine only for another prompt or position.
        self._draw_cell(attention=True)

    def _metric_keys(self) -> list[str]:
        return [key for _, key in self.metric.options]

    def _metric_options(self) -> list[tuple[str, str]]:
        if self.result is None:
            return [(metric.title, key) for key, metric in METRICS.items()]
        return [(metric_grid(self.result, key)[1].title, key) for key in metric_keys(self.result)]

    def _say(self, text: str, error: bool = False, details: str = "") -> None:
        self.message.value = message_html(text, error=error, details=details)

    # -- the inputs ------------------------------------------------------------------------

    def _on_targets(self, _: Any = None) -> None:
        """Each typed target's tokens, one line each: a warning first where only its first
        token is measured, and a line too long for the column cut with an ellipsis (its
        whole text in the line's tooltip), so the targets never push the heatmap down."""
        if self.engine is None:
            self.tokenization.value = ""
            return
        rows = []
        for piece in typed_targets(self.targets.value):
            tokens = describe_target(self.engine.tokenizer, piece)
            listed = " ".join(repr(t) for t in tokens)
            if not tokens:
                note, listed = f"<b style='color:{ERROR}'>tokenizes to nothing</b>", ""
            elif len(tokens) > 1:
                first = html.escape(repr(tokens[0]))
                note = (
                    f"<b style='color:{WARNING}'>{len(tokens)} tokens: only "
                    f"<code>{first}</code> is measured</b>: "
                )
            else:
                note = ""
            whole = html.escape(f"{piece!r} → {listed}", quote=True)
            rows.append(
                f"<div class='ek-target-line' title=\"{whole}\">"
                f"<code>{html.escape(repr(piece))}</code> → {note}"
                + " ".join(f"<code>{html.escape(repr(t))}</code>" for t in tokens)
                + "</div>"
            )
        self.tokenization.value = "".join(rows)

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

    def _on_layers(self, _: Any) -> None:
        if self.engine is None:
            self._say("")
            self._show()
        else:
            self.status.value = "rows changed: press Run to lens them"

    def _sweep_again(self) -> None:
        """The sweep shown, measuring the token now picked (nothing before a first Sweep)."""
        if self.sweep is not None:
            self.sweep_panel.start(self.run_sweep)

    def _on_selected(self, _: Any) -> None:
        self._draw_trajectory()
        self._draw_cell(attention=True)


def _picker(source: Any) -> LayerPicker:
    """The layer picker: a stored result's rows, all picked; or every row of the engine's
    model, its sub-layer sites among them."""
    if isinstance(source, LensResult):
        picker = LayerPicker(result_layers(source))
        picker.rows = zip(source.layers.tolist(), source.sites)
        return picker
    family = source.readout.family
    sublayers = () if family is None else sites_of(family)
    return LayerPicker(picker_layers(source.locations(), sublayers=sublayers))


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
