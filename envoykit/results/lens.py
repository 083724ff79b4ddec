"""`LensResult`: the statistic a logit lens produces — labelled, validated, immutable.

Plots and widgets read only this; tests check this. Every transform returns a new instance
(``res.select(layers=[1, 2]).stride(2)``), and a result is checked on construction — dtypes,
shapes against each other, value ranges — so an inconsistent result cannot exist. Its arrays
are read-only copies and its ``meta`` a read-only mapping: nothing that holds a result (a
plot, a widget, a notebook cell) can change what another holder sees.

Rows are (layer, site) pairs (``layers``, ``sites``), columns sequence positions
(``positions``). `select` picks by those labels; `take` picks by index into the arrays.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np

from envoykit.errors import InvalidRequest
from envoykit.results.base import Result, freeze_json, thaw

# Where in a layer a lens row reads the model, in the order the model computes them.
SITES = ("attn", "resid_mid", "mlp", "resid")
# How a row's label names its site: layer 12's rows are "12.attn", "12.mid", "12.mlp", "12".
SITE_SUFFIXES = {"attn": ".attn", "resid_mid": ".mid", "mlp": ".mlp", "resid": ""}

# How far outside its valid range a statistic may fall by float rounding in the code that
# computed it (a probability of 1.0000001, an entropy of -1e-7). Such values are kept as they
# are, not clipped — a result holds the numbers the ranks computed, bit for bit — and anything
# further out is refused.
TOLERANCE = 1e-5


@dataclass(frozen=True)
class TargetTrace(Result):
    """One target token across the lens: ``prob`` and ``rank`` are ``[layers, positions]``.

    ``rank`` 0 means the target is the most likely token at that cell. Both arrays are
    read-only.
    """

    label: str
    token_id: int
    token: str
    prob: np.ndarray
    rank: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "prob", _frozen(np.array(self.prob, dtype=np.float32)))
        object.__setattr__(self, "rank", _frozen(np.array(self.rank, dtype=np.int64)))


@dataclass(frozen=True, eq=False)
class LensResult(Result):
    """A logit lens of one prompt.

    Layer 0 is the embedding output, layer ``i`` the residual stream after decoder layer
    ``i`` (so the last layer is ``n_layers``). Shapes: ``L`` layers, ``P`` positions, ``k``
    top tokens, ``N`` targets.

    Attributes:
        prompt: the prompt text.
        token_ids: ``[P]`` the input token at each position.
        tokens: ``[P]`` the decoded input tokens, as they are (a token may repeat);
            `token_labels` makes them distinct for display (``"the#5"``).
        positions: ``[P]`` sequence position of each column, strictly increasing.
        layers: ``[L]`` layer number of each row (0 = embedding).
        sites: ``[L]`` where in its layer each row reads the model: ``"resid"`` (after the
            layer), ``"resid_mid"`` (between attention and MLP), ``"attn"`` or ``"mlp"``
            (what that block writes); see `envoykit.analyses.lens`. Rows are labelled ``"12"``,
            ``"12.mid"``, ``"12.attn"``, ``"12.mlp"`` (`layer_labels`). All ``"resid"`` when
            not given.
        top_ids: ``[L, P, k]`` the k most likely next tokens, most likely first.
        top_tokens: ``[L, P, k]`` those tokens, decoded.
        top_probs: ``[L, P, k]`` their probabilities, non-increasing along ``k``.
        entropy: ``[L, P]`` entropy of the next-token distribution, in nats.
        kl: ``[L, P]`` KL(final layer || this layer), in nats.
        target_ids: ``[N]`` target token ids; target_labels: ``[N]`` as the user gave them;
        target_tokens: ``[N]`` decoded.
        target_probs, target_ranks: ``[L, P, N]``.
        n_generated: how many of the last positions are generated tokens.
        meta: model name, TP size, dtype and the like: a read-only mapping of JSON values.

    On construction, integer arrays (ids, positions, layers, ranks) are stored as int64 and
    real ones (probabilities, entropy, KL) as float32, the precision the ranks send; token
    arrays hold ``str``. Ids, positions, layers and ranks are >= 0; probabilities lie in
    [0, 1], entropy and KL are >= 0 (each within `TOLERANCE`). NaN is allowed in the real
    arrays and means "no value at this cell" (a plot leaves it blank). A violation raises
    ``ValueError`` naming the field.

    >>> import numpy as np
    >>> res = LensResult.example()
    >>> res.top_probs.shape, res.stride(2).layers.tolist()
    ((3, 2, 2), [0, 2])
    >>> res.top_probs.flags.writeable
    False
    """

    prompt: str
    token_ids: np.ndarray
    tokens: tuple[str, ...]
    positions: np.ndarray
    layers: np.ndarray
    top_ids: np.ndarray
    top_tokens: np.ndarray
    top_probs: np.ndarray
    entropy: np.ndarray
    kl: np.ndarray
    target_ids: np.ndarray
    target_labels: tuple[str, ...]
    target_tokens: tuple[str, ...]
    target_probs: np.ndarray
    target_ranks: np.ndarray
    n_generated: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    sites: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._freeze()
        self._check_shapes()
        self._check_ranges()

    def _freeze(self) -> None:
        """Store read-only copies in canonical dtypes, refusing values of the wrong kind.

        Copies, so the caller's own arrays stay writeable and cannot change this result.
        """
        if not isinstance(self.prompt, str):
            raise ValueError(f"LensResult.prompt must be a string, not {type(self.prompt)}")
        for name, (kind, dtype) in _ARRAY_FIELDS.items():
            object.__setattr__(
                self, name, _frozen(_as_array(name, getattr(self, name), kind, dtype))
            )
        for name in _TEXT_FIELDS:
            if isinstance(getattr(self, name), str):
                raise ValueError(f"LensResult.{name} is a sequence of strings, not one string")
            value = tuple(getattr(self, name))
            bad = [item for item in value if not isinstance(item, str)]
            if bad:
                raise ValueError(f"LensResult.{name} must hold strings, not {bad[0]!r}")
            object.__setattr__(self, name, value)
        sites = tuple(self.sites) or ("resid",) * len(self.layers)
        unknown = sorted({str(site) for site in sites} - set(SITES))
        if unknown:
            raise ValueError(f"LensResult.sites holds unknown sites {unknown}: sites are {SITES}")
        object.__setattr__(self, "sites", sites)
        if isinstance(self.n_generated, bool) or not isinstance(self.n_generated, Integral):
            raise ValueError(f"LensResult.n_generated must be an integer, not {self.n_generated!r}")
        object.__setattr__(self, "n_generated", int(self.n_generated))
        object.__setattr__(self, "meta", freeze_json(self.meta, "LensResult.meta"))

    def _check_shapes(self) -> None:
        n_layers, n_pos = len(self.layers), len(self.positions)
        k = self.top_ids.shape[-1] if self.top_ids.ndim == 3 else -1
        n_targets = len(self.target_ids)
        expected = {
            "positions": (n_pos,),
            "layers": (n_layers,),
            "sites": (n_layers,),
            "token_ids": (n_pos,),
            "target_ids": (n_targets,),
            "top_ids": (n_layers, n_pos, k),
            "top_tokens": (n_layers, n_pos, k),
            "top_probs": (n_layers, n_pos, k),
            "entropy": (n_layers, n_pos),
            "kl": (n_layers, n_pos),
            "target_probs": (n_layers, n_pos, n_targets),
            "target_ranks": (n_layers, n_pos, n_targets),
        }
        for name, shape in expected.items():
            actual = np.shape(getattr(self, name))
            if actual != shape:
                raise ValueError(f"LensResult.{name} has shape {actual}, expected {shape}")
        for name, size in (
            ("tokens", n_pos),
            ("target_labels", n_targets),
            ("target_tokens", n_targets),
        ):
            if len(getattr(self, name)) != size:
                raise ValueError(
                    f"LensResult.{name} has {len(getattr(self, name))} entries, expected {size}"
                )
        rows = list(zip(self.layers.tolist(), self.sites))
        if len(set(rows)) != len(rows):
            raise ValueError("LensResult rows must be distinct (layer, site) pairs")
        if any(layer == 0 and site != "resid" for layer, site in rows):
            raise ValueError("LensResult: layer 0 (the embedding) has only the 'resid' site")
        if not 0 <= self.n_generated <= n_pos:
            raise ValueError(f"LensResult.n_generated={self.n_generated} outside 0..{n_pos}")
        if n_layers == 0 or n_pos == 0:
            raise ValueError("a LensResult needs at least one layer and one position")

    def _check_ranges(self) -> None:
        for name in ("token_ids", "positions", "layers", "top_ids", "target_ids", "target_ranks"):
            _check_bound(name, getattr(self, name), low=0)
        if np.any(np.diff(self.positions) <= 0):
            raise ValueError(
                f"LensResult.positions must be strictly increasing: {self.positions.tolist()}"
            )
        for name in ("top_probs", "target_probs"):
            _check_bound(name, getattr(self, name), low=-TOLERANCE, high=1 + TOLERANCE)
        for name in ("entropy", "kl"):
            _check_bound(name, getattr(self, name), low=-TOLERANCE)
        # NaN compares false, so a missing cell breaks neither order nor sum.
        rising = np.diff(self.top_probs, axis=-1) > TOLERANCE
        if rising.any():
            where = tuple(int(i) for i in np.argwhere(rising)[0])
            raise ValueError(
                f"LensResult.top_probs must be most likely first: it rises after {where}"
            )
        _check_bound("top_probs summed over k", self.top_probs.sum(-1), high=1 + TOLERANCE)

    # -- reading ---------------------------------------------------------------------------

    @property
    def layer_labels(self) -> list[str]:
        """One label per row: ``"embed"``, ``"12"``, ``"12.mid"``, ``"12.attn"``, ``"12.mlp"``."""
        return [
            "embed" if layer == 0 else f"{int(layer)}{SITE_SUFFIXES[site]}"
            for layer, site in zip(self.layers, self.sites)
        ]

    @property
    def run_label(self) -> str:
        """What was run, in words, from ``meta``: "logit lens" or "tuned lens", then
        "patched (…)" and "steered (…)" where the run was, so no title, status line or
        export passes an edited run off as a plain one."""
        parts = ["tuned lens" if self.meta.get("lens") == "tuned" else "logit lens"]
        patches = self.meta.get("patches") or ()
        if patches:
            cells = ", ".join(
                f"head {p['head']} of layer {p['layer']}"
                if p.get("head") is not None
                else f"layer {p['layer']} {p.get('site', 'resid')}"
                for p in patches
            )
            parts.append(f"patched ({cells})")
        steers = self.meta.get("steer") or ()
        if steers:
            where = ", ".join(f"layer {s['layer']} x{s['scale']:g}" for s in steers)
            parts.append(f"steered ({where})")
        return ", ".join(parts)

    @property
    def token_labels(self) -> tuple[str, ...]:
        """The input tokens as display labels: a token that repeats suffixed with its
        position (``"the#5"``), so every column has a name of its own."""
        return distinct_labels(self.tokens, self.positions.tolist())

    def target(self, which: str | int) -> TargetTrace:
        """The trace of one target, by the label it was asked with, its token text or its id."""
        for i, (label, token, tid) in enumerate(
            zip(self.target_labels, self.target_tokens, self.target_ids)
        ):
            if which in (label, token) or (isinstance(which, int) and which == int(tid)):
                return TargetTrace(
                    label, int(tid), token, self.target_probs[..., i], self.target_ranks[..., i]
                )
        raise KeyError(f"{which!r} is not a target of this lens: targets are {self.target_labels}")

    def top1(self, position: int = -1) -> list[tuple[int, str, float]]:
        """``(layer, token, probability)`` of the most likely token per layer at one column.

        ``position`` is an index into ``positions`` (-1, the default, is the last column).
        """
        return [
            (
                int(layer),
                str(self.top_tokens[i, position, 0]),
                float(self.top_probs[i, position, 0]),
            )
            for i, layer in enumerate(self.layers)
        ]

    def top_k_trace(self, token_id: int, position: int = -1) -> tuple[str, np.ndarray]:
        """The token text and ``[L]`` probability of a token that is not a target, read from
        the top-k lists at one column: NaN at the rows where it was not among the top k.

        It is what a stored result can say of a token nobody asked for; a target's trace
        (`target`) is exact at every row.

        >>> res = LensResult.example()
        >>> res.top_k_trace(4)
        ('w', array([0.3, 0.2, 0.1], dtype=float32))
        >>> res.top_k_trace(99)[1]
        array([nan, nan, nan], dtype=float32)
        """
        hits = self.top_ids[:, position, :] == token_id
        probs = np.where(hits, self.top_probs[:, position, :], 0).sum(axis=1)
        where = np.argwhere(self.top_ids == token_id)
        token = str(self.top_tokens[tuple(where[0])]) if len(where) else str(token_id)
        return token, np.where(hits.any(axis=1), probs, np.nan).astype(np.float32)

    # -- transforms ------------------------------------------------------------------------

    def select(
        self,
        layers: int | Sequence[int] | None = None,
        positions: int | Sequence[int] | None = None,
        sites: str | Sequence[str] | None = None,
    ) -> LensResult:
        """A result restricted to some layers, positions and sites, named by their values.

        ``layers`` are layer numbers (values of ``self.layers``): the rows come in the order
        asked, each with every row of that layer. ``positions`` are sequence positions
        (values of ``self.positions``): on a result with positions ``[3, 7]``,
        ``positions=[3]`` keeps the first column. Columns stay in sequence order. ``sites``
        keeps the rows of those sites. A value the result does not hold raises ``KeyError``
        naming those it does. `take` selects by index.
        """
        layer_index = None
        if layers is not None:
            wanted = _values("layers", layers, self.layers)
            layer_index = [i for layer in wanted for i in np.flatnonzero(self.layers == layer)]
        if sites is not None:
            wanted_sites = [sites] if isinstance(sites, str) else list(sites)
            missing = [site for site in wanted_sites if site not in self.sites]
            if missing:
                raise KeyError(f"sites {missing} are not in this result: {sorted(set(self.sites))}")
            rows = range(len(self.layers)) if layer_index is None else layer_index
            layer_index = [i for i in rows if self.sites[i] in wanted_sites]
        position_index = None
        if positions is not None:
            wanted = _values("positions", positions, self.positions)
            position_index = [int(np.flatnonzero(self.positions == p)[0]) for p in wanted]
        return self.take(layer_index=layer_index, position_index=position_index)

    def take(
        self,
        layer_index: int | Sequence[int] | None = None,
        position_index: int | Sequence[int] | None = None,
    ) -> LensResult:
        """A result restricted to some rows and columns, named by their index in the arrays.

        Indices follow Python (-1 is the last). Rows come in the order asked; columns stay in
        sequence order, each once. `select` picks by layer number and sequence position.
        """
        rows = _indices("layer_index", layer_index, len(self.layers))
        columns = _indices("position_index", position_index, len(self.positions))
        columns = sorted(set(columns))
        n_prompt = len(self.positions) - self.n_generated
        changes: dict[str, Any] = {name: _pick(getattr(self, name), rows) for name in _ROW_FIELDS}
        changes.update({name: _pick(getattr(self, name), columns) for name in _COLUMN_FIELDS})
        grid = np.ix_(np.array(rows, dtype=np.intp), np.array(columns, dtype=np.intp))
        changes.update({name: getattr(self, name)[grid] for name in _GRID_FIELDS})
        changes["n_generated"] = sum(1 for c in columns if c >= n_prompt)
        return dataclasses.replace(self, **changes)

    def stride(self, n: int) -> LensResult:
        """Every ``n``-th row, always keeping the last (where the prediction is made)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidRequest(f"stride must be an integer of at least 1, not {n!r}")
        keep = list(range(0, len(self.layers), n))
        if keep[-1] != len(self.layers) - 1:
            keep.append(len(self.layers) - 1)
        return self.take(layer_index=keep)

    # -- export ----------------------------------------------------------------------------

    def to_pandas(self) -> Any:
        """Long format: one row per (layer, position, rank) with that cell's statistics."""
        import pandas as pd

        n_layers, n_pos, k = self.top_ids.shape
        li, pi, ri = np.meshgrid(np.arange(n_layers), np.arange(n_pos), np.arange(k), indexing="ij")
        frame = pd.DataFrame(
            {
                "layer": self.layers[li.ravel()],
                "site": np.array(self.sites, dtype=object)[li.ravel()],
                "row": np.array(self.layer_labels, dtype=object)[li.ravel()],
                "position": self.positions[pi.ravel()],
                "input_token": np.array(self.tokens, dtype=object)[pi.ravel()],
                "rank": ri.ravel(),
                "token_id": self.top_ids.ravel(),
                "token": self.top_tokens.ravel(),
                "prob": self.top_probs.ravel(),
                "entropy": self.entropy[li.ravel(), pi.ravel()],
                "kl": self.kl[li.ravel(), pi.ravel()],
            }
        )
        for i, label in enumerate(self.target_labels):
            frame[f"target_prob[{label}]"] = self.target_probs[li.ravel(), pi.ravel(), i]
            frame[f"target_rank[{label}]"] = self.target_ranks[li.ravel(), pi.ravel(), i]
        return frame

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values (lists, dicts), ready for `json.dumps`."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.tolist() if isinstance(value, np.ndarray) else thaw(value)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LensResult:
        kwargs = dict(data)
        for name, (_, dtype) in _ARRAY_FIELDS.items():
            kwargs[name] = np.asarray(kwargs[name], dtype=dtype)
        return cls(**kwargs)

    def plot(self, metric: str = "prob", **kwargs: Any) -> Any:
        """The heatmap of this result (see `envoykit.plot.heatmap`)."""
        from envoykit import plot

        return plot.heatmap(self, metric, **kwargs)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{label}</td><td><code>{html.escape(repr(tok))}"
            f"</code></td><td>{prob:.3f}</td></tr>"
            for label, (_, tok, prob) in zip(self.layer_labels, self.top1(-1))
        )
        where = html.escape(repr(self.tokens[-1]))
        return (
            f"<div><b>{html.escape(self.run_label.capitalize())}</b> of "
            f"{html.escape(repr(self.prompt))} — top-1 per layer at "
            f"the last position ({where})<table><tr><th>layer</th><th>top-1</th><th>p</th></tr>"
            f"{rows}</table></div>"
        )

    def __repr__(self) -> str:
        return (
            f"LensResult(prompt={self.prompt!r}, layers={len(self.layers)}, "
            f"positions={len(self.positions)}, k={self.top_ids.shape[-1]}, "
            f"targets={list(self.target_labels)})"
        )

    @classmethod
    def example(cls) -> LensResult:
        """A small hand-made result (3 layers, 2 positions, k=2) for docs and tests."""
        probs = np.array(
            [[[0.5, 0.2], [0.4, 0.3]], [[0.6, 0.1], [0.5, 0.2]], [[0.9, 0.05], [0.7, 0.1]]]
        )
        return cls(
            prompt="a b",
            token_ids=np.array([5, 6]),
            tokens=("a", " b"),
            positions=np.array([0, 1]),
            layers=np.array([0, 1, 2]),
            top_ids=np.array([[[1, 2], [3, 4]]] * 3),
            top_tokens=np.array([[["x", "y"], ["z", "w"]]] * 3, dtype=object),
            top_probs=probs.astype(np.float32),
            entropy=np.ones((3, 2), dtype=np.float32),
            kl=np.array([[0.5, 0.4], [0.2, 0.1], [0.0, 0.0]], dtype=np.float32),
            target_ids=np.array([3]),
            target_labels=(" z",),
            target_tokens=(" z",),
            target_probs=np.full((3, 2, 1), 0.1, dtype=np.float32),
            target_ranks=np.zeros((3, 2, 1), dtype=np.int64),
        )


