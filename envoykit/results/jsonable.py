"""JSON export shared by every result class: one way to write a result and read it back.

A result is a frozen dataclass of numpy arrays, tuples, numbers and a read-only ``meta``;
`Jsonable` writes its fields as plain lists and dicts and reads them back through the class's
own constructor, which checks them again. float32 values survive the round trip bit for bit
(JSON keeps the shortest decimal that reads back to the same double, which holds the float).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

T = TypeVar("T", bound="Jsonable")


class Jsonable:
    """Mixin for frozen dataclasses: `to_dict`, `to_json`, `from_dict`, `from_json`."""

    if TYPE_CHECKING:  # every subclass is a dataclass
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (lists, dicts), ready for `json.dumps`."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self, path: str | None = None) -> str:
        """The result as JSON (exact: float32 values survive the round trip bit for bit)."""
        text = json.dumps(self.to_dict())
        if path is not None:
            with open(path, "w") as handle:
                handle.write(text)
        return text

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any]) -> T:
        return cls(**data)

    @classmethod
    def from_json(cls: type[T], text_or_path: str) -> T:
        """Read what `to_json` wrote: the JSON text itself, or the path of a file holding it."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path) as handle:
                text = handle.read()
        return cls.from_dict(json.loads(text))


def plain(value: Any) -> Any:
    """``value`` as lists, dicts and scalars: arrays and tuples become lists, mappings dicts."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value
