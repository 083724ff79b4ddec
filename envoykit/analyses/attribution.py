"""Direct logit attribution, computed on the ranks.

The final residual stream is a sum: the embedding, plus what every attention block and every
MLP block writes. The final norm is nonlinear only through its scale ``1 / rms(stream)``;
frozen at its value on the final stream (the standard definition, as in TransformerLens's
``logit_attrs``), it is linear, so each component's contribution to a target's logit is

    contribution(c) = (c * gain * scale(final stream)) . W_U[target] * logit_scale

and the contributions add up to the model's logit before any soft-cap. Each rank reads the
whole component outputs, gathers only the targets' unembedding rows (``[targets, d_model]``,
never the full vocabulary) and reduces to ``[components, positions, targets]`` numbers, which
is all that comes back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envoykit.analyses.request import (
    Target,
    normalise_positions,
    normalise_prompts,
    single_token_target,
)
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Readout, at
from envoykit.results.attribution import AttributionResult


@dataclass(frozen=True)
class AttributionRequest:
    """A validated attribution request: the prompt tokenized, targets and positions checked."""

    prompt: str
    prompt_ids: tuple[int, ...]
    targets: tuple[Target, ...]
    positions: tuple[int, ...] | None


def build_request(
    tokenizer: Any,
    vocab: int,
    max_model_len: int,
    prompt: str,
    targets: str | int | Sequence[str | int],
    positions: int | Sequence[int] | None = None,
) -> AttributionRequest:
    """Check an attribution request before anything reaches the ranks."""
    if not isinstance(prompt, str):
        raise InvalidRequest(f"attribute takes one prompt (a string), not {type(prompt).__name__}")
    (prompt,) = normalise_prompts(prompt)
    ids = tuple(tokenizer(prompt)["input_ids"])
    if not ids:
        raise InvalidRequest(f"prompt {prompt!r} tokenizes to no tokens")
    if len(ids) > max_model_len:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens exceeds the engine's max_model_len={max_model_len}"
        )
    wanted = [targets] if isinstance(targets, (str, int)) else list(targets)
    if not wanted:
        raise InvalidRequest("attribute needs at least one target token, e.g. [' Paris']")
    return AttributionRequest(
        prompt=prompt,
        prompt_ids=ids,
        targets=tuple(single_token_target(tokenizer, vocab, t) for t in wanted),
        positions=normalise_positions(positions, len(ids)),
    )


def attribution_statistics(
    norm: Any,
    head: Any,
    parts: Sequence[torch.Tensor],
    final: tuple[torch.Tensor, torch.Tensor],
    positions: torch.Tensor | None,
    targets: Sequence[int],
    logit_scale: float,
) -> dict[str, torch.Tensor]:
    """Reduce the attribution on this rank: ``parts`` (``[T, d_model]`` each) sum to the
    final stream ``final = (hidden, residual)``.

    Returns float32 tensors on the streams' device: ``values`` ``[parts, positions,
    targets]``, ``logits`` (the model's pre-soft-cap logit, from its own final norm) and
    ``model_logits`` (what the head returns, soft-cap included), both ``[positions, targets]``.
    """
    hidden, residual = final
    ids = torch.tensor(list(targets), dtype=torch.long, device=hidden.device)
    normed = norm(hidden.clone(), residual.clone())[0]
    model_logits = head(normed)[:, ids].float()
    rows = head.rows(ids).float()
    eps = float(norm.variance_epsilon)
    # The norm's gain (weight, or 1 + weight for Gemma), read off the norm itself: a
    # constant row of ones has rms 1, so the norm returns gain / sqrt(1 + eps).
    ones = torch.ones(1, normed.shape[-1], dtype=normed.dtype, device=normed.device)
    gain = norm(ones)[0].float() * math.sqrt(1.0 + eps)
    stream = hidden.float() + residual.float()
    frozen = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + eps)
    stacked = torch.stack([part.float() for part in parts])
    values = (stacked * (frozen * gain)) @ rows.T * logit_scale
    logits = normed.float() @ rows.T * logit_scale
    if positions is not None:
        picked = positions.to(values.device)
        values, logits, model_logits = (
            values[:, picked],
            logits[picked],
            model_logits[picked],
        )
    return {"values": values, "logits": logits, "model_logits": model_logits}


def run(
    model: Any, readout: Readout, request: AttributionRequest, meta: dict[str, Any]
) -> AttributionResult:
    """Attribute ``request`` on ``model`` (an envoy tree) in one forward pass."""
    import nnsight

    from envoykit.analyses.lens import distinct_labels

    readout.require_sublayers()
    prenorm = readout.mlp_prenorm
    positions = None if request.positions is None else torch.tensor(request.positions)
    target_ids = [t.token_id for t in request.targets]
    processor = model._module.logits_processor
    logit_scale = float(processor.scale)
    with model.trace(request.prompt, temperature=0.0, max_tokens=1):
        # Envoys found from the root inside the trace: shipped with the root, the unembedding
        # envoy can reach the model's logits processor on the rank.
        layer_list = at(model, readout.layers)
        norm = at(model, readout.final_norm)
        head = at(model, readout.unembedding)
        args, kwargs = layer_list[0].inputs
        embedded = args[1] if len(args) > 1 else kwargs["hidden_states"]
        # Cloned where read: the fused add-norm may overwrite its inputs later on.
        parts = [embedded.clone()]
        for layer in layer_list:
            parts.append(getattr(layer, prenorm).inputs[0][0].clone())
            hidden, residual = layer.output[:2]
            hidden, residual = hidden.clone(), residual.clone()
            parts.append(hidden)
        stats = attribution_statistics(
            norm, head, parts, (hidden, residual), positions, target_ids, logit_scale
        )
        stats = nnsight.save({key: value.cpu() for key, value in stats.items()})
    tokenizer = model.tokenizer
    ids = list(request.prompt_ids)
    picked = list(range(len(ids))) if request.positions is None else list(request.positions)
    components = ["embed"] + [
        f"{kind} {n}" for n in range(1, readout.n_layers + 1) for kind in ("attn", "mlp")
    ]
    return AttributionResult(
        prompt=request.prompt,
        token_ids=np.array([ids[p] for p in picked]),
        tokens=distinct_labels([tokenizer.decode([ids[p]]) for p in picked], picked),
        positions=np.array(picked),
        components=tuple(components),
        target_ids=np.array(target_ids),
        target_labels=tuple(t.label for t in request.targets),
        target_tokens=tuple(t.token for t in request.targets),
        values=stats["values"].numpy(),
        logits=stats["logits"].numpy(),
        model_logits=stats["model_logits"].numpy(),
        meta={
            **meta,
            "soft_cap": processor.soft_cap,
            "logit_scale": logit_scale,
            "returned_bytes": sum(t.numel() * t.element_size() for t in stats.values()),
        },
    )
