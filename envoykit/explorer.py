"""`LensExplorer`: the logit lens as a JupyterLab widget, on an engine or a stored result.

The browser side lives in the top-level ``widgets/`` folder as framework-free anywidget
modules (no build step); state crosses between kernel and browser only through named
traitlets, so every interaction can be driven and checked from Python:

- `Heatmap`: ``data`` (what the canvas draws, see `heatmap_data`), ``metric``, ``selected``
  (``[layer_index, position_index]`` or None) and ``pinned`` (token ids clicked in a tooltip).
- `LayerPicker`: ``layers`` (one item per lens layer, see `picker_layers`) and ``selected``
  (layer numbers).

With an engine, pinning a token that is not yet a target re-runs the lens with it added, so
its trajectory is exact. With a stored `LensResult` (read-only) nothing can be recomputed: a
pinned token that is not a target is drawn from the top-k lists only, as a dotted line with
gaps wherever it was not among the top k, and labelled so.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import anywidget
import ipywidgets as widgets
import numpy as np
import traitlets

from envoykit import plot
from envoykit.errors import EnvoykitError, InvalidRequest
from envoykit.request import describe_target
from envoykit.result import LensResult

METRIC_NAMES = {"prob": "top-1 probability", "entropy": "entropy", "kl": "KL to final"}
PROB_DECIMALS = 6


def widgets_dir() -> Path:
    """The folder of the browser modules: inside the package in a wheel, top-level in a checkout."""
    import envoykit

    package = Path(envoykit.__file__).parent
    for folder in (package / "widgets", package.parent / "widgets"):
        if (folder / "heatmap.js").is_file():
            return folder
    raise FileNotFoundError(f"envoykit's widgets/ folder is missing next to {package}")


def _asset(name: str) -> str:
    return (widgets_dir() / name).read_text()


class Heatmap(anywidget.AnyWidget):
    """Layers x positions of a `LensResult` on a canvas; hover, select a cell, pin tokens."""

    _esm = traitlets.Unicode().tag(sync=True)
    _css = traitlets.Unicode().tag(sync=True)
    data = traitlets.Dict().tag(sync=True)
    metric = traitlets.Unicode("prob").tag(sync=True)
    selected = traitlets.List(default_value=None, allow_none=True).tag(sync=True)
    pinned = traitlets.List(traitlets.Int()).tag(sync=True)

    def __init__(self, result: LensResult | None = None, **kwargs: Any) -> None:
        super().__init__(_esm=_asset("heatmap.js"), _css=_asset("explorer.css"), **kwargs)
        if result is not None:
            self.data = heatmap_data(result)


class LayerPicker(anywidget.AnyWidget):
    """A strip of lens layers (with their whole-valued sub-locations); click or drag to pick."""

    _esm = traitlets.Unicode().tag(sync=True)
    _css = traitlets.Unicode().tag(sync=True)
    layers = traitlets.List(traitlets.Dict()).tag(sync=True)
    selected = traitlets.List(traitlets.Int()).tag(sync=True)

    def __init__(self, layers: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(_esm=_asset("layer_picker.js"), _css=_asset("explorer.css"), **kwargs)
        if layers is not None:
            self.layers = layers
            self.selected = [item["layer"] for item in layers]


def _json_grid(values: np.ndarray) -> list:
    """Nested lists for JSON, rounded to what a tooltip can show; NaN becomes None."""
    values = np.asarray(values, dtype=np.float64)
    out = np.round(values, PROB_DECIMALS).astype(object)
    out[~np.isfinite(values)] = None
    return out.tolist()


def heatmap_data(res: LensResult) -> dict[str, Any]:
    """What the heatmap view draws: labels, the top-k ids of every cell (their text in
    ``vocab``) and one grid per metric.

    Every metric's grid is sent at once, so switching the metric needs no round trip.
    """
    grids = {}
    for metric in [*METRIC_NAMES, *res.target_labels]:
        values, label = plot.metric_values(res, metric)
        cmap, limits = plot.METRICS.get(metric, ("target", "Greens", (0.0, 1.0)))[1:]
        finite = values[np.isfinite(values)]
        if limits is None:
            limits = (float(finite.min()), float(finite.max()) or 1.0) if finite.size else (0, 1)
        grids[metric] = {
            "label": label,
            "cmap": cmap,
            "vmin": limits[0],
            "vmax": limits[1],
            "values": _json_grid(values),
        }
    return {
        "prompt": res.prompt,
        "layer_labels": res.layer_labels,
        "tokens": list(res.tokens),
        "top_ids": res.top_ids.tolist(),
        # Each distinct token once (by id), not once per cell: a tenth of the bytes at k=10.
        "vocab": {str(int(i)): str(t) for i, t in zip(res.top_ids.flat, res.top_tokens.flat)},
        "top_probs": _json_grid(res.top_probs),
        "grids": grids,
    }


def picker_layers(locations: list[Any]) -> list[dict[str, Any]]:
    """Lens layers from an engine's whole-valued locations (`Engine.locations`).

    Layer 0 is the embedding, layer ``i`` the output of decoder layer ``i - 1`` (0-based);
    each carries its attention- and MLP-output locations.
    """
    items: dict[int, dict[str, Any]] = {}
    for loc in locations:
        if loc.kind == "embed":
            items[0] = {"layer": 0, "label": "embed", "path": loc.path, "subs": []}
        elif loc.kind == "layer":
            n = loc.layer + 1
            items.setdefault(n, {"layer": n, "label": str(n), "subs": []})["path"] = loc.path
        elif loc.kind in ("attn", "mlp") and loc.layer is not None:
            n = loc.layer + 1
            item = items.setdefault(n, {"layer": n, "label": str(n), "path": "", "subs": []})
            item["subs"].append({"kind": loc.kind, "path": loc.path})
    return [items[n] for n in sorted(items)]


def result_layers(res: LensResult) -> list[dict[str, Any]]:
    """Picker items for a stored result: its layers, with no locations to name."""
    return [
        {"layer": int(n), "label": label, "path": "", "subs": []}
        for n, label in zip(res.layers, res.layer_labels)
    ]


class LensExplorer(widgets.VBox):
    """Prompt, targets, metric, top-k and layers in; heatmap and trajectory out.

    ``LensExplorer(engine)`` runs the lens on the engine (`run`, or the Run button);
    ``LensExplorer(result)`` shows a stored `LensResult` read-only (the layer picker then
    filters the layers shown). ``result`` is the last lens; ``export`` saves what is shown.
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
        self.picker = LayerPicker(
            result_layers(source) if readonly else picker_layers(source.locations())
        )
        self.heatmap = Heatmap()
        self.trajectory = widgets.Output()

        self.targets.observe(self._on_targets, "value")
        self.metric.observe(self._on_metric, "value")
        self.picker.observe(self._on_layers, "selected")
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
            ]
        )
        self._on_targets()
        if metric in self._metric_keys():
            self.metric.value = metric
        if readonly:
            self._show()

    # -- actions ---------------------------------------------------------------------------

    def run(self) -> LensResult | None:
        """Lens the prompt with the picked layers, top-k and targets (same as pressing Run).

        Returns the new result, or None when the request was refused (the reason is shown).
        """
        if self.engine is None:
            self._say("read-only: this explorer shows a stored LensResult and has no engine", True)
            return None
        text = self.targets.value
        return self._lens(
            {
                "prompt": self.prompt.value,
                "layers": list(self.picker.selected),
                "top_k": self.top_k.value,
                "targets": self._targets_with_pins(text.split(",") if text else []),
            }
        )

    def export(self, path: str | Path) -> Path:
        """Save what is shown: ``.png``/``.svg`` (matplotlib heatmap of the current metric),
        ``.json`` (`LensResult.to_json`) or ``.html`` (a page that draws the interactive
        heatmap in any browser, with no kernel)."""
        shown = self._shown()
        if shown is None:
            raise InvalidRequest("nothing to export yet: run the lens first")
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".png", ".svg"):
            import matplotlib.pyplot as plt

            figure = plot.heatmap(shown, self.heatmap.metric)
            figure.savefig(path)
            plt.close(figure)
        elif suffix == ".json":
            shown.to_json(str(path))
        elif suffix == ".html":
            path.write_text(standalone_html(shown, self.heatmap.metric))
        else:
            raise InvalidRequest(f"cannot export to {suffix!r}: use .png, .svg, .json or .html")
        return path

    # -- internals -------------------------------------------------------------------------

    def _lens(self, request: dict[str, Any]) -> LensResult | None:
        self.run_button.disabled = True
        self.run_button.description = "Running…"
        self.status.value = f"<i>⏳ running the lens on {html.escape(self.engine.info.name)}…</i>"
        # The button comes back only once everything below is drawn: enabled means done.
        try:
            try:
                result = self.engine.lens(**request)
            except EnvoykitError as err:
                self._say(str(err), True)
                self.status.value = ""
                return None
            self._request = request
            self.result = result
            self._say("")
            self.status.value = (
                f"{len(result.layers)} layers × {len(result.positions)} positions, "
                f"top-{result.top_ids.shape[-1]}"
            )
            self._show()
            return result
        finally:
            self.run_button.disabled = False
            self.run_button.description = "Run"

    def _shown(self) -> LensResult | None:
        """The result restricted, when read-only, to the layers picked in the layer picker."""
        if self.result is None or self.engine is not None:
            return self.result
        picked = [n for n in self.picker.selected if n in self.result.layers]
        return self.result.select(layers=picked) if picked else None

    def _show(self) -> None:
        shown = self._shown()
        if shown is None:
            self._say("no layers picked: pick at least one layer to show", True)
            return
        old = self.heatmap.selected
        fits = old is not None and old[0] < len(shown.layers) and old[1] < len(shown.positions)
        self.heatmap.selected = old if fits else None
        self.heatmap.data = heatmap_data(shown)
        value = self.metric.value
        self.metric.options = self._metric_options()
        self.metric.value = value if value in self._metric_keys() else "prob"
        self._draw_trajectory()

    def _metric_keys(self) -> list[str]:
        return [key for _, key in self.metric.options]

    def _metric_options(self) -> list[tuple[str, str]]:
        options = [(name, key) for key, name in METRIC_NAMES.items()]
        if self.result is not None:
            options += [
                (f"p({token!r})", label)
                for label, token in zip(self.result.target_labels, self.result.target_tokens)
            ]
        return options

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
        colour = "#c92a2a" if error else "#333"
        self.message.value = (
            f'<div style="color:{colour};white-space:pre-wrap">{html.escape(text)}</div>'
            if text
            else ""
        )

    def _on_targets(self, _: Any = None) -> None:
        if self.engine is None:
            self.tokenization.value = ""
            return
        text = self.targets.value
        rows = []
        for piece in text.split(",") if text else []:
            tokens = describe_target(self.engine.tokenizer, piece)
            if not tokens:
                shown = "<b style='color:#c92a2a'>tokenizes to nothing</b>"
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
            self.status.value = "layers changed: press Run to lens them"

    def _on_selected(self, _: Any) -> None:
        self._draw_trajectory()

    def _on_pinned(self, change: dict[str, Any]) -> None:
        if self.result is None:
            return
        known = set(self.result.target_ids.tolist())
        new = [i for i in change["new"] if i not in known]
        if new and self.engine is not None and self._request is not None:
            typed = [t for t in self._request["targets"] if isinstance(t, str)]
            self._lens({**self._request, "targets": self._targets_with_pins(typed)})
        else:
            self._draw_trajectory()

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
                _text_output("type targets, or click a token in a heatmap tooltip to pin it"),
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
        buffer = io.BytesIO()
        ax.figure.savefig(buffer, format="png")
        self.trajectory_figure, self.trajectory_targets = ax.figure, labels
        self.trajectory.outputs = (
            {
                "output_type": "display_data",
                "data": {
                    "image/png": base64.b64encode(buffer.getvalue()).decode(),
                    "text/plain": f"trajectory of {labels} at position {position}",
                },
                "metadata": {},
            },
        )


