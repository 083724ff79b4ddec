"""What every holder of an engine offers: lens, attribution, patching, comparison, traces.

`EngineSurface` is the request side of `Engine`: `envoykit.analyses.base.EngineBase` (the
model, its shape and the guard) with each analysis's entry function taken as a method
(``lens = lens.lens``), so an engine in this process and one reached through a server offer
the same methods with the same checks and the same results. The module of each analysis
(`envoykit.analyses.lens`, `attribution`, `attention`, `sweep`, `compare`, `generation`,
`steering_vector`, `steer_sweep`, `collect`, `corpus_lens`, `features`, `feature_stats`)
checks the request whole before any trace, runs it and returns its result.
"""

from __future__ import annotations

from envoykit.analyses import (
    attention,
    attribution,
    collect,
    corpus_lens,
    feature_stats,
    features,
    generation,
    lens,
    steer_sweep,
    steering_vector,
    sweep,
)
from envoykit.analyses.base import EngineBase


class EngineSurface(EngineBase):
    """The request side of an engine; subclasses provide `model`, `info` and `exclusive`."""

    # The analyses, each its module's entry function (see the module docstring).
    lens = lens.lens
    attribute = attribution.attribute
    attention = attention.attention
    patch_sweep = sweep.patch_sweep
    generate = generation.generate
    generate_ids = generation.generate_ids
    trace = generation.trace
    steering_vector = steering_vector.steering_vector
    steer_sweep = steer_sweep.steer_sweep
    collect = collect.collect
    lens_corpus = corpus_lens.lens_corpus
    attribute_features = features.attribute_features
    feature_logits = features.feature_logits
    features = features.features  # (last: from here on the name is the method)
    feature_stats = feature_stats.feature_stats
