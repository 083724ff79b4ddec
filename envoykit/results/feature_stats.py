"""`FeatureStats`: what each feature of an SAE does over a corpus, and where it fires most.

Per feature: how many tokens it fired on, the sum of its activations, a histogram of them
(log-spaced bins shared by every feature), and its ``n`` max-activating contexts: the
document, the position, the activation, and a window of tokens around it with the
feature's activation at each (one context per document piece: the piece's maximum).

On disk (``engine.feature_stats(..., out=PATH)``), readable without envoykit::

    PATH/index.json                  settings, progress, the token texts of the windows
    PATH/stats-00003.safetensors     the arrays below (`ARRAYS`), float32/float64/int64

The index names the one stats file that is current; a newer one is written beside it and
named by a rewritten index before the old one is removed, so an interrupt leaves the last
whole state, which a rerun with the same arguments continues.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envoykit.errors import InvalidRequest
from envoykit.results.activations import StoreWriteError
from envoykit.results.base import Result, freeze_json, frozen_array

FORMAT = "envoykit-feature-stats"
VERSION = 1
INDEX = "index.json"
# The arrays of a state, in the safetensors file under these names.
ARRAYS = (
    "fired",
    "activation_sum",
    "histograms",
    "edges",
    "top_acts",
    "top_documents",
    "top_positions",
    "window_acts",
    "window_ids",
)
# The index keys that must match for a rerun to continue a store.
SETTINGS = ("model", "sae", "contexts", "window", "max_length")


@dataclass(frozen=True)
class Context:
    """One max-activating context of a feature: ``tokens`` around position ``position`` of
    document ``document`` (the window's ``focus``-th), and the feature's activation at each."""

    document: int
    position: int
    activation: float
    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]
    activations: tuple[float, ...]
    focus: int


@dataclass(frozen=True)
class FeatureStats(Result):
    """Corpus statistics of every feature of one SAE (see the module's docstring).

    ``fired`` ``[d_sae]`` tokens where the feature was on; ``activation_sum`` ``[d_sae]``;
    ``histograms`` ``[d_sae, bins]`` over the bin ``edges`` ``[bins + 1]`` (activations below
    the first edge count in the first bin, above the last in the last); ``top_acts``,
    ``top_documents``, ``top_positions`` ``[d_sae, n]`` the ``n`` best contexts, best first
    (document -1 where a feature has fewer); ``window_acts``/``window_ids`` ``[d_sae, n,
    window]`` their windows (id -1 outside the document's piece). ``token_text`` maps a
    window's token ids (as strings: JSON keys) to their text.
    """

    fired: np.ndarray
    activation_sum: np.ndarray
    histograms: np.ndarray
    edges: np.ndarray
    top_acts: np.ndarray
    top_documents: np.ndarray
    top_positions: np.ndarray
    window_acts: np.ndarray
    window_ids: np.ndarray
    n_tokens: int
    n_documents: int
    token_text: Any = field(default_factory=dict)
    meta: Any = field(default_factory=dict)

    def __post_init__(self) -> None:
        owner = "FeatureStats"
        fired = np.asarray(self.fired)
        tops = np.asarray(self.top_acts)
        windows = np.asarray(self.window_acts)
        d_sae, n = tops.shape if tops.ndim == 2 else (len(fired), -1)
        width = windows.shape[-1] if windows.ndim == 3 else -1
        bins = len(self.edges) - 1
        for name, dtype, shape in (
            ("fired", np.int64, (d_sae,)),
            ("activation_sum", np.float64, (d_sae,)),
            ("histograms", np.int64, (d_sae, bins)),
            ("edges", np.float64, (bins + 1,)),
            ("top_acts", np.float32, (d_sae, n)),
            ("top_documents", np.int64, (d_sae, n)),
            ("top_positions", np.int64, (d_sae, n)),
            ("window_acts", np.float32, (d_sae, n, width)),
            ("window_ids", np.int64, (d_sae, n, width)),
        ):
            object.__setattr__(
                self, name, frozen_array(owner, name, getattr(self, name), dtype, shape)
            )
        object.__setattr__(self, "n_tokens", int(self.n_tokens))
        object.__setattr__(self, "n_documents", int(self.n_documents))
        object.__setattr__(
            self, "token_text", freeze_json(dict(self.token_text), "FeatureStats.token_text")
        )
        object.__setattr__(self, "meta", freeze_json(dict(self.meta), "FeatureStats.meta"))

    @property
    def d_sae(self) -> int:
        return len(self.fired)

    @property
    def frequency(self) -> np.ndarray:
        """``[d_sae]`` the fraction of the corpus's tokens each feature fired on."""
        return self.fired / max(self.n_tokens, 1)

    @property
    def mean(self) -> np.ndarray:
        """``[d_sae]`` each feature's mean activation over every token (0 where off)."""
        return self.activation_sum / max(self.n_tokens, 1)

    @property
    def mean_when_active(self) -> np.ndarray:
        """``[d_sae]`` each feature's mean activation over the tokens it fired on (NaN for
        a feature that never fired)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.fired > 0, self.activation_sum / self.fired, np.nan)

    @property
    def max(self) -> np.ndarray:
        """``[d_sae]`` each feature's largest activation (0 for one that never fired)."""
        return self.top_acts[:, 0].astype(np.float64)

    def dead(self) -> np.ndarray:
        """The ids of the features that never fired on the corpus."""
        return np.flatnonzero(self.fired == 0)

    def histogram(self, feature: int) -> tuple[np.ndarray, np.ndarray]:
        """(bin edges ``[bins + 1]``, counts ``[bins]``) of ``feature``'s activations."""
        return self.edges, self.histograms[self._feature(feature)]

    def contexts(self, feature: int) -> list[Context]:
        """``feature``'s max-activating contexts, best first."""
        f = self._feature(feature)
        out = []
        for slot in range(self.top_acts.shape[1]):
            if self.top_documents[f, slot] < 0:
                break
            ids = self.window_ids[f, slot]
            inside = ids >= 0
            before = int((~inside[: _focus_index(len(ids))]).sum())
            kept = ids[inside]
            out.append(
                Context(
                    document=int(self.top_documents[f, slot]),
                    position=int(self.top_positions[f, slot]),
                    activation=float(self.top_acts[f, slot]),
                    tokens=tuple(str(self.token_text.get(str(i), "")) for i in kept),
                    token_ids=tuple(int(i) for i in kept),
                    activations=tuple(float(a) for a in self.window_acts[f, slot][inside]),
                    focus=_focus_index(len(ids)) - before,
                )
            )
        return out

    def to_pandas(self) -> Any:
        """One row per feature: frequency, mean, mean when active, max."""
        import pandas as pd

        return pd.DataFrame(
            {
                "frequency": self.frequency,
                "mean": self.mean,
                "mean_when_active": self.mean_when_active,
                "max": self.max,
            },
            index=pd.RangeIndex(self.d_sae, name="feature"),
        )

    @classmethod
    def open(cls, path: str | Path) -> FeatureStats:
        """The statistics stored at ``path`` (as far as they got, if the run was cut)."""
        path = Path(path)
        index = read_index(path)
        from safetensors.numpy import load_file

        arrays = load_file(str(path / index["file"]))
        return cls(
            **{name: arrays[name] for name in ARRAYS},
            n_tokens=index["tokens"],
            n_documents=index["documents"],
            token_text=index["token_text"],
            meta={**index["meta"], "complete": index["complete"]},
        )

    def _feature(self, feature: Any) -> int:
        if isinstance(feature, (bool, np.bool_)) or not isinstance(feature, (int, np.integer)):
            raise InvalidRequest(f"a feature id is an integer, not {feature!r}")
        if not 0 <= int(feature) < self.d_sae:
            raise InvalidRequest(f"feature {feature} is out of range: this SAE has {self.d_sae}")
        return int(feature)

    def __repr__(self) -> str:
        sae = self.meta.get("sae", {})
        return (
            f"FeatureStats({self.d_sae} features of {sae.get('hook_name', 'an SAE')} over "
            f"{self.n_tokens} tokens of {self.n_documents} documents; "
            f"{len(self.dead())} never fired)"
        )


def _focus_index(width: int) -> int:
    """Where a context's focus token sits in its window (see `envoykit.ranks.feature_stats`)."""
    return width - width // 4 - 1


def read_index(path: Path) -> dict[str, Any]:
    """The index of the statistics store at ``path``; `InvalidRequest` if there is none."""
    try:
        index = json.loads((path / INDEX).read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"{path} holds no feature statistics (no {INDEX})") from None
    if index.get("format") != FORMAT:
        raise InvalidRequest(f"{path / INDEX} is not an envoykit feature-statistics index")
    return index


class StatsWriter:
    """Writes a run's state to its store, each time whole, and continues a cut one."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path, self.index = path, index

    @classmethod
    def open(cls, path: str | Path, settings: dict[str, Any]) -> StatsWriter:
        """The store at ``path``: a new one, or one of the same settings to continue. A
        store of other settings is refused and left as it is."""
        path = Path(path)
        if (path / INDEX).exists():
            index = read_index(path)
            other = [key for key in SETTINGS if index["settings"].get(key) != settings[key]]
            if other:
                raise InvalidRequest(
                    f"{path} holds feature statistics of other settings ({', '.join(other)} "
                    "differ): give another out directory (the store was left as it is)"
                )
        else:
            path.mkdir(parents=True, exist_ok=True)
            index = {
                "format": FORMAT,
                "version": VERSION,
                "settings": settings,
                "file": None,
                "documents": 0,
                "tokens": 0,
                "chain": "",
                "complete": False,
                "token_text": {},
                "meta": {},
            }
        for stray in path.glob("*.tmp"):
            stray.unlink()
        for old in path.glob("stats-*.safetensors"):
            if old.name != index["file"]:
                old.unlink()
        return cls(path, index)

    def state(self) -> dict[str, np.ndarray] | None:
        """The arrays stored so far; None for a new store."""
        if self.index["file"] is None:
            return None
        from safetensors.numpy import load_file

        return load_file(str(self.path / self.index["file"]))

    def write(self, arrays: dict[str, np.ndarray], progress: dict[str, Any]) -> None:
        """Store ``arrays`` as the current state, with ``progress`` (documents, tokens, chain,
        complete, token_text, meta) in the index."""
        from safetensors.numpy import save

        previous = self.index["file"]
        generation = 0 if previous is None else int(previous[6:11]) + 1
        name = f"stats-{generation:05d}.safetensors"
        blob = save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
        self._replace(name, blob)
        self.index.update(progress, file=name)
        self._replace(INDEX, json.dumps(self.index).encode())
        if previous is not None:
            (self.path / previous).unlink(missing_ok=True)

    def _replace(self, name: str, blob: bytes) -> None:
        temporary = self.path / (name + ".tmp")
        try:
            temporary.write_bytes(blob)
            os.replace(temporary, self.path / name)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            full = "the disk is full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else str(error)
            raise StoreWriteError(
                error.errno,
                f"writing {name} in {self.path} failed: {full}. The state before it "
                f"({self.index['documents']} documents) is intact; free space and run the "
                "same feature_stats again to continue",
            ) from error
