"""`LensExplorer`: the controller that ties the inputs, the views and the lens together.

It owns no drawing and no JSON shaping (`views`, `payload`) and writes no files (`export`):
it turns widget events into lens requests and results into view state. Every piece of model
text it puts into an HTML widget (tokenizations, error messages, the engine's name) is
escaped, since ipywidgets' HTML widget renders its value as markup.

The layer picker picks rows — (layer, site) pairs — which need not be a cross product of
layers and sites; the lens runs on the union and keeps the picked rows (`rows`).

With an engine, pinning a token that is not yet a target re-runs the lens with it added, so
its trajectory is exact, and clicking a cell shows the direct logit attribution at its
position (`AttributionPanel`). With a stored `LensResult` (read-only) nothing can be
recomputed: a pinned token that is not a target is drawn from the top-k lists only, as a
dotted line with gaps wherever it was not among the top k, and labelled so; the attribution
panel says it needs an engine.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np

from envoykit import plot
from envoykit.attribution_result import AttributionResult
from envoykit.errors import EnvoykitError, InvalidRequest
from envoykit.explorer import export, rows
from envoykit.explorer.attribution_panel import AttributionPanel
from envoykit.explorer.outputs import ERROR, figure_output, message_html, text_output
from envoykit.explorer.payload import heatmap_data, picker_layers, result_layers
from envoykit.explorer.views import Heatmap, LayerPicker
from envoykit.metrics import METRICS, metric_grid, metric_keys
from envoykit.request import Row, describe_target
from envoykit.result import LensResult


class LensExplorer(widgets.VBox):
    """Prompt, targets, metric, top-k and lens rows in; heatmap, trajectory and attribution out.

    ``LensExplorer(engine)`` runs the lens on the engine (`run`, or the Run button);
    ``LensExplorer(result)`` shows a stored `LensResult` read-only (the layer picker then
    filters the rows shown). ``result`` is the last lens, ``attribution`` the attribution
    shown for the selected cell; ``export`` saves what is shown.
    """

    def __init__(
        self,
        source: Any,
        *,
        prompt: str = "",
        targets: tuple[str, ...] | list[str] = (),
        top_k: int = 10,
        metric: str = "prob",
    ) -> None:
        readonly = isinstance(source, LensResult)
        self.engine = None if readonly else source
        self.result: LensResult | None = source if readonly else None
        self.trajectory_figure: Any = None
        self.trajectory_targets: list[str] = []
        self._request: dict[str, Any] | None = None
        self._rows: list[Row] = []

        self.prompt = widgets.Textarea(
            value=source.prompt if readonly else prompt,
            placeholder="prompt",
            layout=widgets.Layout(width="100%", height="70px"),
            disabled=readonly,
        )
        self.targets = widgets.Text(
            value=",".join(source.target_labels if readonly else targets),
            description="targets",
            placeholder="comma-separated, spaces kept: ' Paris, London'",
            disabled=readonly,
            layout=widgets.Layout(width="100%"),
        )
        self.tokenization = widgets.HTML()
        self.metric = widgets.Dropdown(description="metric", options=self._metric_options())
        self.top_k = widgets.BoundedIntText(
            value=source.top_ids.shape[-1] if readonly else top_k,
            min=1,
            max=1000,
            description="top-k",
            disabled=readonly,
            layout=widgets.Layout(width="160px"),
        )
        self.run_button = widgets.Button(
            description="Run", button_style="primary", icon="play", disabled=readonly
        )
        self.status = widgets.HTML("read-only: a stored LensResult" if readonly else "")
        self.message = widgets.HTML()
        if readonly:
            self.picker = LayerPicker(result_layers(source))
            self.picker.rows = zip(source.layers.tolist(), source.sites)
        else:
            sublayers = source.readout.mlp_prenorm is not None
            self.picker = LayerPicker(picker_layers(source.locations(), sublayers=sublayers))
        self.heatmap = Heatmap()
        self.trajectory = widgets.Output()
        self.trajectory.add_class("ek-trajectory")
        self.attribution_panel = AttributionPanel()

        self.targets.observe(self._on_targets, "value")
        self.metric.observe(self._on_metric, "value")
        self.picker.observe(self._on_layers, ["selected", "selected_sites"])
        self.heatmap.observe(self._on_selected, "selected")
        self.heatmap.observe(self._on_pinned, "pinned")
        self.run_button.on_click(lambda _: self.run())

        controls = widgets.VBox(
            [
                self.targets,
                self.tokenization,
                widgets.HBox([self.metric, self.top_k]),
                widgets.HBox([self.run_button, self.status]),
            ],
            layout=widgets.Layout(width="55%"),
        )
        super().__init__(
            [
                widgets.HBox([widgets.Box([self.prompt], layout={"width": "45%"}), controls]),
                self.message,
                self.picker,
                self.heatmap,
                self.trajectory,
                self.attribution_panel,
            ]
        )
        self._on_targets()
        if metric in self._metric_keys():
            self.metric.value = metric
        if readonly:
            self._show()
        else:
            self._draw_attribution()

    @property
    def attribution(self) -> AttributionResult | None:
        """The attribution drawn for the selected cell; None while the panel shows a message."""
        return self.attribution_panel.result

    @property
    def attribution_figure(self) -> Any:
        """The matplotlib figure of `attribution`, or None."""
        return self.attribution_panel.figure

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
        text = self.targets.value
        layers, sites = rows.lens_arguments(picked)
        request = {
            "prompt": self.prompt.value,
            "layers": layers,
            "sites": sites,
            "top_k": self.top_k.value,
            "targets": self._targets_with_pins(text.split(",") if text else []),
        }
        return self._lens(request, picked)

    def export(self, path: str | Path) -> Path:
        """Save what is shown: ``.png``/``.svg`` (matplotlib heatmap of the current metric),
        ``.json`` (`LensResult.to_json`) or ``.html`` (a page that draws the interactive
        heatmap in any browser, with no kernel)."""
        shown = self._shown()
        if shown is None:
            raise InvalidRequest("nothing to export yet: run the lens first")
        return export.save(shown, self.heatmap.metric, path)

    # -- internals -------------------------------------------------------------------------

    def _lens(self, request: dict[str, Any], picked: list[Row]) -> LensResult | None:
        """Run ``request`` (`Engine.lens`'s arguments) and keep the ``picked`` rows."""
        self.run_button.disabled = True
        self.run_button.description = "Running…"
        self.status.value = f"<i>⏳ running the lens on {html.escape(self.engine.info.name)}…</i>"
        # The button comes back only once everything below is drawn: enabled means done.
        try:
            try:
                result = rows.keep(self.engine.lens(**request), picked)
            except EnvoykitError as err:
                self._say(str(err), True)
                self.status.value = ""
                return None
            self._request, self._rows = request, picked
            self.result = result
            self._say("")
            self.status.value = (
                f"{len(result.layers)} rows × {len(result.positions)} positions, "
                f"top-{result.top_ids.shape[-1]}"
            )
            self._show()
            return result
        finally:
            self.run_button.disabled = False
            self.run_button.description = "Run"

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
        labels = self.heatmap.data.get("layer_labels", [])
        self.heatmap.selected = _same_cell(self.heatmap.selected, labels, shown)
        self.heatmap.data = heatmap_data(shown)
        value = self.metric.value
        self.metric.options = self._metric_options()
        self.metric.value = value if value in self._metric_keys() else "prob"
        self._draw_trajectory()
        self._draw_attribution()

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

    def _say(self, text: str, error: bool = False) -> None:
        self.message.value = message_html(text, error=error)

    def _on_targets(self, _: Any = None) -> None:
        if self.engine is None:
            self.tokenization.value = ""
            return
        text = self.targets.value
        rows = []
        for piece in text.split(",") if text else []:
            tokens = describe_target(self.engine.tokenizer, piece)
            if not tokens:
                shown = f"<b style='color:{ERROR}'>tokenizes to nothing</b>"
            else:
                shown = " ".join(f"<code>{html.escape(repr(t))}</code>" for t in tokens)
                if len(tokens) > 1:
                    shown += f" (the lens uses <code>{html.escape(repr(tokens[0]))}</code>)"
            rows.append(f"<code>{html.escape(repr(piece))}</code> → {shown}")
        self.tokenization.value = "<br>".join(rows)

    def _on_metric(self, change: dict[str, Any]) -> None:
        if change["new"] is not None:
            self.heatmap.metric = change["new"]

    def _on_layers(self, _: Any) -> None:
        if self.engine is None:
            self._say("")
            self._show()
        else:
            self.status.value = "rows changed: press Run to lens them"

    def _on_selected(self, _: Any) -> None:
        self._draw_trajectory()
        self._draw_attribution()

    def _on_pinned(self, change: dict[str, Any]) -> None:
        if self.result is None:
            return
        known = set(self.result.target_ids.tolist())
        new = [i for i in change["new"] if i not in known]
        if new and self.engine is not None and self._request is not None:
            typed = [t for t in self._request["targets"] if isinstance(t, str)]
            self._lens({**self._request, "targets": self._targets_with_pins(typed)}, self._rows)
        else:
            self._draw_trajectory()
            self._draw_attribution()

    def _draw_trajectory(self) -> None:
        """Every target, and (read-only) every pinned top-k token, at the selected position."""
        from matplotlib.figure import Figure

        shown = self._shown()
        if shown is None:
            return
        position = self.heatmap.selected[1] if self.heatmap.selected else -1
        known = set(shown.target_ids.tolist())
        extra = [i for i in self.heatmap.pinned if i not in known]
        labels = list(shown.target_labels)
        if not labels and not extra:
            self.trajectory_figure, self.trajectory_targets = None, []
            self.trajectory.outputs = (
                text_output("type targets, or click a token in a heatmap tooltip to pin it"),
            )
            return
        ax = Figure(figsize=(7, 3.5)).subplots()
        if labels:
            plot.trajectory(shown, labels, position=position, ax=ax)
        x = np.arange(len(shown.layers))
        for token_id in extra:
            hits = shown.top_ids[:, position, :] == token_id
            probs = np.where(hits, shown.top_probs[:, position, :], 0).sum(axis=1)
            probs = np.where(hits.any(axis=1), probs, np.nan)
            token = _token_of(shown, token_id)
            ax.plot(x, probs, marker="x", linestyle=":", label=f"p({token!r}) where in top-k")
            labels.append(token)
        ax.set_ylim(0, 1)
        ax.set_xticks(x, shown.layer_labels, fontsize=8)
        ax.set_xlabel("layer")
        ax.set_ylabel("probability")
        ax.set_title(f"target tokens at position {shown.tokens[position]!r}", fontsize=10)
        ax.legend(loc="upper left", fontsize=8)
        ax.figure.tight_layout()
        self.trajectory_figure, self.trajectory_targets = ax.figure, labels
        self.trajectory.outputs = (
            figure_output(ax.figure, f"trajectory of {labels} at position {position}"),
        )

    def _draw_attribution(self) -> None:
        """The direct logit attribution at the selected cell's position, for the token pinned
        last or else the first target; the engine is asked only when either changed."""
        panel = self.attribution_panel
        if self.engine is None:
            panel.say("needs an engine: this explorer shows a stored LensResult")
            return
        shown = self._shown()
        if shown is None or self.heatmap.selected is None:
            panel.say("click a heatmap cell to see who wrote the prediction at its position")
            return
        if self.heatmap.pinned:
            target = int(self.heatmap.pinned[-1])
        elif len(shown.target_ids):
            target = int(shown.target_ids[0])
        else:
            panel.say("type or pin a target to see its attribution at the selected cell")
            return
        row, column = self.heatmap.selected
        prompt, position = shown.prompt, int(shown.positions[column])
        att = panel.result
        fresh = (
            att is not None
            and att.prompt == prompt
            and att.positions.tolist() == [position]
            and att.target_ids.tolist() == [target]
        )
        if not fresh:
            panel.busy(f"attributing at position {position}")
            try:
                att = self.engine.attribute(prompt, [target], positions=[position])
            except EnvoykitError as err:
                panel.say(str(err), error=True)
                return
        panel.show(att, target, layer=int(shown.layers[row]), row=shown.layer_labels[row])


def _same_cell(cell: list[int] | None, labels: list[str], shown: LensResult) -> list[int] | None:
    """Cell ``cell`` of rows ``labels`` in ``shown``: the same row (by label, since rows come
    and go with the picker) and column; None when it is not shown any more."""
    if cell is None or cell[0] >= len(labels) or cell[1] >= len(shown.positions):
        return None
    label = labels[cell[0]]
    return [shown.layer_labels.index(label), cell[1]] if label in shown.layer_labels else None


def _token_of(res: LensResult, token_id: int) -> str:
    where = np.argwhere(res.top_ids == token_id)
    return str(res.top_tokens[tuple(where[0])]) if len(where) else str(token_id)
