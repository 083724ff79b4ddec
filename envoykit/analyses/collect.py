"""Collecting whole activations over a corpus into a store on disk.

Each trace prefills a batch of whole documents (`envoykit.analyses.corpus.batches`, one
invoke per piece, so vLLM batches them); on the ranks each piece's rows are read where the
lens reads them (`envoykit.model.readout.walk`: the residual stream whole at every TP size,
a block's write as it enters the stream), cut to the positions asked for and cast to the
store's dtype there. The batch becomes one shard (`envoykit.results.activations`): for an
engine in this process the shard is laid out on disk before the trace and the ranks write
each piece's rows into it (each its share), so they never travel; for a served engine the
rows come back as the trace's saves and this process writes them. Either way the shard is
complete before the next trace starts: memory holds one batch whatever the corpus's size. A
rerun continues after the last shard written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from envoykit import _compat as compat
from envoykit._compat import Model, Tokenizer
from envoykit.analyses import corpus, request
from envoykit.analyses.corpus import Piece, batches, pieces
from envoykit.analyses.request import Documents, LayerSpec, PositionSpec, Row
from envoykit.errors import InvalidRequest
from envoykit.model.envoys import first_rank, rank_share
from envoykit.model.readout import Readout, at, stream_of, walk
from envoykit.results.activations import PLACES, StoreWriter, row_key, text_chain
from envoykit.results.lens import SITES
from envoykit.results.shard_file import ShardFile, write_rows

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.results.activations import Activations

STORE_DTYPES = ("bfloat16", "float16", "float32")


def piece_positions(piece: Piece, positions: Sequence[int] | None) -> list[int]:
    """The positions of ``piece`` to keep (None: all; negative: from the piece's end); those
    a short piece does not have are skipped."""
    n = len(piece.ids)
    if positions is None:
        return list(range(n))
    return sorted({p % n for p in positions if -n <= p < n})


def activations(
    model: Model,
    readout: Readout,
    batch: Sequence[Piece],
    rows: Sequence[Row],
    keep: Sequence[Sequence[int]],
    dtype: torch.dtype,
    guard: Callable[[], AbstractContextManager],
    shard: ShardFile | None = None,
) -> list[torch.Tensor]:
    """One trace over ``batch``. Without ``shard``: per piece ``[rows, len(keep[i]), d_model]``
    in ``dtype``. With it, the ranks write each piece's rows into ``shard`` (its tokens one
    piece after another), and nothing comes back."""
    import nnsight

    order = sorted(rows, key=lambda row: (row[0], SITES.index(row[1])))  # as `walk` reads
    reads: dict[int, set[str]] = {}
    for layer, site in order:
        reads.setdefault(layer, set()).add(site)
    picked = [order.index(row) for row in rows]
    keys = [row_key(layer, site) for layer, site in rows]
    firsts = [sum(len(kept) for kept in keep[:i]) for i in range(len(keep))]
    path = "" if shard is None else str(shard.path)  # "": the rows come back as saves
    token_bytes = 0 if shard is None else shard.token_bytes
    # Each invoke's code travels to the ranks pickled on its own, and an envoy pickles with
    # every envoy below it: the decoder layers were 50 kB an invoke, 1.6 MB a batch, pickled
    # by this process and unpickled by every rank. The ranks find their own layers from the
    # interleaver, which travels as a reference.
    interleaver = compat.interleaver_by_reference(model)
    out: Any = None  # the first rank's saves, one per invoke, pushed back after the trace
    with guard(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for piece, kept, first in zip(batch, keep, firsts):
            where = torch.tensor(kept, dtype=torch.long)  # (empty for a short piece)
            offsets = [] if shard is None else shard.offsets(keys, first)
            with tracer.invoke(list(piece.ids)):
                layer_list = at(compat.rank_root(interleaver), readout.layers)
                streams = walk(readout, layer_list, reads, {})
                # Every rank reads the same whole values (a read may be a collective).
                if path:
                    # Each rank writes every tp-th row: three ranks sharing two cores wait
                    # for the slowest at the next layer's all-reduce.
                    mine = rank_share(len(picked))
                    write_rows(
                        path,
                        [offsets[i] for i in mine],
                        stored_rows(streams, [picked[i] for i in mine], where, dtype),
                        len(kept) * token_bytes,
                    )
                elif first_rank():  # the client keeps one rank's saves: one rank sends them
                    out = nnsight.save(torch.stack(stored_rows(streams, picked, where, dtype)))
    if shard is not None:
        return []
    return out if len(batch) > 1 else [out]


def stored_rows(
    streams: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    indices: Sequence[int],
    where: torch.Tensor,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """On a rank: the rows ``indices`` of a piece's ``streams`` (as `walk` reads them) at the
    positions ``where``, as stored (``dtype``, on the CPU). A stream's pair is summed, a
    block's write taken as it is; only the rows this rank stores are summed."""
    rows = []
    for i in indices:
        whole = stream_of(*streams[i])
        rows.append(whole[where.to(whole.device)].to(dtype).cpu())
    return rows


