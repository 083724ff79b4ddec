"""The self-check at load: the readout contract confirmed on the model's real weights.

An architecture's layer family (`envoykit.model.families`) says where its stream is; this
checks that it is there, on one short prompt, before the engine is handed over (about a
second on ``demo``):

* ``lens`` — the last layer's lens equals the model's own next-token distribution;
* ``attribution`` — the embedding and every block's write add up to the model's logit;
* ``sites`` — the stream between the blocks plus the MLP's write is the stream after the
  layer, and the stream before the layer plus the attention's write is the stream between
  (for parallel blocks: the stream before plus both writes is the stream after).

A check that fails disables what it vouches for (`ModelInfo.require`), with the check named; the
others stay available. ``engine.info.validated`` lists what passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.errors import InvalidRequest

if TYPE_CHECKING:
    from envoykit.analyses.surface import EngineSurface

PROMPT = "The capital of France is"
CHECKS = ("lens", "attribution", "sites")


def tolerance(dtype: str) -> float:
    """Agreement asked of a probability or a relative sum: float32 rounding, or bfloat16's."""
    return 1e-4 if dtype == "float32" else 3e-2


def run(engine: EngineSurface) -> dict[str, str | None]:
    """Every check on ``engine``: None for a check that passed, else why it failed."""
    if engine.readout.family is None:
        reason = f"no readout contract for {engine.readout.architecture}"
        return dict.fromkeys(CHECKS, reason)
    tol = tolerance(engine.info.dtype)
    try:  # one lens for the two checks that need one
        last = engine.lens(PROMPT, layers=[-1], top_k=5)
    except InvalidRequest as error:
        return {
            "lens": str(error),
            "attribution": str(error),
            "sites": _failure(_check_sites, engine, tol),
        }
    return {
        "lens": _failure(_check_lens, engine, last, tol),
        "attribution": _failure(_check_attribution, engine, last, tol),
        "sites": _failure(_check_sites, engine, tol),
    }


def _failure(check: Any, *args: Any) -> str | None:
    try:
        return check(*args)
    except InvalidRequest as error:
        return str(error)


def _check_lens(engine: EngineSurface, res: Any, tol: float) -> str | None:
    """``res``, the last layer's lens of `PROMPT`, against the model's own logits."""
    import nnsight

    with engine.exclusive(), engine.trace(PROMPT):
        logits = nnsight.save(engine.model.logits.float().cpu())
    probs = np.exp(_log_softmax(logits.numpy().reshape(-1, logits.shape[-1])[-1]))
    gap = float(np.abs(res.top_probs[0, -1] - probs[res.top_ids[0, -1]]).max())
    if gap > tol:
        return f"the last layer's lens is {gap:.2g} from the model's own probabilities"
    return None


def _check_attribution(engine: EngineSurface, res: Any, tol: float) -> str | None:
    """Attribution of the lens ``res``'s two most likely last tokens."""
    targets = [int(i) for i in res.top_ids[0, -1, :2]]
    try:
        att = engine.attribute(PROMPT, targets, positions=[-1])
    except ValueError as error:  # AttributionResult refuses values that do not add up
        return str(error)
    gap = float(np.abs(att.model_logits - att.logits).max()) if not att.meta["soft_cap"] else 0.0
    scale = float(np.abs(att.logits).max()) + 1.0
    if gap > tol * scale:
        return f"the attributed logit is {gap:.2g} from the model's own logit"
    return None


def _check_sites(engine: EngineSurface, tol: float) -> str | None:
    import nnsight

    from envoykit.model.readout import at, walk

    readout = engine.readout
    assert readout.family is not None  # `run` checks nothing without a layer family
    parallel = readout.family.parallel
    layer = min(2, readout.n_layers)
    sites = {"attn", "mlp", "resid"} | (set() if parallel else {"resid_mid"})
    reads = {layer - 1: {"resid"}, layer: sites}
    with engine.exclusive(), engine.trace(PROMPT):
        rows = walk(readout, at(engine.model, readout.layers), reads, {})
        values = nnsight.save(
            [(v if r is None else v + r).float().cpu() for v, r in rows]  # the streams
        )
    before, *here = values
    named = dict(zip([s for s in ("attn", "resid_mid", "mlp", "resid") if s in sites], here))
    size = float(named["resid"].abs().max()) + 1.0
    if parallel:
        rebuilt = {"resid": before + named["attn"] + named["mlp"]}
    else:
        rebuilt = {"resid": named["resid_mid"] + named["mlp"], "resid_mid": before + named["attn"]}
    for site, value in rebuilt.items():
        gap = float((value - named[site]).abs().max())
        if gap > tol * size:
            return f"layer {layer}: the writes do not add up to the stream at {site!r} ({gap:.2g})"
    return None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())
