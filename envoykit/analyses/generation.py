"""Greedy generation, plain or steered, and nnsight traces of an engine.

Plain generation goes through vLLM (`EngineBase._greedy`); a steered one runs in one
trace, one invoke per run, every step steered on the ranks, so a sweep of strengths
(`envoykit.analyses.steer_sweep`) is one trace whose runs share every step. Stop tokens are
cut as vLLM cuts them, so a steer of scale 0 gives plain generation's ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from envoykit._compat import Model, Tokenizer
from envoykit.analyses import steering
from envoykit.analyses.request import check_count, one_prompt
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Addition, Readout, at, at_step, walk, writes_by_layer

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.analyses.clamp import Clamp
    from envoykit.analyses.steering import Steer
    from envoykit.results.steering import Generation


def generate(
    engine: EngineBase,
    prompt: str,
    max_tokens: int = 16,
    *,
    steer: Steer | Sequence[Steer] | None = None,
    cancellable: bool = False,
) -> Generation:
    """Greedy continuation of ``prompt``: a `Generation`, the text itself (a ``str``)
    with its ``token_ids``. Plain vLLM generation, or with ``steer`` (an `ek.Steer`, or a
    list of them, which add up) the steered one, every step steered on the ranks; its
    ``meta["steer"]`` says so.

    A steered generation stops after any step on `engine.cancel` (`Cancelled`). A plain
    one is one vLLM request that runs to its end, unless ``cancellable``: then it runs in
    a trace like a steered one, with the same ids.
    """
    from envoykit.results.steering import Generation

    steers = steering.engine_steers(engine, steer)
    if not steers and not cancellable:
        prompt, _, max_tokens = generation_ids(engine, prompt, max_tokens)  # not by vLLM
        output = engine._greedy(prompt, max_tokens)
        return Generation(output.text, output.token_ids)
    (ids,), meta, _ = steered_ids(engine, prompt, [steers], max_tokens)
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    return Generation(text, ids, meta) if steers else Generation(text, ids)


def generate_ids(
    engine: EngineBase,
    prompt: str,
    max_tokens: int = 16,
    *,
    steer: Steer | Sequence[Steer] | None = None,
) -> list[int]:
    """Token ids of the greedy continuation of ``prompt`` (steered with ``steer``)."""
    return list(generate(engine, prompt, max_tokens, steer=steer).token_ids)


def trace(
    engine: EngineBase,
    *prompts: Any,
    steer: Steer | Sequence[Steer] | None = None,
    **kwargs: Any,
) -> Any:
    """nnsight's trace on this engine; greedy and one new token unless told otherwise.

    Its run is serialised with every other request and guarded like `lens`: a dead
    engine raises `EngineDead`, an interrupt aborts what it left in flight.
    ``steer``: `ek.Steer`s (at every position: ``positions=None``) added to the stream
    of every invoke at every step, before the trace's own code sees it.
    """
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 1)
    steers = steering.engine_steers(engine, steer)
    if not steers:
        return engine.model.trace(*prompts, **kwargs)
    info = engine.info
    additions = steering.plan_additions(steers, info.n_layers, info.d_model, None)
    return engine._steered_trace(additions, prompts, kwargs)


def steered_ids(
    engine: EngineBase,
    prompt: str,
    runs: Sequence[Sequence[Steer | Clamp]],
    max_tokens: int,
    lens: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[list[list[int]], dict[str, Any], list[dict[str, Any]] | None]:
    """Greedy ids of ``prompt`` under each run's steers (one trace), cut at the stop
    token as plain generation is, the meta of a result of the last run, and with
    ``lens`` = (layers, target ids) each run's lens at the last prompt position
    (`generated_ids`; else None)."""
    info = engine.info
    prompt, ids, max_tokens = generation_ids(engine, prompt, max_tokens)
    planned = [
        steering.plan_additions(steers, info.n_layers, info.d_model, len(ids)) for steers in runs
    ]
    where = None if lens is None else (*lens, len(ids) - 1)
    with engine._cancellable("the steered generation") as (cancel, guard):
        found, stats = generated_ids(
            engine.model, engine.readout, prompt, planned, max_tokens, guard, where, cancel
        )
    stops = stop_ids(engine.tokenizer)
    meta = {**engine._result_meta(), "steer": [s.describe() for s in runs[-1]]}
    meta.pop("vocab")
    return [until_stop(run, stops) for run in found], meta, stats


def generation_ids(
    engine: EngineBase, prompt: Any, max_tokens: Any
) -> tuple[str, tuple[int, ...], int]:
    """A generation's prompt, its ids and ``max_tokens``, checked against the context."""
    limit = engine.info.max_model_len
    prompt, ids = one_prompt(engine.tokenizer, prompt, limit, "generate")
    max_tokens = check_count("max_tokens", max_tokens, 1)
    if len(ids) + max_tokens > limit:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens plus max_tokens={max_tokens} exceeds the engine's "
            f"max_model_len={limit}"
        )
    return prompt, ids, max_tokens


