"""A steer at many strengths: every scale's greedy continuation of one prompt and the lens
of some targets at its last position, several scales per trace (one invoke each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from envoykit.analyses import generation, steering
from envoykit.analyses.request import (
    LayerSpec,
    TargetSpec,
    as_list,
    check_count,
    normalise_layers,
    single_token_target,
)
from envoykit.errors import InvalidRequest

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.results.steering import SteerSweepResult


def steer_sweep(
    engine: EngineBase,
    prompt: str,
    steer: steering.Steer,
    *,
    scales: Sequence[float],
    max_tokens: int = 16,
    targets: TargetSpec = (),
    layers: LayerSpec = None,
    batch: int = 8,
    progress: bool = True,
) -> SteerSweepResult:
    """``steer`` at each of ``scales``: every scale's greedy continuation of ``prompt``
    and the lens probability of ``targets`` at the prompt's last position at every layer
    of ``layers`` (as in `lens`), after steering. ``batch`` scales per trace (one invoke
    each), with a progress bar over scales.

    Returns a `SteerSweepResult`; its ``meta["steer"]`` is ``steer`` at scale 1.
    """
    from tqdm.auto import tqdm

    from envoykit.results.steering import SteerSweepResult

    if not isinstance(steer, steering.Steer):
        raise InvalidRequest(f"steer_sweep sweeps one ek.Steer, not {type(steer).__name__}")
    scales = steering.check_scales(scales)
    batch = check_count("batch", batch, minimum=1)
    info = engine.info
    picked = normalise_layers(layers, info.n_layers)
    found = [single_token_target(engine.tokenizer, info.vocab, t) for t in as_list(targets)]
    steering.engine_steers(engine, steer)  # the scales differ, nothing else: one check for all
    runs = [[steer.scaled(scale)] for scale in scales]
    ids: list[list[int]] = []
    stats: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    with tqdm(total=len(runs), desc="steer sweep", unit="scale", disable=not progress) as bar:
        for start in range(0, len(runs), batch):
            chunk = runs[start : start + batch]
            got, meta, chunk_stats = generation.steered_ids(
                engine, prompt, chunk, max_tokens, (picked, [t.token_id for t in found])
            )
            ids += got
            assert chunk_stats is not None  # asked for: the lens was given
            stats += chunk_stats
            bar.update(len(chunk))
    meta["steer"] = [steer.scaled(1.0).describe()]
    decode = engine.tokenizer.decode
    return SteerSweepResult(
        prompt=prompt,
        scales=np.array(scales),
        texts=tuple(decode(run, skip_special_tokens=True) for run in ids),
        token_ids=tuple(tuple(run) for run in ids),
        layers=np.array(picked),
        target_labels=tuple(t.label for t in found),
        target_tokens=tuple(t.token for t in found),
        target_probs=np.array([s["target_probs"][:, 0].numpy() for s in stats]),
        top_tokens=np.array(
            [[decode([int(i)]) for i in s["top_ids"][:, 0, 0]] for s in stats], dtype=object
        ),
        meta=meta,
    )
