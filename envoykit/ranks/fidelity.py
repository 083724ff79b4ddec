"""How far a spliced model's next-token distribution is from the model's own, on the ranks.

A splice lens (`envoykit.analyses.lens` with an SAE's reconstruction in place of the
stream) is one trace; the model's own distribution at the same positions comes from a plain
trace just before it, under the same guard. Each rank keeps its slice of that plain run's
log-probabilities here between the two traces (`remember`; a few at a time), and the spliced
trace compares its own slice with it (`compare`): KL per position and the next token's
log-probability under each, summed over the ranks in one exchange. Full-vocabulary
distributions never leave the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from envoykit.model.readout import normalize
from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import vocab_parallel

# key -> this rank's slice of the plain run's final log-probs [T, size].
PLAIN: dict[str, torch.Tensor] = {}


def final_logp(
    norm: Any, shard: VocabShard, row: tuple[torch.Tensor, torch.Tensor | None]
) -> torch.Tensor:
    """This rank's slice ``[T, size]`` of the final distribution's log-probs (float32)."""
    logits = shard.logits(normalize(norm, *row)).float()
    largest, log_sum, *_ = vocab_parallel.summaries(shard, logits, 1, ())
    return logits.sub_(largest.unsqueeze(-1)).sub_(log_sum.unsqueeze(-1))


# Plain runs kept at once: splice lenses of several clients of one server may interleave
# their two traces; an older one (its spliced trace never came) is dropped.
_KEPT = 4


def remember(key: str, logp: torch.Tensor) -> None:
    """Keep the plain run's slice for the spliced trace that follows."""
    while len(PLAIN) >= _KEPT:
        del PLAIN[next(iter(PLAIN))]
    PLAIN[key] = logp


def compare(
    shard: VocabShard, key: str, logp: torch.Tensor, next_ids: Sequence[int]
) -> dict[str, torch.Tensor]:
    """KL(plain || spliced) ``[T]`` and each position's next-token cross-entropy under the
    plain and the spliced run ``[T]`` (``next_ids[t]`` < 0: no next token, NaN), the same on
    every rank; the remembered slice is dropped."""
    plain = PLAIN.pop(key)
    kl = (plain.exp() * (plain - logp)).sum(-1)
    held = logp.new_zeros(logp.shape[0], 2)
    for t, token in enumerate(next_ids):
        if shard.start <= token < shard.start + shard.size:
            held[t, 0] = plain[t, token - shard.start]
            held[t, 1] = logp[t, token - shard.start]
    total = shard.gather(torch.cat([kl.unsqueeze(-1), held], dim=-1)).sum(0)
    missing = torch.tensor([token < 0 for token in next_ids], device=logp.device)
    ce = (-total[:, 1:]).masked_fill(missing.unsqueeze(-1), float("nan"))
    return {"kl": total[:, 0].clamp_min(0.0), "ce_plain": ce[:, 0], "ce_spliced": ce[:, 1]}
