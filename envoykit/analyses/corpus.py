"""A corpus as the engine sees it: documents tokenized, cut to the context, and grouped into
traces that fill vLLM's batches.

Both corpus analyses (`envoykit.analyses.collect` and `envoykit.analyses.corpus_lens`) hand
vLLM many documents per trace, one invoke each, so its continuous batching prefills them
together: a trace is not one prompt. A document longer than the engine's context is cut into
consecutive *pieces* of at most ``max_length`` tokens; each piece is its own context (the
model does not see the previous piece), and positions stay counted from the document's start.
Texts are read lazily, so a corpus given as a generator is never held whole. A document is a
string, or a list of token ids (a pre-tokenized dataset, taken as it is).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from envoykit._compat import Tokenizer
from envoykit.analyses.request import check_count
from envoykit.errors import InvalidRequest

# Tokens per trace: enough documents that vLLM's steps are full (its batch takes up to the
# context length of tokens per step with chunked prefill off, as nnsight needs it), few enough
# that what a trace brings back stays small.
TOKENS_PER_TRACE = 4096


@dataclass(frozen=True)
class Piece:
    """One context the engine runs: tokens ``start .. start + len(ids)`` of document ``doc``."""

    doc: int
    start: int
    ids: tuple[int, ...]


def documents(texts: Any) -> Iterator[str]:
    """``texts`` (a list or any iterable of strings, read lazily) with its first document
    checked before anything starts: an empty corpus is refused here, not after a store or a
    progress bar exists."""
    if isinstance(texts, (str, bytes)):
        raise InvalidRequest("a corpus is a list (or iterable) of documents, not one string")
    try:
        stream = iter(texts)
    except TypeError:
        raise InvalidRequest(
            f"a corpus is a list (or iterable) of strings, not {type(texts).__name__}"
        ) from None
    first = next(stream, None)
    if first is None:
        raise InvalidRequest("the corpus is empty: give at least one document")
    return itertools.chain([first], stream)


def pieces(
    tokenizer: Tokenizer, texts: Iterable[Any], max_length: int, vocab: int
) -> Iterator[Piece]:
    """Every document's pieces in corpus order (`Piece`), documents numbered from 0; a
    document that tokenizes to nothing has none."""
    for doc, document in enumerate(texts):
        ids = document_ids(tokenizer, document, doc, vocab)
        for start in range(0, len(ids), max_length):
            yield Piece(doc, start, tuple(ids[start : start + max_length]))


def document_ids(tokenizer: Tokenizer, document: Any, doc: int, vocab: int) -> list[int]:
    """A document's token ids: a string tokenized as a prompt is (special tokens added), or
    a list of token ids taken as they are (a pre-tokenized dataset), each checked."""
    if isinstance(document, str):
        return tokenizer(document)["input_ids"]
    if isinstance(document, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in document
    ):
        outside = [i for i in document if not 0 <= i < vocab]
        if outside:
            raise InvalidRequest(
                f"document {doc} has token id {outside[0]}, outside the vocabulary 0..{vocab - 1}"
            )
        return list(document)
    raise InvalidRequest(
        f"document {doc} is a {type(document).__name__}: a document is a string or a list of "
        "token ids"
    )


def batches(
    stream: Iterable[Piece], tokens_per_trace: int = TOKENS_PER_TRACE
) -> Iterator[list[Piece]]:
    """``stream`` in groups of whole documents of about ``tokens_per_trace`` tokens (a
    document longer than that is a group of its own), so a trace, and a shard, never holds
    part of a document."""
    group: list[Piece] = []
    size = 0
    for piece in stream:
        starts_document = piece.start == 0
        if group and starts_document and size + len(piece.ids) > tokens_per_trace:
            yield group
            group, size = [], 0
        group.append(piece)
        size += len(piece.ids)
    if group:
        yield group


class ProgressBar(Protocol):
    """A caller's own progress bar: tqdm's two methods that corpus work reports through."""

    def update(self, n: int) -> object: ...

    def set_postfix(self, **values: Any) -> object: ...


def progress_bar(
    progress: bool | ProgressBar, what: str, total: int | None = None
) -> AbstractContextManager:
    """The bar a corpus analysis reports its tokens to: tqdm's in tokens/s for True (out of
    ``total`` tokens, when known), none for False, or the caller's own object with tqdm's
    ``update(n)`` and ``set_postfix(**kw)`` (a widget's; an exception it raises stops the
    work between two traces, the engine free)."""
    from tqdm.auto import tqdm

    if isinstance(progress, bool):
        return tqdm(desc=what, total=total, unit="tok", unit_scale=True, disable=not progress)
    if not all(callable(getattr(progress, name, None)) for name in ("update", "set_postfix")):
        raise InvalidRequest(
            f"progress is True, False or a bar with update(n) and set_postfix(), not "
            f"{type(progress).__name__}"
        )
    return contextlib.nullcontext(progress)


def total_tokens(tokenizer: Tokenizer, texts: Any, vocab: int) -> int | None:
    """How many tokens a corpus held in memory (a list) has, every document checked on the
    way, so a bad one is refused before anything starts; None for a stream, which is read
    only once."""
    if not isinstance(texts, Sequence):
        return None
    return sum(len(document_ids(tokenizer, text, doc, vocab)) for doc, text in enumerate(texts))


def shipped_corpus() -> list[str]:
    """The short English corpus shipped in the package (the built-in tokenizer's training
    text), one document per line: a corpus for examples that needs no download."""
    text = (Path(__file__).parents[1] / "data" / "corpus.txt").read_text()
    return [line for line in text.splitlines() if line.strip()]


def check_max_length(max_length: Any, context: int) -> int:
    """The piece length a request asked for, checked; None is the longest a trace can run:
    the engine's context less the one token each trace generates (vLLM counts it in)."""
    longest = context - 1
    if max_length is None:
        return longest
    max_length = check_count("max_length", max_length, 1)
    if max_length > longest:
        raise InvalidRequest(
            f"max_length={max_length} exceeds {longest}, the engine's max_model_len={context} "
            "less the one token each trace generates: documents are cut into pieces that fit"
        )
    return max_length
