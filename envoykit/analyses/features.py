"""SAE features of a prompt, read on the ranks: each rank encodes its own slice of the
features (`envoykit.ranks.sae`) from the stream, which is whole on every rank, and the ranks
merge their top features per token, their L0 counts and their partial reconstructions;
only ``O(positions * k)`` numbers per SAE come back. Several SAEs, at several sites, are read
in the same trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit import _compat as compat
from envoykit._compat import Model, Tokenizer
from envoykit.analyses import sae as sae_module
from envoykit.analyses.installed import InstalledSAEs
from envoykit.analyses.request import Integers, check_count, normalise_prompts, one_prompt
from envoykit.analyses.sae import SAE, as_saes
from envoykit.errors import InvalidRequest
from envoykit.model.envoys import gather_ranks
from envoykit.model.readout import Readout, at, stream_of, walk
from envoykit.ranks import sae as on_ranks
from envoykit.results.features import (
    FeatureAttributionResult,
    FeatureLogitsResult,
    FeatureResult,
)

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.runtime.info import ModelInfo

# The order `walk` returns a layer's rows in.
_WALK_ORDER = ("attn", "resid_mid", "mlp", "resid")


@dataclass(frozen=True)
class FeatureRequest:
    """A checked request: prompts tokenized, SAEs fitting the model, ids to track."""

    prompts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    saes: tuple[SAE, ...]
    top_k: int
    tracked: tuple[int, ...]


def build_request(
    tokenizer: Tokenizer,
    info: ModelInfo,
    prompt: str | Sequence[str],
    sae: SAE | Sequence[SAE],
    *,
    top_k: int = 16,
    features: Any = None,
) -> FeatureRequest:
    """Everything `run` needs, checked before any trace: the prompts' lengths, each SAE
    against the model (`SAE.check_engine`), ``top_k`` and the feature ids to track."""
    prompts = normalise_prompts(prompt)
    saes = as_saes(sae)
    if len({item.key for item in saes}) > InstalledSAEs.LIMIT:
        raise InvalidRequest(
            f"one request reads at most {InstalledSAEs.LIMIT} SAEs (the ranks hold that many "
            f"at once), not {len(saes)}"
        )
    for item in saes:
        item.check_engine(info)
    if isinstance(top_k, np.integer):
        top_k = int(top_k)
    check_count("top_k", top_k, 1)
    ids = [one_prompt(tokenizer, text, info.max_model_len, "features")[1] for text in prompts]
    tracked: tuple[int, ...] = ()
    if features is not None:
        if len(saes) != 1:
            raise InvalidRequest("features= names features of one SAE: read one SAE with it")
        many = isinstance(features, (list, tuple, range, np.ndarray))
        tracked = tuple(saes[0].check_feature(f) for f in (features if many else [features]))
    return FeatureRequest(prompts, tuple(ids), tuple(saes), top_k, tracked)


def run(
    model: Model,
    readout: Readout,
    request: FeatureRequest,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
) -> list[list[FeatureResult]]:
    """Read ``request`` in one trace, one invoke per prompt; per prompt, one result per SAE
    (in the request's order). The SAEs must be installed on the ranks already."""
    import nnsight

    reads: dict[int, set[str]] = {}
    for sae in request.saes:
        reads.setdefault(sae.layer, set()).add(sae.site)
    order = sorted(
        {(layer, site) for layer, sites in reads.items() for site in sites},
        key=lambda row: (row[0], _WALK_ORDER.index(row[1])),
    )
    where = [order.index((sae.layer, sae.site)) for sae in request.saes]
    keys = [sae.key for sae in request.saes]
    tracked = torch.tensor(request.tracked, dtype=torch.long)
    layer_list = at(model, readout.layers)
    top_k = request.top_k
    with guard(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in request.prompts:
            with tracer.invoke(prompt):
                streams = walk(readout, layer_list, reads, {})
                found = nnsight.save([])
                for key, index in zip(keys, where):
                    found.append(read_features(key, streams[index], top_k, tracked))
    if len(request.prompts) == 1:
        found = [found]
    return [
        [
            _assemble(model.tokenizer, request, meta, i, sae, stats)
            for sae, stats in zip(request.saes, prompt_stats)
        ]
        for i, prompt_stats in enumerate(found)
    ]


def read_features(
    key: str,
    row: tuple[torch.Tensor, torch.Tensor | None],
    top_k: int,
    tracked: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """On a rank, inside a trace: the statistics of SAE ``key`` on one stream row, on the
    host, the same on every rank."""
    x = stream_of(*row, torch.float32)
    encoded = on_ranks.encode(key, x, gather_ranks)
    ids, acts, l0 = on_ranks.top_features(key, encoded, top_k, gather_ranks)
    recon = on_ranks.decode(key, encoded, gather_ranks)
    out = {
        "top_ids": ids.cpu(),
        "top_acts": acts.cpu(),
        "l0": l0.cpu(),
        "sq_error": (x - recon).square().sum(-1).cpu(),
        "sq_centered": (x - x.mean(0)).square().sum(-1).cpu(),
    }
    if tracked.numel():
        out["tracked_acts"] = on_ranks.activations_of(key, encoded, tracked, gather_ranks).T.cpu()
    return out


def _assemble(
    tokenizer: Tokenizer,
    request: FeatureRequest,
    meta: dict[str, Any],
    index: int,
    sae: SAE,
    stats: dict[str, torch.Tensor],
) -> FeatureResult:
    ids = request.prompt_ids[index]
    if stats["l0"].shape[0] != len(ids):
        raise RuntimeError(
            f"the ranks returned {stats['l0'].shape[0]} positions, expected {len(ids)}: the "
            "engine tokenized the prompt differently from its tokenizer"
        )
    return FeatureResult(
        prompt=request.prompts[index],
        tokens=tuple(tokenizer.decode([i]) for i in ids),
        token_ids=np.array(ids),
        # A position with fewer features on than k lists no feature (-1) past them.
        top_ids=np.where(stats["top_acts"].numpy() > 0, stats["top_ids"].numpy(), -1),
        top_acts=stats["top_acts"].numpy(),
        l0=stats["l0"].round().long().numpy(),
        sq_error=stats["sq_error"].numpy(),
        sq_centered=stats["sq_centered"].numpy(),
        d_model=sae.d_in,
        tracked=np.array(request.tracked, dtype=np.int64),
        tracked_acts=stats["tracked_acts"].numpy() if "tracked_acts" in stats else None,
        meta={**{k: v for k, v in meta.items() if k != "vocab"}, "sae": sae.describe()},
    )


@dataclass(frozen=True)
class FeatureAttributionRequest:
    """A checked feature attribution: one prompt, one SAE, single-token targets."""

    prompt: str
    prompt_ids: tuple[int, ...]
    sae: SAE
    targets: tuple[Any, ...]
    positions: tuple[int, ...] | None
    top_k: int


def build_attribution_request(
    tokenizer: Tokenizer,
    info: ModelInfo,
    prompt: str,
    sae: SAE,
    targets: Any,
    *,
    positions: Any = None,
    top_k: int = 10,
) -> FeatureAttributionRequest:
    """Everything `attribute` needs, checked before any trace."""
    from envoykit.analyses.request import normalise_positions, single_token_target

    (sae,) = as_saes(sae)
    sae.check_engine(info)
    if isinstance(top_k, np.integer):
        top_k = int(top_k)
    check_count("top_k", top_k, 1)
    prompt, ids = one_prompt(tokenizer, prompt, info.max_model_len, "attribute_features")
    wanted = [targets] if isinstance(targets, (str, int, np.integer)) else list(targets)
    if not wanted:
        raise InvalidRequest("attribute_features needs at least one target token, e.g. [' Paris']")
    return FeatureAttributionRequest(
        prompt,
        ids,
        sae,
        tuple(single_token_target(tokenizer, info.vocab, t) for t in wanted),
        normalise_positions(positions, len(ids)),
        top_k,
    )


def attribute(
    model: Model,
    readout: Readout,
    request: FeatureAttributionRequest,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
) -> FeatureAttributionResult:
    """Each SAE feature's direct effect on the targets' logits, in one trace, reduced on the
    ranks (`envoykit.ranks.sae.attribution`); the SAE must be installed there already."""
    import nnsight

    from envoykit.analyses.attribution import attribution_statistics

    sae, n = request.sae, readout.n_layers
    reads: dict[int, set[str]] = {sae.layer: {sae.site}}
    reads.setdefault(n, set()).add("resid")
    last_is_site = (sae.layer, sae.site) == (n, "resid")
    positions = None if request.positions is None else torch.tensor(request.positions)
    target_ids = [t.token_id for t in request.targets]
    logit_scale = float(compat.envoy_module(model).logits_processor.scale)
    key, top_k = sae.key, request.top_k
    with guard(), model.trace(request.prompt, temperature=0.0, max_tokens=1):
        norm = at(model, readout.final_norm)
        head = at(model, readout.unembedding)
        rows = walk(readout, at(model, readout.layers), reads, {})
        site, final = (rows[-1], rows[-1]) if last_is_site else (rows[0], rows[-1])
        x = stream_of(*site, torch.float32)
        stats = attribution_statistics(norm, head, [x], final, positions, target_ids, logit_scale)
        picked = x if positions is None else x[positions.to(x.device)]
        found = on_ranks.attribution(key, picked, stats["directions"], top_k, gather_ranks)
        found["site"] = stats["values"][0]
        found = nnsight.save({name: value.cpu() for name, value in found.items()})
    picked_positions = request.positions or tuple(range(len(request.prompt_ids)))
    return FeatureAttributionResult(
        prompt=request.prompt,
        tokens=tuple(model.tokenizer.decode([request.prompt_ids[p]]) for p in picked_positions),
        positions=np.array(picked_positions),
        target_ids=np.array(target_ids),
        target_labels=tuple(t.label for t in request.targets),
        feature_ids=found["feature_ids"].numpy(),
        effects=found["effects"].numpy(),
        features=found["features"].numpy(),
        error=found["error"].numpy(),
        bias=found["bias"].numpy(),
        site=found["site"].numpy(),
        meta={**{k: v for k, v in meta.items() if k != "vocab"}, "sae": sae.describe()},
    )


def logit_effects(
    model: Model,
    readout: Readout,
    sae: SAE,
    features: Sequence[int],
    k: int,
    meta: dict[str, Any],
    guard: Callable[[], AbstractContextManager],
) -> FeatureLogitsResult:
    """The tokens each feature's decoder direction pushes up and down, alone through the
    final norm and the unembedding (as the lens reads a block's write), reduced on the
    ranks against their vocabulary slices; one trace (its prompt is not read)."""
    import nnsight

    from envoykit.model.readout import normalize

    ids = torch.tensor(list(features), dtype=torch.long)
    key = sae.key
    with guard(), model.trace("The", temperature=0.0, max_tokens=1):
        norm = at(model, readout.final_norm)
        shard = at(model, readout.unembedding).vocab_shard()
        found = on_ranks.logit_effects(
            key,
            ids,
            lambda rows: shard.logits(normalize(norm, rows, None)),
            shard.start,
            k,
            gather_ranks,
        )
        found = nnsight.save({name: value.cpu() for name, value in found.items()})
    decode = model.tokenizer.decode

    def tokens(table: torch.Tensor) -> list[list[str]]:
        return [[decode([int(i)]) for i in row] for row in table]

    return FeatureLogitsResult(
        features=np.array(features),
        top_ids=found["top_ids"].numpy(),
        top_tokens=tokens(found["top_ids"]),
        top_logits=found["top_logits"].numpy(),
        bottom_ids=found["bottom_ids"].numpy(),
        bottom_tokens=tokens(found["bottom_ids"]),
        bottom_logits=found["bottom_logits"].numpy(),
        meta={**{k: v for k, v in meta.items() if k != "vocab"}, "sae": sae.describe()},
    )


def features(
    engine: EngineBase,
    prompt: str | Sequence[str],
    sae: SAE | Sequence[SAE],
    *,
    top_k: int = 16,
    features: Integers | None = None,
) -> Any:
    """SAE features of ``prompt``, each rank encoding its own slice of the features (see
    `envoykit.analyses.features`). ``sae``: an `ek.SAE` or a list of them (read in one
    trace). ``top_k``: features kept per token. ``features``: ids (of one SAE) whose
    activation at every token is returned too (`FeatureResult.activation`).

    Returns a `FeatureResult` (a list of them for a list of SAEs; for a list of prompts,
    a list of those).
    """
    engine.readout.require("SAE features")
    req = build_request(engine.tokenizer, engine.info, prompt, sae, top_k=top_k, features=features)
    engine._require_sites([item.site for item in req.saes])
    for item in req.saes:
        engine._install_sae(item)
    found = run(engine.model, engine.readout, req, engine._result_meta(), engine.exclusive)
    per_prompt = [items if isinstance(sae, (list, tuple)) else items[0] for items in found]
    return per_prompt if isinstance(prompt, (list, tuple)) else per_prompt[0]


def attribute_features(
    engine: EngineBase,
    prompt: str,
    sae: SAE,
    targets: str | int | Sequence[str | int],
    *,
    positions: int | Sequence[int] | None = None,
    top_k: int = 10,
) -> FeatureAttributionResult:
    """Each SAE feature's direct effect on the targets' logits: its activation times
    its decoder row, through the final norm frozen on the final stream (as `attribute`
    does). Returns a `FeatureAttributionResult` of the ``top_k`` features by absolute
    effect per position and target, whose features, error and decoder bias add up to
    the effect of the SAE's site itself."""
    engine.readout.require("feature attribution")
    engine.info.require("attribution")
    req = build_attribution_request(
        engine.tokenizer, engine.info, prompt, sae, targets, positions=positions, top_k=top_k
    )
    sae_module.require(engine, req.sae)
    return attribute(engine.model, engine.readout, req, engine._result_meta(), engine.exclusive)


def feature_logits(
    engine: EngineBase, sae: SAE, features: int | Sequence[int], *, k: int = 10
) -> FeatureLogitsResult:
    """The ``k`` tokens each feature's decoder direction raises and lowers most (its
    logit effects), computed on the ranks against their vocabulary slices: a
    `FeatureLogitsResult`."""
    (sae,) = as_saes(sae)
    # A numpy integer has __array__ too, and is one feature: many means one dimension or more.
    many = isinstance(features, (list, tuple, range)) or np.ndim(features) > 0
    given = features if many and not isinstance(features, int) else [features]
    ids = [sae.check_feature(f) for f in given]
    if not ids:
        raise InvalidRequest("feature_logits needs at least one feature id")
    k = check_count("k", k, 1)
    sae_module.require(engine, sae)
    return logit_effects(
        engine.model,
        engine.readout,
        sae,
        ids,
        min(k, engine.info.vocab),
        engine._result_meta(),
        engine.exclusive,
    )
