"""envoykit: interpretability on tensor-parallel vLLM engines.

Every module of the served model is an nnsight envoy; ad-hoc calls on sharded modules take
and return whole tensors; a logit lens runs on the ranks and ships back only what is shown.
"""

from envoykit import _compat, plot
from envoykit.analyses.clamp import Clamp
from envoykit.analyses.compare import Run, compare
from envoykit.analyses.corpus import shipped_corpus
from envoykit.analyses.patching import Ablate, Patch
from envoykit.analyses.sae import SAE
from envoykit.analyses.sae_training import train_sae
from envoykit.analyses.steering import Steer
from envoykit.analyses.tuned import LensQuality, TunedLens
from envoykit.engine import Engine
from envoykit.errors import (
    Cancelled,
    EngineDead,
    EnvoykitError,
    InvalidRequest,
    ServerUnavailable,
    ShardedValue,
)
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


def __getattr__(name: str):
    # The widget needs the `notebooks` extra (ipywidgets, anywidget): imported on first use,
    # so `import envoykit` works without it.
    if name == "LensExplorer":
        from envoykit.explorer import LensExplorer

        return LensExplorer
    # The client needs nnsight's vLLM wrapper (about a second to import): on first use too.
    if name == "connect":
        from envoykit.serve.client import connect

        return connect
    raise AttributeError(f"module 'envoykit' has no attribute {name!r}")
