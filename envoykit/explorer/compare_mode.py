"""`CompareMode`, a part of `LensExplorer`: a second prompt beside the first, the diff of
the two, a cell of the second patched into the first's run, and the patch sweep.

Compare mode adds a second prompt (`ComparePanel`): Run lenses it with the same rows and
draws the diff of the two; a cell dragged from the second prompt's heatmap onto the first's
(or clicked, then Patch it in) patches it into the first prompt's run, whose lens replaces
the first heatmap and whose diff against the unpatched run replaces the diff. The first
prompt is always the run studied: what the main heatmap, trajectory, attribution and export
show. The sweep (`SweepPanel`) patches the second prompt into the first at every picked
layer and position. Which `Patch` a drop means is `compare_panel`'s; this part turns the
events into lens requests on the lens thread (`LensRuns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envoykit.analyses.compare import compare
from envoykit.analyses.patching import Patch
from envoykit.errors import InvalidRequest
from envoykit.explorer.compare_panel import drop_patch
from envoykit.explorer.outputs import failure
from envoykit.explorer.state import ExplorerState
from envoykit.results.compare import CompareResult
from envoykit.results.lens import LensResult
from envoykit.results.sweep import SweepResult


class CompareMode(ExplorerState):
    """Mixed into `LensExplorer`: ``comparison``, ``patch`` and ``sweep``, `patch_cell` and
    `run_sweep`, the compare box, drops and the diff drawn after each lens."""

    @property
    def comparison(self) -> CompareResult | None:
        """The diff drawn in compare mode: the two prompts, or the run and its patched run."""
        return self.compare_panel.result

    @property
    def patch(self) -> Patch | None:
        """The patch the lens shown was run with (a drop in compare mode), or None."""
        return None if self.current is None else self.current.patch

    @property
    def sweep(self) -> SweepResult | None:
        """The last patch sweep drawn; None while the sweep panel shows a message."""
        return self.sweep_panel.result

    @property
    def sweep_figure(self) -> Any:
        """The matplotlib figure of `sweep`, or None."""
        return self.sweep_panel.figure

    def patch_cell(self, source: Sequence[int], target: Sequence[int]) -> LensResult | None:
        """Patch cell ``source`` of the second prompt's heatmap into the first prompt's run at
        the column of cell ``target`` of the first heatmap (what a drop does); cells are
        ``[layer_index, position_index]``.

        The patch copies the source cell's row — its layer and site — at its position into
        the same row of the first run, at the target column's position; the target's row
        is not used. Returns the patched lens, or None when refused (the reason is shown).
        """
        run = self.current
        if self.engine is None or run is None or run.other_result is None:
            self._say("patching needs compare mode: tick it, type a second prompt, Run", True)
            return None
        try:
            patch = drop_patch(run.other_result, source, run.result, target)
        except InvalidRequest as err:
            self._say(str(err), True)
            return None
        assert run.request is not None  # a run with an engine answers a request
        return self._lens({**run.request, "patch": patch}, list(run.rows), run.other)

    def run_sweep(self) -> SweepResult | None:
        """Patch the second prompt's residual stream into the first at every picked layer
        and every position (same as pressing Sweep), measuring the first prompt's next
        token picked in the sweep panel (the first target until another is picked).
        Returns the `SweepResult`, or None when refused (the reason is shown)."""
        panel = self.sweep_panel
        run = self.current
        if self.engine is None or run is None or run.other is None:
            panel.say(
                "Run in compare mode first: the sweep patches the second prompt into the first",
                error=True,
            )
            return None
        target = panel.target.chosen()
        if target is None:
            panel.say(
                "type a target, or pin a token: the sweep measures its probability", error=True
            )
            return None
        layers = sorted(set(run.result.layers.tolist()))
        return panel.run(self.engine, run.other, run.prompt, layers=layers, target_token=target)

    def _on_compare(self, change: Any = None) -> None:
        """The second prompt's box and the Compare tab follow the tick (a tick by the
        researcher opens the tab)."""
        shown = None if self.compare.value else "none"
        self.other_prompt.layout.display = shown
        self.compare_box.layout.display = shown
        self.compare_hint.layout.display = "none" if shown is None else None
        if change is not None and self.compare.value:
            self.open_panel("Compare")
        if self.engine is not None and self.result is not None:
            self.status.value = "compare mode changed: press Run"

    def _on_drop(self, change: dict[str, Any]) -> None:
        drop = change["new"]
        if drop is None:
            return
        self.heatmap.drop = None  # an event: the same drop made again is seen again
        dropped_on = self.current

        def patch() -> None:
            # The cells name rows and columns of the heatmaps the drop was made on.
            if self.current is not dropped_on:
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

    def _show_comparison(self) -> None:
        """The second prompt's heatmap and the diff: the two prompts, or, with a patch, the
        first prompt's run against its patched run (each picked layer's stream)."""
        panel, run = self.compare_panel, self.current
        if run is None or run.other_result is None:
            panel.clear()
            return
        # The second prompt's lens comes from a Run on the engine, with the first's.
        assert self.engine is not None and run.other is not None
        panel.show_source(run.other_result)
        panel.source.metric = self.heatmap.metric
        panel.source.pinned = list(self.heatmap.pinned)
        prompt, patch = run.prompt, run.patch
        layers = sorted(set(run.result.layers.tolist()))
        targets = run.result.target_ids.tolist()
        try:
            if patch is None:
                res = self.engine.lens(
                    [prompt, run.other], compare=True, layers=layers, targets=targets
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
