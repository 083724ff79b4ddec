"""The logit lens as a JupyterLab widget, on an engine or a stored result.

One module per job: `views` (the anywidget classes `Heatmap` and `LayerPicker`), `payload`
(what they receive, shaped as JSON), `controller` (`LensExplorer`, which ties inputs, views
and the lens together), `export` (figures, JSON and the standalone page) and `assets` (the
browser modules in ``widgets/``, read once). The browser side is framework-free anywidget
modules, no build step; state crosses between kernel and browser only through named
traitlets, so every interaction can be driven and checked from Python.
"""

from envoykit.explorer.assets import widgets_dir
from envoykit.explorer.controller import LensExplorer
from envoykit.explorer.export import standalone_html
from envoykit.explorer.payload import heatmap_data, picker_layers, result_layers
from envoykit.explorer.views import Heatmap, LayerPicker

__all__ = [
    "Heatmap",
    "LayerPicker",
    "LensExplorer",
    "heatmap_data",
    "picker_layers",
    "result_layers",
    "standalone_html",
    "widgets_dir",
]
