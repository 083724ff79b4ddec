"""A collection of activations on disk: safetensors shards and one JSON index.

Why safetensors: it memory-maps, it keeps bfloat16 (``.npy`` cannot: numpy has no
bfloat16), it is already how envoykit stores tuned lenses and steering vectors, and a shard
opens with ``safetensors.safe_open(path, "pt")`` or ``safetensors.torch.load_file`` and no
envoykit at all. The layout::

    PATH/index.json               what was collected, on which model, and the shards in order
    PATH/shard-00000.safetensors  "resid.10", "mlp.4", ... [tokens, d_model] one per (site, layer);
                                  "token_ids", "document", "position" [tokens] int64

Rows of a shard are tokens in corpus order: ``document`` is the document's index in the
corpus, ``position`` the token's position in that document. A shard holds whole documents.

Nothing is lost or half-written: a shard is written to a temporary name and renamed into
place, then the index is rewritten the same way to name it, so an interrupt or a killed
kernel leaves at most a stray temporary file, which the next run removes. The index records
how many documents its shards cover and a hash chain of their texts, so a rerun of the same
collection continues after the last shard, and a rerun on another corpus, model or set of
layers is refused rather than mixed in.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from envoykit.errors import EnvoykitError, InvalidRequest
from envoykit.results.identity import check_same_model
from envoykit.results.shard_file import SAFETENSORS_DTYPES, ShardFile, shard_header, write_rows

FORMAT = "envoykit-activations"
VERSION = 1
INDEX = "index.json"
# The index keys that must match for a rerun to continue a store.
SETTINGS = ("model", "rows", "positions", "dtype", "max_length")
# Each token's place in the corpus, one int64 tensor each in every shard.
PLACES = ("token_ids", "document", "position")


class StoreWriteError(EnvoykitError, OSError):
    """A shard could not be written (a full disk, a lost mount). The shards already in the
    index are intact; free the space and run the same collection again to continue."""


def row_key(layer: int, site: str) -> str:
    """The tensor name of (``layer``, ``site``) in a shard: ``"resid.10"``."""
    return f"{site}.{layer}"


def text_chain(previous: str, text: str) -> str:
    """The hash chain over a corpus's texts, one link per document."""
    link = previous + hashlib.sha256(text.encode()).hexdigest()
    return hashlib.sha256(link.encode()).hexdigest()


