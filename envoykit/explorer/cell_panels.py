"""`CellPanels`, a part of `LensExplorer`: what a click on a heatmap cell draws under the
heatmap — the direct logit attribution at its position and what that position attends to.

A cell says what the model would predict at a position if it stopped at that row; the
attribution says who wrote the prediction it does make there (`AttributionPanel`) and the
attention where the position reads from, per layer and head (`AttentionPanel`). Both need
the engine, so they run on the cells' thread (``cells``, a `Background`), the latest click's
in place of any still waiting, while what can be said at once (no engine, no target, a
patched run) is said on the kernel's thread. With a stored `LensResult` the panels say they
need an engine. An attribution already drawn for the same prompt, position and target is
drawn again without asking the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from envoykit.analyses.attribution import HEADS_DO_NOT_ADD_UP
from envoykit.analyses.request import token_ids
from envoykit.errors import InvalidRequest
from envoykit.explorer.outputs import failure
from envoykit.explorer.state import ExplorerState
from envoykit.results.attribution import AttributionResult

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface


class CellPanels(ExplorerState):
    """Mixed into `LensExplorer`: ``attribution`` and its figure, and the attribution and
    attention runs of the selected cell (`_draw_cell`)."""

    @property
    def attribution(self) -> AttributionResult | None:
        """The attribution drawn for the selected cell; None while the panel shows a message."""
        return self.attribution_panel.result

    @property
    def attribution_figure(self) -> Any:
        """The matplotlib figure of `attribution`, or None."""
        return self.attribution_panel.figure

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

    def _draw_attribution(self) -> Callable[[], None] | None:
        """The direct logit attribution at the selected cell's position, for the token picked
        in the panel (the first target until another is picked); the engine is asked only
        when either changed, by the job returned (None: all is said)."""
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
        target = panel.target.chosen()
        if target is None:
            panel.say("type a target, or pin a token, to see its attribution at the selected cell")
            return None
        row, column = self.heatmap.selected
        prompt, position = shown.prompt, int(shown.positions[column])
        layer, label = int(shown.layers[row]), shown.layer_labels[row]
        engine, att = self.engine, panel.result
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
                fresh = _attribute(engine, prompt, target, position)
            except Exception as err:  # on the cells' thread: said here, or nowhere
                line, details = failure(err)
                panel.say(line, error=True, details=details)
                return
            panel.show(fresh, target, layer=layer, row=label)

        return attribute

    def _draw_attention(self) -> Callable[[], None] | None:
        """What the selected cell's position attends to at every layer and head, opened at
        the cell's layer; the heads' contributions to the attribution's target as bars. The
        engine is asked by the job returned, after the attribution's, unless the panel holds
        this prompt's pattern at this position already (None: all is said)."""
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
        if position >= len(token_ids(self.engine.tokenizer, prompt)):
            panel.say("a generated position: attention is drawn for the prompt's positions")
            return None
        layer = max(1, int(shown.layers[row]))
        held = panel.result
        if held is None or held.prompt != prompt or panel.query != position:
            held = None  # a pattern of another prompt or position: the engine is asked
            panel.busy(f"attention at position {position}")
        engine = self.engine

        def attend() -> None:
            try:
                res = held if held is not None else engine.attention(prompt, queries=[position])
            except Exception as err:  # on the cells' thread: said here, or nowhere
                line, details = failure(err)
                panel.say(line, error=True, details=details)
                return
            panel.fetch = lambda layer, head: engine.attention(prompt, layers=[layer], heads=[head])
            att = self.attribution_panel.result
            if (
                att is None
                or att.head_values is None
                or att.prompt != prompt
                or att.positions.tolist() != [position]
            ):
                att = None  # the heads' bars are of this prompt's position only
            panel.show(
                res,
                position,
                layer=layer,
                attribution=att,
                target=None if att is None else int(att.target_ids[0]),
            )

        return attend


def _attribute(engine: EngineSurface, prompt: str, target: int, position: int) -> AttributionResult:
    """The attribution at one position, split into heads where the model allows it (the
    attention panel draws the heads); else by layer only. Only the refusals of the head
    split fall back: any other refusal is the attribution's own, and is said."""
    if isinstance(engine.readout.heads, str):  # no head layout here
        return engine.attribute(prompt, [target], positions=[position])
    try:
        return engine.attribute(prompt, [target], positions=[position], heads=True)
    except InvalidRequest as err:
        if HEADS_DO_NOT_ADD_UP not in str(err):
            raise
        return engine.attribute(prompt, [target], positions=[position])
