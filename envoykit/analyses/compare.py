"""Two runs compared cell by cell, on the ranks: two prompts, a run and its patched run, or
one prompt on two engines (TP=1 against TP=N, float32 against bfloat16).

Run ``a`` goes first, on its own engine: its streams at the compared layers and positions go
through its final norm and come back (``layers x positions x d_model`` numbers, no
vocabulary). Run ``b`` then runs on its engine, and inside that trace both runs' rows go
through ``b``'s unembedding in one call per chunk; each rank reduces the two full
distributions to their Jensen-Shannon divergence (in float64: the two runs of a TP-equivalence
check differ by ~1e-9 nats, below float32's resolution of a sum over the vocabulary), both
top-1 tokens and every target's two probabilities. The full-vocabulary tensors never leave
the ranks. Across engines, run ``a``'s rows are unembedded with ``b``'s head: what is compared
is everything up to and including the final norm, and the head's arithmetic is ``b``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit._compat import Model, Tokenizer
from envoykit.analyses.clamp import Clamp
from envoykit.analyses.patching import Patch, as_patches, head_shape, plan_writes, source_writes
from envoykit.analyses.request import (
    LayerSpec,
    PositionSpec,
    TargetSpec,
    as_list,
    normalise_layers,
    normalise_positions,
    one_prompt,
    single_token_target,
)
from envoykit.analyses.steering import Steer, as_steers, engine_steers, plan_additions
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Addition, Write, at, normalize, walk, writes_by_layer
from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import vocab_parallel
from envoykit.ranks.lens import DEFAULT_MEMORY_BUDGET
from envoykit.results.compare import CompareResult

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase


@dataclass(frozen=True)
class Run:
    """One side of a comparison: a prompt on an engine, optionally patched and steered."""

    engine: EngineBase
    prompt: str
    patch: Patch | Sequence[Patch] | None = None
    steer: Steer | Clamp | Sequence[Steer | Clamp] | None = None

    def describe(self) -> str:
        info = self.engine.info
        patched = f", {len(as_patches(self.patch))} patch(es)" if self.patch else ""
        steered = "".join(
            f", clamped at layer {s.layer}"
            if isinstance(s, Clamp)
            else f", steered at layer {s.layer} x{s.scale:g}"
            for s in as_steers(self.steer)
        )
        return f"{info.name} tp={info.tp} {info.dtype}: {self.prompt!r}{patched}{steered}"


def as_run(value: Any) -> Run:
    """A `Run`, or an ``(engine, prompt[, patch[, steer]])`` tuple."""
    if isinstance(value, Run):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3, 4):
        return Run(*value)
    raise InvalidRequest(
        "compare takes ek.Run(engine, prompt, patch=None, steer=None) or (engine, prompt"
        f"[, patch[, steer]]), not {type(value).__name__}"
    )


def compare(
    a: Any,
    b: Any,
    *,
    layers: LayerSpec = None,
    positions: PositionSpec = None,
    targets: TargetSpec = (),
    budget: int = DEFAULT_MEMORY_BUDGET,
) -> CompareResult:
    """Compare run ``a`` with run ``b`` cell by cell (see the module docstring).

    ``a``/``b``: `Run` or ``(engine, prompt[, patch])``. ``layers`` as in `Engine.lens`
    (default: the embedding and every layer). ``positions``: token indices compared in both
    runs (default: every position, which needs both prompts to tokenize to the same length).
    ``targets``: single tokens whose probability changes are reported.
    """
    a, b = as_run(a), as_run(b)
    info_a, info_b = a.engine.info, b.engine.info
    if (info_a.n_layers, info_a.vocab) != (info_b.n_layers, info_b.vocab):
        raise InvalidRequest(
            f"runs on {info_a.name} ({info_a.n_layers} layers, vocabulary {info_a.vocab}) and "
            f"{info_b.name} ({info_b.n_layers}, {info_b.vocab}) cannot be compared cell by cell"
        )
    tokenizer = b.engine.tokenizer
    ids = _token_ids(a, b, positions)
    picked = normalise_positions(positions, min(map(len, ids))) or tuple(range(len(ids[0])))
    rows = normalise_layers(("embed", "all") if layers is None else layers, info_b.n_layers)
    wanted = [single_token_target(tokenizer, info_b.vocab, t) for t in as_list(targets)]
    writes = [_writes(run, seq) for run, seq in zip((a, b), ids)]
    rows_a = normed_rows(a.engine, a.prompt, rows, picked, writes[0])
    stats = compared_rows(b.engine, b.prompt, rows, picked, writes[1], rows_a, wanted, budget)
    return _result(a, b, tokenizer, ids, picked, rows, wanted, stats)


def _token_ids(a: Run, b: Run, positions: Any) -> list[list[int]]:
    """Both runs' prompt token ids; without ``positions``, they must be as long."""
    ids = []
    for run in (a, b):
        limit = run.engine.info.max_model_len
        ids.append(list(one_prompt(run.engine.tokenizer, run.prompt, limit, "compare")[1]))
    if positions is None and len(ids[0]) != len(ids[1]):
        tokenizer = b.engine.tokenizer
        shown = [[tokenizer.decode([i]) for i in seq] for seq in ids]
        raise InvalidRequest(
            "comparing every position needs prompts with as many tokens: a has "
            f"{len(ids[0])} {shown[0]}, b {len(ids[1])} {shown[1]}; pass positions=[...] "
            "(token indices valid in both) to compare some"
        )
    return ids