# Each array field: the kind of values it takes ("int", "real" or "text") and how it is stored.
_ARRAY_FIELDS: dict[str, tuple[str, Any]] = {
    "token_ids": ("int", np.int64),
    "positions": ("int", np.int64),
    "layers": ("int", np.int64),
    "top_ids": ("int", np.int64),
    "top_tokens": ("text", object),
    "top_probs": ("real", np.float32),
    "entropy": ("real", np.float32),
    "kl": ("real", np.float32),
    "target_ids": ("int", np.int64),
    "target_probs": ("real", np.float32),
    "target_ranks": ("int", np.int64),
}
_TEXT_FIELDS = ("tokens", "target_labels", "target_tokens")
# What `take` cuts along rows, along columns, and along both. A field labelling rows (one
# entry per layer row) goes in _ROW_FIELDS, an array or a tuple alike.
_ROW_FIELDS = ("layers", "sites")
_COLUMN_FIELDS = ("token_ids", "tokens", "positions")
_GRID_FIELDS = (
    "top_ids",
    "top_tokens",
    "top_probs",
    "entropy",
    "kl",
    "target_probs",
    "target_ranks",
)


def _as_array(name: str, value: Any, kind: str, dtype: Any) -> np.ndarray:
    """``value`` as a fresh array of ``dtype``, if its values are of ``kind``."""
    array = np.asarray(value)
    if array.size == 0:  # nothing in it to misread, whatever dtype an empty list got
        return np.array(array, dtype=dtype)
    if kind == "int":
        ok = np.issubdtype(array.dtype, np.integer)
    elif kind == "real":
        ok = np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    else:
        ok = array.dtype.kind == "U" or (
            array.dtype == object and all(isinstance(item, str) for item in array.flat)
        )
    if not ok:
        wanted = {"int": "integers", "real": "real numbers", "text": "strings"}[kind]
        raise ValueError(f"LensResult.{name} must hold {wanted}, not {array.dtype}")
    return np.array(array, dtype=dtype)


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _check_bound(name: str, values: np.ndarray, low: float = -np.inf, high: float = np.inf) -> None:
    """Refuse values below ``low`` or above ``high`` (NaN passes: it marks a missing cell)."""
    with np.errstate(invalid="ignore"):
        outside = (values < low) | (values > high)
    if outside.any():
        where = tuple(int(i) for i in np.argwhere(outside)[0])
        if high == np.inf:
            bound = f">= {low}"
        elif low == -np.inf:
            bound = f"<= {high}"
        else:
            bound = f"in [{low}, {high}]"
        raise ValueError(
            f"LensResult.{name} must be {bound}: it is {values[where]} at index {list(where)}"
        )


