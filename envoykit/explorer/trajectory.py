"""`TrajectoryView`, a part of `LensExplorer`: every target's metric along the rows at the
selected position, the lens read down one column.

A heatmap cell shows one token's value at one row; the trajectory shows how each target's
value grows or fades from the embedding to the last layer, which is the question a logit
lens is asked. With a stored `LensResult` a pinned token that is not a target has no exact
values: it is drawn from the top-k lists only, as a dotted line with gaps wherever it was
not among the top k, and labelled so (`plot.trajectory`'s ``from_top_k``). The figure is a
bare matplotlib ``Figure`` (`outputs`), kept with its labels for `export` and for tests.
"""

from __future__ import annotations

from envoykit import plot
from envoykit.explorer.outputs import PANEL_FIGURE, figure_output, text_output
from envoykit.explorer.state import ExplorerState


class TrajectoryView(ExplorerState):
    """Mixed into `LensExplorer`: `_draw_trajectory`, which sets ``trajectory_figure`` and
    ``trajectory_targets`` (the labels drawn) and the ``trajectory`` output."""

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
        ax = Figure(figsize=PANEL_FIGURE).subplots()
        labels = list(shown.target_labels)
        plot.trajectory(shown, labels, position=position, from_top_k=extra, ax=ax)
        labels += [shown.top_k_trace(token_id, position)[0] for token_id in extra]
        self.trajectory_figure, self.trajectory_targets = ax.figure, labels
        self.trajectory.outputs = (
            figure_output(ax.figure, f"trajectory of {labels} at position {position}"),
        )
