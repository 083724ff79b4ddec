"""The tuned lens (Belrose et al., 2023): one affine translator per layer, trained against
the engine, applied on the ranks.

A layer's residual stream is not in the basis the final norm and head expect, so the logit
lens is biased at early layers. The tuned lens learns, for every layer but the last,
``h -> h + A h + b`` (A and b start at zero: the logit lens) minimising KL(final || lens).

Training takes the streams from the engine in traces (whole tensors at any TP, batch by
batch: memory stays bounded), and the final distribution from the head's weights, gathered
from the engine once: a batch's final logits would be ``tokens x vocab`` floats to ship
every step (25 MB per 128 tokens on the demo model), the head is ``vocab x d_model`` once.
The translators train on this process's CPU, layer by layer (one layer's ``tokens x vocab``
logits at a time, never all layers'). Applying them runs on the ranks: the engine installs
them once (`envoykit.ranks.translators`) and every lens names them by their hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, load_file, save, save_file

from envoykit import _compat as compat
from envoykit.errors import InvalidRequest
from envoykit.model.readout import at, norm_parameters, walk
from envoykit.results.identity import IDENTITY, check_same_model
from envoykit.results.tuned import LensQuality

# Head rows hashed to recognise a model (bfloat16-rounded: the same model in float32 and in
# bfloat16 is the same model).
_FINGERPRINT_ROWS = 64
_HEAD_CHUNK = 8192
_SEQUENCE_TOKENS = 128
# Optimizer steps between two measurements on the held-out texts.
_VALIDATE_EVERY = 5


@dataclass(frozen=True)
class Head:
    """The model's readout, gathered whole on the client: final norm and unembedding."""

    weight: torch.Tensor  # [vocab, d_model]
    gain: torch.Tensor  # [d_model]
    bias: torch.Tensor  # [d_model], zeros for an RMS norm
    eps: float
    centered: bool  # a LayerNorm: the mean is subtracted first
    head_bias: torch.Tensor  # [vocab], zeros for a head without one
    soft_cap: float | None
    logit_scale: float

    def log_probs(self, stream: torch.Tensor) -> torch.Tensor:
        """``log_softmax`` of the logits the model would give for ``stream`` ``[T, d]``."""
        if self.centered:
            stream = stream - stream.mean(-1, keepdim=True)
        scale = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = stream * scale * self.gain + self.bias
        logits = normed @ self.weight.T + self.head_bias
        if self.soft_cap:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return torch.log_softmax(logits * self.logit_scale, -1)


