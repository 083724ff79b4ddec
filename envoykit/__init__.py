"""envoykit: interpretability on tensor-parallel vLLM engines.

Every module of the served model is an nnsight envoy; ad-hoc calls on sharded modules take
and return whole tensors; a logit lens runs on the ranks and ships back only what is shown.

The package imports its public names on first use (`__getattr__`): ``import envoykit`` costs
milliseconds, not the seconds of torch, nnsight and vLLM, so a client of ``envoykit serve``
or the CLI's ``--help`` does not pay for an engine, and the first lookup of `Engine` can
start the engine core's imports (`envoykit.runtime.forkserver.start_early`) before the
owner's own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from envoykit import _compat
from envoykit.errors import (
    Cancelled,
    EngineDead,
    EnvoykitError,
    InvalidRequest,
    ServerUnavailable,
    ShardedValue,
)

if TYPE_CHECKING:
    from envoykit import plot
    from envoykit.analyses.clamp import Clamp
    from envoykit.analyses.compare import Run, compare
    from envoykit.analyses.corpus import shipped_corpus
    from envoykit.analyses.patching import Ablate, Patch
    from envoykit.analyses.sae import SAE
    from envoykit.analyses.sae_training import train_sae
    from envoykit.analyses.steering import Steer
    from envoykit.analyses.tuned import LensQuality, TunedLens
    from envoykit.engine import Engine
    from envoykit.explorer import LensExplorer
    from envoykit.results.activations import Activations, StoreWriteError
    from envoykit.results.attention import AttentionResult
    from envoykit.results.attribution import AttributionResult
    from envoykit.results.compare import CompareResult
    from envoykit.results.corpus import CorpusLensResult
    from envoykit.results.feature_stats import FeatureStats
    from envoykit.results.features import (
        FeatureAttributionResult,
        FeatureLogitsResult,
        FeatureResult,
    )
    from envoykit.results.lens import LensResult, TargetTrace
    from envoykit.results.steering import Generation, SteeringVector, SteerSweepResult
    from envoykit.results.sweep import SweepResult
    from envoykit.runtime.info import ModelInfo
    from envoykit.serve.client import connect

# Where each lazily imported public name lives (the modules above, for type checkers).
_HOMES = {
    "Ablate": "envoykit.analyses.patching",
    "Activations": "envoykit.results.activations",
    "AttentionResult": "envoykit.results.attention",
    "AttributionResult": "envoykit.results.attribution",
    "Clamp": "envoykit.analyses.clamp",
    "CompareResult": "envoykit.results.compare",
    "CorpusLensResult": "envoykit.results.corpus",
    "Engine": "envoykit.engine",
    "FeatureAttributionResult": "envoykit.results.features",
    "FeatureLogitsResult": "envoykit.results.features",
    "FeatureResult": "envoykit.results.features",
    "FeatureStats": "envoykit.results.feature_stats",
    "Generation": "envoykit.results.steering",
    # The widget needs the `notebooks` extra (ipywidgets, anywidget).
    "LensExplorer": "envoykit.explorer",
    "LensQuality": "envoykit.analyses.tuned",
    "LensResult": "envoykit.results.lens",
    "ModelInfo": "envoykit.runtime.info",
    "Patch": "envoykit.analyses.patching",
    "Run": "envoykit.analyses.compare",
    "SAE": "envoykit.analyses.sae",
    "Steer": "envoykit.analyses.steering",
    "SteerSweepResult": "envoykit.results.steering",
    "SteeringVector": "envoykit.results.steering",
    "StoreWriteError": "envoykit.results.activations",
    "SweepResult": "envoykit.results.sweep",
    "TargetTrace": "envoykit.results.lens",
    "TunedLens": "envoykit.analyses.tuned",
    "compare": "envoykit.analyses.compare",
    "connect": "envoykit.serve.client",
    "shipped_corpus": "envoykit.analyses.corpus",
    "train_sae": "envoykit.analyses.sae_training",
}

__all__ = [
    "SAE",
    "Ablate",
    "Activations",
    "AttentionResult",
    "AttributionResult",
    "Cancelled",
    "Clamp",
    "CompareResult",
    "CorpusLensResult",
    "Engine",
    "EngineDead",
    "EnvoykitError",
    "FeatureAttributionResult",
    "FeatureLogitsResult",
    "FeatureResult",
    "FeatureStats",
    "Generation",
    "InvalidRequest",
    "LensExplorer",
    "LensQuality",
    "LensResult",
    "ModelInfo",
    "Patch",
    "Run",
    "ServerUnavailable",
    "ShardedValue",
    "Steer",
    "SteerSweepResult",
    "SteeringVector",
    "StoreWriteError",
    "SweepResult",
    "TargetTrace",
    "TunedLens",
    "compare",
    "connect",
    "plot",
    "shipped_corpus",
    "train_sae",
]
__version__ = "0.1.0"

_compat.check_versions()


def __getattr__(name: str) -> Any:
    if name == "plot":
        return importlib.import_module("envoykit.plot")
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'envoykit' has no attribute {name!r}")
    if name == "Engine":
        from envoykit.runtime import forkserver

        forkserver.start_early()
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # looked up once
    return value