def _values(name: str, wanted: Any, available: np.ndarray) -> list[int]:
    """The labels asked for, as a list; ``KeyError`` naming what there is if one is absent."""
    items = [wanted] if isinstance(wanted, Integral) else list(wanted)
    missing = [
        item
        for item in items
        if isinstance(item, bool) or not isinstance(item, Integral) or item not in available
    ]
    if missing:
        index = "layer_index" if name == "layers" else "position_index"
        raise KeyError(
            f"{name} {missing} are not in this result, whose {name} are {available.tolist()} "
            f"(take({index}=...) picks by index)"
        )
    return [int(item) for item in items]


def _indices(name: str, index: Any, size: int) -> list[int]:
    """Indices into an axis of ``size``, negative ones from the end, as non-negative ints."""
    if index is None:
        return list(range(size))
    items = [index] if isinstance(index, Integral) else list(index)
    for item in items:
        outside = not isinstance(item, Integral) or not -size <= int(item) < size
        if isinstance(item, bool) or outside:
            raise IndexError(
                f"{name} {item!r} is outside the result: it has {size} (0..{size - 1}, "
                f"or -{size}..-1 from the end)"
            )
    return [int(item) % size for item in items]


def _pick(value: np.ndarray | tuple, index: list[int]) -> np.ndarray | tuple:
    return value[index] if isinstance(value, np.ndarray) else tuple(value[i] for i in index)


def distinct_labels(tokens: Sequence[str], positions: Sequence[int]) -> tuple[str, ...]:
    """Tokens as labels, a repeated one suffixed with its position (``"the#5"``)."""
    counts: dict[str, int] = {}
    for token in tokens:
        counts[token] = counts.get(token, 0) + 1
    return tuple(
        token if counts[token] == 1 else f"{token}#{position}"
        for token, position in zip(tokens, positions)
    )
