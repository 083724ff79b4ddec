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
logits at a time, never all layers'), in `envoykit.analyses.tuned_training`. Applying them
runs on the ranks: the engine installs them once (`envoykit.ranks.translators`) and every
lens names them by their hash.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save, save_file

from envoykit.analyses.tuned_data import cut_pieces
from envoykit.analyses.tuned_training import train_translators
from envoykit.errors import InvalidRequest
from envoykit.results import safetensors_file
from envoykit.results.identity import IDENTITY, check_same_model
from envoykit.results.tuned import LensQuality

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase

# Where a saved tuned lens names its model (in the safetensors metadata), and what it is.
MODEL_KEY = "envoykit.model"
KIND = "a tuned lens saved by envoykit"

# Head rows hashed to recognise a model (bfloat16-rounded: the same model in float32 and in
# bfloat16 is the same model).


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
        engine: EngineBase,
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
        translators kept are those best on it (measured every `tuned_training.VALIDATE_EVERY`
        steps and at the end), not those with the lowest training loss. ``weight_decay``
        (AdamW) pulls the translators towards zero, the logit lens, where the data do not say
        otherwise.

        Stops after ``steps`` optimizer steps of ``batch_tokens`` tokens, or after one pass
        over the texts if no budget is given, or within ``max_seconds`` (counted from the
        call): the held-out set is then cut to what a tenth of the budget measures, the first
        step takes one piece of text (128 tokens at most) to learn the pace, and each later
        step as much of its batch as the time left holds at that pace, keeping the time of
        the final held-out measurement; training ends when no piece fits.
        ``model["step_tokens"]`` records each step's tokens. ``stop`` (anything with
        ``is_set()``, such as a ``threading.Event`` a Cancel button sets from another
        thread) is looked at before each piece of text, each layer's backward and each layer
        of a held-out measurement, so it acts within one of them: the step in flight is
        dropped, and the best translators so far are returned (the logit lens's zero
        translators if none beat them), with ``model["stopped"]`` saying so. Deterministic
        given ``seed`` and ``steps``. The result's ``quality`` is its `LensQuality` on the
        held-out texts; a warning says so when it beats the logit lens at fewer than half of
        the layers (``warn=False``: the caller says it, as the explorer's training panel
        does in its header, since a warning from a thread lands under whichever cell ran
        last).
        """
        run = train_translators(
            engine,
            texts,
            max_seconds=max_seconds,
            steps=steps,
            lr=lr,
            weight_decay=weight_decay,
            batch_tokens=batch_tokens,
            validation=validation,
            seed=seed,
            progress=progress,
            stop=stop,
        )
        n = engine.info.n_layers
        tuned = cls(
            run.weights,
            {
                **engine.fingerprint(),
                "steps": run.steps,
                "step_tokens": list(run.step_tokens),
                "seed": seed,
                **({"stopped": True} if run.stopped else {}),
            },
        )
        tuned.quality = run.quality
        if warn and tuned.quality.better < 0.5:
            warnings.warn(
                f"the tuned lens is closer to the final distribution than the logit lens at "
                f"only {round(tuned.quality.better * n)} of {n} layers on held-out text: "
                "train it for longer or on more text (tuned.quality has the figures)",
                stacklevel=2,
            )
        return tuned

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, engine: EngineBase, texts: Sequence[str]) -> LensQuality:
        """Mean KL(final || layer) per layer, logit lens and tuned lens, on ``texts``, from
        the engine's own lens statistics."""
        logit: float | np.ndarray = 0.0  # [L] sums once the first piece is added
        tuned: float | np.ndarray = 0.0
        tokens = 0
        pieces = cut_pieces(engine.tokenizer, texts)
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
        tensors, model = safetensors_file.read(blob, MODEL_KEY, KIND)
        return cls._from_tensors(tensors, model)

    @classmethod
    def _from_tensors(cls, tensors: dict[str, torch.Tensor], model: object) -> TunedLens:
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
        return {MODEL_KEY: json.dumps(self.model)}

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
    def load(cls, path: str | Path, engine: EngineBase | None = None) -> TunedLens:
        """Read what `save` wrote, checked as `from_bytes` checks; with ``engine``, refuse
        translators of another model."""
        path = Path(path)
        if not path.is_file():
            raise InvalidRequest(
                f"no translators at {path}: train them with TunedLens.train or `envoykit tune`"
            )
        lens = cls._from_tensors(*safetensors_file.read(path, MODEL_KEY, KIND))
        if engine is not None:
            lens.check(engine)
        return lens

    def check(self, engine: EngineBase) -> None:
        """`InvalidRequest` naming both models unless these translators are ``engine``'s."""
        self.check_fingerprint(engine.fingerprint())

    def check_fingerprint(self, model: dict) -> None:
        """`check` against a model's `fingerprint` (a server checks with its own)."""
        check_same_model(
            self.model, model, "these translators were trained", "train them on this model"
        )


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
