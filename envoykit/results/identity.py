"""What identifies a model, so that something made on one model (translators, a steering
vector, an activation store) is never silently used with another.

A model's fingerprint (`envoykit.analyses.base.EngineBase.fingerprint`) is its name, its shape and a
hash of rows of its unembedding; two fingerprints name the same model when all but the name
agree (a checkpoint may be served under another name).
"""

from __future__ import annotations

from envoykit.errors import InvalidRequest

IDENTITY = ("name", "n_layers", "d_model", "vocab", "head_hash")


def check_same_model(mine: dict, model: dict, made: str, advice: str) -> None:
    """`InvalidRequest` naming both models unless ``mine`` (the fingerprint of the model
    something ``made`` on: "these translators were trained") identifies the same model as
    ``model`` (a model's `fingerprint`)."""
    ours = {k: mine.get(k) for k in IDENTITY if k != "name"}
    theirs = {k: v for k, v in model.items() if k in ours}
    if ours != theirs:
        raise InvalidRequest(
            f"{made} on {mine.get('name')!r} ({_shape(mine)}), not on the "
            f"engine's {model.get('name')!r} ({_shape(theirs)}): {advice}"
        )


def _shape(model: dict) -> str:
    return (
        f"{model.get('n_layers')} layers, d_model {model.get('d_model')}, vocabulary "
        f"{model.get('vocab')}, head {str(model.get('head_hash'))[:12]}"
    )
