"""The rows an SAE trains on, read a fixed number at a time: from a store's shards (never
the whole store) or from one tensor, with the same numbers either way.

`Rows` names where they are, `Reader` hands them out whatever the blocks' boundaries,
`statistics` checks and measures them in one read before training, and `batches` shuffles
them into training batches through a bounded buffer. Apart from the training loop
(`envoykit.analyses.sae_training`) because none of it depends on the SAE being trained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from envoykit.errors import InvalidRequest
from envoykit.results.activations import Activations, row_key

# Rows per read when the source is checked and measured before training.
READ_ROWS = 8192


@dataclass(frozen=True)
class Rows:
    """The rows an SAE trains on, in corpus order: blocks of known sizes (a store's shards,
    or one tensor), each loaded only when read."""

    sizes: tuple[int, ...]
    load: Callable[[int], torch.Tensor]
    d_in: int
    where: str
    model_name: str | None

    @property
    def count(self) -> int:
        return sum(self.sizes)

    def pieces(self, start: int, stop: int) -> Iterator[torch.Tensor]:
        """Rows ``start .. stop`` as slices of the blocks that hold them, in order."""
        first = 0
        for block, size in enumerate(self.sizes):
            end = first + size
            if first < stop and end > start:
                values = self.load(block)
                if tuple(values.shape) != (size, self.d_in):
                    raise InvalidRequest(
                        f"{self.where}: block {block} holds {tuple(values.shape)}, not "
                        f"({size}, {self.d_in}) as its index says: collect the store again"
                    )
                yield values[max(start - first, 0) : min(stop, end) - first]
            first = end


def rows_of(source: Any, layer: int, site: str) -> Rows:
    """The `Rows` of a store (or its path) or of a tensor, refused if it cannot train."""
    if isinstance(source, torch.Tensor):
        if source.dim() != 2 or not source.is_floating_point() or source.shape[1] < 1:
            raise InvalidRequest(
                f"a tensor source is [tokens, d_in] floating point, not {tuple(source.shape)} "
                f"{source.dtype}"
            )
        tensor = source.detach().cpu()
        return Rows((len(tensor),), lambda _: tensor, int(tensor.shape[1]), "the tensor", None)
    store = source if isinstance(source, Activations) else Activations.open(source)
    where = f"the store at {str(store.path)!r}"
    if (layer, site) not in store.rows:
        raise InvalidRequest(
            f"{where} holds no ({layer}, {site!r}) activations: it holds {store.rows}. Train on "
            f"one of those, or collect these with engine.collect(texts, layers=[{layer}], "
            f"sites=[{site!r}], out=...)"
        )
    key, files = row_key(layer, site), store.shard_files

    def load(block: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(files[block]), "pt") as handle:
            return handle.get_tensor(key)

    sizes = tuple(int(shard["tokens"]) for shard in store.index["shards"])
    d_in = int(store.model["d_model"])
    return Rows(sizes, load, d_in, f"{where} ({layer}, {site!r})", store.model.get("name"))


class Reader:
    """Rows ``start .. stop`` handed out ``n`` at a time, each time as a new float32 tensor
    whatever the blocks' boundaries: the only way rows reach training, so that the same rows
    stored in shards or held in one tensor give the same numbers in the same memory layout."""

    def __init__(self, rows: Rows, start: int, stop: int) -> None:
        self._pieces = rows.pieces(start, stop)
        self._rest = torch.empty(0, rows.d_in)
        self.left = stop - start

    def take(self, n: int) -> torch.Tensor:
        parts, need = [], min(n, self.left)
        self.left -= need
        while need:
            if not len(self._rest):
                self._rest = next(self._pieces)
            part = self._rest[:need]
            self._rest = self._rest[len(part) :]
            parts.append(part)
            need -= len(part)
        return torch.cat(parts).float() if parts else torch.empty(0, self._rest.shape[1])


@dataclass(frozen=True)
class Statistics:
    """What training needs to know of its rows before it starts."""

    mean: torch.Tensor  # [d_in] float64, the training rows' mean
    mean_norm: float


def statistics(rows: Rows, n_train: int) -> Statistics:
    """One read of every row: a non-finite value anywhere is refused, and the training rows'
    mean and mean norm are measured (in float64), before any step."""
    reader = Reader(rows, 0, rows.count)
    norms, total = 0.0, torch.zeros(rows.d_in, dtype=torch.float64)
    low = high = None
    start = 0
    while reader.left:
        chunk = reader.take(READ_ROWS)
        bad = ~torch.isfinite(chunk).all(1)
        if bool(bad.any()):
            row = start + int(bad.nonzero()[0])
            raise InvalidRequest(
                f"row {row} of {rows.where} holds NaN or infinite values: an SAE cannot train "
                "on them; drop those tokens (or collect the store again)"
            )
        train = chunk[: max(n_train - start, 0)]
        if len(train):
            norms += float(train.norm(dim=1).double().sum())
            total += train.sum(0, dtype=torch.float64)
            low = train.amin(0) if low is None else torch.minimum(low, train.amin(0))
            high = train.amax(0) if high is None else torch.maximum(high, train.amax(0))
        start += len(chunk)
    if torch.equal(low, high):
        raise InvalidRequest(
            f"the {n_train} training rows of {rows.where} are all the same vector: there is "
            "nothing for an SAE to learn"
        )
    return Statistics(total / n_train, norms / n_train)


def batches(
    rows: Rows, n_train: int, batch_size: int, buffer_tokens: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Batches of the training rows (``0 .. n_train``), pass after pass: a shuffle buffer of
    ``buffer_tokens`` rows (at least two batches) is filled in corpus order, permuted with
    ``generator``, and emptied down to half before it is filled again; at a pass's end the
    rest is emitted, the last batch taking the remainder, so every row is seen once a pass."""
    capacity = max(buffer_tokens, 2 * batch_size)
    while True:
        reader = Reader(rows, 0, n_train)
        buffer = torch.empty(0, rows.d_in)
        while True:
            buffer = torch.cat([buffer, reader.take(capacity - len(buffer))])
            order = torch.randperm(len(buffer), generator=generator)
            if reader.left:
                emit = (len(buffer) - capacity // 2) // batch_size * batch_size
                ends = list(range(batch_size, emit + 1, batch_size))
            else:
                full = max(len(buffer) // batch_size, 1)
                ends = [batch_size * (i + 1) for i in range(full - 1)] + [len(buffer)]
            start = 0
            for end in ends:
                yield buffer[order[start:end]]
                start = end
            buffer = buffer[order[start:]]
            if not reader.left:
                break
