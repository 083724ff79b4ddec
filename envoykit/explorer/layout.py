"""What a `LensExplorer` shows and where: its widgets, built and arranged, and nothing else.

`ExplorerLayout` is the explorer's screen: the prompt boxes, the controls, the message line,
the layer picker and the heatmap, then the panels in tabs (``panels``): the trajectory, the
attribution, the attention, the compare and sweep panels, and those the controller adds
(steering, corpus, training, features). One panel is open at a time, beside the heatmap
where the width holds both, and the heatmap's height is bounded by the window's, so the
controls, the heatmap and the panel in use fit one screen (1280 x 800).
`envoykit.explorer.controller` and the parts it mixes in add what they do.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import ipywidgets as widgets

from envoykit.explorer.attention_panel import AttentionPanel
from envoykit.explorer.attribution_panel import AttributionPanel
from envoykit.explorer.compare_panel import ComparePanel
from envoykit.explorer.outputs import message_html
from envoykit.explorer.sweep_panel import SweepPanel
from envoykit.explorer.views import Heatmap, LayerPicker

# A row of controls that wraps onto a second line when the column is narrow.
_WRAP = {"flex_flow": "row wrap"}


class ExplorerLayout(widgets.VBox):
    """The widgets of an explorer, arranged: inputs beside the prompts, then the views.

    ``readonly`` (a stored result) disables every input that would ask an engine.
    """

    children: tuple[widgets.Widget, ...]  # the Box's trait (ipywidgets is not typed)

    def __init__(
        self,
        picker: LayerPicker,
        *,
        prompt: str,
        targets: Sequence[str],
        top_k: int,
        compare_with: str,
        metric_options: list[tuple[str, str]],
        readonly: bool,
    ) -> None:
        self._build_inputs(prompt, targets, top_k, metric_options, readonly)
        self._build_run_controls(compare_with, readonly)
        self._build_views(picker)
        super().__init__(self._arrange())
        self.add_class("ek-explorer")  # the page's handle on the whole explorer

    def _build_inputs(
        self,
        prompt: str,
        targets: Sequence[str],
        top_k: int,
        metric_options: list[tuple[str, str]],
        readonly: bool,
    ) -> None:
        self.prompt = widgets.Textarea(
            value=prompt,
            placeholder="prompt",
            layout=widgets.Layout(width="auto", height="56px"),
            disabled=readonly,
        )
        self.targets = widgets.Text(
            value=",".join(targets),
            description="targets",
            placeholder="comma-separated, spaces kept: ' Paris, London'",
            disabled=readonly,
            layout=widgets.Layout(width="auto"),
        )
        self.tokenization = widgets.HTML()
        self.metric = widgets.Dropdown(description="metric", options=metric_options)
        self.metric.add_class("ek-metric")  # the page's handle on it, beside other menus
        # The colour scale, set by hand: blank limits are the metric's own.
        # Narrow enough for one row beside each other in the controls' column.
        # Labels as wide as their words, so each box shows its whole value or placeholder.
        label = {"description_width": "initial"}
        self.colour_min = widgets.Text(
            description="colour min",
            placeholder="auto",
            style=label,
            layout=widgets.Layout(width="150px"),
        )
        self.colour_max = widgets.Text(
            description="max", placeholder="auto", style=label, layout=widgets.Layout(width="110px")
        )
        self.colour_scale = widgets.Dropdown(
            description="scale",
            options=["linear", "log"],
            style=label,
            layout=widgets.Layout(width="130px"),
        )
        for control in (self.colour_min, self.colour_max, self.colour_scale):
            control.add_class("ek-colour-control")
        self.top_k = widgets.BoundedIntText(
            value=top_k,
            min=1,
            max=1000,
            description="top-k",
            disabled=readonly,
            layout=widgets.Layout(width="160px"),
        )
        self.lens_kind = widgets.Dropdown(
            description="lens",
            options=[("logit lens", "logit"), ("tuned lens", "tuned")],
            layout=widgets.Layout(width="260px", display="none"),  # "tuned lens" whole
        )

    def _build_run_controls(self, compare_with: str, readonly: bool) -> None:
        """Run and Cancel, the status and message lines, and the second prompt's box."""
        self.run_button = widgets.Button(
            description="Run", button_style="primary", icon="play", disabled=readonly
        )
        self.cancel_button = widgets.Button(
            description="Cancel",
            icon="stop",
            disabled=True,
            tooltip="stop the lens on the ranks before its next chunk of work",
            layout=widgets.Layout(display="none" if readonly else None),
        )
        self.cancel_button.add_class("ek-run-cancel")  # the page's handle, beside other Cancels
        self.status = widgets.HTML("read-only: a stored LensResult" if readonly else "")
        self.message = widgets.HTML()
        self.compare = widgets.Checkbox(
            value=bool(compare_with) and not readonly,
            description="compare with a second prompt",
            indent=False,
            disabled=readonly,
        )
        self.other_prompt = widgets.Textarea(
            value=compare_with,
            placeholder="second prompt: compared with the first; drag a cell of its heatmap "
            "onto the first's to patch it in",
            layout=widgets.Layout(width="auto", height="44px"),
            disabled=readonly,
        )

    def _build_views(self, picker: LayerPicker) -> None:
        self.picker = picker
        self.patch_note = widgets.HTML()
        # The pinned tokens as chips to unpin, and what attribution and the sweep measure.
        self.pins = widgets.HBox(layout={"flex_flow": "row wrap", "align_items": "center"})
        self.pins.add_class("ek-pins")
        group = uuid.uuid4().hex  # drops from this explorer's second heatmap only
        self.heatmap = Heatmap(drag_role="target", drag_group=group)
        self.heatmap.add_class("ek-main-heatmap")
        self.compare_panel = ComparePanel(group)
        self.sweep_panel = SweepPanel()
        self.sweep_panel.say(
            "patches the second prompt's residual stream into the first at every picked "
            "layer and position, for the token picked beside the Sweep button"
        )
        self.compare_box = widgets.VBox([self.compare_panel, self.sweep_panel])
        self.compare_hint = widgets.HTML(
            message_html(
                "tick 'compare with a second prompt' and Run: the diff of the two prompts, "
                "drag-to-patch and the patch sweep are drawn here"
            )
        )
        self.trajectory = widgets.Output()
        self.trajectory.add_class("ek-trajectory")
        self.attribution_panel = AttributionPanel()
        self.attention_panel = AttentionPanel()
        self.panels = widgets.Tab()
        self.panels.add_class("ek-panels")
        for title, panel in (
            ("Trajectory", self.trajectory),
            ("Attribution", self.attribution_panel),
            ("Attention", self.attention_panel),
            ("Compare", widgets.VBox([self.compare_hint, self.compare_box])),
        ):
            self.add_panel(title, panel)

    def add_panel(self, title: str, panel: widgets.Widget) -> None:
        """``panel`` as the last tab, named ``title``."""
        self.panels.children = (*self.panels.children, panel)
        self.panels.titles = (*self.panels.titles[:-1], title)

    def open_panel(self, title: str) -> None:
        """Open the tab named ``title``."""
        self.panels.selected_index = list(self.panels.titles).index(title)

    def _arrange(self) -> list[widgets.Widget]:
        """Inputs beside the prompts, then the message line and the views, top to bottom."""
        controls = widgets.VBox(
            [
                self.targets,
                self.tokenization,
                # Rows wrap rather than clip: at a narrow width the lens menu went past
                # the edge ("tune…").
                widgets.HBox([self.metric, self.top_k, self.lens_kind], layout=_WRAP),
                widgets.HBox([self.colour_min, self.colour_max, self.colour_scale], layout=_WRAP),
            ],
            layout=widgets.Layout(width="55%"),
        )
        # Run under the prompt it runs, where the prompts' column has room.
        prompts = widgets.VBox(
            [
                self.prompt,
                self.compare,
                self.other_prompt,
                widgets.HBox([self.run_button, self.cancel_button, self.status], layout=_WRAP),
            ],
            layout={"width": "45%"},
        )
        # The heatmap and the open panel side by side where the width holds both (a cell
        # clicked and its attribution in one glance, and one screen's height for both); the
        # panel wraps under a heatmap too wide to leave it room.
        # A tooltip reaches out of the heatmap: the boxes around it do not clip it.
        views = widgets.VBox(
            [self.pins, self.patch_note, self.heatmap],  # the notes right above the heatmap
            layout={
                "flex": "0 1 auto",
                "min_width": "0",
                "max_width": "100%",
                "overflow": "visible",
            },
        )
        self.panels.layout = widgets.Layout(flex="1 1 360px", min_width="360px")
        beside = widgets.HBox(
            [views, self.panels],
            layout={**_WRAP, "align_items": "flex-start", "overflow": "visible"},
        )
        beside.add_class("ek-beside")  # the room the heatmap's cells fit (widgets/canvas.js)
        return [widgets.HBox([prompts, controls]), self.message, self.picker, beside]


def typed_targets(text: str) -> list[str]:
    """The targets typed in the box: its comma-separated pieces, spaces kept (' Paris' is
    not 'Paris'), blank pieces left out (a trailing comma is not a target)."""
    return [piece for piece in text.split(",") if piece.strip()]
