"""Causal tracing (Meng et al., 2022): patch a source prompt's stream into a target prompt at
every (layer, position) and measure what the target then predicts. With ``site="head"`` the
cells are (layer, head) instead: each copies one head's output at every picked position, a
layers x heads map of which heads carry the difference.

The source runs once and every cell's value comes back (``d_model`` numbers a cell); then
the target runs in batches of patched copies, one invoke per cell, several per trace, each
reduced on the ranks to one number from the model's own last-position logits. A batch is the
unit of interruption: Ctrl-C stops the sweep between batches and aborts the one in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit._compat import Model, Tokenizer
from envoykit.analyses.patching import metric_of_runs, read_cells
from envoykit.analyses.request import (
    SITES,
    LayerSpec,
    PositionSpec,
    Target,
    as_list,
    normalise_layers,
    normalise_positions,
    normalise_prompts,
    single_token_target,
    token_ids,
)
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Addition, Cell, Readout, Write
from envoykit.results.sweep import METRICS, SweepResult

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.analyses.steering import Steer


@dataclass(frozen=True)
class SweepRequest:
    """A checked sweep: both prompts tokenized to the same length, every cell in range."""

    source: str
    target: str
    source_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    site: str
    metric: str
    target_token: Target
    other_token: Target | None
    batch: int
    heads: tuple[int, ...] = ()

    @property
    def groups(self) -> list[list[Cell]]:
        """What each patched copy copies, row by row: one (layer, position) cell, or for a
        head sweep one (layer, head) at every position."""
        if self.site == "head":
            return [
                [Cell(layer, "head", p, head) for p in self.positions]
                for layer in self.layers
                for head in self.heads
            ]
        return [[Cell(layer, self.site, p)] for layer in self.layers for p in self.positions]


def build_request(
    tokenizer: Tokenizer,
    n_layers: int,
    vocab: int,
    source: str,
    target: str,
    *,
    layers: LayerSpec = None,
    positions: PositionSpec = None,
    site: str = "resid",
    metric: str = "prob",
    target_token: str | int,
    other_token: str | int | None = None,
    batch: int = 8,
    n_heads: int | None = None,
    max_model_len: int | None = None,
) -> SweepRequest:
    """Check a sweep before anything reaches the ranks (``n_heads``: the model's, where its
    heads can be read, for ``site="head"``; prompts longer than ``max_model_len`` refused)."""
    (source,) = normalise_prompts(source)
    (target,) = normalise_prompts(target)
    source_ids, target_ids = _same_length_ids(tokenizer, source, target, max_model_len)
    for name, value in (("layers", layers), ("positions", positions)):
        if value is not None and not as_list(value):
            raise InvalidRequest(f"an empty sweep: no {name} given")
    if site not in (*SITES, "head"):
        raise InvalidRequest(f"unknown site {site!r}: a site is one of {(*SITES, 'head')}")
    if site == "head" and n_heads is None:
        raise InvalidRequest("a head sweep needs the model's heads, which cannot be read here")
    picked = normalise_layers(("embed", "all") if layers is None else layers, n_layers)
    if site != "resid":
        picked = tuple(layer for layer in picked if layer > 0)
        if not picked:
            raise InvalidRequest(f"the embedding (layer 0) has no {site!r} site: pick layers >= 1")
    _check_metric(metric, other_token)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidRequest(f"batch must be an integer >= 1, not {batch!r}")
    return SweepRequest(
        source=source,
        target=target,
        source_ids=source_ids,
        target_ids=target_ids,
        layers=picked,
        positions=normalise_positions(positions, len(target_ids)) or tuple(range(len(target_ids))),
        site=site,
        metric=metric,
        target_token=single_token_target(tokenizer, vocab, target_token),
        other_token=None
        if other_token is None
        else single_token_target(tokenizer, vocab, other_token),
        batch=batch,
        heads=tuple(range(n_heads)) if site == "head" and n_heads is not None else (),
    )


def _same_length_ids(
    tokenizer: Tokenizer, source: str, target: str, max_model_len: int | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Both prompts' token ids: a sweep copies position p into position p, so as many."""
    source_ids = token_ids(tokenizer, source, max_model_len)
    target_ids = token_ids(tokenizer, target, max_model_len)
    if len(source_ids) != len(target_ids):
        shown = [[tokenizer.decode([i]) for i in ids] for ids in (source_ids, target_ids)]
        raise InvalidRequest(
            "a sweep copies position p of the source into position p of the target, so both "
            f"prompts must have as many tokens: the source has {len(source_ids)} {shown[0]}, "
            f"the target {len(target_ids)} {shown[1]}"
        )
    return source_ids, target_ids


