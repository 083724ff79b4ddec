"""Feature statistics over a corpus: every feature's firing frequency, mean and maximum
activation, histogram and max-activating contexts, in one pass of many documents per trace.

Each trace prefills a batch of documents (`envoykit.analyses.corpus.batches`); on the ranks
each rank folds every piece into a tally of its own slice of the features
(`envoykit.ranks.feature_stats`), and a one-token trace after it brings the merged tally
back. The client keeps the running statistics (`Running`): sums, histograms, and the ``n``
best contexts per feature, so memory is ``O(d_sae * n * window)`` whatever the corpus's size.
With ``out=`` the state is written to a store (`envoykit.results.feature_stats`) after the
first trace and then every `CHECKPOINT_SECONDS`, so a rerun after an interrupt or a killed
kernel continues from the last write.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit import _compat as compat
from envoykit._compat import Model, Tokenizer
from envoykit.analyses import sae as sae_module
from envoykit.analyses.collect import ChainedTexts
from envoykit.analyses.corpus import Piece, batches, check_max_length, pieces
from envoykit.analyses.request import Documents, check_count
from envoykit.analyses.sae import SAE
from envoykit.errors import InvalidRequest
from envoykit.model.envoys import gather_ranks
from envoykit.model.readout import Readout, at, stream_of, walk
from envoykit.ranks import feature_stats as on_ranks
from envoykit.results.feature_stats import ARRAYS, FeatureStats, StatsWriter

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.runtime.info import ModelInfo

# How often a run's state is written to its store (and once after the first trace).
CHECKPOINT_SECONDS = 10.0
# The most contexts and the widest window a request may ask for: what comes back per trace
# grows with their product times the SAE's width.
MAX_CONTEXTS = 100
MAX_WINDOW = 128


@dataclass(frozen=True)
class StatsRequest:
    """A checked request: the SAE, how many contexts per feature and how wide."""

    sae: SAE
    contexts: int
    window: int
    max_length: int
    batch_tokens: int


def build_request(
    info: ModelInfo,
    sae: SAE,
    *,
    contexts: Any = 20,
    window: Any = 16,
    max_length: Any = None,
    batch_tokens: Any = 4096,
) -> StatsRequest:
    """Everything `run` needs, checked before any trace."""
    if not isinstance(sae, SAE):
        raise InvalidRequest(f"feature_stats reads one ek.SAE, not {type(sae).__name__}")
    sae.check_engine(info)
    contexts = check_count("contexts", contexts, 1)
    window = check_count("window", window, 1)
    if contexts > MAX_CONTEXTS or window > MAX_WINDOW:
        raise InvalidRequest(
            f"contexts is at most {MAX_CONTEXTS} and window at most {MAX_WINDOW}, not "
            f"{contexts} and {window}"
        )
    length = check_max_length(max_length, info.max_model_len)
    batch = check_count("batch_tokens", batch_tokens, 1)
    return StatsRequest(sae, contexts, window, length, batch)


class Running:
    """The statistics so far, on the client: the arrays of a `FeatureStats`, updated in
    place by each trace's merged tally."""

    def __init__(self, arrays: dict[str, np.ndarray], tokens: int, documents: int) -> None:
        self.arrays, self.tokens, self.documents = arrays, tokens, documents

    @classmethod
    def empty(cls, d_sae: int, contexts: int, window: int) -> Running:
        bins = len(on_ranks.EDGES) - 1
        arrays = {
            "fired": np.zeros(d_sae, np.int64),
            "activation_sum": np.zeros(d_sae, np.float64),
            "histograms": np.zeros((d_sae, bins), np.int64),
            "edges": on_ranks.EDGES.numpy().copy(),
            "top_acts": np.zeros((d_sae, contexts), np.float32),
            "top_documents": np.full((d_sae, contexts), -1, np.int64),
            "top_positions": np.full((d_sae, contexts), -1, np.int64),
            "window_acts": np.zeros((d_sae, contexts, window), np.float32),
            "window_ids": np.full((d_sae, contexts, window), -1, np.int64),
        }
        return cls(arrays, 0, 0)

    def threshold(self) -> torch.Tensor:
        """``[d_sae]`` what a new context must beat: each feature's last kept activation
        (0 while it has fewer than ``n``)."""
        last = self.arrays["top_acts"][:, -1]
        return torch.from_numpy(np.where(self.arrays["top_documents"][:, -1] >= 0, last, 0))

    def add(self, tally: dict[str, torch.Tensor]) -> None:
        """Fold one trace's merged tally in."""
        a = self.arrays
        a["fired"] += tally["count"].numpy()
        a["activation_sum"] += tally["total"].numpy()
        a["histograms"] += tally["histogram"].numpy()
        new = {name: value.numpy() for name, value in tally.items() if name not in _SUMS}
        if not len(new["feature"]):
            return
        touched = np.unique(new["feature"])
        n = a["top_acts"].shape[1]
        held = a["top_documents"][touched] >= 0
        pool = {
            "feature": np.concatenate([np.repeat(touched, n)[held.ravel()], new["feature"]]),
            "activation": np.concatenate([a["top_acts"][touched][held], new["activation"]]),
            "document": np.concatenate([a["top_documents"][touched][held], new["document"]]),
            "position": np.concatenate([a["top_positions"][touched][held], new["position"]]),
            "window_acts": np.concatenate([a["window_acts"][touched][held], new["window_acts"]]),
            "window_ids": np.concatenate([a["window_ids"][touched][held], new["window_ids"]]),
        }
        # Per feature, best first; ties: the earlier document, then the earlier position.
        order = np.lexsort((pool["position"], pool["document"], -pool["activation"]))
        order = order[np.argsort(pool["feature"][order], kind="stable")]
        features = pool["feature"][order]
        slot = np.arange(len(order)) - np.searchsorted(features, features)
        keep, slot = order[slot < n], slot[slot < n]
        rows = pool["feature"][keep]
        a["top_acts"][touched], a["top_documents"][touched] = 0, -1
        a["top_positions"][touched], a["window_acts"][touched] = -1, 0
        a["window_ids"][touched] = -1
        for name, field in _SLOTS.items():
            a[name][rows, slot] = pool[field][keep]


