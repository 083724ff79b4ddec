"""Direct logit attribution, computed on the ranks.

The final residual stream is a sum: the embedding, plus what every attention block and every
MLP block writes (read through the model's layer family, `envoykit.model.readout`). The final
norm is nonlinear only through its scale ``1 / rms(stream)`` (``1 / std(stream)`` for a
LayerNorm, which also subtracts the mean: a linear map); frozen at its value on the final
stream (the standard definition, as in TransformerLens's ``logit_attrs``), it is linear, so
each component's contribution to a target's logit is

    contribution(c) = (centre(c) * gain * scale(final stream)) . W_U[target] * logit_scale

plus one ``bias`` component where the norm or the LM head has a bias, and the contributions
add up to the model's logit before any soft-cap. Each rank reads the
whole component outputs, gathers only the targets' unembedding rows (``[targets, d_model]``,
never the full vocabulary) and reduces to ``[components, positions, targets]`` numbers, which
is all that comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit import _compat as compat
from envoykit._compat import Model, Tokenizer
from envoykit.analyses.request import (
    Target,
    normalise_positions,
    one_prompt,
    single_token_target,
)
from envoykit.errors import InvalidRequest
from envoykit.model.envoys import gather_ranks
from envoykit.model.heads import HeadLayout
from envoykit.model.readout import Readout, at, norm_parameters, normalize, stream_of, walk
from envoykit.ranks.heads import head_writes
from envoykit.results.attribution import AttributionResult

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase

# How a per-head split that would not add up is refused (a post-norm family): the explorer
# then attributes by layer only.
HEADS_DO_NOT_ADD_UP = "this layer's attention write is not its heads' writes summed"


@dataclass(frozen=True)
class AttributionRequest:
    """A validated attribution request: the prompt tokenized, targets and positions checked."""

    prompt: str
    prompt_ids: tuple[int, ...]
    targets: tuple[Target, ...]
    positions: tuple[int, ...] | None
    heads: bool = False


def build_request(
    tokenizer: Tokenizer,
    vocab: int,
    max_model_len: int,
    prompt: str,
    targets: str | int | Sequence[str | int],
    positions: int | Sequence[int] | None = None,
    heads: bool = False,
) -> AttributionRequest:
    """Check an attribution request before anything reaches the ranks."""
    if not isinstance(heads, bool):
        raise InvalidRequest(f"heads takes True or False, not {heads!r}")
    prompt, ids = one_prompt(tokenizer, prompt, max_model_len, "attribute")
    wanted = [targets] if isinstance(targets, (str, int)) else list(targets)
    if not wanted:
        raise InvalidRequest("attribute needs at least one target token, e.g. [' Paris']")
    return AttributionRequest(
        prompt=prompt,
        prompt_ids=ids,
        targets=tuple(single_token_target(tokenizer, vocab, t) for t in wanted),
        positions=normalise_positions(positions, len(ids)),
        heads=heads,
    )


def attribution_statistics(
    norm: Any,
    head: Any,
    parts: Sequence[torch.Tensor],
    final: tuple[torch.Tensor, torch.Tensor | None],
    positions: torch.Tensor | None,
    targets: Sequence[int],
    logit_scale: float,
) -> dict[str, torch.Tensor]:
    """Reduce the attribution on this rank: ``parts`` (``[T, d_model]`` each) sum to the
    final stream, the row ``final`` (a pair, or the stream alone; see
    `envoykit.model.readout`).

    Returns float32 tensors on the streams' device: ``values`` ``[parts, positions,
    targets]``, ``bias`` ``[positions, targets]`` (what the final norm's bias and the head's
    bias add, the same at every position), ``logits`` (the model's pre-soft-cap logit, from
    its own final norm) and ``model_logits`` (what the head returns, soft-cap included),
    both ``[positions, targets]``, and ``directions`` ``[positions, targets, d_model]``: what
    a write into the stream is dotted with to give its contribution (`head_statistics`).
    """
    value, residual = final
    ids = torch.tensor(list(targets), dtype=torch.long, device=value.device)
    normed = normalize(norm, value, residual)
    model_logits = head(normed)[:, ids].float()
    rows = head.rows(ids).float()
    head_bias = head.bias_of(ids).float()
    affine = norm_parameters(norm, normed.shape[-1], normed)
    stream = stream_of(value, residual, torch.float32)
    picked = slice(None) if positions is None else positions.to(value.device)
    centered = affine["centered"]

    def centre(x: torch.Tensor) -> torch.Tensor:
        return x - centered * x.mean(-1, keepdim=True)

    # Centring is a symmetric projection: centre(x) . v == x . centre(v), so a write's
    # contribution is the write dotted with one direction per position and target.
    frozen = torch.rsqrt(centre(stream[picked]).pow(2).mean(-1, keepdim=True) + affine["eps"])
    directions = centre((frozen * affine["gain"])[:, None, :] * rows[None]) * logit_scale
    stacked = torch.stack([part[picked].float() for part in parts])
    values = torch.einsum("cpd,pnd->cpn", stacked, directions)
    bias = (affine["bias"] @ rows.T + head_bias) * logit_scale
    logits = (normed[picked].float() @ rows.T + head_bias) * logit_scale
    return {
        "values": values,
        "bias": bias.expand(logits.shape[0], -1),
        "logits": logits,
        "model_logits": model_logits[picked],
        "directions": directions,
    }


def _split_into_heads(
    layer_list: Any,
    layout: HeadLayout,
    heads_in: dict[int, torch.Tensor],
    parts: Sequence[torch.Tensor],
    directions: torch.Tensor,
    positions: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """On the ranks: every layer's `head_statistics`, stacked as ``head_values`` ``[layers,
    heads, positions, targets]`` and ``head_bias`` ``[layers, positions, targets]``;
    ``parts`` are the attribution's components (layer ``l``'s attention is ``2l - 1``)."""
    split = [
        head_statistics(
            compat.envoy_module(at(layer_list[layer - 1], layout.output)),
            heads_in[layer],
            parts[2 * layer - 1],
            directions,
            positions,
            layout.head_size,
        )
        for layer in sorted(heads_in)
    ]
    return {
        "head_values": torch.stack([s["heads"] for s in split]),
        "head_bias": torch.stack([s["bias"] for s in split]),
    }


def head_statistics(
    projection: Any,
    heads_in: torch.Tensor,
    attn_write: torch.Tensor,
    directions: torch.Tensor,
    positions: torch.Tensor | None,
    head_size: int,
) -> dict[str, torch.Tensor]:
    """One layer's attention contribution split into its heads, on this rank.

    Each rank projects its own heads' writes (`envoykit.ranks.heads.head_writes`) on the
    ``directions`` (`attribution_statistics`); the group gathers ``[heads, positions,
    targets]``. The layer's attention write into the stream is the sum of the heads' writes
    and the projection's bias times one factor (1, or Granite's residual multiplier), found
    by least squares and checked: a write that is not that (a norm after the attention)
    raises `InvalidRequest` instead of a split that does not add up.
    """
    picked = slice(None) if positions is None else positions.to(attn_write.device)
    writes = head_writes(projection, heads_in[picked], head_size)
    total = gather_ranks(writes.sum(0)).sum(0)
    bias = getattr(projection, "bias", None)
    bias = torch.zeros_like(total[0]) if bias is None else bias.float().to(total.device)
    summed = (total + bias).double()
    written = attn_write[picked].double()
    factor = (written * summed).sum() / (summed * summed).sum().clamp_min(1e-30)
    gap = (written - factor * summed).norm() / written.norm().clamp_min(1e-30)
    if gap > 1e-3:
        raise InvalidRequest(
            f"{HEADS_DO_NOT_ADD_UP} (a norm or another nonlinear map follows the output "
            f"projection; relative gap {float(gap):.2g}): per-head attribution would not add up"
        )
    local = torch.einsum("hpd,pnd->hpn", writes, directions) * factor.float()
    return {
        "heads": gather_ranks(local).flatten(0, 1),
        "bias": torch.einsum("d,pnd->pn", bias, directions) * factor.float(),
    }


def run(
    model: Model,
    readout: Readout,
    request: AttributionRequest,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
) -> AttributionResult:
    """Attribute ``request`` on ``model`` (an envoy tree) in one forward pass, its trace
    under ``guard`` (the engine's)."""
    import nnsight

    n = readout.n_layers
    readout.require("attribution")
    positions = None if request.positions is None else torch.tensor(request.positions)
    target_ids = [t.token_id for t in request.targets]
    processor = compat.envoy_module(model).logits_processor
    logit_scale = float(processor.scale)
    # The embedding, each layer's two writes, and the final stream: the writes sum to it;
    # with heads, each layer's heads' projection input too.
    extra = {"heads"} if request.heads else set()
    reads = {0: {"resid"}} | {layer: {"attn", "mlp"} | extra for layer in range(1, n + 1)}
    reads[n] = {"attn", "mlp", "resid"} | extra
    layout = readout.require_heads("per-head attributions") if request.heads else None
    with guard(), model.trace(request.prompt, temperature=0.0, max_tokens=1):
        # Envoys found from the root inside the trace: shipped with the root, the unembedding
        # envoy can reach the model's logits processor on the rank.
        norm = at(model, readout.final_norm)
        head = at(model, readout.unembedding)
        layer_list = at(model, readout.layers)
        heads_in: dict[int, torch.Tensor] = {}
        rows = walk(readout, layer_list, reads, {}, heads=heads_in)
        parts = [value for value, _ in rows[:-1]]
        stats = attribution_statistics(
            norm, head, parts, rows[-1], positions, target_ids, logit_scale
        )
        directions = stats.pop("directions")
        if layout is not None:
            stats |= _split_into_heads(layer_list, layout, heads_in, parts, directions, positions)
        stats = nnsight.save({key: value.cpu() for key, value in stats.items()})
    meta = {**meta, "soft_cap": processor.soft_cap, "logit_scale": logit_scale}
    return _result(model.tokenizer, request, n, stats, meta)


def _result(
    tokenizer: Tokenizer,
    request: AttributionRequest,
    n: int,
    stats: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> AttributionResult:
    """The `AttributionResult` of what the ranks sent, with its components named."""

    target_ids = [t.token_id for t in request.targets]
    ids = list(request.prompt_ids)
    picked = list(range(len(ids))) if request.positions is None else list(request.positions)
    components = ["embed"] + [f"{kind} {k}" for k in range(1, n + 1) for kind in ("attn", "mlp")]
    values = stats["values"].numpy()
    bias = stats["bias"].numpy()
    if bias.any():  # a LayerNorm's bias or an LM head's: a component of its own
        components.append("bias")
        values = np.concatenate([values, bias[None]])
    return AttributionResult(
        prompt=request.prompt,
        token_ids=np.array([ids[p] for p in picked]),
        tokens=tuple(tokenizer.decode([ids[p]]) for p in picked),
        positions=np.array(picked),
        components=tuple(components),
        target_ids=np.array(target_ids),
        target_labels=tuple(t.label for t in request.targets),
        target_tokens=tuple(t.token for t in request.targets),
        values=values,
        logits=stats["logits"].numpy(),
        model_logits=stats["model_logits"].numpy(),
        head_values=stats["head_values"].numpy() if "head_values" in stats else None,
        head_bias=stats["head_bias"].numpy() if "head_bias" in stats else None,
        meta={
            **meta,
            "returned_bytes": sum(t.numel() * t.element_size() for t in stats.values()),
        },
    )


def attribute(
    engine: EngineBase,
    prompt: str,
    targets: str | int | Sequence[str | int],
    *,
    positions: int | Sequence[int] | None = None,
    heads: bool = False,
) -> AttributionResult:
    """Direct logit attribution: how much the embedding and each layer's attention and
    MLP write into each target's final logit, at each position (see
    `envoykit.analyses.attribution`). Targets must be single tokens (strings or ids).
    ``heads=True`` also splits each layer's attention contribution into its heads,
    each computed on the rank that holds it (``head_values``).

    Returns an `AttributionResult` whose ``values.sum(0)`` equals its ``logits`` (and
    whose heads add up to their layer's attention row).
    """
    engine.readout.require("attribution")
    engine.info.require("attribution")
    if heads is True:
        engine.readout.require_heads("per-head attributions")
    info = engine.info
    req = build_request(
        engine.tokenizer, info.vocab, info.max_model_len, prompt, targets, positions, heads
    )
    return run(engine.model, engine.readout, req, engine._result_meta(), engine.exclusive)