class TunedLens:
    """Per-layer translators of one model; ``engine.lens(..., translator=tuned)`` applies them.

    ``weights[layer] = (A, b)`` for lens layers ``0..n_layers-1`` (the last layer's stream is
    the model's own output, so it is left as is). ``model`` names the model they belong to:
    name, shape and a hash of its head (`fingerprint`).
    """

    def __init__(self, weights: dict[int, tuple[torch.Tensor, torch.Tensor]], model: dict):
        self.weights = {
            layer: (a.detach().float(), b.detach().float()) for layer, (a, b) in weights.items()
        }
        self.model = dict(model)
        # Set by `train`: how it did against the logit lens on the texts it held out.
        self.quality: LensQuality | None = None
        # The weights and the model they belong to: the same numbers for another model are
        # other translators (and are checked against the engine again).
        identity = json.dumps({k: self.model.get(k) for k in IDENTITY}, sort_keys=True)
        self.key = hashlib.sha256(self.to_bytes() + identity.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"TunedLens({self.model['name']!r}, {len(self.weights)} translators, key={self.key})"

    # -- training ---------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        engine: Any,
        texts: Sequence[str],
        *,
        max_seconds: float | None = None,
        steps: int | None = None,
        lr: float = 1e-3,
        weight_decay: float = 1e-3,
        batch_tokens: int = 256,
        validation: float = 0.1,
        seed: int = 0,
        progress: bool = True,
        stop: Any = None,
        warn: bool = True,
    ) -> TunedLens:
        """Train translators on ``texts`` against ``engine``, the way the tuned lens is
        trained to be trusted: a ``validation`` share of the texts is held out, and the
        translators kept are those best on it (measured every `_VALIDATE_EVERY` steps and at
        the end), not those with the lowest training loss. ``weight_decay`` (AdamW) pulls
        the translators towards zero, the logit lens, where the data do not say otherwise.

        Stops after ``steps`` optimizer steps, or before a step that would end past
        ``max_seconds`` at the pace of the steps so far (one step always runs), or after one
        pass over the texts if neither is given, or before the next step once ``stop``
        (anything with ``is_set()``, such as a ``threading.Event`` a Cancel button sets from
        another thread) is set: the best translators so far are returned, as at any other
        end, and ``model["stopped"]`` says so. Deterministic given ``seed``. The
        result's ``quality`` is its `LensQuality` on the held-out texts; a warning says so
        when it beats the logit lens at fewer than half of the layers (``warn=False``: the
        caller says it, as the explorer's training panel does in its header, since a
        warning from a thread lands under whichever cell ran last).
        """
        from tqdm.auto import tqdm

        for name, value in (("max_seconds", max_seconds), ("steps", steps)):
            if value is not None and (isinstance(value, bool) or value <= 0):
                raise InvalidRequest(f"{name} must be positive, not {value!r}")
        if batch_tokens < 1:
            raise InvalidRequest(f"batch_tokens must be at least 1, not {batch_tokens!r}")
        if not 0 < validation < 1:
            raise InvalidRequest(
                f"validation is a share of the texts in (0, 1), not {validation!r}"
            )
        batches, held_out = _batches(engine.tokenizer, texts, batch_tokens, seed, validation)
        info = engine.info
        torch.manual_seed(seed)
        head = gather_head(engine)
        checking = layer_streams(engine, held_out)
        n, d = info.n_layers, info.d_model
        weight = torch.zeros(n, d, d, requires_grad=True)
        bias = torch.zeros(n, d, requires_grad=True)
        optimizer = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=weight_decay)
        started = time.monotonic()
        # Zero translators (the logit lens) are the first candidate: training that never
        # beats them on held-out text returns them.
        best = _keep_best((math.inf, None, None), head, checking, weight, bias)
        total = steps or (None if max_seconds else len(batches))
        # The bar counts steps; with only a time budget, its total is the seconds allowed.
        bar = tqdm(total=total or max_seconds, desc="tuned lens", disable=not progress)
        step = 0
        try:
            # At least one step, however long the set-up took of a time budget; after it,
            # no step that would end past the budget at the pace of the steps so far.
            stepping = time.monotonic()
            while (total is None or step < total) and not (
                max_seconds and step and _over_budget(started, stepping, step, max_seconds)
            ):
                if stop is not None and step and stop.is_set():
                    break
                streams = layer_streams(engine, batches[step % len(batches)])
                loss = _step(head, streams, weight, bias, optimizer)
                step += 1
                if step % _VALIDATE_EVERY == 0:
                    best = _keep_best(best, head, checking, weight, bias)
                bar.set_postfix(kl=f"{loss:.3f}", held_out=f"{best[0]:.3f}")
                bar.n = round(time.monotonic() - started) if total is None else step
                bar.refresh()
        finally:
            bar.close()
        best = _keep_best(best, head, checking, weight, bias)
        _, (final_weight, final_bias), quality = best
        assert quality is not None  # it comes with the translators just unpacked
        weights = {layer: (final_weight[layer], final_bias[layer]) for layer in range(n)}
        stopped = stop is not None and stop.is_set()
        tuned = cls(
            weights,
            {
                **fingerprint(engine),
                "steps": step,
                "seed": seed,
                **({"stopped": True} if stopped else {}),
            },
        )
        tuned.quality = quality
        if warn and tuned.quality.better < 0.5:
            warnings.warn(
                f"the tuned lens is closer to the final distribution than the logit lens at "
                f"only {round(tuned.quality.better * n)} of {n} layers on held-out text: "
                "train it for longer or on more text (tuned.quality has the figures)",
                stacklevel=2,
            )
        return tuned

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, engine: Any, texts: Sequence[str]) -> LensQuality:
        """Mean KL(final || layer) per layer, logit lens and tuned lens, on ``texts``, from
        the engine's own lens statistics."""
        logit: float | np.ndarray = 0.0  # [L] sums once the first piece is added
        tuned: float | np.ndarray = 0.0
        tokens = 0
        pieces = _pieces(engine.tokenizer, texts)
        if not pieces:
            raise InvalidRequest(
                "evaluate needs texts of at least 8 tokens: these give no piece to measure"
            )
        for text, _ in pieces:
            plain = engine.lens(text, layers=range(0, engine.info.n_layers))
            translated = engine.lens(text, layers=range(0, engine.info.n_layers), translator=self)
            logit = logit + plain.kl.sum(1)
            tuned = tuned + translated.kl.sum(1)
            tokens += plain.kl.shape[1]
        return LensQuality(
            plain.layers, np.asarray(logit / tokens), np.asarray(tuned / tokens), tokens
        )

    # -- files ------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The translators as safetensors bytes (what the ranks install)."""
        return save(self._tensors())

    def to_file_bytes(self) -> bytes:
        """What `save` writes, as bytes: the translators and, in the metadata, the model
        (what a connection sends to a server)."""
        return save(self._tensors(), metadata=self._metadata())

    @classmethod
    def from_bytes(cls, blob: bytes) -> TunedLens:
        """Read what `to_file_bytes` (or `save`) wrote; `InvalidRequest` unless it is a
        tuned lens whose translators have the shapes of the model it names. Safetensors,
        not pickle: reading it runs nothing."""
        try:
            tensors = load(bytes(blob))
            meta = _safetensors_metadata(blob)
            model = json.loads(meta["envoykit.model"])
        except Exception as error:
            raise InvalidRequest(
                f"not a tuned lens saved by envoykit ({type(error).__name__}: {error})"
            ) from error
        return cls._from_tensors(tensors, model)

    @classmethod
    def _from_tensors(cls, tensors: dict[str, torch.Tensor], model: Any) -> TunedLens:
        if not isinstance(model, dict) or not all(k in model for k in IDENTITY):
            raise InvalidRequest("not a tuned lens saved by envoykit: its model is not named")
        n, d = model["n_layers"], model["d_model"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, d)):
            raise InvalidRequest(f"not a tuned lens: n_layers {n!r}, d_model {d!r}")
        expected = len(tensors) == 2 * n and {f"{k}.{i}" for i in range(n) for k in "Ab"}
        if set(tensors) != expected:
            raise InvalidRequest(
                f"a tuned lens of {n} layers holds A.0..A.{n - 1} and b.0..b.{n - 1}, "
                f"not {sorted(tensors)[:8]}"
            )
        for name, tensor in sorted(tensors.items()):
            shape = (d, d) if name.startswith("A.") else (d,)
            if tuple(tensor.shape) != shape or not tensor.is_floating_point():
                raise InvalidRequest(
                    f"translator {name} is {tuple(tensor.shape)} {tensor.dtype}, not a "
                    f"floating-point {shape} (d_model {d})"
                )
        return cls(
            {layer: (tensors[f"A.{layer}"], tensors[f"b.{layer}"]) for layer in range(n)}, model
        )

    def _metadata(self) -> dict[str, str]:
        return {"envoykit.model": json.dumps(self.model)}

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for layer, (a, b) in self.weights.items():
            tensors[f"A.{layer}"], tensors[f"b.{layer}"] = a.contiguous(), b.contiguous()
        return tensors

    def save(self, path: str | Path) -> Path:
        """``path`` (safetensors) holding the translators and, in its metadata, the model."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(self._tensors(), str(path), metadata=self._metadata())
        return path

    @classmethod
    def load(cls, path: str | Path, engine: Any = None) -> TunedLens:
        """Read what `save` wrote; with ``engine``, refuse translators of another model."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise InvalidRequest(
                f"no translators at {path}: train them with TunedLens.train or `envoykit tune`"
            )
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata() or {}
        if "envoykit.model" not in meta:
            raise InvalidRequest(f"{path} is not a tuned lens saved by envoykit")
        tensors = load_file(str(path))
        layers = sorted({int(name.split(".")[1]) for name in tensors})
        lens = cls(
            {layer: (tensors[f"A.{layer}"], tensors[f"b.{layer}"]) for layer in layers},
            json.loads(meta["envoykit.model"]),
        )
        if engine is not None:
            lens.check(engine)
        return lens

    def check(self, engine: Any) -> None:
        """`InvalidRequest` naming both models unless these translators are ``engine``'s."""
        self.check_fingerprint(fingerprint(engine))

    def check_fingerprint(self, model: dict) -> None:
        """`check` against a model's `fingerprint` (a server checks with its own)."""
        check_same_model(
            self.model, model, "these translators were trained", "train them on this model"
        )


