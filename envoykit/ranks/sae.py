"""Sparse autoencoders on the ranks, sharded by feature: installed once, applied inside traces.

At TP=N each rank keeps 1/N of an SAE's features (`install`): the encoder's columns, the
decoder's rows, their biases and thresholds; the decoder's bias ``b_dec`` (``d_model``
numbers) is on every rank. The stream is whole on every rank, so each rank encodes its own
features with no exchange. What needs every feature is reduced the way the vocabulary is
(`envoykit.ranks.vocab_parallel`): a TopK SAE's global top-k and the top features per token
from each rank's own top-k candidates, L0 as a sum of counts, a reconstruction as each
rank's partial decode ``acts @ W_dec[slice]`` summed once over the ranks.

The owning engine sends the whole SAE once through vLLM's ``collective_rpc`` (the worker
method `SAEStore.envoykit_install_sae`), each rank keeps its slice and drops the rest, and
trace code names only the SAE's content key. The arithmetic is float32 on the stream's
device, in the order SAELens writes it (``x - b_dec`` when the SAE subtracts it, then
``x @ W_enc + b_enc``, the activation, ``acts @ W_dec + b_dec``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_tensors

from envoykit.model.readout import Addition

Gather = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RankSAE:
    """One rank's slice of an SAE: features ``start .. start + size`` of ``d_sae``."""

    architecture: str  # "relu", "jumprelu" or "topk"
    W_enc: torch.Tensor  # [d_in, size]
    b_enc: torch.Tensor  # [size]
    W_dec: torch.Tensor  # [size, d_in]
    b_dec: torch.Tensor  # [d_in]
    threshold: torch.Tensor | None  # [size], JumpReLU only
    k: int | None  # TopK only: the global number of active features per token
    subtract_b_dec: bool  # SAELens's apply_b_dec_to_input
    normalize: str  # "none", "constant_norm_rescale" or "layer_norm"
    start: int
    size: int
    d_sae: int
    largest: int  # the largest slice any rank holds: every rank sends that many candidates
    on: dict[str, torch.Tensor] = field(default_factory=dict)  # the tensors per device

    def tensor(self, name: str, device: torch.device) -> torch.Tensor:
        """``name`` on ``device`` (moved once per device, then kept)."""
        key = f"{name}@{device}"
        if key not in self.on:
            self.on[key] = getattr(self, name).to(device)
        return self.on[key]


# key -> this rank's slice, in each rank process.
INSTALLED: dict[str, RankSAE] = {}


def feature_slice(d_sae: int, rank: int, ranks: int) -> tuple[int, int]:
    """(start, size) of the features rank ``rank`` of ``ranks`` holds: equal slices of
    ``ceil(d_sae / ranks)``, the last one shorter (or empty)."""
    per = math.ceil(d_sae / ranks)
    start = min(d_sae, rank * per)
    return start, min(d_sae, start + per) - start


def unpack(config: str, blob: bytes, rank: int, ranks: int) -> RankSAE:
    """This rank's slice of the SAE that `envoykit.analyses.sae.SAE.to_wire` packed."""
    spec = json.loads(config)
    tensors = load_tensors(blob)
    d_sae = tensors["b_enc"].shape[0]
    start, size = feature_slice(d_sae, rank, ranks)
    end = start + size
    threshold = tensors.get("threshold")
    return RankSAE(
        architecture=spec["architecture"],
        W_enc=tensors["W_enc"][:, start:end].contiguous(),
        b_enc=tensors["b_enc"][start:end].contiguous(),
        W_dec=tensors["W_dec"][start:end].contiguous(),
        b_dec=tensors["b_dec"].clone(),
        threshold=None if threshold is None else threshold[start:end].contiguous(),
        k=spec.get("k"),
        subtract_b_dec=bool(spec["apply_b_dec_to_input"]),
        normalize=spec["normalize_activations"],
        start=start,
        size=size,
        d_sae=d_sae,
        largest=feature_slice(d_sae, 0, ranks)[1],
    )


