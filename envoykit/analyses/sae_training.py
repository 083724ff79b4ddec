"""`train_sae`: a sparse autoencoder trained on stored activations, on this process's CPU.

What it reads: one (layer, site) row of an activation store (`envoykit.results.activations`),
shard by shard, never the whole store; or the same rows as a tensor in memory; or an
engine's activations of ``texts``, collected into a temporary store removed afterwards.
Every row reaches training through `envoykit.analyses.sae_rows.Reader`, which hands out a
fixed number of rows at a time whatever the shards' boundaries, so a store and its rows in
memory give the same batches in the same order, and the same SAE bit for bit.

The recipe is TopK (Gao et al., 2024, "Scaling and evaluating sparse autoencoders",
arXiv:2406.04093) as EleutherAI's sparsify implements it (eai-sparsify 1.3.3,
``sparsify/sparse_coder.py``, ``sparsify/trainer.py``, ``sparsify/config.py``): the loss is
the batch's fraction of variance unexplained plus 1/32 of the AuxK loss on dead latents
(the paper's coefficient; sparsify's ``auxk_alpha`` defaults to 0 since 1.x); decoder rows
are unit norm, their gradient's component along each row removed before Adam's step;
the encoder starts as the decoder's transpose, ``b_dec`` as the data's mean. The encoder's
backward pass is sparse (only the k picked latents of a token carry a gradient), as
sparsify's fused encoder is on GPU. ReLU is SAELens 6's "standard" recipe (an L1 penalty
on the activations weighted by the decoder rows' norms). ``docs/sae_training.md`` has the
choices and their sources.

Inputs are scaled as SAELens's ``normalize_activations="expected_average_only_in"`` does:
one factor, ``sqrt(d_in) / mean ||x||`` over the training rows, then folded into the saved
weights (``W_enc * s``, ``W_dec / s``, ``b_dec / s``), so the SAE returned reads raw
activations and says ``normalize_activations="none"``.

This module holds the entry point and the loop; the arguments and the run's plan are
`envoykit.analyses.sae_plan`'s, the rows `envoykit.analyses.sae_rows`', the SAE being
trained `envoykit.analyses.sae_model`'s.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from envoykit.analyses.corpus import ProgressBar, progress_bar
from envoykit.analyses.request import Documents
from envoykit.analyses.sae import SAE
from envoykit.analyses.sae_model import TrainingSAE
from envoykit.analyses.sae_plan import Options, Plan, check_options, plan_run
from envoykit.analyses.sae_rows import Reader, Rows, batches, rows_of, statistics
from envoykit.errors import InvalidRequest
from envoykit.results.activations import Activations

# The rows kept out of training: the source's last ones, a tenth of them, at most this many.
HELD_OUT_SHARE = 0.1
HELD_OUT_MAX = 4096
# Optimizer steps between two measurements on the held-out rows.
EVAL_EVERY = 20
LOG = "training_log.json"


def train_sae(
    source: Any,
    *,
    layer: int,
    site: str = "resid",
    architecture: str = "topk",
    d_sae: int | None = None,
    expansion: float = 16,
    k: int | None = None,
    l1_coefficient: float | None = None,
    max_seconds: float | None = None,
    max_tokens: int | None = None,
    batch_size: int = 4096,
    lr: float | None = None,
    dead_tokens: int | None = None,
    buffer_tokens: int = 65536,
    seed: int = 0,
    out: str | Path | None = None,
    texts: Documents | None = None,
    progress: bool | ProgressBar = True,
) -> SAE:
    """Train an SAE of (``layer``, ``site``) on ``source`` and return it (`SAE`, float32,
    reading raw activations: ``normalize_activations="none"``).

    ``source``: an `Activations` store or its path; a tensor ``[tokens, d_in]`` of the same
    rows in memory (training on it equals training on the store, bit for bit); or an engine,
    whose activations of ``texts`` are collected (float32) into a temporary store, removed
    afterwards. ``architecture``: "topk" (``k`` active latents per token, default 32) or
    "relu" (``l1_coefficient``, default 1.0, SAELens's); ``d_sae`` latents (default
    ``expansion * d_in``).

    The source's last rows (a tenth, at most 4096) are held out: every 20 steps and at the
    end the held-out variance explained is measured, and the SAE returned is the best on
    it. Stops after ``max_tokens`` training tokens (passes over the rows repeat, reshuffled),
    before a step that would end past ``max_seconds`` (counted from the call, collection
    excluded), or after one pass if neither is given. ``batch_size`` tokens per Adam step
    (``lr`` default: sparsify's ``2e-4 / sqrt(d_sae / 2**14)`` for TopK, SAELens's 3e-4 for
    ReLU); ``buffer_tokens`` rows in the shuffle buffer (memory: ``buffer_tokens * d_in``
    floats); a latent is dead, and trained by AuxK, after ``dead_tokens`` tokens without
    firing (default: a tenth of the planned tokens, at most 10M). Deterministic given
    ``seed`` and a token budget (a time budget ends wherever the machine's pace puts it).

    ``out``: a directory to write the SAE to (SAELens's format, `SAE.save`) with
    ``training_log.json`` beside it (the settings and one record per measurement).
    ``progress``: a tqdm bar in tokens (True), none (False), or your own bar.
    """
    engine = None if isinstance(source, (Activations, torch.Tensor, str, os.PathLike)) else source
    if engine is not None and not callable(getattr(engine, "collect", None)):
        raise InvalidRequest(
            f"train_sae reads an ek.Activations store, its path, a tensor [tokens, d_in] or "
            f"an engine (with texts=), not {type(source).__name__}"
        )
    if (engine is None) != (texts is None):
        raise InvalidRequest(
            "texts= is what an engine source collects: give it with source=engine, and only then"
        )
    checked = check_options(
        architecture=architecture,
        layer=layer,
        site=site,
        d_sae=d_sae,
        expansion=expansion,
        k=k,
        l1_coefficient=l1_coefficient,
        max_seconds=max_seconds,
        max_tokens=max_tokens,
        batch_size=batch_size,
        lr=lr,
        dead_tokens=dead_tokens,
        buffer_tokens=buffer_tokens,
        seed=seed,
        out=out,
    )
    if engine is None:
        return _train(rows_of(source, checked.layer, checked.site), checked, progress)
    with tempfile.TemporaryDirectory(prefix="envoykit-sae-") as folder:
        store = engine.collect(
            texts,
            out=Path(folder) / "store",
            layers=[checked.layer],
            sites=[checked.site],
            dtype="float32",
            progress=progress,
        )
        return _train(rows_of(store, checked.layer, checked.site), checked, progress)


# -- the run --------------------------------------------------------------------------------


def _train(rows: Rows, options: Options, progress: Any) -> SAE:
    started = time.monotonic()
    if rows.count < 3:
        raise InvalidRequest(
            f"{rows.where} holds {rows.count} tokens: an SAE needs at least 3 (two to train "
            "on, one held out); collect more text"
        )
    held = max(1, min(HELD_OUT_MAX, round(HELD_OUT_SHARE * rows.count)))
    n_train = rows.count - held
    stats = statistics(rows, n_train)
    plan = plan_run(rows, options, n_train, math.sqrt(rows.d_in) / stats.mean_norm)
    generator = torch.Generator().manual_seed(plan.seed)
    model = TrainingSAE(plan, stats.mean, generator)
    mean = (stats.mean * plan.scale).float()
    held_out = Reader(rows, n_train, rows.count).take(held) * plan.scale
    log = _Log(model, held_out, started)
    shuffled = batches(rows, n_train, plan.batch_size, plan.buffer_tokens, generator)
    log.measure()  # the initial SAE is the first candidate
    stopped = _steps(model, shuffled, mean, log, n_train, progress)
    # The first measurement (a finite fraction: the rows were checked finite) beat the inf.
    assert log.best[1] is not None
    sae = model.sae(log.best[1])
    if options.out is not None:
        _write(options.out, sae, plan, log.records, stopped)
    return sae


class _Log:
    """The measurements on the held-out rows, the training figures since the last one, and
    the state of the SAE best on them so far."""

    def __init__(self, model: TrainingSAE, held_out: torch.Tensor, started: float) -> None:
        self.model, self.held_out, self.started = model, held_out, started
        self.spread = float((held_out - held_out.mean(0)).pow(2).sum(dtype=torch.float64))
        self.records: list[dict[str, Any]] = []
        self.best: tuple[float, dict[str, torch.Tensor] | None] = (math.inf, None)
        self.steps = self.tokens = 0
        self.since = {"loss": 0.0, "l0": 0.0, "steps": 0}

    def add(self, tokens: int, loss: float, l0: float) -> None:
        """Count one step of ``tokens`` tokens, its loss and mean L0."""
        self.steps += 1
        self.tokens += tokens
        self.since["loss"] += loss
        self.since["l0"] += l0
        self.since["steps"] += 1

    def measure(self) -> None:
        """Record the held-out figures and the steps' since the last record; keep the SAE's
        state if it is the best yet."""
        since = self.since
        fvu = self.model.unexplained(self.held_out, self.spread)
        done = max(since["steps"], 1)
        self.records.append(
            {
                "step": self.steps,
                "tokens": self.tokens,
                "seconds": round(time.monotonic() - self.started, 3),
                "loss": since["loss"] / done if since["steps"] else None,
                "l0": since["l0"] / done if since["steps"] else None,
                "held_out_fvu": fvu,
                "held_out_variance_explained": 1.0 - fvu,
                "dead_fraction": float(self.model.dead.float().mean()),
            }
        )
        since.update(loss=0.0, l0=0.0, steps=0)
        if fvu < self.best[0]:
            self.best = (fvu, self.model.state())


def _steps(
    model: TrainingSAE,
    shuffled: Iterator[torch.Tensor],
    mean: torch.Tensor,
    log: _Log,
    n_train: int,
    progress: Any,
) -> str:
    """Adam steps on ``shuffled`` batches, measured every `EVAL_EVERY` and at the end, until
    the token budget, one pass or the time budget; which of them stopped it."""
    plan = model.plan
    # Tokens to train on: the budget's, one pass's when no budget is given, or none known.
    limit = plan.max_tokens or (None if plan.max_seconds else n_train)
    stopped = "max_tokens" if plan.max_tokens else "one pass"
    with progress_bar(progress, "train sae", limit) as bar:
        # At least one step, however long the set-up took of a time budget; after it, no
        # step that would end past the budget at the pace of the steps so far.
        stepping = time.monotonic()
        while limit is None or log.tokens < limit:
            budget = plan.max_seconds
            if budget and log.steps and over_budget(log.started, stepping, log.steps, budget):
                stopped = "max_seconds"
                break
            batch = next(shuffled)
            if limit is not None:
                batch = batch[: limit - log.tokens]
            loss, l0 = model.step(batch * plan.scale, mean)
            log.add(len(batch), loss, l0)
            if log.steps % EVAL_EVERY == 0:
                log.measure()
            bar.update(len(batch))
            _show(bar, loss, l0, log.records[-1])
        if log.since["steps"]:
            log.measure()
            _show(bar, loss, l0, log.records[-1])
    return stopped


def _show(bar: Any, loss: float, l0: float, record: dict[str, Any]) -> None:
    """The bar's figures: the last step's loss and L0, the last measurement's held-out
    variance explained and dead fraction."""
    bar.set_postfix(
        loss=f"{loss:.3f}",
        l0=f"{l0:.1f}",
        ve=f"{record['held_out_variance_explained']:.3f}",
        dead=f"{record['dead_fraction']:.2f}",
        refresh=False,
    )


def _write(out: Path, sae: SAE, plan: Plan, records: list[dict[str, Any]], stopped: str) -> None:
    """The SAE in SAELens's format and, beside it, the log of its training."""
    sae.save(out)
    best = min(records, key=lambda record: record["held_out_fvu"])
    log = {"settings": asdict(plan), "stopped": stopped, "best": best, "records": records}
    (out / LOG).write_text(json.dumps(log, indent=1))


def over_budget(started: float, stepping: float, steps: int, budget: float) -> bool:
    """Whether one more step, as long as the mean step since ``stepping``, would end more
    than ``budget`` seconds after ``started``."""
    now = time.monotonic()
    return now + (now - stepping) / steps - started > budget
