"""Activation steering: add a direction to the residual stream on the ranks.

A `Steer` adds ``scale * vector`` to the stream after a layer (or between its blocks), at
chosen token positions or at every position of every step, generated tokens included. It
becomes an `envoykit.model.readout.Addition`, written through the same walk of the layer
family as every patch: the stream is whole on every rank at any TP size (a pair family's
``hidden + residual`` included), so each rank adds the same vector to the same numbers and
the ranks stay alike with no exchange at all.

`mean_difference` builds a vector the usual way (ActAdd, CAA): the mean of the stream at one
position over a list of positive prompts minus the mean over negative ones, many prompts per
trace; each prompt sends back its ``d_model`` numbers and nothing else. `generated_ids` runs
steered greedy generations, one invoke per run, so a sweep of strengths
(`Engine.steer_sweep`) is one trace whose runs share every step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envoykit.analyses.request import normalise_layers, normalise_prompts
from envoykit.analyses.sae import SAE, Clamp
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Addition, Cell, Readout, at, at_step, walk, writes_by_layer
from envoykit.ranks.sae import SAEEdit

STEER_SITES = ("resid", "resid_mid")
# Prompts per trace of `mean_difference`: vLLM batches each trace's prompts into its steps.
_PROMPTS_PER_TRACE = 32


@dataclass(frozen=True, eq=False)
class Steer:
    """Add ``scale * vector`` to the stream after decoder layer ``layer`` (0 or "embed": the
    embedding; negative from the end), at ``site`` "resid" (after the layer) or "resid_mid"
    (between its attention and MLP).

    ``vector``: ``[d_model]`` numbers (a tensor, an array, or a `SteeringVector`, which is
    checked against the engine's model). ``positions``: token positions of the prompt
    (negative from the end), or None for every position of the prompt and of every generated
    token. ``norm_match``: rescale each steered position to the norm it had before, so only
    the direction changes.
    """

    vector: Any
    layer: int | str
    site: str = "resid"
    positions: int | Sequence[int] | None = None
    scale: float = 1.0
    norm_match: bool = False

    @classmethod
    def from_feature(
        cls,
        sae: Any,
        feature: int,
        scale: float = 1.0,
        *,
        positions: int | Sequence[int] | None = None,
        norm_match: bool = False,
    ) -> Steer:
        """Add ``scale`` times an SAE feature's decoder direction (``W_dec[feature]``) where
        the SAE reads: its residual-stream site, or, for an SAE of what a block writes, the
        stream that write goes into (after the layer for "mlp", between its blocks for
        "attn")."""
        from envoykit.analyses.sae import SAE

        if not isinstance(sae, SAE):
            raise InvalidRequest(f"Steer.from_feature takes an ek.SAE, not {type(sae).__name__}")
        site = {"mlp": "resid", "attn": "resid_mid"}.get(sae.site, sae.site)
        return cls(sae.direction(feature), sae.layer, site, positions, scale, norm_match)

    def scaled(self, scale: float) -> Steer:
        """This steer at another strength."""
        return Steer(self.vector, self.layer, self.site, self.positions, scale, self.norm_match)

    def describe(self) -> dict[str, Any]:
        """What a result's ``meta["steer"]`` records of this steer (the vector by its norm)."""
        vector = _as_tensor(self.vector)
        positions = self.positions
        return {
            "layer": self.layer if isinstance(self.layer, str) else int(self.layer),
            "site": self.site,
            "positions": positions
            if positions is None or isinstance(positions, int)
            else [int(p) for p in positions],
            "scale": float(self.scale),
            "norm_match": bool(self.norm_match),
            "vector_norm": float(vector.double().norm()) if vector is not None else None,
            "from": getattr(self.vector, "label", None),
        }


def as_steers(steer: Steer | Clamp | Sequence[Steer | Clamp] | None) -> list[Steer | Clamp]:
    """One steer (or SAE clamp), a list of them (they add up), or None, as a list; anything
    else refused."""
    if steer is None:
        return []
    steers = [steer] if isinstance(steer, (Steer, Clamp)) else list(steer)
    for item in steers:
        if not isinstance(item, (Steer, Clamp)):
            raise InvalidRequest(
                f"steer takes ek.Steer objects (or ek.Clamp), not {type(item).__name__}"
            )
    return steers


def plan_additions(
    steers: Sequence[Steer], n_layers: int, d_model: int, length: int | None
) -> list[Addition]:
    """The checked `Addition` of each steer into a prompt of ``length`` tokens (None: a
    trace whose prompts are not known here, where only ``positions=None`` is meaningful)."""
    additions: list[Addition] = []
    for steer in steers:
        if isinstance(steer, Clamp):
            additions.append(plan_clamp(steer, n_layers, length))
            continue
        vector = check_vector(steer.vector, d_model)
        (scale,) = check_scales([steer.scale])
        layer = check_site(steer.layer, steer.site, n_layers)
        if not isinstance(steer.norm_match, bool):
            raise InvalidRequest(f"norm_match is True or False, not {steer.norm_match!r}")
        positions = _positions(steer.positions, length)
        additions.append(
            Addition(
                Cell(layer, steer.site, None), vector * float(scale), positions, steer.norm_match
            )
        )
    return additions


def plan_clamp(clamp: Clamp, n_layers: int, length: int | None) -> SAEEdit:
    """The edit a clamp makes on the ranks (its SAE installed there under its key)."""
    pairs = clamp.pairs()
    if clamp.site not in STEER_SITES:
        raise InvalidRequest(
            f"a clamp edits the residual stream: this SAE reads {clamp.site!r} (its features "
            "can be read with engine.features; Steer.from_feature adds their directions)"
        )
    layer = check_site(clamp.layer, clamp.site, n_layers)
    return SAEEdit(
        Cell(layer, clamp.site, None),
        torch.zeros(0),
        _positions(clamp.positions, length),
        key=clamp.sae.key,
        clamps=pairs,
    )


def plan_splice(sae: SAE, n_layers: int, keep_error: bool) -> SAEEdit:
    """The edit that puts ``sae``'s reconstruction in place of the stream at its site, at
    every position of every step."""
    if sae.site not in STEER_SITES:
        raise InvalidRequest(
            f"a splice replaces the residual stream: this SAE reads {sae.site!r} (its "
            "features can be read with engine.features)"
        )
    if not isinstance(keep_error, bool):
        raise InvalidRequest(f"keep_error is True or False, not {keep_error!r}")
    layer = check_site(sae.layer, sae.site, n_layers)
    return SAEEdit(
        Cell(layer, sae.site, None), torch.zeros(0), None, key=sae.key, keep_error=keep_error
    )


def check_site(layer: Any, site: str, n_layers: int) -> int:
    """The layer number of a steer's (``layer``, ``site``), checked."""
    if site not in STEER_SITES:
        raise InvalidRequest(
            f"a steer adds to the stream at site 'resid' or 'resid_mid', not {site!r}"
        )
    (number,) = normalise_layers([layer], n_layers)
    if number == 0 and site != "resid":
        raise InvalidRequest("the embedding (layer 0) has only the 'resid' site to steer")
    return number


def check_scales(scales: Any) -> list[float]:
    """Steering strengths: a non-empty list of finite numbers."""
    items = list(scales) if isinstance(scales, (list, tuple, np.ndarray)) else [scales]
    if not items:
        raise InvalidRequest("scales is empty: give the strengths to sweep")
    for scale in items:
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float, np.floating))
            or not (math.isfinite(scale))
        ):
            raise InvalidRequest(f"a steer's scale is a finite number, not {scale!r}")
    return [float(scale) for scale in items]