class SAEStore:
    """Worker mixin: the RPC that installs an SAE's slice in this rank's `INSTALLED`."""

    def envoykit_install_sae(
        self, key: str, config: str, blob: bytes, keep: tuple[str, ...] = ()
    ) -> int:
        """Install this rank's slice of SAE ``key`` and drop every other SAE but ``keep``:
        the owning engine decides what its ranks hold. Returns the slice's bytes."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        for other in [k for k in INSTALLED if k != key and k not in keep]:
            del INSTALLED[other]
        if key not in INSTALLED:
            rank = get_tensor_model_parallel_rank()
            ranks = get_tensor_model_parallel_world_size()
            INSTALLED[key] = unpack(config, blob, rank, ranks)
        return slice_bytes(INSTALLED[key])


def slice_bytes(sae: RankSAE) -> int:
    """The bytes of the tensors a rank holds of an SAE."""
    tensors = [sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, sae.threshold]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# -- inside a trace, on every rank ------------------------------------------------------------


def normalized(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAELens's run-time normalisation of an SAE's input ``[T, d_in]``: the normalised
    input, and the ``scale`` and ``shift`` ``[T, 1]`` that map a reconstruction back
    (``out * scale + shift``). "constant_norm_rescale" scales each token to norm
    ``sqrt(d_in)``; "layer_norm" subtracts each token's mean and divides by its (unbiased)
    standard deviation plus 1e-5, mapping back by the deviation alone, as SAELens does;
    "none" leaves it."""
    one = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    if mode == "constant_norm_rescale":
        norm = x.norm(dim=-1, keepdim=True)
        return x * (x.shape[-1] ** 0.5 / norm), norm / x.shape[-1] ** 0.5, one * 0
    if mode == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        centered = x - mu
        std = centered.std(-1, keepdim=True)
        return centered / (std + 1e-5), std, mu
    return x, one, one * 0


@dataclass
class Encoded:
    """This rank's features of a block of tokens: ``acts`` ``[T, size]`` (zero where a
    feature is off), and how a reconstruction maps back to the stream (``out * scale +
    shift``; 1 and 0 unless the SAE normalises its input)."""

    acts: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor


def encode(key: str, stream: torch.Tensor, gather: Gather) -> Encoded:
    """This rank's feature activations of ``stream`` ``[T, d_in]`` (float32). A TopK SAE
    keeps the k largest pre-activations over every rank's features (one exchange of each
    rank's k candidates), then applies ReLU, as SAELens's and sparsify's TopK do."""
    sae = INSTALLED[key]
    x, scale, shift = normalized(stream.float(), sae.normalize)
    device = x.device
    if sae.subtract_b_dec:
        x = x - sae.tensor("b_dec", device)
    pre = x @ sae.tensor("W_enc", device) + sae.tensor("b_enc", device)
    if sae.architecture == "topk":
        return Encoded(_global_topk(sae, pre, gather).relu(), scale, shift)
    acts = pre.relu()
    if sae.architecture == "jumprelu":
        acts = acts * (pre > sae.tensor("threshold", device))
    return Encoded(acts, scale, shift)


def _global_topk(sae: RankSAE, pre: torch.Tensor, gather: Gather) -> torch.Tensor:
    """``pre`` with every entry outside the k largest over all ranks' features zeroed."""
    assert sae.k is not None  # a TopK SAE is installed with its k (checked on the client)
    k = int(sae.k)
    values, ids = _candidates(pre, k, sae.start)
    every = gather(torch.cat([values, ids.to(values.dtype)], dim=-1))  # [ranks, T, 2k]
    candidates, candidate_ids = _columns(every, k, 2)
    picked = candidate_ids.gather(-1, candidates.topk(k, dim=-1).indices).long()
    if sae.size == 0:  # a rank with no features of its own (more ranks than features)
        return pre
    local = picked - sae.start
    mine = (local >= 0) & (local < sae.size)
    # A count of the picks per feature, not a boolean index: no shape that depends on the
    # data, so no wait for the device, and the others' picks (clamped) add nothing.
    hits = torch.zeros_like(pre, dtype=torch.int32)
    hits.scatter_add_(-1, local.clamp(0, sae.size - 1), mine.to(torch.int32))
    return pre * (hits > 0)


