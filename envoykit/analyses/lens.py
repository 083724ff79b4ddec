"""The logit lens, computed on the ranks: what runs inside the trace, and what comes back.

A lens row is a (layer, site) pair. Sites (see `envoykit.model.readout` for where they are read):

* ``resid`` — the residual stream after the layer, through the model's final norm the way
  the model computes its own last step (for a pair family, vLLM's fused add-norm of its
  ``(hidden, residual)`` pair), so the last layer's lens is the model's own next-token
  distribution (to float32 rounding), in bfloat16 as in float32;
* ``resid_mid`` — the stream between the attention and the MLP block, normalised the same
  way;
* ``attn`` / ``mlp`` — what one block writes into the stream, **on its own**: the lone vector
  goes through the final norm by itself (scaled by its own RMS, then the norm's gain) and the
  head. This shows which tokens the block's write points towards, not how much it moves the
  final logits; `envoykit.analyses.attribution` measures that, with the final stream's scale frozen.

All rows are stacked into one ``[rows * positions, d_model]`` matrix and unembedded in one
call per rank (one GEMM on the rank's own slice of the vocabulary), chunked only when that
slice's logits would pass a memory budget. Each rank reduces its slice — top-k, target
probability and rank, entropy, KL to the final layer — and the ranks combine a few numbers
per cell (`envoykit.ranks.vocab_parallel`); only those ``O(rows * positions * k)`` numbers are
saved. Full-vocabulary logits are never gathered, let alone sent back.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envoykit.analyses import lens_run, request
from envoykit.analyses import sae as sae_module
from envoykit.analyses.compare import compare_prompts
from envoykit.analyses.patching import PatchPlan, as_patches, plan_for, source_writes
from envoykit.analyses.request import LayerSpec, LensRequest, PositionSpec, TargetSpec
from envoykit.analyses.steering import (
    as_list_of,
    engine_steers,
    plan_additions,
    plan_splice,
    split_clamps,
)
from envoykit.errors import InvalidRequest
from envoykit.model.readout import (
    Addition,
    writes_by_layer,
)
from envoykit.ranks.sae import SAEEdit
from envoykit.results.lens import LensResult

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.analyses.patching import Ablate, Patch
    from envoykit.analyses.sae import SAE
    from envoykit.analyses.steering import Steer
    from envoykit.analyses.tuned import TunedLens


def lens(
    engine: EngineBase,
    prompt: str | list[str],
    *,
    layers: LayerSpec = None,
    positions: PositionSpec = None,
    top_k: int = 10,
    targets: TargetSpec = (),
    generate: int = 0,
    sites: str | Sequence[str] = ("resid",),
    reduce_dtype: str = "float32",
    patch: Patch | Ablate | Sequence[Patch | Ablate] | None = None,
    compare: bool = False,
    translator: TunedLens | None = None,
    steer: Steer | Sequence[Steer] | None = None,
    splice: SAE | None = None,
    keep_error: bool = False,
) -> Any:
    """Logit lens of ``prompt`` in one forward pass, reduced on the ranks.

    ``layers``: None/"all" (decoder layers 1..n), numbers (negative from the end), a
    range, and/or "embed" (layer 0). ``sites``: any of "resid" (after the layer),
    "resid_mid" (between its attention and MLP), "attn" and "mlp" (what that block
    writes, normalised on its own: see `envoykit.analyses.lens`); one row per layer and site.
    ``targets``: strings (their first token) or token ids. ``generate=N`` also lenses
    the N greedily generated tokens. ``reduce_dtype``: precision of the reductions on
    the ranks ("float32", or "float64"). A list of prompts gives a list of results
    (one trace). ``patch``: an `ek.Patch`, an `ek.Ablate` (a head removed) or a list of
    them; the result is the lens of the patched run (see `envoykit.analyses.patching`),
    and its ``meta["patches"]`` says so.
    ``compare=True`` with two prompts gives their `CompareResult` (`envoykit.analyses.compare`).
    ``translator``: a `TunedLens` of this model; the residual-stream rows go through its
    translators on the ranks (a tuned lens), and ``meta["lens"]`` says "tuned".
    ``steer``: an `ek.Steer` or a list of them (they add up); the lens is that of the
    steered run (with ``generate=N``, of the steered generation), ``meta["steer"]`` says so.
    An `ek.Clamp` (SAE features set to values) is accepted as a ``patch`` or a ``steer``.
    ``splice``: an `ek.SAE` of a residual-stream site; the model runs with the SAE's
    reconstruction in place of the stream there, at every position and step (with
    ``keep_error``, plus the SAE's error), and ``meta["splice"]`` says so.

    Returns a `LensResult` (a list of them for a list of prompts).
    """
    if compare:
        given = {
            "translator": translator is not None,
            "generate": generate != 0,
            "reduce_dtype": reduce_dtype != "float32",
            "steer": steer is not None,
            "splice": splice is not None,
            "keep_error": keep_error,
            "top_k": top_k != 10,  # (each cell's top-1 of both runs: statistics of no top-k)
        }
        dropped = [name for name, was_given in given.items() if was_given]
        return compare_prompts(engine, prompt, layers, positions, targets, sites, patch, dropped)
    req = request.build_request(
        engine.tokenizer,
        engine.info.n_layers,
        engine.info.vocab,
        engine.info.max_model_len,
        prompt,
        layers=layers,
        positions=positions,
        top_k=top_k,
        targets=targets,
        generate=generate,
        sites=sites,
        reduce_dtype=reduce_dtype,
    )
    plan = build_plan(engine, req, patch, translator, steer, splice, keep_error)
    results = _run_cancellable(engine, plan)
    return results if isinstance(prompt, (list, tuple)) else results[0]


@dataclass(frozen=True)
class LensPlan:
    """A lens checked whole before its trace: the request, where its patches write, its
    steers' additions, the translators' key on the ranks, a splice's edit and the meta."""

    req: LensRequest
    patches: PatchPlan
    additions: tuple[Addition | SAEEdit, ...]
    translator: str | None
    splice: SAEEdit | None
    meta: dict[str, Any]


def build_plan(
    engine: EngineBase,
    req: LensRequest,
    patch: Any,
    translator: TunedLens | None,
    steer: Any,
    splice: SAE | None,
    keep_error: bool,
) -> LensPlan:
    """Everything a lens's options ask of ``engine``, checked (and SAEs and translators
    installed on the ranks) before the trace: a refusal never leaves half a lens run."""
    clamps, patch = split_clamps(patch)
    patches = as_patches(patch)
    plan = plan_for(engine, req, patches)
    engine.readout.require("the lens")
    engine._require_sites([site for _, site in req.rows] + [p.site for p in patches])
    meta = engine._result_meta()
    key = None if translator is None else _translator_key(engine, req, translator)
    if key is not None:
        meta.update(lens="tuned", translator=key)
    if patches:
        meta["patches"] = [dataclasses.asdict(p) for p in patches]
    steers = engine_steers(engine, [*as_list_of(steer), *clamps])
    if steers and len(req.prompts) != 1:
        raise InvalidRequest("a steer goes into one prompt, not a list of them")
    info = engine.info
    additions = plan_additions(steers, info.n_layers, info.d_model, len(req.prompt_ids[0]))
    if additions:
        meta["steer"] = [item.describe() for item in steers]
    edit = None
    if keep_error and splice is None:
        raise InvalidRequest("keep_error=True goes with splice=: it keeps an SAE's error term")
    if splice is not None:
        if len(req.prompts) != 1:
            raise InvalidRequest("a splice lens runs one prompt, not a list of them")
        edit = plan_splice(splice, info.n_layers, keep_error)
        sae_module.require(engine, splice)
        meta["splice"] = {**splice.describe(), "keep_error": keep_error}
    return LensPlan(req, plan, tuple(additions), key, edit, meta)


def _translator_key(engine: EngineBase, req: LensRequest, translator: TunedLens) -> str:
    """The key of ``translator`` installed on the ranks, for a request of stream rows."""
    if any(site != "resid" for _, site in req.rows):
        raise InvalidRequest(
            "tuned-lens translators are trained for the residual stream after each "
            "layer: use sites=('resid',) with a translator"
        )
    return engine._install_translator(translator)


def _run_cancellable(engine: EngineBase, plan: LensPlan) -> list[LensResult]:
    """`run` of ``plan``, registered before its sources are read so that a cancel heard
    meanwhile stops the lens at its first chunk."""
    model, readout = engine.model, engine.readout
    with engine._cancellable() as (cancel, guard):
        writes = source_writes(model, readout, plan.patches, engine.exclusive)
        additions, fidelity = list(plan.additions), None
        if plan.splice is not None:
            plain = writes_by_layer([*writes, *additions])
            fidelity = lens_run.Fidelity(uuid.uuid4().hex, (*plan.req.prompt_ids[0][1:], -1), plain)
            additions.append(plan.splice)
        return lens_run.run(
            model,
            readout,
            plan.req,
            plan.meta,
            guard,
            writes=writes,
            translator=plan.translator,
            additions=additions,
            cancel=cancel,
            fidelity=fidelity,
        )