def _token_of(res: LensResult, token_id: int) -> str:
    where = np.argwhere(res.top_ids == token_id)
    return str(res.top_tokens[tuple(where[0])]) if len(where) else str(token_id)


def _text_output(text: str) -> dict[str, Any]:
    return {"output_type": "stream", "name": "stdout", "text": text + "\n"}


def standalone_html(res: LensResult, metric: str = "prob") -> str:
    """A self-contained page drawing the interactive heatmap of ``res``: no kernel, no network.

    The same ``heatmap.js`` runs against a stand-in for the anywidget model that keeps the
    state in the page; a metric menu replaces the explorer's dropdown.
    """
    data = heatmap_data(res)
    options = "".join(
        f'<option value="{html.escape(key)}"{" selected" if key == metric else ""}>'
        f"{html.escape(grid['label'])}</option>"
        for key, grid in data["grids"].items()
    )

    def script_json(value: Any) -> str:
        return json.dumps(value).replace("</", "<\\/")

    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>logit lens: {html.escape(res.prompt[:60])}</title>
<style>body {{ font: 13px sans-serif; margin: 16px; }}
{_asset("explorer.css")}</style></head>
<body><h3>Logit lens of <code>{html.escape(repr(res.prompt))}</code></h3>
<p>{html.escape(str(res.meta.get("model", "stored result")))} ·
metric <select id="ek-metric">{options}</select> ·
hover a cell for its top-{res.top_ids.shape[-1]}, click it to keep the tooltip open</p>
<div id="ek-root"></div>
<script type="module">
const state = {{ data: {script_json(data)}, metric: {script_json(metric)}, selected: null,
  pinned: [] }};
const listeners = {{}};
const model = {{
  get: (key) => state[key],
  set: (key, value) => {{
    state[key] = value;
    (listeners["change:" + key] || []).forEach((f) => f());
  }},
  save_changes: () => {{}},
  on: (event, f) => {{ (listeners[event] ||= []).push(f); }},
  off: () => {{}},
}};
const source = {script_json(_asset("heatmap.js"))};
const widget = (await import("data:text/javascript;charset=utf-8," + encodeURIComponent(source)))
  .default;
widget.render({{ model, el: document.getElementById("ek-root") }});
document.getElementById("ek-metric").addEventListener("change", (event) =>
  model.set("metric", event.target.value));
window.ekModel = model;
</script></body></html>
"""