def _candidates(values: torch.Tensor, k: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k largest ``values`` per row and their global ids, padded with -inf
    where it holds fewer than k (every rank sends k candidates: a collective's shapes
    match). Ids travel as float32: exact below 2**24 features."""
    top, ids = values.topk(min(k, values.shape[-1]), dim=-1)
    if top.shape[-1] < k:
        short = (*top.shape[:-1], k - top.shape[-1])
        top = torch.cat([top, top.new_full(short, -torch.inf)], dim=-1)
        ids = torch.cat([ids, ids.new_zeros(short)], dim=-1)
    return top, ids + start


def _columns(every: torch.Tensor, k: int, n: int) -> list[torch.Tensor]:
    """The first ``n`` blocks of ``k`` columns of a gather ``[ranks, ..., n * k (+ more)]``,
    each as ``[..., ranks * k]``: every rank's candidates side by side, for a top-k over
    them."""
    return [every[..., i * k : (i + 1) * k].movedim(0, -2).flatten(-2) for i in range(n)]


def decode(key: str, encoded: Encoded, gather: Gather) -> torch.Tensor:
    """The whole reconstruction ``[T, d_in]`` (float32) on every rank: the ranks' partial
    decodes summed, plus ``b_dec``, mapped back where the SAE normalised its input."""
    sae = INSTALLED[key]
    device = encoded.acts.device
    partial = encoded.acts @ sae.tensor("W_dec", device)
    whole = gather(partial).sum(0) + sae.tensor("b_dec", device)
    return whole * encoded.scale + encoded.shift


def top_features(
    key: str, encoded: Encoded, top_k: int, gather: Gather
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: the ``top_k`` most active features over every rank (ids ``[T, k]``
    int64, activations ``[T, k]`` float32, largest first) and L0 ``[T]`` (features on)."""
    sae = INSTALLED[key]
    k = min(top_k, sae.d_sae)
    values, ids = _candidates(encoded.acts, k, sae.start)
    count = (encoded.acts > 0).sum(-1, keepdim=True).to(values.dtype)
    every = gather(torch.cat([values, ids.to(values.dtype), count], dim=-1))
    candidates, candidate_ids = _columns(every, k, 2)
    top, picked = candidates.topk(k, dim=-1)
    return candidate_ids.gather(-1, picked).long(), top, every[..., -1].sum(0)


def activations_of(
    key: str, encoded: Encoded, features: torch.Tensor, gather: Gather
) -> torch.Tensor:
    """The activations ``[T, len(features)]`` of the given global feature ids, from the
    rank that holds each (the others send zero)."""
    sae = INSTALLED[key]
    local = features.to(encoded.acts.device) - sae.start
    mine = (local >= 0) & (local < sae.size)
    held = encoded.acts[:, local.clamp(0, max(sae.size - 1, 0))] * mine
    return gather(held).sum(0)


def decoder_rows(key: str, features: torch.Tensor, device: torch.device, gather: Gather):
    """The decoder rows ``[len(features), d_in]`` of the given global feature ids, whole on
    every rank (each row from the rank that holds it)."""
    sae = INSTALLED[key]
    local = features.to(device) - sae.start
    mine = (local >= 0) & (local < sae.size)
    rows = sae.tensor("W_dec", device)[local.clamp(0, max(sae.size - 1, 0))] * mine.unsqueeze(-1)
    return gather(rows).sum(0)


@dataclass(frozen=True)
class SAEEdit(Addition):
    """An SAE's edit of the stream at ``cell``, made on every rank alike (an `Addition`, so
    it goes wherever a steer goes: the prompt's pass and every generated token's).

    ``clamps`` empty: a splice, the stream replaced by the SAE's reconstruction (with
    ``keep_error``, plus the SAE's error ``x - x_hat``, which changes nothing on its own and
    keeps the model exact around clamps). ``clamps`` ``((feature, value), ...)``: those
    features set to ``value``, the stream becoming ``x + (value - a_f) * W_dec[f]``.
    """

    key: str = ""
    clamps: tuple[tuple[int, float], ...] = ()
    keep_error: bool = False

    def apply(self, first: torch.Tensor, second: torch.Tensor | None) -> None:
        from envoykit.model.envoys import gather_ranks

        rows = slice(None) if self.positions is None else list(self.positions)
        stream = first[rows].float() if second is None else first[rows].float() + second[rows]
        encoded = encode(self.key, stream, gather_ranks)
        if self.clamps:
            ids = torch.tensor([f for f, _ in self.clamps], device=stream.device)
            wanted = torch.tensor([v for _, v in self.clamps], device=stream.device)
            current = activations_of(self.key, encoded, ids, gather_ranks)
            directions = decoder_rows(self.key, ids, stream.device, gather_ranks)
            edited = stream + ((wanted - current) * encoded.scale) @ directions
        else:
            edited = decode(self.key, encoded, gather_ranks)
            if self.keep_error:
                edited = edited + (stream - edited)
        first[rows] = edited.to(first.dtype)
        if second is not None:
            second[rows] = 0


def attribution(
    key: str,
    stream: torch.Tensor,
    directions: torch.Tensor,
    top_k: int,
    gather: Gather,
) -> dict[str, torch.Tensor]:
    """Each feature's direct effect on the targets' logits from the SAE's site ``stream``
    ``[P, d]`` (the picked positions): ``a_f * W_dec[f] . direction``, with ``directions``
    ``[P, targets, d]`` what a write into the stream is dotted with (the frozen final norm
    and the targets' unembedding rows, `envoykit.analyses.attribution`). Returns, the same
    on every rank, the ``top_k`` features by absolute effect per (position, target) (ids and
    effects ``[P, targets, k]``), and ``features`` (all of them), ``error`` (``x - x_hat``)
    and ``bias`` (``b_dec``, mapped back like a reconstruction) ``[P, targets]``, which add
    up to the site's own effect."""
    sae = INSTALLED[key]
    encoded = encode(key, stream, gather)
    device = stream.device
    # [P, features, targets]: this rank's features, each scaled back to the stream.
    per_row = torch.einsum("fd,pnd->pfn", sae.tensor("W_dec", device), directions)
    effects = encoded.acts.unsqueeze(-1) * encoded.scale.unsqueeze(-1) * per_row
    k = min(top_k, sae.d_sae)
    flat = effects.movedim(1, -1)  # [P, targets, features]
    mine = min(k, sae.size)
    top = flat.abs().topk(mine, dim=-1).indices
    values = flat.gather(-1, top)
    magnitudes = values.abs()
    picked = top
    if mine < k:  # a slice smaller than k: every rank sends k candidates
        short = (*values.shape[:-1], k - mine)
        values = torch.cat([values, values.new_zeros(short)], -1)
        magnitudes = torch.cat([magnitudes, magnitudes.new_full(short, -torch.inf)], -1)
        picked = torch.cat([picked, picked.new_zeros(short)], -1)
    every = gather(
        torch.cat(
            [magnitudes, values, (picked + sae.start).float(), flat.sum(-1, keepdim=True)], -1
        )
    )
    candidates, signed, ids = _columns(every, k, 3)
    order = candidates.topk(k, dim=-1).indices
    recon = decode(key, encoded, gather)
    bias = sae.tensor("b_dec", device) * encoded.scale + encoded.shift  # [P, d]
    return {
        "feature_ids": ids.gather(-1, order).long(),
        "effects": signed.gather(-1, order),
        "features": every[..., -1].sum(0),
        "error": torch.einsum("pd,pnd->pn", stream.float() - recon, directions),
        "bias": torch.einsum("pd,pnd->pn", bias, directions),
    }


def logit_effects(
    key: str,
    features: torch.Tensor,
    logits: Callable[[torch.Tensor], torch.Tensor],
    start: int,
    k: int,
    gather: Gather,
) -> dict[str, torch.Tensor]:
    """The ``k`` tokens each feature's decoder direction raises most and lowers most:
    ``logits`` (this rank's vocabulary slice of a row through the final norm and the
    unembedding; its first token id ``start``) of the features' rows, merged over the
    ranks. Ids and logits ``[features, k]``, largest first and smallest first."""
    device = features.device
    rows = decoder_rows(key, features, device, gather)
    found = {}
    for side, sign in (("top", 1.0), ("bottom", -1.0)):
        values, ids = _candidates(sign * logits(rows).float(), k, start)
        every = gather(torch.cat([values, ids.float()], -1))
        candidates, candidate_ids = _columns(every, k, 2)
        best, picked = candidates.topk(k, dim=-1)
        found[f"{side}_ids"] = candidate_ids.gather(-1, picked).long()
        found[f"{side}_logits"] = sign * best
    return found