class StoreWriter:
    """The writing side of a store: opened (or created) for one collection's settings."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = path, index

    @classmethod
    def open(cls, path: str | Path, settings: dict[str, Any]) -> StoreWriter:
        """The store at ``path``, new, or continuing one collected with the same
        ``settings``; anything else at ``path`` is refused and left as it is."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise InvalidRequest(f"out={str(path)!r} is a file: give a directory for the store")
        index_file = path / INDEX
        if index_file.exists():
            index = read_index(path)
            _refuse_other_settings(path, index, settings)
            for stray in path.glob("*.tmp"):
                stray.unlink()
            return cls(path, index)
        if path.exists() and any(path.iterdir()):
            raise InvalidRequest(
                f"out={str(path)!r} is a directory that holds no activation store: give a new "
                "or empty directory (nothing was written)"
            )
        path.mkdir(parents=True, exist_ok=True)
        index = {
            "format": FORMAT,
            "version": VERSION,
            **settings,
            "documents": 0,
            "tokens": 0,
            "chain": "",
            "complete": False,
            "shards": [],
        }
        writer = cls(path, index)
        writer._write_index()
        return writer

    @property
    def documents_done(self) -> int:
        return int(self.index["documents"])

    def add_shard(self, tensors: Mapping[str, Any], documents: int, chain: str) -> None:
        """Write ``tensors`` as the next shard, covering documents up to ``documents``
        (exclusive) whose texts hash to ``chain``, and name it in the index."""
        from safetensors.torch import save

        name = self._next_name()
        temporary = self.path / (name + ".tmp")
        # Serialised here and written by Python, whose OSError carries the errno (safetensors'
        # own file writer reports a full disk as a SafetensorError of text).
        blob = save(dict(tensors), metadata={"format": FORMAT})
        try:
            temporary.write_bytes(blob)
            os.replace(temporary, self.path / name)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise self._write_error(name, error) from error
        self._name_shard(name, int(tensors["token_ids"].shape[0]), documents, chain)

    def open_shard(self, keys: Sequence[str], tokens: int, d_model: int, dtype: str) -> ShardFile:
        """The next shard laid out for ``tokens`` tokens of the rows ``keys``, its space
        taken on disk now: a full disk fails here, before any rank has written to it."""
        name = self._next_name()
        temporary = self.path / (name + ".tmp")
        header, begins, size = shard_header(PLACES, keys, tokens, d_model, dtype, FORMAT)
        try:
            with open(temporary, "wb") as file:
                file.write(header)
                file.flush()
                os.posix_fallocate(file.fileno(), 0, size)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise self._write_error(name, error) from error
        token_bytes = d_model * SAFETENSORS_DTYPES[dtype][1]
        return ShardFile(temporary.resolve(), name, tokens, token_bytes, begins)

    def close_shard(
        self, shard: ShardFile, places: Mapping[str, Any], documents: int, chain: str
    ) -> None:
        """Write the token ``places`` (int64 tensors of `PLACES`) into ``shard``, whose rows
        are all written, and name it in the index as `add_shard` does."""
        try:
            tensors = [places[key] for key in PLACES]
            write_rows(str(shard.path), shard.offsets(PLACES, 0), tensors, 8 * shard.tokens)
            os.replace(shard.path, self.path / shard.name)
        except OSError as error:
            shard.path.unlink(missing_ok=True)
            raise self._write_error(shard.name, error) from error
        self._name_shard(shard.name, shard.tokens, documents, chain)

    def _next_name(self) -> str:
        return f"shard-{len(self.index['shards']):05d}.safetensors"

    def _name_shard(self, name: str, tokens: int, documents: int, chain: str) -> None:
        shard = {"file": name, "documents": [self.documents_done, documents], "tokens": tokens}
        self.index["shards"].append(shard)
        self.index.update(
            documents=documents, tokens=self.index["tokens"] + tokens, chain=chain, complete=False
        )
        self._write_index()

    def finish(self, documents: int, chain: str) -> None:
        """Record that the collection reached its corpus's end: ``documents`` in all, whose
        texts hash to ``chain``."""
        self.index.update(documents=documents, chain=chain, complete=True)
        self._write_index()

    def _write_index(self) -> None:
        temporary = self.path / (INDEX + ".tmp")
        try:
            temporary.write_text(json.dumps(self.index, indent=1))
            os.replace(temporary, self.path / INDEX)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise self._write_error(INDEX, error) from error

    def _write_error(self, name: str, error: OSError) -> StoreWriteError:
        full = error.errno in (errno.ENOSPC, errno.EDQUOT)
        why = "the disk is full" if full else str(error)
        return StoreWriteError(
            error.errno,
            f"writing {name} in {self.path} failed: {why}. The {len(self.index['shards'])} "
            f"shard(s) before it ({self.documents_done} documents) are intact; free space and "
            "run the same collect again to continue",
        )


def read_index(path: Path) -> dict[str, Any]:
    """The index of the store at ``path``; `InvalidRequest` if there is none."""
    try:
        index = json.loads((path / INDEX).read_text())
    except FileNotFoundError:
        raise InvalidRequest(
            f"{str(path)!r} holds no activation store (no {INDEX}): collect one with "
            "engine.collect(texts, out=...)"
        ) from None
    if index.get("format") != FORMAT:
        raise InvalidRequest(f"{path / INDEX} is not the index of an envoykit activation store")
    if index.get("version") != VERSION:
        raise InvalidRequest(
            f"{path} is a version {index.get('version')} store; this envoykit reads version "
            f"{VERSION}"
        )
    return index


def _refuse_other_settings(path: Path, index: dict[str, Any], settings: dict[str, Any]) -> None:
    """`InvalidRequest` unless the store at ``path`` was collected with ``settings``."""

    check_same_model(
        index["model"],
        settings["model"],
        f"the store at {str(path)!r} was collected",
        "give another out directory (the store was left as it is)",
    )
    differ = [key for key in SETTINGS if key != "model" and index.get(key) != settings[key]]
    if differ:
        shown = ", ".join(f"{key}={index.get(key)!r} (asked: {settings[key]!r})" for key in differ)
        raise InvalidRequest(
            f"the store at {str(path)!r} was collected with other settings: {shown}. Give "
            "another out directory, or the same settings to continue it (nothing was written)"
        )