# What a tally carries as sums, and where each candidate field goes in the arrays.
_SUMS = ("count", "total", "histogram")
_SLOTS = {
    "top_acts": "activation",
    "top_documents": "document",
    "top_positions": "position",
    "window_acts": "window_acts",
    "window_ids": "window_ids",
}


def run(
    model: Model,
    readout: Readout,
    tokenizer: Tokenizer,
    texts: Iterable[Any],
    req: StatsRequest,
    vocab: int,
    meta: dict[str, Any],
    writer: StatsWriter | None,
    guard: Callable[[], AbstractContextManager],
    progress: Any,
) -> FeatureStats:
    """The statistics of ``texts`` (continuing ``writer``'s store where it stopped);
    ``progress`` counts tokens. The SAE must be installed on the ranks already."""
    sae = req.sae
    running = _resumed(writer, req)
    done = running.documents
    corpus = ChainedTexts(texts, done, writer.index["chain"] if writer else "")
    stream = (
        Piece(piece.doc + done, piece.start, piece.ids)
        for piece in pieces(tokenizer, corpus, req.max_length, vocab)
    )
    texts_of: dict[int, str] = dict(writer.index["token_text"]) if writer else {}
    written = -np.inf
    for batch in batches(stream, req.batch_tokens):
        running.add(_trace(model, readout, sae, batch, running.threshold(), req, guard))
        running.tokens += sum(len(piece.ids) for piece in batch)
        running.documents = batch[-1].doc + 1
        progress.update(sum(len(piece.ids) for piece in batch))
        progress.set_postfix(documents=running.documents, refresh=False)
        if writer is not None and time.monotonic() - written > CHECKPOINT_SECONDS:
            _write(writer, running, tokenizer, texts_of, corpus.chain_at(running.documents), meta)
            written = time.monotonic()
    running.documents = corpus.count
    if writer is not None:
        _write(writer, running, tokenizer, texts_of, corpus.chain, meta, complete=True)
    return FeatureStats(
        **running.arrays,
        n_tokens=running.tokens,
        n_documents=running.documents,
        token_text=_token_texts(tokenizer, running.arrays["window_ids"], texts_of),
        meta={**meta, "complete": True},
    )