def steer_in_trace(
    model: Model, readout: Readout, additions: Sequence[Addition], tracer: Any
) -> None:
    """The body of a block that steers every step of whatever it runs in (an installed
    edit, see `Engine.trace`)."""
    layer_list = at(model, readout.layers)
    for _ in tracer.iter[:]:
        walk(readout, layer_list, {}, writes_by_layer(additions))


def stop_ids(tokenizer: Tokenizer) -> set[int]:
    """Token ids plain generation stops at: the tokenizer's end of sequence and the
    checkpoint's generation config's (vLLM stops at both)."""
    ids = {tokenizer.eos_token_id} - {None}
    return {int(i) for i in ids | _config_eos(tokenizer.name_or_path)}


@functools.cache
def _config_eos(checkpoint: str) -> frozenset[int]:
    """The end-of-sequence ids of ``checkpoint``'s generation config (read once per
    checkpoint, not at every generation); none when it has no config."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except (OSError, ValueError):
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def until_stop(ids: Sequence[int], stops: set[int]) -> list[int]:
    """``ids`` up to and including the first stop token (as vLLM returns them)."""
    out = []
    for token in ids:
        out.append(int(token))
        if token in stops:
            break
    return out


def generated_ids(
    model: Model,
    readout: Readout,
    prompt: str,
    runs: Sequence[Sequence[Addition]],
    max_tokens: int,
    guard: Callable[[], AbstractContextManager],
    lens: tuple[Sequence[int], Sequence[int], int] | None = None,
    cancel: str | None = None,
) -> tuple[list[list[int]], list[dict[str, torch.Tensor]] | None]:
    """Greedy generations of ``prompt``, one invoke per run of ``runs`` (each with its own
    additions), in one trace under ``guard``; stop tokens are not cut here (`until_stop`).

    ``lens`` = (layers, target ids, position): each run also reduces on the ranks the lens
    at that prompt position of those layers' streams after steering (top 1 and the targets'
    probabilities), from the prompt's own pass. ``cancel``: the key whose flag stops the
    generation on the ranks after any step (`envoykit.ranks.cancel`), since vLLM would
    only stop a request it was asked to abort; the first run looks for it, with one
    exchange a step, and its error is the trace's.
    """
    import nnsight

    from envoykit.ranks.cancel import stop_if_cancelled
    from envoykit.ranks.lens import lens_statistics

    layer_list = at(model, readout.layers)
    layers, targets, position = lens if lens is not None else ((), (), 0)
    reads = {layer: {"resid"} for layer in layers}
    where = torch.tensor([position])
    norm, head = at(model, readout.final_norm), at(model, readout.unembedding)
    with guard(), model.trace(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) as tracer:
        for run, additions in enumerate(runs):
            with tracer.invoke(prompt):
                samples = nnsight.save([])
                stats = nnsight.save([])
                for step in tracer.iter[:max_tokens]:
                    here = writes_by_layer(at_step(additions, step))
                    streams = walk(readout, layer_list, reads if step == 0 else {}, here)
                    if step == 0 and lens is not None:
                        found = lens_statistics(
                            norm, head.vocab_shard(), streams, where, 1, targets
                        )
                        stats.append({key: value.cpu() for key, value in found.items()})
                    sample = model.samples
                    samples.append(sample.cpu())
                    if cancel is not None and run == 0:  # one exchange a step is enough
                        stop_if_cancelled(head.vocab_shard(), cancel, sample.device)
    if len(runs) == 1:
        samples, stats = [samples], [stats]
    ids = [[int(s.flatten()[0]) for s in run] for run in samples]
    return ids, None if lens is None else [run[0] for run in stats]
