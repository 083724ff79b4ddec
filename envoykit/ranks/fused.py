"""The lens's per-row reductions as single expressions, compiled on the CPU into fused loops.

`envoykit.ranks.vocab_parallel` reduces each row of a slice's logits to a few sums (its
largest logit and its index, the sums of the exponentials that give the log-sum-exp and the
entropy, and its share of KL against the final layer). In torch's passes that is half a dozen
elementwise calls per block of rows, each reading and writing the block. Written as one
expression and compiled by torch's inductor, a row's reductions become one loop over it with
no temporaries: `final_sums` for the final layer's rows (keeping their exponentials, which
every layer's KL reads) and `layer_sums` for every other layer's. The sums accumulate in
float64 in the loop (inductor's float32 sums are sequential per lane: 4e-6 relative over 49k
terms, where torch's cascade sum keeps 2e-7), which costs nothing measurable.

Compiling takes 1-3 s the first time a process asks (inductor's cache on disk makes later
processes quicker), so only long work asks for it: the corpus lens, whose every chunk reduces
hundreds of rows. Where compiling is impossible (no C++ compiler) `compiled()` says so once
and the caller keeps its eager passes, which give the same statistics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from envoykit import _compat as compat

log = logging.getLogger(__name__)
F64 = torch.float64


def _row_sums(
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both loops share, per row of ``rows`` ``[..., size]``: its largest value ``m``
    ``[..., 1]``, ``d = rows - m``, ``exp(d)``, the first index of ``m`` (int32; the last index
    where there is none, as for a row with a NaN) and the sums of ``exp(d)`` and of
    ``exp(d) * d`` in float64 (`envoykit.ranks.vocab_parallel.lens_summaries` says why)."""
    largest = rows.amax(-1, keepdim=True)
    d = rows - largest
    e = d.exp()
    size = rows.shape[-1]
    index = torch.arange(size, device=rows.device, dtype=torch.int32)
    first = torch.where(d == 0, index, size - 1).amin(-1)
    return largest, d, e, first, e.sum(-1, dtype=F64), (e * d).sum(-1, dtype=F64)


def final_sums(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The final layer's rows ``[positions, size]``: their largest value ``[positions, 1]``,
    its first index, the two sums (`_row_sums`) and ``exp(d)`` itself ``[positions, size]``,
    which every other layer's share of KL reads (`layer_sums`)."""
    largest, _, e, first, exp_sum, weighted = _row_sums(rows)
    return largest, first, exp_sum, weighted, e


def layer_sums(rows: torch.Tensor, final_exp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Any layer's rows ``[layers, positions, size]``: their largest value
    ``[layers, positions, 1]``, its first index, the two sums (`_row_sums`) and, with the
    final layer's ``exp(d)`` ``final_exp`` ``[positions, size]`` (`final_sums`), the sum of
    ``final_exp * d`` in float64: this slice's share of KL(final || layer)."""
    largest, d, _, first, exp_sum, weighted = _row_sums(rows)
    return largest, first, exp_sum, weighted, (final_exp * d).sum(-1, dtype=F64)


class Reductions(NamedTuple):
    """`final_sums` and `layer_sums`, compiled."""

    final_sums: Callable[..., tuple[torch.Tensor, ...]]
    layer_sums: Callable[..., tuple[torch.Tensor, ...]]


_lock = threading.Lock()
_NOT_YET = object()
_compiled: Any = _NOT_YET  # Reductions | None once the first call has tried


def compiled() -> Reductions | None:
    """The reductions compiled for this process's CPU, or None where compiling failed.

    The first call compiles both on small rows, with every size symbolic (one compiled loop
    serves every slice and chunk), and keeps the outcome for the process's threads."""
    global _compiled
    with _lock:
        if _compiled is _NOT_YET:
            _compiled = _compile()
        return _compiled


def _compile() -> Reductions | None:
    compat.compile_in_process()
    found = Reductions(_compiled_anyway(final_sums), _compiled_anyway(layer_sums))
    # Sizes of at least 2 and all different, and no tensor passed twice: dynamo specialises
    # sizes 0 and 1, sizes equal to one another and aliases, compiling again for the first
    # call that differs.
    layers, positions, size = 2, 3, 5
    zeros = torch.zeros
    try:
        found.final_sums(zeros(positions, size))
        found.layer_sums(zeros(layers, positions, size), zeros(positions, size))
    except Exception as error:  # no C++ compiler, or one inductor cannot use
        log.warning("the lens's reductions run uncompiled: %s", _first_line(error))
        return None
    return found


def _compiled_anyway(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled, and run compiled even in a rank, whose stance is eager
    (`envoykit.ranks.cpu` keeps vLLM's own compiled helpers from compiling there)."""
    compiled = torch.compile(function, dynamic=True)

    def run(*args: torch.Tensor) -> Any:
        with torch.compiler.set_stance("default"):
            return compiled(*args)

    return run


def _first_line(error: Any) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
