"""`AttentionPanel`: the attention at one position, every layer and head, and one head whole.

What a lens cell cannot say is where its prediction's information came from. The panel
shows, for the selected cell's position, a layers x heads grid of what that query attends
to (`AttentionView`); a click on a head draws its token-by-token pattern (from the result,
or, where it holds the one query only, from ``fetch``, which the controller points at the
engine, on a thread of the panel's own so the kernel stays free: `wait` waits for it); with an
attribution of the target picked in the attribution panel (``attribute(..., heads=True)``)
the selected layer's heads are drawn as bars of their contribution to its logit. The panel
draws from results only: the controller (or a user with a stored `AttentionResult`) calls
the engine. Its header is an ipywidgets ``HTML``, so its text is escaped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import numpy as np

from envoykit.explorer.outputs import ENGINE_ERRORS, message_html
from envoykit.explorer.payload import attention_data
from envoykit.explorer.views import AttentionView
from envoykit.explorer.work import Background
from envoykit.results.attention import AttentionResult
from envoykit.results.attribution import AttributionResult

TITLE = "Attention"


class AttentionPanel(widgets.VBox):
    """A header over the attention view.

    ``AttentionPanel(result)`` shows a stored `AttentionResult` at its last query;
    ``show`` draws another. ``result`` is what is drawn (None while the panel shows a
    message), ``query`` the focus position and ``selected`` the ``[layer, head]`` whose
    pattern is drawn whole.
    """

    def __init__(self, result: AttentionResult | None = None, query: int | None = None) -> None:
        self.header = widgets.HTML()
        self.view = AttentionView()
        self.result: AttentionResult | None = None
        self.query: int | None = None
        self.fetch: Callable[[int, int], AttentionResult] | None = None
        self._attribution: tuple[AttributionResult, int] | None = None
        self._whole: dict[tuple[int, int], AttentionResult] = {}
        self._showing = False  # `show` draws what it selects itself
        self.work = Background(
            "envoykit-attention",
            lambda why, details: self._head(why, error=True, details=details),
        )
        super().__init__([self.header, self.view])
        self.add_class("ek-attention-panel")
        self.view.observe(self._on_selected, "selected")
        if result is not None:
            self.show(result, int(result.queries[-1]) if query is None else query)
        else:
            self.say("click a heatmap cell to see what its position attends to")

    @property
    def selected(self) -> list[int] | None:
        return self.view.selected

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in place of the view."""
        self.result, self.query, self._attribution = None, None, None
        self.view.data = {}
        self._head(text, error=error, details=details)

    def busy(self, text: str) -> None:
        """Say what is being computed; what is drawn stays until the new one lands."""
        self._head(f"{text}…")

    def show(
        self,
        res: AttentionResult,
        query: int,
        *,
        layer: int | None = None,
        attribution: AttributionResult | None = None,
        target: int | None = None,
    ) -> None:
        """Draw ``res`` at query position ``query``, with the head of ``layer`` (default:
        the first layer shown) that attends most away from the query itself selected; with
        ``attribution`` (per-head, at ``query``) the selected layer's heads' contribution to
        ``target`` as bars."""
        if query not in res.queries:
            raise ValueError(f"query {query} is not in this result: {res.queries.tolist()}")
        self.result, self.query, self._whole = res, int(query), {}
        self._attribution = None
        if attribution is not None:
            assert target is not None  # the bars are the heads' contributions to ``target``
            self._attribution = (attribution, int(target))
        layer = int(res.layers[0]) if layer is None else int(layer)
        row = int(np.flatnonzero(res.queries == query)[0])
        li = int(np.flatnonzero(res.layers == layer)[0])
        strips = res.weights[li, :, row]  # [heads, K]: the keys each head looks at
        keys = res.keys[li, :, row]
        away = np.where(keys == query, 0.0, strips).max(-1)
        head = int(res.heads[int(away.argmax())])
        self._showing = True
        try:
            with self.view.hold_sync():
                self.view.selected = [layer, head]
                self._draw()
        finally:
            self._showing = False
        self._head(
            f"what position {query} ({res.tokens[query]!r}) attends to in every layer and "
            "head; click a head for its whole pattern"
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the head's pattern a click asked the engine for; whether it is drawn."""
        return self.work.wait(timeout)

    def _on_selected(self, change: dict[str, Any]) -> None:
        """A head clicked: drawn at once from what is held, else once ``fetch`` answers (the
        latest click's head, on the panel's thread)."""
        if self.result is None or change["new"] is None or self._showing:
            return
        layer, head = (int(i) for i in change["new"])
        if self._fetches(layer, head):
            self.work.submit(self._redraw)
        else:
            self._redraw()

    def _fetches(self, layer: int, head: int) -> bool:
        """Whether drawing head ``head`` of ``layer`` whole asks the engine."""
        res = self.result
        partial = res is not None and len(res.queries) < len(res.token_ids)
        return partial and self.fetch is not None and (layer, head) not in self._whole

    def _redraw(self) -> None:
        try:
            self._draw()
        except ENGINE_ERRORS as err:
            self._head(str(err), error=True)

    def _draw(self) -> None:
        res, query, selected = self.result, self.query, self.view.selected
        if res is None or query is None:
            return  # a message took the view's place since the click that asked for this
        bars = None
        if self._attribution is not None and selected is not None:
            att, target = self._attribution
            layer = int(selected[0])
            values = att.head(layer, target)[:, 0]
            bars = (layer, att.target_tokens[att.target_index(target)], values)
        whole = None
        if selected is not None and len(res.queries) < len(res.token_ids):
            whole = self._whole_pattern(int(selected[0]), int(selected[1]))
            if whole is None:
                selected = None
        self.view.data = attention_data(res, query, selected, bars, whole)

    def _whole_pattern(self, layer: int, head: int) -> AttentionResult | None:
        """Head ``head`` of ``layer`` at every query, asked of ``fetch`` once per head."""
        key = (layer, head)
        if key not in self._whole and self.fetch is not None:
            self._whole[key] = self.fetch(layer, head)
        return self._whole.get(key)

    def _head(self, text: str, *, error: bool = False, details: str = "") -> None:
        self.header.value = f"<b>{TITLE}</b>{message_html(text, error=error, details=details)}"