def check_vector(value: Any, d_model: int) -> torch.Tensor:
    """A steering vector as float32 ``[d_model]``: the right size, a floating dtype, finite."""
    vector = _as_tensor(value)
    if vector is None:
        raise InvalidRequest(
            f"a steering vector is a tensor, an array or an ek.SteeringVector, not "
            f"{type(value).__name__}"
        )
    if not vector.is_floating_point():
        dtype = str(vector.dtype).removeprefix("torch.")
        raise InvalidRequest(f"a steering vector holds floating-point numbers, not {dtype}")
    if tuple(vector.shape) != (d_model,):
        raise InvalidRequest(
            f"a steering vector of this model has d_model={d_model} numbers, not shape "
            f"{tuple(vector.shape)}"
        )
    vector = vector.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(vector).all()):
        raise InvalidRequest("the steering vector holds NaN or infinite values")
    return vector


def _as_tensor(value: Any) -> torch.Tensor | None:
    value = getattr(value, "vector", value)  # a SteeringVector
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return torch.from_numpy(np.array(value))
    return None


def _positions(positions: Any, length: int | None) -> tuple[int, ...] | None:
    if positions is None:
        return None
    items = [positions] if isinstance(positions, int) else list(positions)
    if not items or any(isinstance(p, bool) or not isinstance(p, int) for p in items):
        raise InvalidRequest(
            f"a steer's positions are token positions (integers) or None, not {positions!r}"
        )
    if length is None:
        raise InvalidRequest(
            "a steer in engine.trace applies at every position (positions=None): the "
            "trace's prompts are not known before it runs"
        )
    outside = [p for p in items if not -length <= p < length]
    if outside:
        raise InvalidRequest(
            f"steer positions {outside} are past the prompt of {length} tokens "
            f"(0..{length - 1}, or -{length}..-1 from the end; positions=None also steers "
            "the generated tokens)"
        )
    return tuple(sorted({p % length for p in items}))


def steer_in_trace(
    model: Any, readout: Readout, additions: Sequence[Addition], tracer: Any
) -> None:
    """The body of a block that steers every step of whatever it runs in (an installed
    edit, see `Engine.trace`)."""
    layer_list = at(model, readout.layers)
    for _ in tracer.iter[:]:
        walk(readout, layer_list, {}, writes_by_layer(additions))


def stop_ids(tokenizer: Any) -> set[int]:
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
    model: Any,
    readout: Readout,
    prompt: str,
    runs: Sequence[Sequence[Addition]],
    max_tokens: int,
    guard: Callable[[], AbstractContextManager],
    lens: tuple[Sequence[int], Sequence[int], int] | None = None,
) -> tuple[list[list[int]], list[dict[str, torch.Tensor]] | None]:
    """Greedy generations of ``prompt``, one invoke per run of ``runs`` (each with its own
    additions), in one trace under ``guard``; stop tokens are not cut here (`until_stop`).

    ``lens`` = (layers, target ids, position): each run also reduces on the ranks the lens
    at that prompt position of those layers' streams after steering (top 1 and the targets'
    probabilities), from the prompt's own pass.
    """
    import nnsight

    from envoykit.analyses.lens import lens_statistics

    layer_list = at(model, readout.layers)
    layers, targets, position = lens if lens is not None else ((), (), 0)
    reads = {layer: {"resid"} for layer in layers}
    where = torch.tensor([position])
    norm, head = at(model, readout.final_norm), at(model, readout.unembedding)
    with guard(), model.trace(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) as tracer:
        for additions in runs:
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
                    samples.append(model.samples.cpu())
    if len(runs) == 1:
        samples, stats = [samples], [stats]
    ids = [[int(s.flatten()[0]) for s in run] for run in samples]
    return ids, None if lens is None else [run[0] for run in stats]


def mean_difference(
    model: Any,
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
    model: Any,
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
                stream = value.float() if residual is None else value.float() + residual
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
