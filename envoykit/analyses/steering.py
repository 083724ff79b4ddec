"""Activation steering: add a direction to the residual stream on the ranks.

A `Steer` adds ``scale * vector`` to the stream after a layer (or between its blocks), at
chosen token positions or at every position of every step, generated tokens included. It
becomes an `envoykit.model.readout.Addition`, written through the same walk of the layer
family as every patch: the stream is whole on every rank at any TP size (a pair family's
``hidden + residual`` included), so each rank adds the same vector to the same numbers and
the ranks stay alike with no exchange at all.

A vector is built by `envoykit.analyses.steering_vector`, steered generations run in
`envoykit.analyses.generation`, and a sweep of strengths in `envoykit.analyses.steer_sweep`;
this module checks steers and turns them into additions, for every analysis that takes
``steer=``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit.analyses import sae as sae_module
from envoykit.analyses.clamp import Clamp
from envoykit.analyses.request import normalise_layers
from envoykit.analyses.sae import SAE
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Addition, Cell
from envoykit.ranks.sae import SAEEdit
from envoykit.results.identity import check_same_model

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase

STEER_SITES = ("resid", "resid_mid")


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
    steers: Sequence[Steer | Clamp], n_layers: int, d_model: int, length: int | None
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


def engine_steers(engine: EngineBase, steer: Any) -> list[Steer | Clamp]:
    """``steer`` as a list, each checked against ``engine``'s model: a `SteeringVector` must
    be of this model, a clamp's SAE is installed on the ranks, every site must be readable."""
    steers = as_steers(steer)
    for item in steers:
        if isinstance(item, Clamp):
            sae_module.require(engine, item.sae)
            continue
        model = getattr(item.vector, "model", None)
        if model is not None:
            check_same_model(
                dict(model),
                engine.fingerprint(),
                "this steering vector was built",
                "build one on this model",
            )
    if steers:
        engine.readout.require("steering")
        engine._require_sites([item.site for item in steers])
    return steers


def split_clamps(patch: Any) -> tuple[list[Clamp], Any]:
    """The `ek.Clamp`s among a lens's ``patch`` (they are steers: edits of the stream by
    SAE features), and the rest of it."""
    items = as_list_of(patch)
    clamps = [item for item in items if isinstance(item, Clamp)]
    if not clamps:
        return [], patch
    rest = [item for item in items if not isinstance(item, Clamp)]
    return clamps, rest or None


def as_list_of(value: Any) -> list:
    """None, one object or a list of them, as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