def _trace(
    model: Model,
    readout: Readout,
    sae: SAE,
    batch: list[Piece],
    threshold: torch.Tensor,
    req: StatsRequest,
    guard: Callable[[], AbstractContextManager],
) -> dict[str, torch.Tensor]:
    """One batch folded on the ranks, then their merged tally fetched by a one-token trace."""
    import nnsight

    run_id, key, window, n = uuid.uuid4().hex, sae.key, req.window, req.contexts
    reads = {sae.layer: {sae.site}}
    # The ranks find their layers from the interleaver, a reference, rather than from
    # shipped envoys (`envoykit.analyses.collect.activations`).
    interleaver = compat.interleaver_by_reference(model)
    with guard():
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for piece in batch:
                ids = torch.tensor(piece.ids, dtype=torch.long)
                doc, start = piece.doc, piece.start
                with tracer.invoke(list(piece.ids)):
                    layer_list = at(compat.rank_root(interleaver), readout.layers)
                    value, residual = walk(readout, layer_list, reads, {})[0]
                    x = stream_of(value, residual)
                    on_ranks.fold(run_id, key, x, ids, doc, start, threshold, window, gather_ranks)
        with model.trace(temperature=0.0, max_tokens=1) as tracer:  # noqa: SIM117
            with tracer.invoke([batch[0].ids[0]]):
                layer_list = at(compat.rank_root(interleaver), readout.layers)
                first, _ = walk(readout, layer_list, {0: {"resid"}}, {})[0]
                tally = nnsight.save(
                    on_ranks.flush(run_id, key, n, window, first.device, gather_ranks)
                )
    return tally


def _resumed(writer: StatsWriter | None, req: StatsRequest) -> Running:
    """The running statistics a store holds, or new ones."""
    if writer is None or (stored := writer.state()) is None:
        return Running.empty(req.sae.d_sae, req.contexts, req.window)
    arrays = {name: stored[name].copy() for name in ARRAYS}
    return Running(arrays, int(writer.index["tokens"]), int(writer.index["documents"]))


def _token_texts(tokenizer: Tokenizer, window_ids: np.ndarray, known: dict[Any, str]) -> dict:
    """The text of every token id in the windows (``known`` ones reused, the new added)."""
    for i in np.unique(window_ids[window_ids >= 0]).tolist():
        if str(i) not in known:
            known[str(i)] = tokenizer.decode([i])
    return {str(i): known[str(i)] for i in np.unique(window_ids[window_ids >= 0]).tolist()}


def _write(
    writer: StatsWriter,
    running: Running,
    tokenizer: Tokenizer,
    texts_of: dict,
    chain: str,
    meta: dict[str, Any],
    complete: bool = False,
) -> None:
    progress = {
        "documents": running.documents,
        "tokens": running.tokens,
        "chain": chain,
        "complete": complete,
        "token_text": _token_texts(tokenizer, running.arrays["window_ids"], texts_of),
        "meta": meta,
    }
    writer.write(running.arrays, progress)


def feature_stats(
    engine: EngineBase,
    texts: Documents,
    sae: SAE,
    *,
    contexts: int = 20,
    window: int = 16,
    out: str | None = None,
    max_length: int | None = None,
    batch_tokens: int = 4096,
    progress: bool = True,
) -> FeatureStats:
    """Every feature of ``sae`` over a corpus: firing frequency, mean and maximum
    activation, a histogram, and its ``contexts`` max-activating contexts (a window of
    ``window`` tokens each, the feature's activation at every one), reduced on the ranks
    (see `envoykit.analyses.feature_stats`). Returns a `FeatureStats`.

    ``texts``, ``max_length``, ``batch_tokens``, ``progress``: as in `collect`. ``out``:
    a directory to keep the statistics in (`ek.FeatureStats.open` reads it back), written
    as the run goes; run the same call again after an interrupt and it continues.
    """
    from envoykit.analyses import corpus

    info = engine.info
    req = build_request(
        info,
        sae,
        contexts=contexts,
        window=window,
        max_length=max_length,
        batch_tokens=batch_tokens,
    )
    sae_module.require(engine, req.sae)
    documents = corpus.documents(texts)  # a corpus refused here leaves no store behind
    total = corpus.total_tokens(engine.tokenizer, texts, info.vocab)
    meta = {**engine._result_meta(), "sae": req.sae.describe()}
    meta.pop("vocab")
    settings = {
        "model": engine.fingerprint(),
        "sae": req.sae.key,
        "contexts": req.contexts,
        "window": req.window,
        "max_length": req.max_length,
    }
    writer = None if out is None else StatsWriter.open(out, settings)
    with corpus.progress_bar(progress, "feature stats", total) as bar:
        if total is not None and writer is not None and writer.index["tokens"]:
            bar.update(writer.index["tokens"])
        return run(
            engine.model,
            engine.readout,
            engine.tokenizer,
            documents,
            req,
            info.vocab,
            meta,
            writer,
            engine.exclusive,
            bar,
        )
