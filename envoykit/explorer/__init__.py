"""The logit lens as a JupyterLab widget, on an engine or a stored result.

One module per job: `views` (the anywidget classes, `FeatureChips` among them), `payload`
(what they receive, shaped as JSON: a lens, or the diff of two runs), `rows` (the picker's
selection as lens rows, and how one lens covers them), `layout` (the explorer's widgets,
built and arranged), `controller` (`LensExplorer`, which ties inputs, views and the engine
together) and the parts it mixes in: `runner` (a Run's lens on a thread of its own, its pace
and Cancel), `pins` (pinned tokens, followed by the lens), `compare_mode` (the second
prompt, drops and the sweep), `trajectory` (the targets along the rows at one position) and
`cell_panels` (a clicked cell's attribution and attention runs), and `state` (what those
parts share, declared once so that each is type-checked against the others);
`attribution_panel` (the direct logit attribution at the selected cell), `attention_panel`
(what the selected cell's position attends to, per layer and head), `compare_panel` (a
second prompt's heatmap to drag cells from, the diff, and which patch a drop means),
`corpus_panel` (the lens over many documents, summarised per layer), `sweep_panel` (a patch
sweep with a progress bar), `steering_panel` (a direction from two prompt lists, the plain
and steered continuations, their diff), `features_panel` (an SAE's features per token as
chips, one feature looked at closely, its clamped continuation), `feature_html` (what that
panel shows, as escaped HTML), `training_panel` (a tuned lens trained within a time budget,
with a Cancel), `work` (a button's work on a thread of its own, and a status line that
counts its seconds), `outputs` (figures and messages as plain ipywidgets show them),
`export` (figures, JSON and the standalone page) and `assets` (the browser modules in
``widgets/``, read once). The browser side is framework-free anywidget modules, no build
step; state crosses between kernel and browser only through named traitlets, so every
interaction can be driven and checked from Python.
"""

from envoykit.explorer.assets import widgets_dir
from envoykit.explorer.attention_panel import AttentionPanel
from envoykit.explorer.attribution_panel import AttributionPanel
from envoykit.explorer.compare_panel import ComparePanel
from envoykit.explorer.controller import LensExplorer
from envoykit.explorer.corpus_panel import CorpusPanel
from envoykit.explorer.export import standalone_html
from envoykit.explorer.features_panel import FeaturesPanel
from envoykit.explorer.payload import compare_data, heatmap_data, picker_layers, result_layers
from envoykit.explorer.steering_panel import SteeringPanel
from envoykit.explorer.sweep_panel import SweepPanel
from envoykit.explorer.training_panel import TrainingPanel
from envoykit.explorer.views import AttentionView, FeatureChips, Heatmap, LayerPicker

__all__ = [
    "AttentionPanel",
    "AttentionView",
    "AttributionPanel",
    "ComparePanel",
    "CorpusPanel",
    "FeatureChips",
    "FeaturesPanel",
    "Heatmap",
    "LayerPicker",
    "LensExplorer",
    "SteeringPanel",
    "SweepPanel",
    "TrainingPanel",
    "compare_data",
    "heatmap_data",
    "picker_layers",
    "result_layers",
    "standalone_html",
    "widgets_dir",
]
