"""Activation patching: copy the stream at a (layer, site, position) of a source run into a
target run.

Two steps, both whole tensors at any TP size. First the source prompt runs once and the
patched cells' values come back (``d_model`` numbers each: a few kB); then the target runs
with those values written in place, inside the same trace that computes its lens or sweep
metric. One trace with a source and a target invoke would save the first forward pass, but
the target's writes would wait on the source's reads across two requests, which only works
if vLLM's scheduler puts both in one step; two steps never depend on it.

What a cell holds, by site (see `envoykit.model.readout`):

* ``resid`` — the ``(hidden, residual)`` pair the layer returns (the embedding for layer 0):
  both are copied, so the stream after the layer is the source's exactly;
* ``resid_mid`` — the MLP pre-norm's ``(attn_out, resid_pre)`` inputs, both copied;
* ``attn`` / ``mlp`` — what that block writes, copied alone: the rest of the target's stream
  stays its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from envoykit.analyses.request import SITES, normalise_layers, normalise_prompts
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Readout, at

# Where a site's value sits: in the MLP pre-norm's inputs, or in what the layer returns.
PRENORM_SITES = ("attn", "resid_mid")
OUTPUT_SITES = ("mlp", "resid")
# Sites whose value is a (hidden, residual) pair: the stream itself, not one block's write.
_PAIRED = ("resid", "resid_mid")


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


@dataclass(frozen=True)
class Cell:
    """A checked patch location: layer number, site and position in its prompt."""

    layer: int
    site: str
    position: int


@dataclass(frozen=True)
class Write:
    """A value to write into a run: at ``cell`` (target position), ``value`` and, for paired
    sites, ``residual`` (each ``[d_model]``)."""

    cell: Cell
    value: torch.Tensor
    residual: torch.Tensor | None = None


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


def walk_layers(
    layer_list: Any,
    prenorm: str | None,
    reads: dict[int, set[str]],
    writes: dict[int, list[Write]],
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Inside a trace: walk the layers in the model's order, write ``writes`` in place, and
    read each layer's ``reads`` sites as ``(value, residual or None)`` rows ``[T, d_model]``,
    in the order the model computes them (per layer: attn, resid_mid, mlp, resid)."""
    streams = []
    for number in sorted({*reads, *writes}):
        sites = reads.get(number, set())
        here = writes.get(number, [])
        if number == 0:
            args, kwargs = layer_list[0].inputs
            embedded = args[1] if len(args) > 1 else kwargs["hidden_states"]
            write_embedding(embedded, here)
            if sites:
                streams.append((embedded.clone(), None))
            continue
        layer = layer_list[number - 1]
        early = [w for w in here if w.cell.site in PRENORM_SITES]
        if early or "attn" in sites or "resid_mid" in sites:
            written, before = getattr(layer, prenorm).inputs[0][:2]
            write_at(written, before, early, PRENORM_SITES)
            # Cloned where read: the fused add-norm may overwrite its inputs.
            written, before = written.clone(), before.clone()
            if "attn" in sites:
                streams.append((written, None))
            if "resid_mid" in sites:
                streams.append((written, before))
        late = [w for w in here if w.cell.site in OUTPUT_SITES]
        if late or "mlp" in sites or "resid" in sites:
            hidden, residual = layer.output[:2]
            write_at(hidden, residual, late, OUTPUT_SITES)
            hidden, residual = hidden.clone(), residual.clone()
            if "mlp" in sites:
                streams.append((hidden, None))
            if "resid" in sites:
                streams.append((hidden, residual))
    return streams


def read_cells(model: Any, readout: Readout, prompt: str, cells: Sequence[Cell]) -> list[Write]:
    """Run ``prompt`` once and read the value of every cell (whole, any TP): one `Write` per
    cell, still at the cell's own position."""
    import nnsight

    rows = sorted({(c.layer, c.site) for c in cells}, key=lambda r: (r[0], SITES.index(r[1])))
    reads: dict[int, set[str]] = {}
    for layer, site in rows:
        reads.setdefault(layer, set()).add(site)
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        streams = walk_layers(at(model, readout.layers), readout.mlp_prenorm, reads, {})
        saved = nnsight.save([(a.cpu(), None if b is None else b.cpu()) for a, b in streams])
    writes = []
    for cell in cells:
        value, residual = dict(zip(rows, saved))[cell.layer, cell.site]
        pair = None if residual is None else residual[cell.position]
        writes.append(Write(cell, value[cell.position], pair))
    return writes


def write_cells(model: Any, readout: Readout, writes: Sequence[Write]) -> None:
    """Inside a trace (one invoke): write every value into this run, layer by layer."""
    walk_layers(at(model, readout.layers), readout.mlp_prenorm, {}, writes_by_layer(writes))


def write_embedding(embedded: torch.Tensor, writes: Sequence[Write]) -> None:
    """Inside a trace, at the first layer's input: overwrite the embedding in place."""
    for item in writes:
        embedded[item.cell.position] = item.value.to(embedded)


def write_at(
    first: torch.Tensor, second: torch.Tensor, writes: Sequence[Write], sites: tuple[str, ...]
) -> None:
    """Inside a trace: overwrite, in place, the cells of ``sites`` in the pair the model is
    about to use (the MLP pre-norm's inputs, or what the layer returns)."""
    for item in writes:
        if item.cell.site in sites:
            first[item.cell.position] = item.value.to(first)
            if item.residual is not None:
                second[item.cell.position] = item.residual.to(second)


def writes_by_layer(writes: Sequence[Write]) -> dict[int, list[Write]]:
    """Writes grouped by layer number, as the lens trace walks the layers."""
    layers: dict[int, list[Write]] = {}
    for item in writes:
        layers.setdefault(item.cell.layer, []).append(item)
    return layers


def source_writes(
    model: Any, readout: Readout, plan: dict[str, list[tuple[Cell, Cell]]]
) -> list[Write]:
    """Read every source once; the values, moved to their target cells."""
    writes = []
    for source, pairs in plan.items():
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
