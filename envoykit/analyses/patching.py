"""Activation patching: copy the stream at a (layer, site, position) of a source run into a
target run.

Two steps, both whole tensors at any TP size. First the source prompt runs once and the
patched cells' values come back (``d_model`` numbers each: a few kB); then the target runs
with those values written in place, inside the same trace that computes its lens or sweep
metric. One trace with a source and a target invoke would save the first forward pass, but
the target's writes would wait on the source's reads across two requests, which only works
if vLLM's scheduler puts both in one step; two steps never depend on it.

What a cell holds, by site (read and written through the model's layer family, see
`envoykit.model.readout`):

* ``resid`` — the stream after the layer (the embedding for layer 0); for a pair family both
  halves of the ``(hidden, residual)`` pair are copied, so the stream is the source's exactly;
* ``resid_mid`` — the stream between attention and MLP, likewise;
* ``attn`` / ``mlp`` — what that block writes, copied alone: the rest of the target's stream
  stays its own (the stream becomes the target's own stream before the block plus the
  source's write);
* ``head`` — one attention head's output (its slice of the output projection's input,
  ``head_size`` numbers): the layer's other heads stay the target's own.

`Ablate` removes a head instead: its output becomes zero, or its mean over the run's own
positions, at every position (or one). Both kinds are planned by `plan_writes` and written
through the same walk as every other write.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from envoykit._compat import Model, Tokenizer
from envoykit.analyses.request import (
    SITES,
    check_head,
    integer,
    normalise_layers,
    normalise_prompts,
    token_ids,
)
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Addition, Cell, Readout, Write, at, walk, writes_by_layer

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.analyses.request import LensRequest


@dataclass(frozen=True)
class Patch:
    """Copy ``source``'s stream at (``layer``, ``site``, ``source_position``) into the target
    run at ``target_position``.

    ``layer`` is named as in `Engine.lens`: a number (negative from the end; 0 or "embed" is
    the embedding) and ``site`` one of "resid", "resid_mid", "attn", "mlp". Positions are
    token indices (negative from the end) in each prompt.
    """

    source: str
    layer: int | str
    source_position: int = -1
    target_position: int = -1
    site: str = "resid"
    head: int | None = None

    def __post_init__(self) -> None:
        python_integers(self)


@dataclass(frozen=True)
class Ablate:
    """Remove head ``head`` of decoder layer ``layer`` from the run: its output (its slice of
    the output projection's input) becomes zero (``kind="zero"``) or its mean over the run's
    positions (``kind="mean"``), at ``position`` (None: every position)."""

    layer: int | str
    head: int
    kind: str = "zero"
    position: int | None = None

    def __post_init__(self) -> None:
        python_integers(self)

    @property
    def site(self) -> str:
        return "head"


def python_integers(edit: Patch | Ablate) -> None:
    """Hold numpy (or torch) integers as Python ints: an edit's fields go into the result's
    meta, which is JSON, and researchers pass ``np.int64`` layers from their own arrays."""
    for name, value in vars(edit).items():
        number = integer(value)
        if number is not None and not isinstance(value, int):
            object.__setattr__(edit, name, number)


@dataclass(frozen=True)
class PatchPlan:
    """Checked patches: per source prompt the (source cell, target cell) pairs to copy, and
    the writes that need no source (ablations)."""

    copies: dict[str, list[tuple[Cell, Cell]]]
    direct: list[Write]


def _check_head(head: Any, n_heads: int | None, what: str) -> int:
    if n_heads is None:
        raise InvalidRequest(f"a {what} names a head, and this model's heads cannot be read")
    return check_head(head, n_heads, what)


def check_cell(layer: Any, site: str, position: Any, n_layers: int, length: int, what: str) -> Cell:
    """A patch location checked against the model and the prompt's length."""
    if site not in (*SITES, "head"):
        raise InvalidRequest(
            f"unknown site {site!r} in a {what}: a site is one of {(*SITES, 'head')}"
        )
    (number,) = normalise_layers([layer], n_layers)
    if number == 0 and site != "resid":
        raise InvalidRequest(f"the embedding (layer 0) has only the 'resid' site, not {site!r}")
    if isinstance(position, bool) or not isinstance(position, int):
        raise InvalidRequest(f"a {what} position is an integer, not {position!r}")
    if not -length <= position < length:
        raise InvalidRequest(
            f"{what} position {position} is outside its prompt of {length} tokens "
            f"(0..{length - 1}, or -{length}..-1 from the end)"
        )
    return Cell(number, site, position % length)


def as_patches(patch: Patch | Ablate | Sequence[Patch | Ablate] | None) -> list[Patch | Ablate]:
    """One patch or ablation, a list of them, or None, as a list; anything else is refused."""
    if patch is None:
        return []
    patches = [patch] if isinstance(patch, (Patch, Ablate)) else list(patch)
    for item in patches:
        if not isinstance(item, (Patch, Ablate)):
            raise InvalidRequest(
                f"patch takes ek.Patch and ek.Ablate objects, not {type(item).__name__}"
            )
    return patches


def plan_writes(
    tokenizer: Tokenizer,
    patches: list[Patch | Ablate],
    target_ids: Sequence[int],
    n_layers: int,
    heads: tuple[int, int] | None = None,
    max_model_len: int | None = None,
) -> PatchPlan:
    """The checked plan of ``patches`` into a target of ``target_ids``; ``heads`` is the
    model's ``(number of heads, head size)`` where its heads can be read. A source longer than
    ``max_model_len`` is refused here, before any run, not by vLLM when the source runs."""
    copies: dict[str, list[tuple[Cell, Cell]]] = {}
    direct: list[Write] = []
    n_heads, size = heads if heads is not None else (None, None)
    for patch in patches:
        if isinstance(patch, Ablate):
            direct.append(_ablation(patch, n_layers, len(target_ids), n_heads, size))
            continue
        (source,) = normalise_prompts(patch.source)
        n_source = len(token_ids(tokenizer, source, max_model_len))
        src = check_cell(
            patch.layer, patch.site, patch.source_position, n_layers, n_source, "source"
        )
        dst = check_cell(
            patch.layer, patch.site, patch.target_position, n_layers, len(target_ids), "target"
        )
        if patch.site == "head":
            head = _check_head(patch.head, n_heads, "patch")
            src, dst = (Cell(c.layer, "head", c.position, head) for c in (src, dst))
        elif patch.head is not None:
            raise InvalidRequest(f"head= goes with site='head', not site={patch.site!r}")
        copies.setdefault(source, []).append((src, dst))
    return PatchPlan(copies, direct)


def _ablation(
    ablate: Ablate, n_layers: int, length: int, n_heads: int | None, size: int | None
) -> Write:
    if ablate.kind not in ("zero", "mean"):
        raise InvalidRequest(f"an ablation's kind is 'zero' or 'mean', not {ablate.kind!r}")
    head = _check_head(ablate.head, n_heads, "ablation")
    position = -1 if ablate.position is None else ablate.position
    cell = check_cell(ablate.layer, "head", position, n_layers, length, "ablation")
    cell = Cell(cell.layer, "head", None if ablate.position is None else cell.position, head)
    return Write(cell, torch.zeros(size) if ablate.kind == "zero" else None)


def read_cells(model: Model, readout: Readout, prompt: str, cells: Sequence[Cell]) -> list[Write]:
    """Run ``prompt`` once and read the value of every cell (whole, any TP): one `Write` per
    cell, still at the cell's own position."""
    import nnsight

    stream_cells = {(c.layer, c.site) for c in cells if c.site != "head"}
    rows = sorted(stream_cells, key=lambda r: (r[0], SITES.index(r[1])))
    reads: dict[int, set[str]] = {}
    for layer, site in rows:
        reads.setdefault(layer, set()).add(site)
    for cell in cells:
        if cell.site == "head":
            reads.setdefault(cell.layer, set()).add("heads")
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        heads: dict[int, torch.Tensor] = {}
        streams = walk(readout, at(model, readout.layers), reads, {}, heads=heads)
        saved = nnsight.save(
            (
                [(a.cpu(), None if b is None else b.cpu()) for a, b in streams],
                {layer: value.cpu() for layer, value in heads.items()},
            )
        )
    stream_values, head_values = saved
    size = None if isinstance(readout.heads, str) else readout.heads.head_size
    writes = []
    for cell in cells:
        if cell.site == "head":
            # A head cell has its head's number, and the walk above read the heads' layout.
            assert cell.head is not None and size is not None
            columns = slice(cell.head * size, (cell.head + 1) * size)
            writes.append(Write(cell, head_values[cell.layer][cell.position, columns]))
            continue
        value, residual = dict(zip(rows, stream_values))[cell.layer, cell.site]
        pair = None if residual is None else residual[cell.position]
        writes.append(Write(cell, value[cell.position], pair))
    return writes


def write_cells(model: Model, readout: Readout, writes: Sequence[Write | Addition]) -> None:
    """Inside a trace (one invoke): write every value (and make every addition) in this run,
    layer by layer."""
    walk(readout, at(model, readout.layers), {}, writes_by_layer(writes))


def source_writes(
    model: Model,
    readout: Readout,
    plan: PatchPlan,
    guard: Callable[[], AbstractContextManager],
) -> list[Write]:
    """Read every source once, each trace under ``guard``; the values, moved to their
    target cells, then the writes that need no source."""
    writes = []
    for source, pairs in plan.copies.items():
        with guard():
            read = read_cells(model, readout, source, [src for src, _ in pairs])
        writes += [Write(dst, item.value, item.residual) for item, (_, dst) in zip(read, pairs)]
    return writes + plan.direct


def next_token_metric(
    logits: torch.Tensor, metric: str, target_id: int, other_id: int | None
) -> torch.Tensor:
    """On the ranks, from the model's own last-position logits ``[..., vocab]``: the
    target's probability, or the logit difference target - other."""
    row = logits.reshape(-1, logits.shape[-1])[-1].float()
    if metric == "prob":
        return torch.log_softmax(row, -1)[target_id].exp().cpu()
    return (row[target_id] - row[other_id]).cpu()


def metric_of_runs(
    model: Model,
    readout: Readout,
    prompt: str,
    runs: Sequence[Sequence[Write | Addition]],
    metric: str,
    target_id: int,
    other_id: int | None,
) -> list[float]:
    """One trace, one invoke per run of ``prompt`` (each with its own writes and additions):
    the next-token metric of every run, reduced on the ranks to one number each."""
    import nnsight

    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for run_writes in runs:
            with tracer.invoke(prompt):
                write_cells(model, readout, run_writes)
                value = nnsight.save(next_token_metric(model.logits, metric, target_id, other_id))
    values = value if len(runs) > 1 else [value]
    return [float(v) for v in values]


def plan_for(engine: EngineBase, req: LensRequest, patches: list[Patch | Ablate]) -> PatchPlan:
    """Where each patch writes in the one prompt of ``req`` (`plan_writes`), on ``engine``."""
    if len(req.prompts) != 1 and patches:
        raise InvalidRequest("a patch goes into one target prompt, not a list of them")
    ids = req.prompt_ids[0] if patches else ()
    info = engine.info
    heads = head_shape(engine, patches)
    return plan_writes(engine.tokenizer, patches, ids, info.n_layers, heads, info.max_model_len)


def head_shape(engine: EngineBase, patches: Sequence[Patch | Ablate]) -> tuple[int, int] | None:
    """The model's (heads, head size) when a patch names a head; refused where its heads
    cannot be read."""
    if not any(p.site == "head" for p in patches):
        return None
    layout = engine.readout.require_heads("head patching and ablation")
    return layout.n_heads, layout.head_size
