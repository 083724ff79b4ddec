"""`Result`: the one frozen base of every statistic envoykit returns.

A result is a frozen dataclass whose arrays are read-only copies and whose ``meta`` is a
read-only JSON value, so nothing that holds it (a plot, a widget, a cache) can change what
another holder sees. Read-only mappings cannot be pickled or deep-copied, and a copy must be
as frozen as its original, so a result pickles (and copies) by rebuilding itself through its
constructor from plain values: multiprocessing, joblib and ``copy.deepcopy`` all work, and the
copy is checked again on the way in.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from envoykit.results.jsonable import Jsonable


class Result(Jsonable):
    """Base class of the frozen result dataclasses (subclasses are ``@dataclass(frozen=True)``)."""

    def __reduce__(self) -> tuple:
        return (type(self), tuple(thaw(getattr(self, f.name)) for f in dataclasses.fields(self)))


def frozen_array(
    owner: str, name: str, value: Any, dtype: Any, shape: tuple[int, ...] | None = None
) -> np.ndarray:
    """A read-only copy of ``value`` as ``dtype``; ``ValueError`` naming ``owner.name`` if its
    shape is not ``shape`` (where given)."""
    array = np.array(value, dtype=dtype)
    if shape is not None and array.shape != shape:
        raise ValueError(f"{owner}.{name} has shape {array.shape}, expected {shape}")
    array.flags.writeable = False
    return array


def freeze_json(value: Any, where: str) -> Any:
    """A read-only copy of a JSON value: mappings become read-only, lists tuples."""
    if isinstance(value, Mapping):
        bad = [key for key in value if not isinstance(key, str)]
        if bad:
            raise ValueError(f"{where} keys must be strings, not {bad[0]!r}")
        return types.MappingProxyType(
            {key: freeze_json(item, f"{where}[{key!r}]") for key, item in value.items()}
        )
    if isinstance(value, (list, tuple)):
        return tuple(freeze_json(item, f"{where}[{i}]") for i, item in enumerate(value))
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise ValueError(
        f"{where} must be a JSON value (str, int, float, bool, None, list, dict), "
        f"not {type(value).__name__}: convert it before storing it"
    )


def thaw(value: Any) -> Any:
    """The ``dict``/``list`` form of what `freeze_json` made; arrays and other values as they
    are (a constructor copies arrays anyway)."""
    if isinstance(value, types.MappingProxyType):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [thaw(item) for item in value]
    return value
