"""Training a tuned lens's translators: the optimisation that fits ``h -> h + A h + b`` per
layer to the final distribution, within a time budget and a Cancel, keeping the
translators best on held-out text.

Apart from `envoykit.analyses.tuned` (the `TunedLens` class and its files) because this is
the one part that runs an optimizer; what it reads of the engine and how texts become
batches is `envoykit.analyses.tuned_data`, and how translators are measured is
`held_out_quality`. `TunedLens.train` calls `train_translators`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envoykit.analyses.tuned_data import Head, batches_of, gather_head, layer_streams
from envoykit.errors import InvalidRequest
from envoykit.results.tuned import LensQuality

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase

# Optimizer steps between two measurements on the held-out texts.
VALIDATE_EVERY = 5


@dataclass(frozen=True)
class Trained:
    """What `train_translators` returns: the translators kept, ``weights[layer] = (A, b)``,
    the optimizer steps taken and the translators' `LensQuality` on the held-out texts."""

    weights: dict[int, tuple[torch.Tensor, torch.Tensor]]
    steps: int
    quality: LensQuality
    step_tokens: tuple[int, ...]  # each step's tokens, as sized for a time budget
    stopped: bool  # the stop ended it


def train_translators(
    engine: EngineBase,
    texts: Sequence[str],
    *,
    max_seconds: float | None,
    steps: int | None,
    lr: float,
    weight_decay: float,
    batch_tokens: int,
    validation: float,
    seed: int,
    progress: bool,
    stop: Any,
) -> Trained:
    """The translators of `TunedLens.train` (which has the arguments), best on the held-out
    share of ``texts``."""
    _check(max_seconds, steps, batch_tokens, validation)
    batches, held_out = batches_of(engine.tokenizer, texts, batch_tokens, seed, validation)
    info = engine.info
    torch.manual_seed(seed)
    head = gather_head(engine)
    checking = layer_streams(engine, held_out)
    translators = _Translators(head, checking, info.n_layers, info.d_model, lr, weight_decay)
    clock = _Clock(time.monotonic(), max_seconds, stop)
    # Zero translators (the logit lens) are the first candidate: training that never
    # beats them on held-out text, or is stopped first, returns them. Measured whole (the
    # one measurement the stop does not cut short) and timed: each costs the same.
    translators.validate(clock, stoppable=False)
    total = steps or (None if max_seconds else len(batches))
    sizes = _optimise(engine, batches, translators, total, clock, progress)
    translators.validate(clock)
    _, (final_weight, final_bias), quality = translators.best
    assert quality is not None  # it comes with the translators just unpacked
    weights = {layer: (final_weight[layer], final_bias[layer]) for layer in range(info.n_layers)}
    return Trained(weights, len(sizes), quality, tuple(sizes), clock.stopped())


class _Clock:
    """A training's time budget and its Cancel: what is left of ``max_seconds`` (counted
    from ``started``), the pace of the steps so far and the cost of a held-out measurement,
    and whether ``stop`` is set. Each stage asks it before each piece of its work, so a
    Cancel acts within one piece (one layer's backward, or one layer's measurement)."""

    def __init__(self, started: float, max_seconds: float | None, stop: Any) -> None:
        self.started, self.max_seconds, self.stop = started, max_seconds, stop
        self.per_token: float | None = None  # seconds a training token costs
        self.measuring = 0.0  # seconds a held-out measurement costs

    def stopped(self) -> bool:
        return self.stop is not None and bool(self.stop.is_set())

    def left(self) -> float:
        if self.max_seconds is None:
            return math.inf
        return self.started + self.max_seconds - time.monotonic()

    def tokens_that_fit(self) -> float:
        """How many training tokens the budget still holds, keeping the time of the final
        held-out measurement; any number before the pace is known, or without a budget."""
        if self.per_token is None or self.max_seconds is None:
            return math.inf
        return (self.left() - self.measuring) / self.per_token


def _check(
    max_seconds: float | None, steps: int | None, batch_tokens: int, validation: float
) -> None:
    """`InvalidRequest` for a budget, batch or held-out share training cannot run with."""
    for name, value in (("max_seconds", max_seconds), ("steps", steps)):
        if value is not None and (isinstance(value, bool) or value <= 0):
            raise InvalidRequest(f"{name} must be positive, not {value!r}")
    if batch_tokens < 1:
        raise InvalidRequest(f"batch_tokens must be at least 1, not {batch_tokens!r}")
    if not 0 < validation < 1:
        raise InvalidRequest(f"validation is a share of the texts in (0, 1), not {validation!r}")


class _Translators:
    """The translators being trained, every layer's at once (``A`` stacked as ``weight``,
    ``b`` as ``bias``, both starting at zero), their optimizer, and the best so far on the
    held-out streams ``checking`` (`_keep_best`)."""

    def __init__(
        self, head: Head, checking: torch.Tensor, n: int, d: int, lr: float, weight_decay: float
    ) -> None:
        self.head, self.checking = head, checking
        self.weight = torch.zeros(n, d, d, requires_grad=True)
        self.bias = torch.zeros(n, d, requires_grad=True)
        self.optimizer = torch.optim.AdamW(
            [self.weight, self.bias], lr=lr, weight_decay=weight_decay
        )
        self.best: tuple[float, Any, LensQuality | None] = (math.inf, None, None)

    def step(self, engine: EngineBase, pieces: list[tuple[str, int]], clock: _Clock) -> bool:
        """One optimizer step on ``pieces`` (`_step`); False, and no step, once the stop is
        set."""
        return _step(engine, self.head, pieces, self.weight, self.bias, self.optimizer, clock)

    def validate(self, clock: _Clock, *, stoppable: bool = True) -> None:
        """Keep the current translators if they are the best on the held-out streams yet
        (and time the measurement); nothing once the stop is set, if ``stoppable``."""
        began = time.monotonic()
        stopped = clock.stopped if stoppable else lambda: False
        best = _keep_best(self.best, self.head, self.checking, self.weight, self.bias, stopped)
        if best is not None:
            self.best = best
            clock.measuring = time.monotonic() - began


