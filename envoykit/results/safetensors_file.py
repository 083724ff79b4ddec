"""Safetensors that carry envoykit's metadata: a tuned lens's translators, a steering vector,
an SAE sent to a server. Each is tensors plus one JSON value under a key of its own in the
file's metadata, and `read` reads any of them, from a file or from bytes: a file that is not
of the kind asked for is refused with the same message whatever the kind, and reading one
runs nothing (safetensors, not pickle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envoykit.errors import InvalidRequest

if TYPE_CHECKING:
    import torch


def metadata_of(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes: an 8-byte little-endian header length,
    then the JSON header."""
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ValueError("header longer than the data")
    header = json.loads(bytes(blob[8 : 8 + size]))
    return dict(header.get("__metadata__") or {})


def read(source: Path | bytes, key: str, kind: str) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors of ``source`` (a file, or a file's bytes) and the JSON value under ``key``
    in its metadata; `InvalidRequest` ("not ``kind``", with what failed) unless it has both."""
    from safetensors import safe_open
    from safetensors.torch import load

    try:
        if isinstance(source, Path):
            with safe_open(str(source), "pt") as handle:  # one open for both
                metadata = handle.metadata() or {}
                names = handle.keys()  # (a safe_open handle is not iterable itself)
                tensors = {name: handle.get_tensor(name) for name in names}
        else:
            blob = bytes(source)
            tensors, metadata = load(blob), metadata_of(blob)
        value = json.loads(metadata[key])
    except Exception as error:
        where = f"{source} is " if isinstance(source, Path) else ""
        raise InvalidRequest(f"{where}not {kind} ({type(error).__name__}: {error})") from error
    return tensors, value
