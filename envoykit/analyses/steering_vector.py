"""A steering vector the usual way (ActAdd, CAA): the mean of the stream at one position
over a list of positive prompts minus the mean over negative ones.

Many prompts per trace (vLLM batches a trace's prompts into its steps); each prompt sends
back its ``d_model`` numbers and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit._compat import Model
from envoykit.analyses.request import normalise_prompts, token_ids
from envoykit.analyses.steering import check_site
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Readout, at, stream_of, walk

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.results.steering import SteeringVector

# Prompts per trace of `mean_difference`.
_PROMPTS_PER_TRACE = 32


def steering_vector(
    engine: EngineBase,
    positive: str | Sequence[str],
    negative: str | Sequence[str],
    layer: int | str,
    *,
    site: str = "resid",
    position: int | None = -1,
    progress: bool = True,
) -> SteeringVector:
    """The contrastive mean difference of the stream at (``layer``, ``site``): its mean
    over the ``positive`` prompts minus its mean over the ``negative`` ones, at token
    ``position`` of each prompt (default the last; None: the mean over its positions).
    Many prompts per trace; each sends back its ``d_model`` numbers only.

    Returns a `SteeringVector` carrying this model's fingerprint: ``ek.Steer(vector,
    vector.layer, scale=...)`` steers with it, and ``save``/``load`` keep it.
    """
    from envoykit.results.steering import SteeringVector

    info = engine.info
    positive, negative = check_prompt_lists(positive, negative)
    number = check_site(layer, site, info.n_layers)
    engine.readout.require("steering vectors")
    engine._require_sites([site])
    lengths = [
        len(token_ids(engine.tokenizer, p, info.max_model_len)) for p in (*positive, *negative)
    ]
    _check_position(position, min(lengths))
    plus, minus = mean_difference(
        engine.model,
        engine.readout,
        positive,
        negative,
        number,
        site,
        position,
        engine.exclusive,
        progress,
    )
    return SteeringVector(
        vector=(plus - minus).astype("float32"),
        layer=number,
        site=site,
        position=position,
        positive=positive,
        negative=negative,
        model=engine.fingerprint(),
        meta={k: v for k, v in engine._result_meta().items() if k != "vocab"},
    )


def _check_position(position: Any, shortest: int) -> None:
    """``position`` (None: each prompt's mean) is a token position of every prompt."""
    if position is None:
        return
    if (
        isinstance(position, bool)
        or not isinstance(position, int)
        or not (-shortest <= position < shortest)
    ):
        raise InvalidRequest(
            f"position {position!r} is not a token position of every prompt (the "
            f"shortest has {shortest} tokens); position=None takes each prompt's mean"
        )


def mean_difference(
    model: Model,
    readout: Readout,
    positive: Sequence[str],
    negative: Sequence[str],
    layer: int,
    site: str,
    position: int | None,
    guard: Callable[[], AbstractContextManager],
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The mean stream at (``layer``, ``site``) over ``positive`` and over ``negative``
    prompts (float64 sums of float32 rows), at token ``position`` of each prompt, or the
    mean over its positions where ``position`` is None."""
    from tqdm.auto import tqdm

    prompts = [*positive, *negative]
    rows = []
    with tqdm(
        total=len(prompts), desc="steering vector", unit="prompt", disable=not progress
    ) as bar:
        for start in range(0, len(prompts), _PROMPTS_PER_TRACE):
            chunk = prompts[start : start + _PROMPTS_PER_TRACE]
            with guard():
                rows += _streams_at(model, readout, chunk, layer, site, position)
            bar.update(len(chunk))
    values = np.stack([row.double().numpy() for row in rows])
    return values[: len(positive)].mean(0), values[len(positive) :].mean(0)


def _streams_at(
    model: Model,
    readout: Readout,
    prompts: Sequence[str],
    layer: int,
    site: str,
    position: int | None,
) -> list[torch.Tensor]:
    """One trace, one invoke per prompt: each prompt's stream row ``[d_model]``."""
    import nnsight

    layer_list = at(model, readout.layers)
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                ((value, residual),) = walk(readout, layer_list, {layer: {site}}, {})
                stream = stream_of(value, residual, torch.float32)
                row = stream.mean(0) if position is None else stream[position]
                saved = nnsight.save(row.cpu())
    return saved if len(prompts) > 1 else [saved]


def check_prompt_lists(positive: Any, negative: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Both prompt lists of a steering vector, each non-empty."""
    lists = []
    for name, value in (("positive", positive), ("negative", negative)):
        if isinstance(value, (list, tuple)) and not value:
            raise InvalidRequest(f"the {name} prompts are empty: a mean needs at least one")
        lists.append(normalise_prompts(value))
    return lists[0], lists[1]
