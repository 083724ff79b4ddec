"""The logit lens over a corpus: per layer, how far its prediction is from the model's own,
and how good it is, summed on the ranks.

Each trace prefills a batch of documents (`envoykit.analyses.corpus.batches`). On the ranks,
every piece goes through the lens's own reduction (`envoykit.ranks.lens.lens_statistics`:
one head GEMM per rank on its vocabulary slice, top-k, entropy and KL to the final layer), and
then through four sums over its positions, per layer: KL(final ‖ layer), entropy, whether the
final layer's top-1 is among the layer's top-k, and whether the actual next token is. Only
those ``4 × layers`` numbers per piece come back. The client adds a document's pieces up;
`envoykit.results.corpus` turns the per-document sums into means with bootstrap intervals.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit import _compat as compat
from envoykit._compat import Model, Tokenizer
from envoykit.analyses import corpus, request
from envoykit.analyses.corpus import Piece, batches, pieces
from envoykit.analyses.lens_run import computed_rows
from envoykit.analyses.request import Documents, LayerSpec
from envoykit.errors import InvalidRequest
from envoykit.model.envoys import vocab_shard_of
from envoykit.model.readout import Readout, at, walk
from envoykit.ranks import grouped
from envoykit.ranks.cancel import LensCancelled, cancel_message, flag_seen
from envoykit.ranks.lens import DEFAULT_MEMORY_BUDGET, lens_messages, statistics_of
from envoykit.ranks.translators import translated
from envoykit.ranks.vocab_parallel import flag_up
from envoykit.results.corpus import STATISTICS

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.analyses.tuned import TunedLens
    from envoykit.results.corpus import CorpusLensResult


# Documents' positions whose lenses the ranks combine in one exchange (`envoykit.ranks.grouped`):
# 8 exchanges instead of 64 for 64 documents of 128 tokens. A cancel is agreed on at each
# exchange, so a group is also how much work a cancel may wait for.
GROUP_POSITIONS = 1024


def piece_sums(
    model: Model,
    readout: Readout,
    batch: Sequence[Piece],
    layers: Sequence[int],
    top_k: int,
    translator: str | None,
    guard: Callable[[], AbstractContextManager],
    budget: int = DEFAULT_MEMORY_BUDGET,
    cancel: str | None = None,
) -> list[torch.Tensor]:
    """One trace over ``batch``: per piece ``[4, len(layers)]`` float64, the `STATISTICS` over its
    positions at each of ``layers`` (accuracy over all but its last position, whose next
    token is not in the piece). ``cancel``: the cancel key the ranks look for in each
    invoke and agree on in each group's exchange."""
    import nnsight

    rows = computed_rows([(layer, "resid") for layer in layers], readout.n_layers)
    keep = torch.tensor([rows.index((layer, "resid")) for layer in layers])
    reads = {layer: {"resid"} for layer, _ in rows}
    groups = _groups(batch)
    # The ranks find their own modules from the interleaver, which travels as a reference:
    # each invoke's code is pickled on its own, envoys with everything below them
    # (`envoykit.analyses.collect.activations`).
    interleaver = compat.interleaver_by_reference(model)
    with guard(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for piece, (group, index, size) in zip(batch, groups):
            following = torch.tensor(piece.ids[1:], dtype=torch.long)
            with tracer.invoke(list(piece.ids)):
                root = compat.rank_root(interleaver)
                norm = compat.envoy_module(at(root, readout.final_norm))
                shard = vocab_shard_of(compat.envoy_module(root))
                streams = walk(readout, at(root, readout.layers), reads, {})
                if translator is not None:
                    streams = translated(streams, rows, translator, readout.n_layers)
                seen = cancel is not None and flag_seen(cancel)
                local = lens_messages(norm, shard, streams, top_k, seen, budget, fused=True)
                parts = grouped.arrive(group, index, size, (local, following))
                found = torch.empty(0, 4, len(layers), dtype=torch.float64)
                if parts is not None:
                    found = _group_sums(shard, parts, top_k, keep, cancel)
                out = nnsight.save(found)
    saved = out if len(batch) > 1 else [out]
    return _by_piece(saved, groups)


def _groups(batch: Sequence[Piece]) -> list[tuple[str, int, int]]:
    """Per piece of ``batch``: its group's key, its index in the group and the group's size;
    consecutive pieces up to `GROUP_POSITIONS` positions (a longer piece alone)."""
    spans: list[list[int]] = []
    positions = GROUP_POSITIONS
    for i, piece in enumerate(batch):
        if positions + len(piece.ids) > GROUP_POSITIONS:
            spans.append([])
            positions = 0
        spans[-1].append(i)
        positions += len(piece.ids)
    trace = uuid.uuid4().hex
    return [(f"{trace}-{g}", i, len(s)) for g, s in enumerate(spans) for i in range(len(s))]


def _group_sums(
    shard: Any,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    top_k: int,
    keep: torch.Tensor,
    cancel: str | None,
) -> torch.Tensor:
    """On a rank, for the invoke that completes a group: one exchange of the group's
    messages, and per piece ``[pieces, 4, layers]`` the `STATISTICS` summed over its
    positions."""
    every = shard.gather(torch.cat([local for local, _ in parts], dim=1))
    if cancel is not None and flag_up(every):
        raise LensCancelled(cancel_message(cancel))
    stats = statistics_of(every, top_k)
    found = []
    start = 0
    for local, following in parts:
        span = slice(start, start + local.shape[1])
        start = span.stop
        top = stats["top_ids"][:, span].long()
        final = top[-1, :, :1]
        agree = (top == final.unsqueeze(0)).any(-1).double().sum(1)
        hits = top[:, :-1, :] == following.to(top.device).view(1, -1, 1)
        sums = torch.stack(
            [
                stats["kl"][:, span].double().sum(1),
                stats["entropy"][:, span].double().sum(1),
                agree,
                hits.any(-1).double().sum(1),
            ]
        )
        found.append(sums[:, keep.to(sums.device)])
    return torch.stack(found).cpu()


def _by_piece(
    saved: Sequence[torch.Tensor], groups: list[tuple[str, int, int]]
) -> list[torch.Tensor]:
    """Each piece's sums from the invokes' saves: a group's sums, in its order, come from
    whichever of its invokes completed it on the ranks."""
    by_group: dict[str, torch.Tensor] = {}
    for found, (group, _, _) in zip(saved, groups):
        if len(found):
            by_group[group] = found
    return [by_group[group][index] for group, index, _ in groups]


def run(
    model: Model,
    readout: Readout,
    tokenizer: Tokenizer,
    texts: Iterable[str],
    layers: Sequence[int],
    top_k: int,
    translator: str | None,
    max_length: int,
    batch_tokens: int,
    vocab: int,
    guard: Callable[[], AbstractContextManager],
    progress: Any,
    cancel: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per document ``[documents, layers, 4]`` the `STATISTICS` and ``[documents, 2]`` how many
    positions they are over (all, and those with a next token); ``progress`` counts tokens,
    ``cancel`` is the key that stops the batch in flight on the ranks."""
    sums: list[np.ndarray] = []
    counts: list[list[int]] = []
    for batch in batches(pieces(tokenizer, texts, max_length, vocab), batch_tokens):
        found = piece_sums(model, readout, batch, layers, top_k, translator, guard, cancel=cancel)
        for piece, value in zip(batch, found):
            while len(sums) <= piece.doc:  # a document with no tokens is dropped below
                sums.append(np.zeros((len(layers), len(STATISTICS))))
                counts.append([0, 0])
            sums[piece.doc] += value.numpy().T
            counts[piece.doc][0] += len(piece.ids)
            counts[piece.doc][1] += len(piece.ids) - 1
        progress.update(sum(len(piece.ids) for piece in batch))
        progress.set_postfix(documents=batch[-1].doc + 1, refresh=False)
    found_counts = np.array(counts, dtype=np.int64).reshape(-1, 2)
    has_tokens = found_counts[:, 0] > 0
    found_sums = np.array(sums).reshape(-1, len(layers), len(STATISTICS))
    return found_sums[has_tokens], found_counts[has_tokens]


def lens_corpus(
    engine: EngineBase,
    texts: Documents,
    *,
    layers: LayerSpec = None,
    top_k: int = 1,
    translator: TunedLens | None = None,
    max_length: int | None = None,
    batch_tokens: int = 4096,
    confidence: float = 0.95,
    n_boot: int = 1000,
    seed: int = 0,
    progress: bool = True,
) -> CorpusLensResult:
    """The logit lens over a corpus: per layer, mean KL(final ‖ layer), mean entropy,
    top-k agreement with the final layer and top-k accuracy against the actual next
    token, with bootstrap intervals over documents (`CorpusLensResult`). Many documents
    per trace; only four sums per layer and document come back from the ranks.

    ``texts``, ``max_length``, ``batch_tokens``: as in `collect`. ``layers``: as in `lens`.
    ``translator``: a `TunedLens` of this model (the tuned lens's statistics).
    ``progress``: as in `collect`. ``engine.cancel(thread)`` from another thread stops it
    inside the batch in flight, as it stops a lens, and it raises `ek.Cancelled`.
    """
    from envoykit.results.corpus import CorpusLensResult

    info = engine.info
    engine.readout.require("the lens")
    picked = request.normalise_layers(layers, info.n_layers)
    top_k = request.check_count("top_k", top_k, minimum=1)
    if top_k > info.vocab:
        raise InvalidRequest(f"top_k={top_k} exceeds the vocabulary size ({info.vocab})")
    n_boot = request.check_count("n_boot", n_boot, minimum=1)
    if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise InvalidRequest(f"confidence lies in (0, 1), not {confidence!r}")
    length = corpus.check_max_length(max_length, info.max_model_len)
    batch = request.check_count("batch_tokens", batch_tokens, minimum=1)
    documents = corpus.documents(texts)
    total = corpus.total_tokens(engine.tokenizer, texts, info.vocab)
    meta, key = _meta_and_key(engine, translator)
    cancellable = engine._cancellable("the corpus lens")
    with cancellable as (cancel, guard), corpus.progress_bar(progress, "corpus lens", total) as bar:
        sums, counts = run(
            engine.model,
            engine.readout,
            engine.tokenizer,
            documents,
            picked,
            top_k,
            key,
            length,
            batch,
            info.vocab,
            guard,
            bar,
            cancel,
        )
    if not len(counts):
        raise InvalidRequest("the corpus tokenizes to no tokens: its documents are all empty")
    return CorpusLensResult(
        layers=np.array(picked),
        top_k=top_k,
        document_sums=sums,
        document_counts=counts,
        confidence=confidence,
        n_boot=n_boot,
        seed=seed,
        meta={"lens": "logit", **meta},
    )


def _meta_and_key(
    engine: EngineBase, translator: TunedLens | None
) -> tuple[dict[str, Any], str | None]:
    """The results' meta and the key of ``translator`` once installed on the ranks (None, and
    the logit lens's meta, without one)."""
    meta = engine._result_meta()
    meta.pop("vocab")
    if translator is None:
        return meta, None
    key = engine._install_translator(translator)
    meta.update(lens="tuned", translator=key)
    return meta, key