def _check_metric(metric: str, other_token: str | int | None) -> None:
    if metric not in METRICS:
        raise InvalidRequest(f"metric must be one of {list(METRICS)}, not {metric!r}")
    if (metric == "logit_diff") != (other_token is not None):
        raise InvalidRequest(
            "metric='logit_diff' needs other_token (and 'prob' takes none): the logit "
            "difference is target_token's logit minus other_token's"
        )


def run(
    model: Model,
    readout: Readout,
    request: SweepRequest,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
    progress: bool = True,
    additions: Sequence[Addition] = (),
) -> SweepResult:
    """Run ``request`` on ``model``; every trace under ``guard`` (the engine's lock).
    ``additions`` (a steer) go into every run of the target, the clean one included; the
    source runs as it is."""
    from tqdm.auto import tqdm

    target_id = request.target_token.token_id
    other_id = None if request.other_token is None else request.other_token.token_id

    def metrics(prompt: str, runs: Sequence[Sequence[Write | Addition]]) -> list[float]:
        with guard():
            return metric_of_runs(model, readout, prompt, runs, request.metric, target_id, other_id)

    groups = request.groups
    with guard():
        read = read_cells(model, readout, request.source, [c for g in groups for c in g])
    size = len(groups[0])
    runs: list[list[Write | Addition]] = [
        [*read[i * size : (i + 1) * size], *additions] for i in range(len(groups))
    ]
    (clean,) = metrics(request.target, [list(additions)])
    (source_value,) = metrics(request.source, [[]])
    values: list[float] = []
    with tqdm(total=len(runs), desc="patch sweep", disable=not progress) as bar:
        for start in range(0, len(runs), request.batch):
            chunk = runs[start : start + request.batch]
            values += metrics(request.target, chunk)
            bar.update(len(chunk))
    columns = len(request.heads) if request.site == "head" else len(request.positions)
    tokenizer = model.tokenizer
    other = request.other_token
    return SweepResult(
        source=request.source,
        target=request.target,
        tokens=tuple(tokenizer.decode([request.target_ids[p]]) for p in request.positions),
        source_tokens=tuple(tokenizer.decode([request.source_ids[p]]) for p in request.positions),
        layers=np.array(request.layers),
        positions=np.array(request.positions),
        site=request.site,
        metric=request.metric,
        target_token=request.target_token.token,
        other_token=None if other is None else other.token,
        values=np.array(values, dtype=np.float32).reshape(len(request.layers), columns),
        clean=clean,
        source_value=source_value,
        meta={**{k: v for k, v in meta.items() if k != "vocab"}, "batch": request.batch},
        heads=np.array(request.heads) if request.site == "head" else None,
    )


def patch_sweep(
    engine: EngineBase,
    source: str,
    target: str,
    *,
    layers: LayerSpec = None,
    positions: PositionSpec = None,
    site: str = "resid",
    metric: str = "prob",
    target_token: str | int,
    other_token: str | int | None = None,
    batch: int = 8,
    progress: bool = True,
    steer: Steer | Sequence[Steer] | None = None,
) -> SweepResult:
    """Causal tracing: patch ``source``'s stream into ``target`` at every (layer,
    position) and measure the target's next token at its last position. With
    ``site="head"``, every (layer, head) instead: each copy takes one head's output from
    the source at every position of ``positions`` (default all), a layers x heads map.

    Both prompts must tokenize to the same length (position p is copied to position p).
    ``metric``: "prob" (``target_token``'s probability) or "logit_diff" (its logit minus
    ``other_token``'s). Runs ``batch`` patched copies of the target per trace (one
    invoke each), reduced on the ranks to one number each, with a progress bar; an
    interrupt stops it between batches and leaves the engine usable. ``steer``: steers
    made in every target run (the clean one included), not in the source's;
    ``meta["steer"]`` says so.
    """
    from envoykit.analyses import steering

    info, heads = engine.info, engine.readout.heads
    req = build_request(
        engine.tokenizer,
        info.n_layers,
        info.vocab,
        source,
        target,
        layers=layers,
        positions=positions,
        site=site,
        metric=metric,
        target_token=target_token,
        other_token=other_token,
        batch=batch,
        n_heads=None if isinstance(heads, str) else heads.n_heads,
        max_model_len=info.max_model_len,
    )
    engine._require_sites([site])
    steers = steering.engine_steers(engine, steer)
    additions = steering.plan_additions(steers, info.n_layers, info.d_model, len(req.target_ids))
    meta = engine._result_meta()
    if steers:
        meta["steer"] = [item.describe() for item in steers]
    return run(engine.model, engine.readout, req, meta, engine.exclusive, progress, additions)