def _over_budget(started: float, stepping: float, steps: int, budget: float) -> bool:
    """Whether one more step, as long as the mean step since ``stepping``, would end more
    than ``budget`` seconds after ``started``."""
    now = time.monotonic()
    return now + (now - stepping) / steps - started > budget


def _step(
    head: Head,
    streams: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    optimizer: torch.optim.Optimizer,
) -> float:
    """One optimizer step on a batch's ``[n_layers + 1, T, d]`` streams; the mean over layers
    of KL(final || tuned layer). Layer by layer, each backward right after its forward, so
    only one layer's ``T x vocab`` logits live at a time."""
    with torch.no_grad():
        final = head.log_probs(streams[-1])
        final_probs = final.exp()
    optimizer.zero_grad()
    total = 0.0
    n = streams.shape[0] - 1
    for layer in range(n):
        h = streams[layer]
        translated = h + h @ weight[layer].T + bias[layer]
        kl = (final_probs * (final - head.log_probs(translated))).sum(-1).mean() / n
        kl.backward()
        total += float(kl.detach())
    optimizer.step()
    return total


def _pieces(tokenizer: Any, texts: Sequence[str]) -> list[tuple[str, int]]:
    """Texts cut into sequences of 8 to `_SEQUENCE_TOKENS` tokens: ``(text, tokens)``."""
    usable = [] if isinstance(texts, str) else [t for t in texts if isinstance(t, str)]
    if not any(t.strip() for t in usable):
        raise InvalidRequest("a tuned lens needs a non-empty list of texts")
    pieces = []
    for text in usable:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), _SEQUENCE_TOKENS):
            chunk = ids[start : start + _SEQUENCE_TOKENS]
            if len(chunk) >= 8:
                pieces.append((tokenizer.decode(chunk), len(chunk)))
    return pieces


