"""Attention patterns on the ranks: each rank computes the patterns of its own heads.

vLLM's paged attention never forms the pattern, so it is rebuilt from what the kernel is
given: the queries and keys after rotary embedding and any q/k norm, which each rank holds
for its slice of the heads (`envoykit.ranks.heads` reproduces the model's scale, mask,
sliding window, soft-cap and sinks). In one prefill trace every rank computes, layer by
layer, the weights of the picked heads it holds at the picked queries (their ``top_k`` keys,
for a long prompt); after the last layer the tensor-parallel group gathers them in one
exchange, and that is all that comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit import _compat as compat
from envoykit._compat import Model, Tokenizer
from envoykit.analyses.request import (
    HeadSpec,
    LayerSpec,
    PositionSpec,
    as_list,
    check_head,
    integer,
    normalise_layers,
    normalise_positions,
    one_prompt,
)
from envoykit.errors import InvalidRequest
from envoykit.model.envoys import gather_ranks
from envoykit.model.heads import HeadLayout
from envoykit.model.readout import Readout, at, rank_inputs
from envoykit.ranks.heads import local_patterns, picked_on_ranks, query_key
from envoykit.results.attention import AttentionResult

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase

# The most bytes of weights (and key positions) one request may bring back: beyond it, ask
# for top_k keys, fewer layers, heads or queries.
MAX_RETURNED_BYTES = 256 * 2**20


@dataclass(frozen=True)
class AttentionRequest:
    """A checked attention request: layers are decoder layer numbers (1-based), heads whole-
    model head numbers, queries token positions; ``top_k`` None keeps every key."""

    prompt: str
    prompt_ids: tuple[int, ...]
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    queries: tuple[int, ...]
    top_k: int | None


def build_request(
    tokenizer: Tokenizer,
    layout: HeadLayout,
    n_layers: int,
    max_model_len: int,
    prompt: str,
    *,
    layers: LayerSpec = None,
    heads: HeadSpec = None,
    queries: PositionSpec = None,
    top_k: int | None = None,
) -> AttentionRequest:
    """Check an attention request before anything reaches the ranks."""
    prompt, ids = one_prompt(tokenizer, prompt, max_model_len, "attention")
    picked_layers = normalise_layers(layers, n_layers)
    if 0 in picked_layers:
        raise InvalidRequest("layer 0 is the embedding, which has no attention: pick layers >= 1")
    picked_heads = _heads(heads, layout.n_heads)
    picked_queries = normalise_positions(queries, len(ids)) or tuple(range(len(ids)))
    if top_k is not None:
        number = integer(top_k)
        if number is None or number < 1:
            raise InvalidRequest(
                f"top_k must be None (every key) or an integer >= 1, not {top_k!r}"
            )
        top_k = number
    kept = len(ids) if top_k is None else min(top_k, len(ids))
    returned = len(picked_layers) * len(picked_heads) * len(picked_queries) * kept * 12
    if returned > MAX_RETURNED_BYTES:
        raise InvalidRequest(
            f"{len(picked_layers)} layers x {len(picked_heads)} heads x {len(picked_queries)} "
            f"queries x {kept} keys would bring back {returned / 2**20:.0f} MiB: pass top_k=, "
            "or fewer layers=, heads= or queries="
        )
    return AttentionRequest(
        prompt, ids, picked_layers, picked_heads, picked_queries, None if top_k is None else kept
    )


def _heads(heads: Any, n_heads: int) -> tuple[int, ...]:
    """Sorted, distinct head numbers; None is every head, negatives count from the end."""
    if heads is None:
        return tuple(range(n_heads))
    picked = {check_head(head, n_heads, "attention") for head in as_list(heads)}
    if not picked:
        raise InvalidRequest("no heads given: pass heads=None for every head")
    return tuple(sorted(picked))


def run(
    model: Model,
    readout: Readout,
    request: AttentionRequest,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
) -> AttentionResult:
    """The patterns of ``request`` on ``model`` (an envoy tree) in one prefill trace, under
    ``guard`` (the engine's)."""
    import nnsight

    layout = readout.require_heads()
    queries = torch.tensor(request.queries)
    ranks = meta["tp"]
    mine_per_rank, places = picked_on_ranks(list(request.heads), layout.n_heads, ranks)
    order = torch.tensor(places)
    with guard(), model.trace(request.prompt, temperature=0.0, max_tokens=1):
        from vllm.distributed import get_tensor_model_parallel_rank

        layer_list = at(model, readout.layers)
        mine = torch.tensor(mine_per_rank[get_tensor_model_parallel_rank()])
        kept = []
        for layer in request.layers:
            kernel = at(layer_list[layer - 1], layout.attention)
            query, key = query_key(*rank_inputs(kernel))
            weights = local_patterns(
                compat.envoy_module(kernel), query, key, queries.to(query.device)
            )
            kept.append(_top(weights[mine.to(weights.device)], request.top_k))
        # One exchange for every layer: [ranks, layers, width, queries, K], then the picked
        # heads in their order. Every key kept: the keys are 0..T-1 on every row, known here.
        stacked = {"weights": torch.stack([w for w, _ in kept])}
        if request.top_k is not None:
            stacked["keys"] = torch.stack([k for _, k in kept])
        saved = nnsight.save(
            {
                name: gather_ranks(value)
                .transpose(0, 1)
                .flatten(1, 2)[:, order.to(value.device)]
                .cpu()
                for name, value in stacked.items()
            }
        )
    tokenizer = model.tokenizer
    return AttentionResult(
        prompt=request.prompt,
        token_ids=np.array(request.prompt_ids),
        tokens=tuple(tokenizer.decode([i]) for i in request.prompt_ids),
        layers=np.array(request.layers),
        heads=np.array(request.heads),
        queries=np.array(request.queries),
        keys=saved["keys"].numpy() if "keys" in saved else _every_key(saved["weights"].shape),
        weights=saved["weights"].numpy(),
        meta={
            **meta,
            "top_k": request.top_k,
            "returned_bytes": sum(t.numel() * t.element_size() for t in saved.values()),
        },
    )


def _top(weights: torch.Tensor, top_k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weights, keys)`` of the ``top_k`` most attended keys, most first; of every key
    (and no keys: they are 0..T-1) without ``top_k``."""
    if top_k is None:
        return weights, None
    values, keys = weights.topk(top_k, dim=-1)
    return values, keys


def _every_key(shape: tuple[int, ...]) -> np.ndarray:
    """The key positions of a result that kept every key: 0..T-1 on every row."""
    return np.broadcast_to(np.arange(shape[-1]), shape)


def attention(
    engine: EngineBase,
    prompt: str,
    *,
    layers: LayerSpec = None,
    heads: HeadSpec = None,
    queries: PositionSpec = None,
    top_k: int | None = None,
) -> AttentionResult:
    """Attention patterns of ``prompt``, each computed on the rank that holds its head.

    ``layers``: decoder layers as in `lens` (None: every one; the embedding has none).
    ``heads``: head numbers over the whole model (None: every head; negatives count from
    the end). ``queries``: token positions whose patterns are kept (None: every one).
    ``top_k``: keep only each query's k most attended keys (for long prompts).

    Returns an `AttentionResult` ``[layers, heads, queries, keys]``, equal to the
    model's own attention weights (transformers' eager ``output_attentions``).
    """
    layout = engine.readout.require_heads()
    info = engine.info
    req = build_request(
        engine.tokenizer,
        layout,
        info.n_layers,
        info.max_model_len,
        prompt,
        layers=layers,
        heads=heads,
        queries=queries,
        top_k=top_k,
    )
    return run(engine.model, engine.readout, req, engine._result_meta(), engine.exclusive)