def _result(
    a: Run,
    b: Run,
    tokenizer: Tokenizer,
    ids: list[list[int]],
    picked: tuple[int, ...],
    rows: Sequence[int],
    wanted: list[Any],
    stats: dict[str, np.ndarray],
) -> CompareResult:
    """The `CompareResult` of the statistics the ranks sent, with its tokens decoded."""
    decode = np.vectorize(lambda i: tokenizer.decode([int(i)]), otypes=[object])
    return CompareResult(
        a=a.describe(),
        b=b.describe(),
        tokens_a=tuple(tokenizer.decode([ids[0][p]]) for p in picked),
        tokens_b=tuple(tokenizer.decode([ids[1][p]]) for p in picked),
        layers=np.array(rows),
        positions=np.array(picked),
        js=stats["js"],
        top_ids_a=stats["top_ids_a"],
        top_ids_b=stats["top_ids_b"],
        top_tokens_a=tuple(decode(stats["top_ids_a"]).ravel()),
        top_tokens_b=tuple(decode(stats["top_ids_b"]).ravel()),
        top_probs_a=stats["top_probs_a"],
        top_probs_b=stats["top_probs_b"],
        target_ids=np.array([t.token_id for t in wanted], dtype=np.int64),
        target_labels=tuple(t.label for t in wanted),
        target_tokens=tuple(t.token for t in wanted),
        target_probs_a=stats["target_probs_a"],
        target_probs_b=stats["target_probs_b"],
        meta={"returned_bytes": int(sum(v.nbytes for v in stats.values()))},
    )


def _writes(run: Run, ids: list[int]) -> Sequence[Write | Addition]:
    """The patches of ``run``, read from their sources on the run's engine, and its steers."""
    engine, info = run.engine, run.engine.info
    steers = engine_steers(engine, run.steer)
    additions = plan_additions(steers, info.n_layers, info.d_model, len(ids))
    patches = as_patches(run.patch)
    if not patches:
        return additions
    heads = head_shape(engine, patches)
    plan = plan_writes(engine.tokenizer, patches, ids, info.n_layers, heads, info.max_model_len)
    return source_writes(engine.model, engine.readout, plan, engine.exclusive) + additions


def _normed_rows(
    model: Model,
    readout: Any,
    layers: Sequence[int],
    writes: Sequence[Write | Addition],
    picked: torch.Tensor,
) -> torch.Tensor:
    """Inside a trace: ``[layers, positions, d_model]``, the residual stream after each of
    ``layers`` (with ``writes`` made) through the final norm, at the ``picked`` positions."""
    reads = {layer: {"resid"} for layer in layers}
    streams = walk(readout, at(model, readout.layers), reads, writes_by_layer(writes))
    norm = at(model, readout.final_norm)
    normed = [normalize(norm, value, residual) for value, residual in streams]
    return torch.stack([row[picked.to(row.device)] for row in normed])


def normed_rows(
    engine: EngineBase,
    prompt: str,
    layers: Sequence[int],
    positions: Sequence[int],
    writes: Sequence[Write | Addition],
) -> torch.Tensor:
    """``[layers, positions, d_model]`` float32: run ``prompt`` (under the engine's guard),
    each layer's stream through the final norm, at ``positions``."""
    import nnsight

    model, readout = engine.model, engine.readout
    picked = torch.tensor(list(positions))
    with engine.exclusive(), model.trace(prompt, temperature=0.0, max_tokens=1):
        rows = nnsight.save(_normed_rows(model, readout, layers, writes, picked).float().cpu())
    return rows


