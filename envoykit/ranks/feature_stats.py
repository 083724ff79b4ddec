"""Feature statistics of a corpus on the ranks, sharded by feature as the SAE is.

Inside a corpus trace every rank encodes each piece with its own slice of the SAE
(`envoykit.ranks.sae.encode`) and folds it into a per-trace tally kept in the rank's process
(`fold`): per feature how often it fired, the sum of its activations, a histogram of them,
and its largest activation in the piece as a context candidate, with a window of the
piece's tokens and the feature's activation at each. A candidate is kept only where it beats
the feature's current ``n``-th best context, which the client sends with the trace, so after
the first traces few candidates survive. A second, one-token trace (`flush`) merges every
rank's tally, each rank's candidates cut to ``n`` per feature first, and hands it back; the
client folds it into its running statistics. What a rank holds is one trace's tally, and
what comes back is ``O(d_sae * (bins + n * window))`` at most, whatever the corpus's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from envoykit.ranks.sae import INSTALLED, Gather, encode

# Histogram bins of an activation: log-spaced from 1e-3 to 1e3 (activations below and above
# fall in the first and last bin), the same for every feature, so tallies merge by addition.
EDGES = torch.logspace(-3, 3, 49, dtype=torch.float64)


@dataclass
class Tally:
    """One rank's statistics of its features over the pieces of one trace."""

    count: torch.Tensor  # [size] int64: tokens where the feature fired
    total: torch.Tensor  # [size] float64: the sum of its activations
    histogram: torch.Tensor  # [size, bins] int64
    candidates: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def empty(cls, size: int) -> Tally:
        return cls(
            torch.zeros(size, dtype=torch.int64),
            torch.zeros(size, dtype=torch.float64),
            torch.zeros(size, len(EDGES) - 1, dtype=torch.int64),
        )


# run -> this rank's tally of the trace in flight, in each rank process.
TALLIES: dict[str, Tally] = {}


def window_offsets(window: int) -> torch.Tensor:
    """Positions of a context's tokens relative to its focus token: three quarters before
    it (the model reads left to right), the rest after."""
    before = window - window // 4 - 1
    return torch.arange(window) - before


def fold(
    run: str,
    key: str,
    stream: torch.Tensor,
    token_ids: torch.Tensor,
    document: int,
    start: int,
    threshold: torch.Tensor,
    window: int,
    gather: Gather,
) -> None:
    """Add one piece (``stream`` ``[T, d_in]``, its ``token_ids`` ``[T]``, tokens ``start ..``
    of ``document``) to this rank's tally for ``run``. ``threshold`` ``[d_sae]``: the
    activation a feature's context must beat to be a candidate."""
    sae = INSTALLED[key]
    acts = encode(key, stream.float(), gather).acts
    for other in [name for name in TALLIES if name != run]:  # an interrupted run's
        del TALLIES[other]
    if run not in TALLIES:
        TALLIES[run] = Tally.empty(sae.size)
    tally = TALLIES[run]
    fired = acts > 0
    tally.count += fired.sum(0).cpu()
    tally.total += acts.double().sum(0).cpu()
    rows, features = fired.nonzero(as_tuple=True)
    values = acts[rows, features].double().cpu()
    bins = torch.bucketize(values, EDGES[1:-1])
    bins_per_feature = tally.histogram.shape[1]
    flat = tally.histogram.view(-1)
    flat.index_add_(0, features.cpu() * bins_per_feature + bins, torch.ones_like(bins))
    best, where = acts.max(0)
    mine = threshold[sae.start : sae.start + sae.size].to(best.device)
    picked = ((best > 0) & (best > mine)).nonzero().squeeze(1)
    if not picked.numel():
        return
    positions = where[picked].unsqueeze(1) + window_offsets(window).to(picked.device)
    inside = (positions >= 0) & (positions < acts.shape[0])
    at = positions.clamp(0, acts.shape[0] - 1)
    ids = token_ids.to(at.device)[at]
    tally.candidates.append(
        {
            "feature": (picked + sae.start).cpu(),
            "activation": best[picked].float().cpu(),
            "document": torch.full((picked.numel(),), document, dtype=torch.int64),
            "position": (where[picked] + start).cpu(),
            # (+ 0.0: a TopK feature that is off holds -0.0, shown as "-0")
            "window_acts": torch.where(inside, acts[at, picked.unsqueeze(1)] + 0.0, 0.0).cpu(),
            "window_ids": torch.where(inside, ids, -1).cpu(),
        }
    )


def flush(
    run: str, key: str, n: int, window: int, device: torch.device, gather: Gather
) -> dict[str, torch.Tensor]:
    """Every rank's tally of ``run`` merged (exchanged on ``device``), on the host, and this
    rank's dropped: ``count``/``total`` ``[d_sae]``, ``histogram`` ``[d_sae, bins]``, and the
    candidates (at most ``n`` per feature from each rank, best first), side by side."""

    def gathered(value: torch.Tensor) -> torch.Tensor:
        return gather(value.to(device)).cpu()

    sae = INSTALLED[key]
    tally = TALLIES.pop(run, None)
    if tally is None:  # no piece reached this rank's fold (an empty trace)
        tally = Tally.empty(sae.size)
    out = {
        name: _padded_gather(getattr(tally, name), sae.largest, gathered)[: sae.d_sae]
        for name in ("count", "total", "histogram")
    }
    out.update(_best_candidates(tally.candidates, n, window, gathered))
    return out


def _padded_gather(value: torch.Tensor, largest: int, gather: Gather) -> torch.Tensor:
    """Each rank's ``value`` ``[size, ...]`` padded to ``largest`` rows, gathered and laid end
    to end: the ranks' slices in feature order."""
    short = largest - value.shape[0]
    if short:
        value = torch.cat([value, value.new_zeros(short, *value.shape[1:])])
    return gather(value).flatten(0, 1)


def _best_candidates(
    candidates: list[dict[str, torch.Tensor]], n: int, window: int, gather: Gather
) -> dict[str, torch.Tensor]:
    """This rank's candidates cut to the ``n`` best per feature (ties: the earlier piece
    first), then every rank's, in two exchanges (how many each has, then the padded lot)."""
    if candidates:
        merged = {name: torch.cat([c[name] for c in candidates]) for name in candidates[0]}
        order = torch.sort(merged["activation"], descending=True, stable=True).indices
        order = order[torch.sort(merged["feature"][order], stable=True).indices]
        features = merged["feature"][order]
        first = torch.searchsorted(features, features)
        keep = order[torch.arange(len(order)) - first < n]
        mine = {name: value[keep] for name, value in merged.items()}
    else:
        mine = {}
    counts = gather(torch.tensor([len(mine.get("feature", ()))], dtype=torch.int64))
    most = int(counts.max())
    out: dict[str, torch.Tensor] = {}
    for name, dtype in (
        ("feature", torch.int64),
        ("activation", torch.float32),
        ("document", torch.int64),
        ("position", torch.int64),
        ("window_acts", torch.float32),
        ("window_ids", torch.int64),
    ):
        width = (window,) if name.startswith("window") else ()
        value = mine.get(name, torch.zeros(0, *width, dtype=dtype))
        if not most:  # no rank has one: nothing to exchange
            out[name] = value
            continue
        padded = torch.cat([value, value.new_zeros(most - len(value), *value.shape[1:])])
        every = gather(padded)
        out[name] = torch.cat([every[r, : int(counts[r])] for r in range(len(counts))])
    return out