def _optimise(
    engine: EngineBase,
    batches: list[list[tuple[str, int]]],
    translators: _Translators,
    total: int | None,
    clock: _Clock,
    progress: bool,
) -> list[int]:
    """Steps over ``batches`` in turn, measured every `VALIDATE_EVERY`, until ``total``
    steps, the time budget or the stop; the tokens of each step taken.

    With a time budget the first step takes one piece of its batch, to learn the pace, and
    each later step as many pieces of its batch as the budget holds at that pace (keeping
    the time of the final measurement): training ends when not one piece fits."""
    from tqdm.auto import tqdm

    # The bar counts steps; with only a time budget, its total is the seconds allowed.
    bar = tqdm(total=total or clock.max_seconds, desc="tuned lens", disable=not progress)
    sizes: list[int] = []
    try:
        while (total is None or len(sizes) < total) and not clock.stopped():
            pieces = _fitting(batches[len(sizes) % len(batches)], clock, first=not sizes)
            began = time.monotonic()
            if not pieces or not translators.step(engine, pieces, clock):
                break
            tokens = sum(n for _, n in pieces)
            clock.per_token = (time.monotonic() - began) / tokens
            sizes.append(tokens)
            # A measurement on the way, if the budget holds it and the final one after it.
            if len(sizes) % VALIDATE_EVERY == 0 and 2 * clock.measuring < clock.left():
                translators.validate(clock)
            bar.set_postfix(held_out=f"{translators.best[0]:.3f}")
            bar.n = round(time.monotonic() - clock.started) if total is None else len(sizes)
            bar.refresh()
    finally:
        bar.close()
    return sizes


def _fitting(batch: list[tuple[str, int]], clock: _Clock, *, first: bool) -> list[tuple[str, int]]:
    """The pieces of ``batch`` a step takes: one for the first step of a time budget (its
    pace is not known yet), else as many as the budget holds (all, without one)."""
    if first and clock.max_seconds is not None:
        return batch[:1]
    room, taken, tokens = clock.tokens_that_fit(), [], 0
    for text, n in batch:
        if tokens + n > room:
            break
        taken.append((text, n))
        tokens += n
    return taken


def _step(
    engine: EngineBase,
    head: Head,
    pieces: list[tuple[str, int]],
    weight: torch.Tensor,
    bias: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    clock: _Clock,
) -> bool:
    """One optimizer step on ``pieces`` against the mean over layers of KL(final || tuned
    layer), averaged over all their tokens: the gradient is accumulated a piece at a time
    (one trace each) and a layer at a time (each backward right after its forward, so only
    one layer's ``T x vocab`` logits live at a time). False, and no step, once the stop is
    set: it is looked at before each piece and each layer."""
    optimizer.zero_grad()
    tokens = sum(n for _, n in pieces)
    for text, n in pieces:
        if clock.stopped():
            return False
        streams = layer_streams(engine, [text])
        with torch.no_grad():
            final = head.log_probs(streams[-1])
            final_probs = final.exp()
        layers = streams.shape[0] - 1
        for layer in range(layers):
            if clock.stopped():
                return False
            h = streams[layer]
            translated = h + h @ weight[layer].T + bias[layer]
            kl = (final_probs * (final - head.log_probs(translated))).sum(-1).mean()
            (kl * (n / tokens / layers)).backward()
    optimizer.step()
    return True


def _keep_best(
    best: tuple[float, Any, LensQuality | None],
    head: Head,
    streams: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    stopped: Callable[[], bool],
) -> tuple[float, Any, LensQuality | None] | None:
    """``best`` or the current translators, whichever is closer to the final distribution
    on the held-out streams (mean KL over layers): ``(score, (A, b), their LensQuality)``;
    None if ``stopped()`` before the measurement ended."""
    quality = held_out_quality(head, streams, weight, bias, stopped)
    if quality is None:
        return None
    score = float(quality.tuned_kl.mean())
    if score < best[0]:
        return score, (weight.detach().clone(), bias.detach().clone()), quality
    return best


@torch.no_grad()
def held_out_quality(
    head: Head,
    streams: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    stopped: Callable[[], bool] = lambda: False,
) -> LensQuality | None:
    """`LensQuality` of translators on held-out ``streams`` ``[n_layers + 1, T, d]``: per
    layer, the mean KL(final || lens) of the logit lens and of the tuned lens; None once
    ``stopped()``, asked before each layer."""
    final = head.log_probs(streams[-1])
    final_probs = final.exp()
    n = streams.shape[0] - 1

    def kl(x: torch.Tensor) -> float:
        return float((final_probs * (final - head.log_probs(x))).sum(-1).mean())

    logit, tuned = [], []
    for layer in range(n):
        if stopped():
            return None
        h = streams[layer]
        logit.append(kl(h))
        tuned.append(kl(h + h @ weight[layer].T + bias[layer]))
    return LensQuality(np.arange(n), np.array(logit), np.array(tuned), int(streams.shape[1]))