def _batches(
    tokenizer: Any, texts: Sequence[str], batch_tokens: int, seed: int, held_out: float
) -> tuple[list[list[str]], list[str]]:
    """`_pieces` shuffled with ``seed``: a ``held_out`` share of them (at least one, at most
    two batches' tokens) apart, the rest grouped into training batches of about
    ``batch_tokens``."""
    pieces = _pieces(tokenizer, texts)
    random.Random(seed).shuffle(pieces)
    # A held-out share, but no more than two batches of tokens: it is measured every few
    # steps, over the whole vocabulary at every layer.
    count, tokens = 0, 0
    while count < max(1, round(held_out * len(pieces))) and tokens < 2 * batch_tokens:
        tokens += pieces[count][1]
        count += 1
    kept, pieces = [text for text, _ in pieces[:count]], pieces[count:]
    if sum(n for _, n in pieces) < batch_tokens:
        raise InvalidRequest(
            f"the texts hold {sum(n for _, n in pieces)} tokens, fewer than one batch "
            f"(batch_tokens={batch_tokens}): give more text or a smaller batch"
        )
    batches, current, count = [], [], 0
    for text, n in pieces:
        current.append(text)
        count += n
        if count >= batch_tokens:
            batches.append(current)
            current, count = [], 0
    return batches, kept


