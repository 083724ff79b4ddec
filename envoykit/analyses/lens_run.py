"""The lens's trace: one forward pass (and N generated steps) whose rows are reduced on the
ranks by `envoykit.ranks.lens`, and the `LensResult` assembled from what comes back.

`envoykit.analyses.lens` checks a request whole and calls `run`; what each site reads is
described there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envoykit._compat import Model, Tokenizer
from envoykit.analyses.request import SITES, LensRequest, Row
from envoykit.model.readout import Addition, Readout, Write, at, at_step, walk, writes_by_layer
from envoykit.ranks import fidelity as fidelity_on_ranks
from envoykit.ranks.lens import DEFAULT_MEMORY_BUDGET, lens_statistics
from envoykit.ranks.translators import translated
from envoykit.results.lens import LensResult


def run(
    model: Model,
    readout: Readout,
    request: LensRequest,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
    budget: int = DEFAULT_MEMORY_BUDGET,
    writes: Sequence[Write] = (),
    translator: str | None = None,
    additions: Sequence[Addition] = (),
    cancel: str | None = None,
    fidelity: Fidelity | None = None,
) -> list[LensResult]:
    """Run ``request`` on ``model`` (an envoy tree) in one trace, one invoke per prompt, the
    whole trace under ``guard`` (the engine's: nnsight cannot build two traces on one model
    from two threads at once).

    ``writes`` (see `envoykit.analyses.patching`) are written into the prompt's forward pass before
    anything downstream of them is read: the lens is that of the patched run. ``translator``
    names tuned-lens translators installed on the ranks (`envoykit.ranks.translators`): every
    residual-stream row but the last layer's goes through them before the final norm.
    ``additions`` (steering, `envoykit.analyses.steering`) go into the prompt's pass and,
    those at every position, into each generated token's. ``cancel``: the key that stops
    this lens on the ranks when its flag goes up (`envoykit.ranks.cancel`). ``fidelity``: the
    lens of one spliced prompt, measured against the plain run of the same prompt in an
    invoke of its own before it (`Fidelity`); ``meta["splice"]`` gets the KL and the
    cross-entropies per position.

    With ``generate=N`` the trace runs N+1 steps: the prompt's prefill, then each generated
    token as it is fed back, so every position in the result is an input token and its lens
    shows what the model predicts next there. ``meta`` (model name, TP size, dtype) is
    recorded in every result.
    """
    import nnsight

    plan = _plan(request, readout.n_layers, writes, additions, budget, cancel, translator)
    layer_list = at(model, readout.layers)
    norm = at(model, readout.final_norm)
    head = at(model, readout.unembedding)
    steps_wanted = request.generate + 1
    with guard(), model.trace(temperature=0.0, max_tokens=steps_wanted) as tracer:
        if fidelity is not None:
            # The plain run first: vLLM takes the trace's requests in order, and within one
            # step the invokes' code runs in order, so the ranks hold its distribution when
            # the spliced invoke compares with it.
            with tracer.invoke(request.prompts[0], max_tokens=1):
                _remember_plain(model, readout, layer_list, norm, fidelity)
        for prompt in request.prompts:
            with tracer.invoke(prompt):
                shard = head.vocab_shard()
                steps = nnsight.save([])
                samples = nnsight.save([])
                for step in tracer.iter[:steps_wanted]:
                    stats = _step_statistics(plan, readout, layer_list, norm, shard, step, fidelity)
                    steps.append({key: value.cpu() for key, value in stats.items()})
                    samples.append(model.samples.cpu())
    if len(request.prompts) == 1:
        steps, samples = [steps], [samples]
    if fidelity is not None:
        first = steps[0][0]
        meta = {**meta, "splice": {**meta["splice"], **splice_fidelity(first)}}
        steps[0][0] = {k: v for k, v in first.items() if not k.startswith("fidelity.")}
    return [
        _assemble(model.tokenizer, request, meta, i, prompt_steps, prompt_samples, plan.rows)
        for i, (prompt_steps, prompt_samples) in enumerate(zip(steps, samples))
    ]


@dataclass(frozen=True)
class _Plan:
    """What every step of a lens's trace reads, writes and reduces, worked out from the
    request before the trace starts."""

    rows: list[Row]
    reads: dict[int, set[str]]
    first_step: dict[int, list[Write | Addition]]
    later_steps: dict[int, list[Write | Addition]]
    positions: torch.Tensor | None
    top_k: int
    target_ids: list[int]
    reduce_dtype: torch.dtype
    budget: int
    cancel: str | None
    translator: str | None


def _plan(
    request: LensRequest,
    n_layers: int,
    writes: Sequence[Write],
    additions: Sequence[Addition],
    budget: int,
    cancel: str | None,
    translator: str | None,
) -> _Plan:
    """`_Plan` of ``request``: the rows computed and, by layer, the sites read; the writes
    of the prompt's own pass (patches and every addition) and those of each generated token
    (additions at every position)."""
    rows = computed_rows(request.rows, n_layers)
    return _Plan(
        rows=rows,
        reads=dict(_sites_by_layer(rows)),
        first_step=writes_by_layer([*writes, *additions]),
        later_steps=writes_by_layer(at_step(additions, 1)),
        positions=None if request.positions is None else torch.tensor(request.positions),
        top_k=request.top_k,
        target_ids=[t.token_id for t in request.targets],
        reduce_dtype=getattr(torch, request.reduce_dtype),
        budget=budget,
        cancel=cancel,
        translator=translator,
    )


def _remember_plain(
    model: Model, readout: Readout, layer_list: Any, norm: Any, fidelity: Fidelity
) -> None:
    """Inside the plain run's invoke: its final distribution, kept on the ranks under
    ``fidelity.key`` for the spliced invoke to compare with."""
    plain = walk(readout, layer_list, {readout.n_layers: {"resid"}}, fidelity.plain)
    # (the unembedding reached from ``model`` inside this invoke: an envoy shipped without
    # the tree above it has no root to find the logits processor by)
    plain_shard = at(model, readout.unembedding).vocab_shard()
    final = fidelity_on_ranks.final_logp(norm, plain_shard, plain[-1])
    fidelity_on_ranks.remember(fidelity.key, final)


def _step_statistics(
    plan: _Plan,
    readout: Readout,
    layer_list: Any,
    norm: Any,
    shard: Any,
    step: int,
    fidelity: Fidelity | None,
) -> dict[str, torch.Tensor]:
    """Inside a prompt's invoke, one step's lens statistics on this rank: the rows read
    (patches go into the prompt's own pass, the first step), translated if asked, reduced;
    at a spliced lens's first step, its comparison with the plain run (``fidelity.*``)."""
    here = plan.first_step if step == 0 else plan.later_steps
    streams = walk(readout, layer_list, plan.reads, here)
    if plan.translator is not None:
        streams = translated(streams, plan.rows, plan.translator, readout.n_layers)
    stats = lens_statistics(
        norm,
        shard,
        streams,
        plan.positions if step == 0 else None,
        plan.top_k,
        plan.target_ids,
        plan.reduce_dtype,
        plan.budget,
        plan.cancel,
    )
    if step == 0 and fidelity is not None:
        final = fidelity_on_ranks.final_logp(norm, shard, streams[-1])
        found = fidelity_on_ranks.compare(shard, fidelity.key, final, fidelity.next_ids)
        stats = {**stats, **{f"fidelity.{k}": v for k, v in found.items()}}
    return stats


@dataclass(frozen=True)
class Fidelity:
    """A splice lens's comparison with the plain model: ``key`` names the plain run's
    distribution on the ranks, ``next_ids`` the next token at each prompt position (-1 at
    the last), ``plain`` the writes the plain run shares with the spliced one (all but the
    splice), by layer."""

    key: str
    next_ids: tuple[int, ...]
    plain: dict[int, list[Write | Addition]]


def splice_fidelity(stats: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a spliced lens records of its distance from the plain run, per prompt position:
    ``kl`` (plain || spliced), the next token's cross-entropy under each (``ce_plain``,
    ``ce_spliced``; the last position has no next token), and their mean difference
    ``ce_increase`` (nats)."""
    found = {
        key.removeprefix("fidelity."): v for key, v in stats.items() if key.startswith("fidelity.")
    }
    plain, spliced = found["ce_plain"].double(), found["ce_spliced"].double()
    known = ~torch.isnan(plain)
    increase = float((spliced[known] - plain[known]).mean()) if bool(known.any()) else float("nan")
    return {
        "kl": [float(v) for v in found["kl"]],
        "ce_plain": [None if torch.isnan(v) else float(v) for v in plain],
        "ce_spliced": [None if torch.isnan(v) else float(v) for v in spliced],
        "ce_increase": increase,
    }


def computed_rows(rows: Sequence[Row], n_layers: int) -> list[Row]:
    """The rows a trace computes, in the order the model produces them: the picked ones plus
    the final layer's stream (KL is measured against it), which therefore comes last."""
    return sorted({*rows, (n_layers, "resid")}, key=lambda row: (row[0], SITES.index(row[1])))


def _sites_by_layer(rows: list[Row]) -> list[tuple[int, set[str]]]:
    layers: dict[int, set[str]] = {}
    for layer, site in rows:
        layers.setdefault(layer, set()).add(site)
    return sorted(layers.items())


def _assemble(
    tokenizer: Tokenizer,
    request: LensRequest,
    meta: dict[str, Any],
    index: int,
    steps: list[dict[str, torch.Tensor]],
    samples: list[torch.Tensor],
    computed: list[Row],
) -> LensResult:
    """Join the steps along positions, drop the unpicked final layer, label everything."""
    stats = {key: torch.cat([step[key] for step in steps], dim=1).numpy() for key in steps[0]}
    keep = [computed.index(row) for row in request.rows]
    stats = {key: value[keep] for key, value in stats.items()}
    prompt_ids = list(request.prompt_ids[index])
    # The tokens fed back: a generation that stops early (an end-of-sequence token) ran
    # no step for its last sample, so the lens has no position for it.
    generated = [int(s.flatten()[0]) for s in samples[: min(request.generate, len(steps) - 1)]]
    prompt_positions = (
        list(range(len(prompt_ids))) if request.positions is None else list(request.positions)
    )
    positions = prompt_positions + [len(prompt_ids) + i for i in range(len(generated))]
    all_ids = prompt_ids + generated
    if stats["entropy"].shape[1] != len(positions):
        raise RuntimeError(
            f"the ranks returned {stats['entropy'].shape[1]} positions, expected {len(positions)}: "
            "the engine tokenized the prompt differently from its tokenizer"
        )
    token_ids = np.array([all_ids[p] for p in positions])
    top_ids = stats["top_ids"]
    decoded = {int(i): tokenizer.decode([int(i)]) for i in np.unique(top_ids)}
    top_tokens = np.vectorize(lambda i: decoded[int(i)], otypes=[object])(top_ids)
    return LensResult(
        prompt=request.prompts[index],
        token_ids=token_ids,
        tokens=tuple(tokenizer.decode([int(i)]) for i in token_ids),
        positions=np.array(positions),
        layers=np.array([layer for layer, _ in request.rows]),
        sites=tuple(site for _, site in request.rows),
        top_ids=top_ids.astype(np.int64),
        top_tokens=top_tokens,
        top_probs=stats["top_probs"].astype(np.float32),
        entropy=stats["entropy"].astype(np.float32),
        kl=stats["kl"].astype(np.float32),
        target_ids=np.array([t.token_id for t in request.targets], dtype=np.int64),
        target_labels=tuple(t.label for t in request.targets),
        target_tokens=tuple(t.token for t in request.targets),
        target_probs=stats["target_probs"].astype(np.float32),
        target_ranks=stats["target_ranks"].astype(np.int64),
        n_generated=len(generated),
        meta={
            "lens": "logit",
            **{key: value for key, value in meta.items() if key != "vocab"},
            "returned_bytes": sum(t.numel() * t.element_size() for s in steps for t in s.values()),
        },
    )
