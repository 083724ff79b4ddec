"""Merged column layers read and written in checkpoint order at every TP size.

``qkv_proj`` and ``gate_up_proj`` come back from nnsight's all-gather in rank order
(``[q0,k0,v0,q1,k1,v1]``), unlike TP=1 and the checkpoint (``[q|k|v]``). The fragment rules
that make a rank's piece whole belong to each rank's interleaver, so the ranks' model runner
(`InstallFragments`) swaps in `CheckpointOrderFragments`, which reorders a merged layer's
value when it is made whole and cuts an edit back into each rank's own layout: slicing by
head means the same thing at every TP size.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from nnsight.modeling.vllm.fragments import VLLMFragments
from nnsight.util import apply


class CheckpointOrderFragments(VLLMFragments):
    """`VLLMFragments` that hands merged column layers back in checkpoint order.

    An all-gather concatenates each rank's ``[q_r | k_r | v_r]``; the checkpoint (and TP=1)
    has ``[q | k | v]``. Reordered on the way to intervention code, and cut back into the
    rank's own ``[q_r | k_r | v_r]`` on the way into the model, so an edit written in
    checkpoint order lands in the right place on every rank.
    """

    def whole(self, location: str, value: Any) -> tuple[Any, Any]:
        value, _ = super().whole(location, value)
        module, side = self.rules[location]
        if side == "output" and merged_layout(module) is not None:
            value = apply(value, partial(to_checkpoint_order, module), torch.Tensor)
        return value, partial(self.split, location)

    def split(self, location: str, whole: Any) -> Any:
        module, side = self.rules[location]
        if side == "output" and merged_layout(module) is not None:
            return apply(whole, partial(rank_piece, module), torch.Tensor)
        return super().split(location, whole)


def merged_layout(module: torch.nn.Module) -> list[tuple[int, int]] | None:
    """Per part of a merged column layer: (size on one rank, ranks holding the same piece).

    KV heads are replicated when there are more ranks than KV heads; the gather then
    carries each of them ``num_kv_head_replicas`` times and one copy is kept.
    """
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        replicas = module.num_kv_head_replicas
        q, k, v = module.output_partition_sizes
        return [(q, 1), (k, replicas), (v, replicas)]
    if isinstance(module, MergedColumnParallelLinear):
        return [(size, 1) for size in module.output_partition_sizes]
    return None


def to_checkpoint_order(module: torch.nn.Module, gathered: torch.Tensor) -> torch.Tensor:
    layout = merged_layout(module)
    assert layout is not None  # called for merged column layers only
    per_rank = sum(size for size, _ in layout)
    if gathered.shape[-1] != per_rank * module.tp_size:
        return gathered
    by_rank = gathered.unflatten(-1, (module.tp_size, per_rank))
    parts = by_rank.split([size for size, _ in layout], dim=-1)
    return torch.cat(
        [part[..., ::replicas, :].flatten(-2) for part, (_, replicas) in zip(parts, layout)],
        dim=-1,
    )


def rank_piece(module: torch.nn.Module, whole: torch.Tensor) -> torch.Tensor:
    layout = merged_layout(module)
    assert layout is not None  # called for merged column layers only
    distinct = [module.tp_size // replicas for _, replicas in layout]
    if whole.shape[-1] != sum(size * n for (size, _), n in zip(layout, distinct)):
        return whole
    parts = whole.split([size * n for (size, _), n in zip(layout, distinct)], dim=-1)
    rank = module.tp_rank
    pieces = [
        part.unflatten(-1, (n, size))[..., rank // replicas, :]
        for part, (size, replicas), n in zip(parts, layout, distinct)
    ]
    return torch.cat(pieces, dim=-1).contiguous()


class InstallFragments:
    """Model-runner mixin: give the rank's interleaver `CheckpointOrderFragments`.

    nnsight's runner builds its interleaver in ``load_model`` with ``VLLMFragments`` and
    offers no argument for it. The rules that records while the tree is built (which
    locations are one rank's piece) are its whole state, so they move into a
    `CheckpointOrderFragments`, which reads and writes them in checkpoint order.
    """

    nnsight_model: Any  # set by nnsight's runner, the class this mixin goes before

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # nnsight's runner, after this mixin in the MRO, defines load_model.
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        interleaver = self.nnsight_model.interleaver
        ordered = CheckpointOrderFragments()
        ordered.__dict__.update(vars(interleaver.fragments))
        interleaver.fragments = ordered
