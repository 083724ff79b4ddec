"""`ExplorerState`: what the parts of `LensExplorer` share, declared once.

`LensExplorer` is one class mixed from parts — `runner` (`LensRuns`), `pins` (`Pins`),
`compare_mode` (`CompareMode`), `trajectory` (`TrajectoryView`) and `cell_panels`
(`CellPanels`) — with the layout that builds its widgets (`ExplorerLayout`) and the
controller that holds its state. The parts are mixed in, not held as objects, because they
share one state — the lens shown, the request it answers, the second prompt's, the pins —
which every one of them reads and a lens replaces all at once; and they call one another
through ``self``. Each part inherits this class, so what it reads of the others is declared
here and the type checker checks every part against the others and against the controller
and the layout that provide it.

It adds nothing at run time: the attributes are annotations only (set by the controller and
the layout), and the methods are declared for the type checker only (defined by the parts
and the controller). It imports no part, so every part may import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import threading

    import ipywidgets as widgets

    from envoykit.analyses.patching import Patch
    from envoykit.analyses.request import Row
    from envoykit.analyses.surface import EngineSurface
    from envoykit.analyses.tuned import TunedLens
    from envoykit.explorer.attention_panel import AttentionPanel
    from envoykit.explorer.attribution_panel import AttributionPanel
    from envoykit.explorer.compare_panel import ComparePanel
    from envoykit.explorer.current_run import CurrentRun
    from envoykit.explorer.interrupt import StopFlag
    from envoykit.explorer.sweep_panel import SweepPanel
    from envoykit.explorer.views import Heatmap, LayerPicker
    from envoykit.explorer.work import Background
    from envoykit.results.lens import LensResult


class ExplorerState:
    """The state and the methods the parts of `LensExplorer` use of one another."""

    # Set by the controller. None with a stored result (read-only).
    engine: EngineSurface | None
    translator: TunedLens | None
    # The lens shown with all it answers, replaced whole by each lens (`LensRuns._lens`);
    # None before the first.
    current: CurrentRun | None
    # The threads the engine's work runs on: lenses, and a cell's attribution and attention.
    work: Background
    cells: Background
    _pace: float | None  # seconds per row x position of the last Run
    _cancelling: StopFlag  # Cancel (or a kernel interrupt) came during the Run in flight
    _drawing: threading.Event  # a Run's lens is done and being drawn: nothing to cancel
    trajectory_figure: Any  # a matplotlib Figure, or None
    trajectory_targets: list[str]

    # Built by the layout.
    prompt: widgets.Textarea
    targets: widgets.Text
    top_k: widgets.BoundedIntText
    lens_kind: widgets.Dropdown
    run_button: widgets.Button
    cancel_button: widgets.Button
    status: widgets.HTML
    compare: widgets.Checkbox
    other_prompt: widgets.Textarea
    picker: LayerPicker
    pins: widgets.HBox
    heatmap: Heatmap
    compare_panel: ComparePanel
    sweep_panel: SweepPanel
    compare_box: widgets.VBox
    compare_hint: widgets.HTML
    panels: widgets.Tab
    trajectory: widgets.Output
    attribution_panel: AttributionPanel
    attention_panel: AttentionPanel

    if TYPE_CHECKING:
        # The controller's.
        def _say(self, text: str, error: bool = False, details: str = "") -> None: ...

        def _shown(self) -> LensResult | None: ...

        @property
        def result(self) -> LensResult | None: ...

        @property
        def other_result(self) -> LensResult | None: ...

        def _show(self) -> None: ...

        # The layout's.
        def open_panel(self, title: str) -> None: ...

        # `LensRuns`'.
        def _lens(
            self, request: dict[str, Any], picked: list[Row], other: str | None
        ) -> LensResult | None: ...

        # `Pins`'.
        def _targets_with_pins(self, typed: list[str]) -> list[str | int]: ...

        # `TrajectoryView`'s.
        def _draw_trajectory(self) -> None: ...

        # `CellPanels`'.
        def _draw_cell(self, attention: bool = False) -> None: ...

        # `CompareMode`'s.
        @property
        def patch(self) -> Patch | None: ...

        def _show_comparison(self) -> None: ...
