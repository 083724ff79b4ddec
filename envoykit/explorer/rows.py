"""The layer picker's selection as lens rows, and how to lens exactly those rows.

A row is a ``(layer, site)`` pair, as in `LensResult` (``layers``, ``sites``). The picker
holds two lists — the layers whose residual stream (``"resid"``) is picked, and the picked
sub-layer rows (``"attn"``, ``"resid_mid"``, ``"mlp"``) — and this module joins them.

`Engine.lens` takes layers x sites, a cross product, but a picked set of rows need not be one
(layer 12's attention and layer 3's stream). The explorer lenses the union — every picked
layer at every picked site — in its one forward pass, then keeps the picked rows (`keep`).
The extra rows cost one larger unembedding GEMM on the ranks, not another forward pass,
which is the expensive part: one pass per distinct set of layers would cost more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from envoykit.analyses.request import Row
from envoykit.results.lens import SITES, LensResult

RESID = "resid"
# The rows inside a decoder layer, in the model's order; the embedding has none of them.
SUBLAYER_SITES = tuple(site for site in SITES if site != RESID)


def ordered(rows: Iterable[Sequence]) -> list[Row]:
    """Distinct ``(layer, site)`` rows in the model's order: by layer, then attention, the
    stream between the blocks, MLP, the stream after the layer."""
    unique = {(int(layer), str(site)) for layer, site in rows}
    return sorted(unique, key=lambda row: (row[0], SITES.index(row[1])))


def picked(layers: Iterable[int], sites: Iterable[Sequence]) -> list[Row]:
    """The picker's rows: the stream after each of ``layers``, plus the sub-layer ``sites``
    (``[layer, site]`` pairs)."""
    return ordered([*((layer, RESID) for layer in layers), *sites])


def lens_arguments(rows: Sequence[Row]) -> tuple[list[int], list[str]]:
    """``layers`` and ``sites`` for `Engine.lens` that cover ``rows``: their union."""
    return sorted({layer for layer, _ in rows}), [s for s in SITES if s in {s for _, s in rows}]


def keep(res: LensResult, rows: Sequence[Row]) -> LensResult | None:
    """``res`` cut to those of ``rows`` it holds, in its own order; None when it holds none."""
    wanted = set(rows)
    index = [i for i, row in enumerate(zip(res.layers.tolist(), res.sites)) if row in wanted]
    if not index:
        return None
    return res if len(index) == len(res.layers) else res.take(layer_index=index)