def places(batch: Sequence[Piece], keep: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Each kept token's id, document and position, in corpus order (a shard's `PLACES`)."""
    kept = [(piece, p) for piece, positions in zip(batch, keep) for p in positions]
    values = {
        "token_ids": [piece.ids[p] for piece, p in kept],
        "document": [piece.doc for piece, _ in kept],
        "position": [piece.start + p for piece, p in kept],
    }
    return {key: torch.tensor(values[key], dtype=torch.int64) for key in PLACES}


def shard_tensors(
    batch: Sequence[Piece],
    keep: Sequence[Sequence[int]],
    values: Sequence[torch.Tensor],
    rows: Sequence[Row],
) -> dict[str, torch.Tensor]:
    """A batch's activations as a shard's tensors, tokens in corpus order."""
    tensors = {
        row_key(layer, site): torch.cat([value[i] for value in values]).contiguous()
        for i, (layer, site) in enumerate(rows)
    }
    return {**tensors, **places(batch, keep)}


def write_shard(
    model: Model,
    readout: Readout,
    writer: StoreWriter,
    batch: Sequence[Piece],
    rows: Sequence[Row],
    keep: Sequence[Sequence[int]],
    dtype: str,
    d_model: int,
    guard: Callable[[], AbstractContextManager],
    end: int,
    chain: str,
) -> None:
    """One batch written by the ranks into a shard laid out for it, then named in the
    index. A failed or cancelled trace removes the shard's temporary file; one a killed
    kernel leaves is removed by the next run of the collection."""
    keys = [row_key(layer, site) for layer, site in rows]
    shard = writer.open_shard(keys, sum(len(kept) for kept in keep), d_model, dtype)
    try:
        activations(model, readout, batch, rows, keep, getattr(torch, dtype), guard, shard)
    except BaseException:
        shard.path.unlink(missing_ok=True)
        raise
    writer.close_shard(shard, places(batch, keep), end, chain)


class ChainedTexts:
    """A corpus read once, lazily: the documents a store already covers are hashed and
    skipped (their chain checked against the store's), the others passed on and hashed.

    ``chain_at(n)`` is the chain over the first ``n`` documents, for a shard that ends
    there: batching reads a document ahead of the shard it writes."""

    def __init__(self, texts: Iterable[str], done: int, chain: str) -> None:
        self._texts, self._done, self._stored = texts, done, chain
        self.chain, self.count = "", 0
        self._links: dict[int, str] = {done: chain}

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            if not isinstance(text, (str, list, tuple)):
                raise InvalidRequest(
                    f"document {self.count} is a {type(text).__name__}: a document is a string "
                    "or a list of token ids"
                )
            self.chain = text_chain(self.chain, text if isinstance(text, str) else repr(list(text)))
            self.count += 1
            if self.count == self._done and self.chain != self._stored:
                raise InvalidRequest(
                    f"the store's first {self._done} documents are not this corpus's: give "
                    "another out directory (the store was left as it is)"
                )
            if self.count > self._done:
                self._links[self.count] = self.chain
                yield text
        if self.count < self._done:
            raise InvalidRequest(
                f"the store already covers {self._done} documents, more than this corpus's "
                f"{self.count}: it was collected from another corpus"
            )

    def chain_at(self, documents: int) -> str:
        """The chain over the first ``documents`` (links before it are forgotten)."""
        chain = self._links[documents]
        for count in [c for c in self._links if c < documents]:
            del self._links[count]
        return chain


def run(
    model: Model,
    readout: Readout,
    tokenizer: Tokenizer,
    texts: Iterable[str],
    writer: StoreWriter,
    rows: Sequence[Row],
    positions: Sequence[int] | None,
    dtype: str,
    max_length: int,
    batch_tokens: int,
    vocab: int,
    guard: Callable[[], AbstractContextManager],
    progress: Any,
    d_model: int,
    ranks_write: bool,
) -> None:
    """Collect ``texts`` into ``writer``'s store after the documents it already holds;
    ``progress`` (a tqdm bar) counts tokens. ``ranks_write``: the ranks write each shard's
    rows (`write_shard`), or they come back as saves (the ranks are elsewhere)."""
    done = writer.documents_done
    corpus = ChainedTexts(texts, done, writer.index["chain"])
    # The documents the store holds are hashed, not tokenized: numbering starts after them.
    stream = (
        Piece(piece.doc + done, piece.start, piece.ids)
        for piece in pieces(tokenizer, corpus, max_length, vocab)
    )
    for batch in batches(stream, batch_tokens):
        keep = [piece_positions(piece, positions) for piece in batch]
        # A batch holds whole documents, so the store then covers all up to its last.
        end = batch[-1].doc + 1
        if ranks_write:
            write_shard(
                model, readout, writer, batch, rows, keep, dtype, d_model, guard, end,
                corpus.chain_at(end),
            )  # fmt: skip
        else:
            values = activations(model, readout, batch, rows, keep, getattr(torch, dtype), guard)
            writer.add_shard(shard_tensors(batch, keep, values, rows), end, corpus.chain_at(end))
        progress.update(sum(len(piece.ids) for piece in batch))
        progress.set_postfix(documents=end, refresh=False)
    # Documents with no tokens after the last shard still count as collected.
    writer.finish(corpus.count, corpus.chain)


def collect(
    engine: EngineBase,
    texts: Documents,
    *,
    out: str,
    layers: LayerSpec = None,
    sites: str | Sequence[str] = ("resid",),
    positions: PositionSpec = None,
    dtype: str = "bfloat16",
    max_length: int | None = None,
    batch_tokens: int = 4096,
    progress: bool = True,
) -> Activations:
    """Save the whole activations of a corpus to the store ``out`` (a directory; see
    `envoykit.results.activations`), many documents per trace, with a progress bar in
    tokens/s; returns the store as `Activations`.

    ``texts``: a list or any iterable of documents (read lazily, so memory holds one
    batch whatever the corpus's size): strings, or lists of token ids taken as they are.
    ``layers``/``sites``: as in `lens`, one stored row each: the residual stream whole
    ("resid", "resid_mid", summed as the model adds it) or what a block writes ("attn",
    "mlp"). ``positions``: None (every token) or positions counted in each piece
    (negative from its end); a piece without one skips it. ``dtype``: what is stored
    ("bfloat16", "float16" or "float32"). A document longer than ``max_length``
    (default: the engine's context) is cut into consecutive pieces, each its own
    context; ``position`` stays counted from the document's start. ``batch_tokens``:
    about how many tokens one trace prefills, and one shard holds (whole documents;
    memory holds one batch).

    Resumable: run it again with the same arguments after an interrupt or a killed
    kernel, and it continues after the last whole shard. A store of another model,
    corpus or settings at ``out`` is refused and left as it is. ``progress``: a tqdm bar
    in tokens/s (True), none (False), or your own bar (`corpus.progress_bar`).
    """
    from envoykit.results.activations import Activations, as_rows

    req = build_request(engine, layers, sites, positions, dtype, max_length, batch_tokens)
    tokenizer, vocab = engine.tokenizer, engine.info.vocab
    documents = corpus.documents(texts)  # a corpus refused here leaves no store behind
    total = corpus.total_tokens(tokenizer, texts, vocab)
    settings = {
        "model": engine.fingerprint(),
        "rows": as_rows(req.rows),
        "positions": req.positions,
        "dtype": req.dtype,
        "max_length": req.max_length,
    }
    writer = StoreWriter.open(out, settings)
    with corpus.progress_bar(progress, "collect", total) as bar:
        if isinstance(texts, Sequence) and writer.documents_done:  # a rerun: those are done
            bar.update(corpus.total_tokens(tokenizer, texts[: writer.documents_done], vocab))
        run(
            engine.model,
            engine.readout,
            tokenizer,
            documents,
            writer,
            req.rows,
            req.positions,
            req.dtype,
            req.max_length,
            req.batch_tokens,
            vocab,
            engine.exclusive,
            bar,
            engine.info.d_model,
            engine._ranks_see_this_disk,
        )
    return Activations.open(out)


@dataclass(frozen=True)
class CollectRequest:
    """A checked collection: the stored rows, positions, dtype and corpus cut."""

    rows: tuple[Row, ...]
    positions: list[int] | None
    dtype: str
    max_length: int
    batch_tokens: int


def build_request(
    engine: EngineBase,
    layers: Any,
    sites: Any,
    positions: Any,
    dtype: Any,
    max_length: Any,
    batch_tokens: Any,
) -> CollectRequest:
    """Every option of `collect` checked against ``engine`` before the corpus is read."""
    info = engine.info
    engine.readout.require("collect")
    rows = request.lens_rows(
        request.normalise_layers(layers, info.n_layers), request.normalise_sites(sites)
    )
    engine._require_sites([site for _, site in rows])
    if dtype not in STORE_DTYPES:
        raise InvalidRequest(f"dtype must be one of {STORE_DTYPES}, not {dtype!r}")
    return CollectRequest(
        rows=rows,
        positions=None if positions is None else corpus_positions(positions),
        dtype=dtype,
        max_length=corpus.check_max_length(max_length, info.max_model_len),
        batch_tokens=request.check_count("batch_tokens", batch_tokens, minimum=1),
    )


def corpus_positions(positions: Any) -> list[int]:
    """Positions of a corpus request: integers counted in each piece (negative from its
    end), checked here since pieces differ in length."""
    picked = request.as_list(positions)
    if not picked or any(isinstance(p, bool) or not isinstance(p, int) for p in picked):
        raise InvalidRequest(
            f"positions are integers (negative from each document's end), not {positions!r}"
        )
    return sorted(set(picked))
