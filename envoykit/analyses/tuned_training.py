"""Training a tuned lens's translators: the optimisation that fits ``h -> h + A h + b`` per
layer to the final distribution, within a time budget and a Cancel, keeping the
translators best on held-out text.

Apart from `envoykit.analyses.tuned` (the `TunedLens` class and its files) because this is
the one part that runs an optimizer; what it reads of the engine and how texts become
batches is `envoykit.analyses.tuned_data`, and how translators are measured is
`_HeldOut`. `TunedLens.train` calls `train_translators`.
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
# With a time budget, the share of it the first held-out measurement may take, which sizes
# the held-out set: the final measurement costs as much, and the rest is the training's.
MEASURING_SHARE = 0.1
# Held-out tokens measured at a time: the unit the budget trims the held-out set by.
_CHUNK = 64


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
    clock = _Clock(time.monotonic(), max_seconds, stop)
    _check(max_seconds, steps, batch_tokens, validation)
    batches, held_out = batches_of(engine.tokenizer, texts, batch_tokens, seed, validation)
    info = engine.info
    torch.manual_seed(seed)
    head = gather_head(engine)
    checking = _HeldOut(head, layer_streams(engine, held_out))
    # Zero translators (the logit lens) are the first candidate: training that never
    # beats them on held-out text, or is stopped first, returns them. Their measurement
    # also sizes the held-out set to the budget and times a measurement.
    checking.measure_logit_lens(clock)
    translators = _Translators(checking, info.n_layers, info.d_model, lr, weight_decay)
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
    held-out set ``checking``: ``(score, (A, b), LensQuality)``, the zero translators
    first."""

    def __init__(self, checking: _HeldOut, n: int, d: int, lr: float, weight_decay: float) -> None:
        self.checking = checking
        self.weight = torch.zeros(n, d, d, requires_grad=True)
        self.bias = torch.zeros(n, d, requires_grad=True)
        self.optimizer = torch.optim.AdamW(
            [self.weight, self.bias], lr=lr, weight_decay=weight_decay
        )
        zero = checking.logit_lens_quality()
        self.best: tuple[float, Any, LensQuality] = (
            float(zero.tuned_kl.mean()),
            (self.weight.detach().clone(), self.bias.detach().clone()),
            zero,
        )

    def step(self, engine: EngineBase, pieces: list[tuple[str, int]], clock: _Clock) -> bool:
        """One optimizer step on ``pieces`` (`_step`); False, and no step, once the stop is
        set."""
        head = self.checking.head
        return _step(engine, head, pieces, self.weight, self.bias, self.optimizer, clock)

    def validate(self, clock: _Clock) -> None:
        """Keep the current translators if they are the best on the held-out set yet;
        nothing once the stop is set."""
        quality = self.checking.quality(self.weight, self.bias, clock.stopped)
        if quality is not None and float(quality.tuned_kl.mean()) < self.best[0]:
            weights = (self.weight.detach().clone(), self.bias.detach().clone())
            self.best = float(quality.tuned_kl.mean()), weights, quality


class _HeldOut:
    """The held-out streams ``[n_layers + 1, T, d]`` in chunks of `_CHUNK` tokens, and the
    logit lens's KL on each chunk: measured once, as it never changes, and as the zero
    translators' measurement (which costs what any later one costs: one KL per layer and
    token)."""

    def __init__(self, head: Head, streams: torch.Tensor) -> None:
        self.head = head
        self.chunks = list(streams.split(_CHUNK, dim=1))
        self.logit = np.zeros(streams.shape[0] - 1)  # summed over the measured chunks' tokens

    def measure_logit_lens(self, clock: _Clock) -> None:
        """The logit lens's KL on the chunks in turn, the first whole; with a time budget,
        only as many as `MEASURING_SHARE` of it holds, and only until the stop: the chunks
        not reached leave the held-out set. Times the measurement for the clock."""
        began = time.monotonic()
        share = math.inf if clock.max_seconds is None else MEASURING_SHARE * clock.max_seconds
        measured = 0
        for chunk in self.chunks:
            if measured and (clock.stopped() or time.monotonic() - began > share):
                break
            sums = _kl_sums(self.head, chunk, lambda h, _: h, lambda: False)
            assert sums is not None  # a stop that is never set
            self.logit += sums
            measured += 1
        self.chunks = self.chunks[:measured]
        clock.measuring = time.monotonic() - began

    @property
    def tokens(self) -> int:
        return sum(int(chunk.shape[1]) for chunk in self.chunks)

    def logit_lens_quality(self) -> LensQuality:
        """The zero translators' `LensQuality`: the logit lens's on both sides."""
        logit = self.logit / self.tokens
        return LensQuality(np.arange(len(logit)), logit, logit.copy(), self.tokens)

    @torch.no_grad()
    def quality(
        self, weight: torch.Tensor, bias: torch.Tensor, stopped: Callable[[], bool]
    ) -> LensQuality | None:
        """`LensQuality` of translators ``(weight, bias)`` on the held-out set: per layer,
        the mean KL(final || lens) of the logit lens and of the tuned lens; None once
        ``stopped()``, asked before each layer."""
        tuned = np.zeros_like(self.logit)
        for chunk in self.chunks:
            sums = _kl_sums(self.head, chunk, lambda h, i: h + h @ weight[i].T + bias[i], stopped)
            if sums is None:
                return None
            tuned += sums
        logit = self.logit / self.tokens
        return LensQuality(np.arange(len(logit)), logit, tuned / self.tokens, self.tokens)


@torch.no_grad()
def _kl_sums(
    head: Head,
    streams: torch.Tensor,
    translate: Callable[[torch.Tensor, int], torch.Tensor],
    stopped: Callable[[], bool],
) -> np.ndarray | None:
    """Per layer, KL(final || lens of ``translate(h, layer)``) summed over the tokens of
    ``streams`` ``[n_layers + 1, T, d]``; None once ``stopped()``, asked before each layer."""
    final = head.log_probs(streams[-1])
    final_probs = final.exp()
    sums = []
    for layer in range(streams.shape[0] - 1):
        if stopped():
            return None
        lens = head.log_probs(translate(streams[layer], layer))
        sums.append(float((final_probs * (final - lens)).sum(-1).sum()))
    return np.array(sums)


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
