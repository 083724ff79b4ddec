"""What an SAE training run is set to: `train_sae`'s arguments checked (`check_options`),
then, once the rows' shape and scale are known, the run's whole plan (`plan_run`), which
the training log records.

Apart from `envoykit.analyses.sae_training` so that the loop reads as a loop: every default
and every refusal of a bad argument is here, before any row is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envoykit.analyses.request import check_count
from envoykit.analyses.sae_hooks import SAE_SITES
from envoykit.errors import InvalidRequest

if TYPE_CHECKING:
    from envoykit.analyses.sae_rows import Rows

TRAINED = ("topk", "relu")
DEFAULT_K = 32
# SAELens 6's StandardTrainingSAEConfig.l1_coefficient and its default learning rate.
DEFAULT_L1 = 1.0
RELU_LR = 3e-4
# Gao et al.'s AuxK coefficient; k_aux is d_in // 2 (sparsify's sparse_coder.py).
AUXK_ALPHA = 1 / 32
# Gao et al.'s and sparsify's dead window (tokens); shorter runs use a tenth of theirs.
DEAD_TOKENS = 10_000_000


@dataclass(frozen=True)
class Options:
    """The checked arguments; what depends on the data (d_sae, k, lr...) is `Plan`'s."""

    architecture: str
    layer: int
    site: str
    d_sae: int | None
    expansion: float
    k: int | None
    l1_coefficient: float | None
    max_seconds: float | None
    max_tokens: int | None
    batch_size: int
    lr: float | None
    dead_tokens: int | None
    buffer_tokens: int
    seed: int
    out: Path | None


def check_options(**given: Any) -> Options:
    """The arguments checked, each refused with what is valid, before anything is read."""
    architecture = _architecture(given["architecture"])
    layer, site = _layer_and_site(given["layer"], given["site"])
    d_sae = given["d_sae"]
    if d_sae is not None:
        d_sae = check_count("d_sae", d_sae, minimum=1)
    expansion = _positive("expansion", given["expansion"])
    k, l1 = _sparsity(architecture, given["k"], given["l1_coefficient"])
    max_seconds = given["max_seconds"]
    if max_seconds is not None:
        max_seconds = _positive("max_seconds", max_seconds)
    max_tokens = given["max_tokens"]
    if max_tokens is not None:
        max_tokens = check_count("max_tokens", max_tokens, minimum=1)
    lr = given["lr"]
    dead = given["dead_tokens"]
    seed = given["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidRequest(f"seed must be an integer, not {seed!r}")
    out = given["out"]
    if out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise InvalidRequest(f"out={str(out)!r} is a file: give a directory for the SAE")
    return Options(
        architecture=architecture,
        layer=layer,
        site=site,
        d_sae=d_sae,
        expansion=expansion,
        k=k,
        l1_coefficient=l1,
        max_seconds=max_seconds,
        max_tokens=max_tokens,
        batch_size=check_count("batch_size", given["batch_size"], minimum=1),
        lr=None if lr is None else _positive("lr", lr),
        dead_tokens=None if dead is None else check_count("dead_tokens", dead, minimum=1),
        buffer_tokens=check_count("buffer_tokens", given["buffer_tokens"], minimum=1),
        seed=seed,
        out=out,
    )


def _architecture(architecture: Any) -> str:
    """``architecture`` if `train_sae` trains it; JumpReLU refused with where to train it."""
    if architecture == "jumprelu":
        raise InvalidRequest(
            "training a JumpReLU SAE is not supported (its threshold needs a straight-through "
            "estimator envoykit does not implement): train architecture='topk' or 'relu', or "
            "train JumpReLU with SAELens and load it with ek.SAE.load"
        )
    if architecture not in TRAINED:
        raise InvalidRequest(
            f"train_sae trains architecture 'topk' or 'relu', not {architecture!r}"
        )
    return str(architecture)


def _layer_and_site(layer: Any, site: Any) -> tuple[int, str]:
    """The (layer, site) an SAE reads, if the model has it."""
    layer = check_count("layer", layer, minimum=0)
    if site not in SAE_SITES:
        raise InvalidRequest(f"site is one of {', '.join(SAE_SITES)}, not {site!r}")
    if layer == 0 and site != "resid":
        raise InvalidRequest("layer 0 (the embedding) has only the 'resid' site")
    return layer, site


def _sparsity(architecture: str, k: Any, l1: Any) -> tuple[int | None, float | None]:
    """``(k, l1_coefficient)``: TopK's k (default `DEFAULT_K`) or ReLU's L1 coefficient
    (default `DEFAULT_L1`), the other one refused if given."""
    if architecture == "topk":
        if l1 is not None:
            raise InvalidRequest("l1_coefficient is ReLU's sparsity penalty: a TopK SAE takes k")
        return check_count("k", DEFAULT_K if k is None else k, minimum=1), None
    if k is not None:
        raise InvalidRequest("k is TopK's: a ReLU SAE's sparsity comes from l1_coefficient")
    return None, DEFAULT_L1 if l1 is None else _positive("l1_coefficient", l1, zero=True)


def _positive(name: str, value: Any, zero: bool = False) -> float:
    """``value`` as a float, if it is a finite number above 0 (or at least 0)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise InvalidRequest(f"{name} must be a finite number {bound}, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Plan:
    """Everything a run is set to, the data's shape included: what the log records."""

    architecture: str
    layer: int
    site: str
    d_in: int
    d_sae: int
    k: int | None
    l1_coefficient: float | None
    lr: float
    batch_size: int
    buffer_tokens: int
    dead_tokens: int
    auxk_alpha: float | None
    max_tokens: int | None
    max_seconds: float | None
    seed: int
    tokens: int
    training_rows: int
    held_out_rows: int
    scale: float
    source: str
    model_name: str | None


def plan_run(rows: Rows, options: Options, n_train: int, scale: float) -> Plan:
    """The run's settings, those that depend on the data checked against it."""
    d_sae = options.d_sae or max(1, round(options.expansion * rows.d_in))
    if options.k is not None and options.k > d_sae:
        raise InvalidRequest(f"k is at most d_sae ({d_sae}) latents, not {options.k}")
    topk = options.architecture == "topk"
    lr = options.lr or (2e-4 / math.sqrt(d_sae / 2**14) if topk else RELU_LR)
    planned = options.max_tokens or n_train
    dead = options.dead_tokens or min(DEAD_TOKENS, max(planned // 10, options.batch_size))
    return Plan(
        architecture=options.architecture,
        layer=options.layer,
        site=options.site,
        d_in=rows.d_in,
        d_sae=d_sae,
        k=options.k,
        l1_coefficient=options.l1_coefficient,
        lr=lr,
        batch_size=options.batch_size,
        buffer_tokens=options.buffer_tokens,
        dead_tokens=dead,
        auxk_alpha=AUXK_ALPHA if topk else None,
        max_tokens=options.max_tokens,
        max_seconds=options.max_seconds,
        seed=options.seed,
        tokens=rows.count,
        training_rows=n_train,
        held_out_rows=rows.count - n_train,
        scale=scale,
        source=rows.where,
        model_name=rows.model_name,
    )