def compared_rows(
    engine: EngineBase,
    prompt: str,
    layers: Sequence[int],
    positions: Sequence[int],
    writes: Sequence[Write | Addition],
    rows_a: torch.Tensor,
    targets: list,
    budget: int,
) -> dict[str, np.ndarray]:
    """Run ``prompt`` on ``engine`` (under its guard) and reduce it against ``rows_a`` on the
    ranks."""
    import nnsight

    model, readout = engine.model, engine.readout
    picked = torch.tensor(list(positions))
    target_ids = [t.token_id for t in targets]
    with engine.exclusive(), model.trace(prompt, temperature=0.0, max_tokens=1):
        head = at(model, readout.unembedding)
        rows_b = _normed_rows(model, readout, layers, writes, picked)
        stats = divergence_statistics(
            head.vocab_shard(), rows_a.to(rows_b), rows_b, target_ids, budget
        )
        stats = nnsight.save({key: value.cpu() for key, value in stats.items()})
    return {key: value.numpy() for key, value in stats.items()}


def divergence_statistics(
    shard: VocabShard,
    rows_a: torch.Tensor,
    rows_b: torch.Tensor,
    targets: Sequence[int],
    budget: int,
) -> dict[str, torch.Tensor]:
    """On a rank: both runs' ``[layers, positions, d_model]`` rows through this rank's slice of
    the head, chunked by layers, reduced to JS divergence, top-1 of each and target
    probabilities of each, with the vocabulary-parallel exchange the lens uses
    (`envoykit.ranks.vocab_parallel`): every rank sums its slice's share, in float64."""
    n_layers, n_pos = rows_a.shape[:2]
    # Two runs' float64 logits, log-probs and the temporaries of their size per layer: 24
    # times one float32 layer's logits.
    per_call = max(1, budget // max(1, n_pos * shard.largest * 4 * 24))
    pieces: dict[str, list[torch.Tensor]] = {}
    for start in range(0, n_layers, per_call):
        chunk = slice(start, start + per_call)
        both = torch.cat([rows_a[chunk], rows_b[chunk]]).flatten(0, 1)
        logits = shard.logits(both).double().unflatten(0, (2, -1, n_pos))
        found = vocab_parallel.summaries(shard, logits, 1, targets)
        logp = vocab_parallel.normalized(logits, found.largest, found.log_sum)
        top_logp, top_ids, target_logp = found.top_logp, found.top_ids, found.target_logp
        mixture = torch.logaddexp(logp[0], logp[1]) - math.log(2.0)
        js = 0.5 * sum((side.exp() * (side - mixture)).sum(-1) for side in logp)
        chunk_stats = {
            "js": shard.gather(js).sum(0).clamp_min(0.0),
            "top_ids_a": top_ids[0, ..., 0],
            "top_ids_b": top_ids[1, ..., 0],
            "top_probs_a": top_logp[0, ..., 0].exp().float(),
            "top_probs_b": top_logp[1, ..., 0].exp().float(),
            "target_probs_a": target_logp[0].exp().float(),
            "target_probs_b": target_logp[1].exp().float(),
        }
        for key, value in chunk_stats.items():
            pieces.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in pieces.items()}


def compare_prompts(
    engine: EngineBase,
    prompts: Any,
    layers: Any,
    positions: Any,
    targets: Any,
    sites: Any,
    patch: Any,
    dropped: Sequence[str],
) -> CompareResult:
    """``engine.lens([a, b], compare=True)``: the `compare` of two plain prompts on one
    engine. ``dropped``: the lens options given that a comparison has no use for; they are
    refused, not ignored."""
    if dropped:
        raise InvalidRequest(
            f"compare=True does not take {', '.join(f'{n}=' for n in dropped)}: it compares the "
            "logit lens of two prompts' own tokens (in float64 on the ranks); run engine.lens "
            "on each prompt with those options instead"
        )
    if not isinstance(prompts, (list, tuple)) or len(prompts) != 2:
        raise InvalidRequest("compare=True compares two prompts: lens([a, b], compare=True)")
    if patch is not None or tuple(sites) != ("resid",):
        raise InvalidRequest(
            "compare=True compares the residual stream of two plain prompts; for a patched "
            "run use ek.compare((engine, prompt), (engine, prompt, patch))"
        )
    a, b = prompts
    return compare((engine, a), (engine, b), layers=layers, positions=positions, targets=targets)
