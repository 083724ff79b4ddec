"""A shard laid out before its rows exist, and the rows written straight into it.

The store (`envoykit.results.activations`) keeps safetensors shards. An in-process
collection's ranks hold each piece's rows; instead of sending them back to be serialised,
the client writes the shard's header and takes the file's space (`shard_header`, a
`ShardFile`), and each rank writes its rows at their offsets (`write_rows`). The bytes are
the ones safetensors' own writer gives the same tensors.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# safetensors' names and element sizes of the stored dtypes.
SAFETENSORS_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


@dataclass(frozen=True)
class ShardFile:
    """A shard laid out on disk before its rows exist: a temporary file of its final size
    with safetensors' header written, so that each piece's rows can be written straight to
    their place (`write_rows`) by whichever process holds them.

    The token places come first (int64, 8-byte aligned from an 8-byte aligned start), then one
    ``[tokens, d_model]`` tensor per row key, each piece's tokens after the previous piece's."""

    path: Path  # the temporary file, renamed into place once complete
    name: str  # the shard's file name in the store
    tokens: int
    token_bytes: int  # bytes of one token's row: d_model x the dtype's size
    begins: Mapping[str, int]  # each tensor's first byte in the file

    def offsets(self, keys: Sequence[str], token: int) -> list[int]:
        """Where the rows ``keys`` of the token ``token`` of this shard start (a place's
        first byte for token 0)."""
        return [self.begins[key] + token * self.token_bytes for key in keys]


def write_rows(path: str, offsets: Sequence[int], rows: Sequence[Any], row_bytes: int) -> None:
    """Each of ``rows`` (CPU tensors of ``row_bytes`` bytes each, as the `ShardFile` laid
    them out) written whole at its offset in the file at ``path``.

    An in-process collection's ranks call this for each piece they computed, so a shard's
    rows never travel: shipped as saves they were pickled by the rank, passed through the
    engine core, unpickled by the client, concatenated, serialised again and written, several
    copies of 141 MB a batch when every layer of ``demo`` is collected, on the cores the
    prefill needs."""
    import torch

    descriptor = os.open(path, os.O_WRONLY)
    try:
        for offset, row in zip(offsets, rows, strict=True):
            data = memoryview(row.contiguous().view(torch.uint8).numpy().reshape(-1))
            if len(data) != row_bytes:  # a row of another shape would overwrite its neighbour
                raise ValueError(
                    f"a row of {tuple(row.shape)} {row.dtype} is {len(data)} bytes; the shard "
                    f"laid out {row_bytes} for it"
                )
            while data:  # a write to a regular file may stop short of a large buffer
                done = os.pwrite(descriptor, data, offset)
                data, offset = data[done:], offset + done
    finally:
        os.close(descriptor)


def shard_header(
    places: Sequence[str],
    keys: Sequence[str],
    tokens: int,
    d_model: int,
    dtype: str,
    file_format: str,
) -> tuple[bytes, dict[str, int], int]:
    """safetensors' header for a shard of the int64 ``places`` and the ``keys`` rows, its
    metadata naming ``file_format``, with each tensor's first byte in the file and the
    file's size."""
    name, size = SAFETENSORS_DTYPES[dtype]
    layout = [(key, "I64", [tokens], 8 * tokens) for key in places]
    layout += [(key, name, [tokens, d_model], tokens * d_model * size) for key in keys]
    header: dict[str, Any] = {"__metadata__": {"format": file_format}}
    spans, end = {}, 0
    for key, kind, shape, length in layout:
        header[key] = {"dtype": kind, "shape": shape, "data_offsets": [end, end + length]}
        spans[key], end = end, end + length
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned, as safetensors writes
    start = 8 + len(text)
    begins = {key: start + span for key, span in spans.items()}
    return struct.pack("<Q", len(text)) + text, begins, start + end
