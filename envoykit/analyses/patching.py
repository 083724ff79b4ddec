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
  source's write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from envoykit.analyses.request import SITES, normalise_layers, normalise_prompts
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Cell, Readout, Write, at, walk, writes_by_layer


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


def check_cell(layer: Any, site: str, position: Any, n_layers: int, length: int, what: str) -> Cell:
    """A patch location checked against the model and the prompt's length."""
    if site not in SITES:
        raise InvalidRequest(f"unknown site {site!r} in a {what}: a site is one of {SITES}")
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


def as_patches(patch: Patch | Sequence[Patch] | None) -> list[Patch]:
    """One patch, a list of them, or None, as a list; anything else is refused."""
    if patch is None:
        return []
    patches = [patch] if isinstance(patch, Patch) else list(patch)
    for item in patches:
        if not isinstance(item, Patch):
            raise InvalidRequest(f"patch takes ek.Patch objects, not {type(item).__name__}")
    return patches


def plan_writes(
    tokenizer: Any, patches: list[Patch], target_ids: Sequence[int], n_layers: int
) -> dict[str, list[tuple[Cell, Cell]]]:
    """Per source prompt, the (source cell, target cell) pairs to copy, all checked."""
    plan: dict[str, list[tuple[Cell, Cell]]] = {}
    for patch in patches:
        (source,) = normalise_prompts(patch.source)
        n_source = len(tokenizer(source)["input_ids"])
        src = check_cell(
            patch.layer, patch.site, patch.source_position, n_layers, n_source, "source"
        )
        dst = check_cell(
            patch.layer, patch.site, patch.target_position, n_layers, len(target_ids), "target"
        )
        plan.setdefault(source, []).append((src, dst))
    return plan


def read_cells(model: Any, readout: Readout, prompt: str, cells: Sequence[Cell]) -> list[Write]:
    """Run ``prompt`` once and read the value of every cell (whole, any TP): one `Write` per
    cell, still at the cell's own position."""
    import nnsight

    rows = sorted({(c.layer, c.site) for c in cells}, key=lambda r: (r[0], SITES.index(r[1])))
    reads: dict[int, set[str]] = {}
    for layer, site in rows:
        reads.setdefault(layer, set()).add(site)
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        streams = walk(readout, at(model, readout.layers), reads, {})
        saved = nnsight.save([(a.cpu(), None if b is None else b.cpu()) for a, b in streams])
    writes = []
    for cell in cells:
        value, residual = dict(zip(rows, saved))[cell.layer, cell.site]
        pair = None if residual is None else residual[cell.position]
        writes.append(Write(cell, value[cell.position], pair))
    return writes


def write_cells(model: Any, readout: Readout, writes: Sequence[Write]) -> None:
    """Inside a trace (one invoke): write every value into this run, layer by layer."""
    walk(readout, at(model, readout.layers), {}, writes_by_layer(writes))


def source_writes(
    model: Any,
    readout: Readout,
    plan: dict[str, list[tuple[Cell, Cell]]],
    guard: Callable[[], AbstractContextManager],
) -> list[Write]:
    """Read every source once, each trace under ``guard``; the values, moved to their
    target cells."""
    writes = []
    for source, pairs in plan.items():
        with guard():
            read = read_cells(model, readout, source, [src for src, _ in pairs])
        writes += [Write(dst, item.value, item.residual) for item, (_, dst) in zip(read, pairs)]
    return writes


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
    model: Any,
    readout: Readout,
    prompt: str,
    runs: Sequence[Sequence[Write]],
    metric: str,
    target_id: int,
    other_id: int | None,
) -> list[float]:
    """One trace, one invoke per run of ``prompt`` (each with its own writes): the next-token
    metric of every run, reduced on the ranks to one number each."""
    import nnsight

    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for run_writes in runs:
            with tracer.invoke(prompt):
                write_cells(model, readout, run_writes)
                value = nnsight.save(next_token_metric(model.logits, metric, target_id, other_id))
    values = value if len(runs) > 1 else [value]
    return [float(v) for v in values]