class Activations:
    """A store written by ``engine.collect``, read back: whole rows (`load`), one document
    (`document`), or shard by shard (`shards`) for stores larger than memory.

    >>> store = Activations.open(path)  # doctest: +SKIP
    >>> store.load(10).shape            # doctest: +SKIP
    torch.Size([32768, 576])
    """

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = path, index

    @classmethod
    def open(cls, path: str | Path) -> Activations:
        path = Path(path)
        return cls(path, read_index(path))

    @property
    def rows(self) -> list[tuple[int, str]]:
        """The (layer, site) pairs collected."""
        return [(int(layer), str(site)) for layer, site in self.index["rows"]]

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.rows})

    @property
    def sites(self) -> list[str]:
        return list(dict.fromkeys(site for _, site in self.rows))

    @property
    def model(self) -> dict[str, Any]:
        """The fingerprint of the model the store was collected on."""
        return dict(self.index["model"])

    @property
    def dtype(self) -> str:
        return str(self.index["dtype"])

    @property
    def complete(self) -> bool:
        """Whether the collection reached its corpus's end (else a rerun continues it)."""
        return bool(self.index["complete"])

    @property
    def n_documents(self) -> int:
        return int(self.index["documents"])

    def __len__(self) -> int:
        """Tokens stored."""
        return int(self.index["tokens"])

    @property
    def shard_files(self) -> list[Path]:
        return [self.path / shard["file"] for shard in self.index["shards"]]

    def shards(self) -> Iterator[dict[str, Any]]:
        """Each shard's tensors (torch): one shard in memory at a time."""
        from safetensors.torch import load_file

        for file in self.shard_files:
            yield load_file(str(file))

    def load(self, layer: int, site: str = "resid") -> Any:
        """``[tokens, d_model]`` the activations of (``layer``, ``site``) over the whole store."""
        return self._concatenated(self._key(layer, site))

    @property
    def token_ids(self) -> np.ndarray:
        return self._concatenated("token_ids").numpy()

    @property
    def documents(self) -> np.ndarray:
        """Each token's document index in the corpus."""
        return self._concatenated("document").numpy()

    @property
    def positions(self) -> np.ndarray:
        """Each token's position in its document."""
        return self._concatenated("position").numpy()

    def document(self, doc: int, layer: int, site: str = "resid") -> Any:
        """``[tokens, d_model]`` one document's activations at (``layer``, ``site``)."""
        import torch
        from safetensors import safe_open

        key = self._key(layer, site)
        for shard, file in zip(self.index["shards"], self.shard_files):
            first, end = shard["documents"]
            if first <= doc < end:
                with safe_open(str(file), "pt") as handle:
                    mask = handle.get_tensor("document") == doc
                    return handle.get_tensor(key)[mask]
        if not 0 <= doc < self.n_documents:
            raise IndexError(f"document {doc} is not in the store (0..{self.n_documents - 1})")
        return torch.empty(0, int(self.index["model"]["d_model"]))

    def _key(self, layer: int, site: str) -> str:
        if (layer, site) not in self.rows:
            raise KeyError(f"({layer}, {site!r}) was not collected; the store holds {self.rows}")
        return row_key(layer, site)

    def _concatenated(self, key: str) -> Any:
        import torch
        from safetensors import safe_open

        parts = []
        for file in self.shard_files:
            with safe_open(str(file), "pt") as handle:
                parts.append(handle.get_tensor(key))
        return torch.cat(parts) if parts else torch.empty(0)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete: rerun collect to continue"
        return (
            f"Activations({str(self.path)!r}: {len(self)} tokens of {self.n_documents} "
            f"documents, {len(self.rows)} (layer, site) rows, {self.dtype}, {state})"
        )


def as_rows(rows: Sequence[tuple[int, str]]) -> list[list[Any]]:
    """(layer, site) pairs as the index stores them (JSON lists)."""
    return [[int(layer), str(site)] for layer, site in rows]