def _keep_best(
    best: tuple[float, Any, LensQuality | None],
    head: Head,
    streams: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> tuple[float, Any, LensQuality | None]:
    """``best`` or the current translators, whichever is closer to the final distribution
    on the held-out streams (mean KL over layers): ``(score, (A, b), their LensQuality)``."""
    quality = held_out_quality(head, streams, weight, bias)
    score = float(quality.tuned_kl.mean())
    if score < best[0]:
        return score, (weight.detach().clone(), bias.detach().clone()), quality
    return best


@torch.no_grad()
def held_out_quality(
    head: Head, streams: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> LensQuality:
    """`LensQuality` of translators on held-out ``streams`` ``[n_layers + 1, T, d]``: per
    layer, the mean KL(final || lens) of the logit lens and of the tuned lens."""
    final = head.log_probs(streams[-1])
    final_probs = final.exp()
    n = streams.shape[0] - 1

    def kl(x: torch.Tensor) -> float:
        return float((final_probs * (final - head.log_probs(x))).sum(-1).mean())

    logit = [kl(streams[layer]) for layer in range(n)]
    tuned = [
        kl(streams[layer] + streams[layer] @ weight[layer].T + bias[layer]) for layer in range(n)
    ]
    return LensQuality(np.arange(n), np.array(logit), np.array(tuned), int(streams.shape[1]))


def layer_streams(engine: Any, texts: Sequence[str]) -> torch.Tensor:
    """``[n_layers + 1, tokens, d_model]`` float32: the residual stream after the embedding and
    every layer, whole, for ``texts`` (one invoke each), joined along tokens."""
    import nnsight

    model, readout = engine.model, engine.readout
    readout.require("the tuned lens")
    reads = {layer: {"resid"} for layer in range(engine.info.n_layers + 1)}
    with engine.exclusive(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for text in texts:
            with tracer.invoke(text):
                streams = walk(readout, at(model, readout.layers), reads, {})
                stacked = nnsight.save(
                    torch.stack([h if r is None else h + r for h, r in streams]).float().cpu()
                )
    pieces = stacked if len(texts) > 1 else [stacked]
    return torch.cat(list(pieces), dim=1)


def gather_head(engine: Any) -> Head:
    """The unembedding and its bias (whole, in chunks of rows), the final norm's affine map
    (`envoykit.model.readout.norm_parameters`), the logit soft-cap and scale: what the final
    distribution is computed from."""
    import nnsight

    model, readout, vocab = engine.model, engine.readout, engine.info.vocab
    d_model = engine.info.d_model
    rows, biases = [], []
    with engine.exclusive():
        for start in range(0, vocab, _HEAD_CHUNK):
            ids = torch.arange(start, min(vocab, start + _HEAD_CHUNK))
            with model.trace("The", temperature=0.0, max_tokens=1):
                head = at(model, readout.unembedding)
                part = nnsight.save(head.rows(ids).float().cpu())
                bias = nnsight.save(head.bias_of(ids).float().cpu())
            rows.append(part)
            biases.append(bias)
        with model.trace("The", temperature=0.0, max_tokens=1):
            norm = at(model, readout.final_norm)
            like = at(model, readout.layers)[0].output
            like = (like[0] if isinstance(like, tuple) else like).float()
            affine = norm_parameters(norm, d_model, like)
            affine = nnsight.save({key: value.cpu() for key, value in affine.items()})
    processor = compat.envoy_module(model).logits_processor
    return Head(
        torch.cat(rows),
        affine["gain"],
        affine["bias"],
        float(affine["eps"]),
        bool(affine["centered"]),
        torch.cat(biases),
        processor.soft_cap,
        float(processor.scale),
    )


def fingerprint(engine: Any) -> dict:
    """What identifies a model here: its name and shape, and a hash of `_FINGERPRINT_ROWS`
    rows of its unembedding rounded to bfloat16."""
    import nnsight

    model, readout = engine.model, engine.readout
    ids = fingerprint_ids(engine.info.vocab)
    with engine.exclusive(), model.trace("The", temperature=0.0, max_tokens=1):
        rows = nnsight.save(at(model, readout.unembedding).rows(ids).float().cpu())
    return fingerprint_of(engine.info, rows)


def fingerprint_ids(vocab: int) -> torch.Tensor:
    """The token ids whose unembedding rows `fingerprint` hashes."""
    return torch.linspace(0, vocab - 1, _FINGERPRINT_ROWS).long()


def fingerprint_of(info: Any, rows: torch.Tensor) -> dict:
    """`fingerprint` of a model of `ModelInfo` ``info`` whose `fingerprint_ids` rows of the
    unembedding are ``rows``."""
    digest = hashlib.sha256(rows.bfloat16().view(torch.int16).numpy().tobytes()).hexdigest()
    return {
        "name": info.name,
        "n_layers": info.n_layers,
        "d_model": info.d_model,
        "vocab": info.vocab,
        "head_hash": digest,
    }


def _safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes: an 8-byte little-endian header length,
    then the JSON header."""
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ValueError("header longer than the data")
    header = json.loads(bytes(blob[8 : 8 + size]))
    return dict(header.get("__metadata__") or {})


def offline_texts() -> tuple[list[str], list[str]]:
    """English text available with no network, split into training and held-out texts: the
    topics of Python's own documentation (``pydoc_data.topics``, part of the standard
    library, under the Python Software Foundation License), in a fixed order, one in ten
    held out."""
    from pydoc_data.topics import topics

    texts = [topics[name] for name in sorted(topics) if len(topics[name]) > 500]
    return [t for i, t in enumerate(texts) if i % 10], [
        t for i, t in enumerate(texts) if not i % 10
    ]


def default_path(model: dict) -> Path:
    """Where translators of ``model`` are cached: the cache directory, by model and head."""
    from envoykit.runtime.models import cache_dir

    return cache_dir() / "tuned" / f"{model['name']}-{str(model['head_hash'])[:12]}.safetensors"


class InstalledTranslators:
    """Which tuned lenses an engine's ranks hold, least recently used first.

    Each tuned lens is ``n_layers * d_model**2`` floats on every rank (40 MB on demo, about
    2 GB on a 7B model), so the ranks keep at most `LIMIT`: installing another drops the
    least recently used, and using an evicted one installs it again.
    """

    LIMIT = 2

    def __init__(self) -> None:
        self._keys: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def keep_for(self, key: str) -> tuple[str, ...] | None:
        """None if ``key`` is installed (marked as just used); else the keys the ranks keep
        beside it, to send with its install."""
        if key in self._keys:
            self._keys.remove(key)
            self._keys.append(key)
            return None
        return tuple(self._keys[-(self.LIMIT - 1) :]) if self.LIMIT > 1 else ()

    def installed(self, key: str, kept: tuple[str, ...]) -> None:
        """Record that the ranks now hold ``kept`` and ``key``, and nothing else."""
        self._keys = [*kept, key]

    def clear(self) -> None:
        """The ranks hold none (a fresh start)."""
        self._keys = []
