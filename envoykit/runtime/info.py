"""What an engine runs and how it may be split: `ModelInfo`, the valid tensor-parallel sizes,
and the check of an engine's arguments, all answered from the checkpoint's config before any
process starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envoykit.errors import InvalidRequest
from envoykit.runtime import platform

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelInfo:
    """What the engine is running: the model's shape and how it is split."""

    name: str
    path: str
    n_layers: int
    d_model: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    tp: int
    platform: str
    dtype: str
    max_model_len: int


def valid_tp_sizes(config: dict) -> list[int]:
    """TP sizes vLLM can split this model into: heads, KV heads and MLP width must divide."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    width = config.get("intermediate_size")
    return [
        tp
        for tp in range(1, heads + 1)
        if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0) and (not width or width % tp == 0)
    ]


def choose_tp(config: dict, requested: int | None, platform_name: str) -> int:
    """The requested TP size, checked; or the largest the model allows that gives every rank
    a device of its own (a GPU, or a CPU core: see `platform.default_ranks`)."""
    valid = valid_tp_sizes(config)
    limit = platform.max_ranks(platform_name)
    if requested is None:
        fitting = [tp for tp in valid if tp <= platform.default_ranks(platform_name)]
        return max(fitting) if fitting else 1
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise InvalidRequest(f"tensor_parallel_size must be a positive integer, not {requested!r}")
    if requested not in valid:
        raise InvalidRequest(
            f"tensor_parallel_size={requested} does not split this model: its "
            f"{config['num_attention_heads']} attention heads, "
            f"{config.get('num_key_value_heads') or config['num_attention_heads']} KV heads and "
            f"MLP width must divide evenly. Valid sizes: {valid}"
        )
    if requested > limit:
        unit = "GPUs" if platform_name == "cuda" else f"ranks ({len(platform.usable_cpus())} cores)"
        raise InvalidRequest(
            f"tensor_parallel_size={requested} is more than this machine hosts: at most {limit} "
            f"{unit}. Valid sizes that fit: {[tp for tp in valid if tp <= limit]}"
        )
    return requested


def refuse_unknown_arguments(engine_kwargs: dict[str, Any]) -> None:
    """Refuse an argument that neither nnsight's ``VLLM`` (``mode``, ``taps``, its envoy
    options), ``vllm.LLM`` nor vLLM's ``AsyncEngineArgs`` takes, before the engine's
    processes start: passed on, it fails inside nnsight's meta build as a ``TypeError``
    from ``EngineArgs`` with a rank prefix (``tp=2`` for ``tensor_parallel_size=2``, say)."""
    import dataclasses
    import inspect

    from nnsight.modeling.mixins.loadable import _ENVOY_KWARGS
    from nnsight.modeling.vllm import VLLM
    from vllm import LLM
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)} | _ENVOY_KWARGS
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for function in (LLM.__init__, VLLM.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if name != "self" and parameter.kind not in variadic:
                known.add(name)
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise InvalidRequest(
            f"unknown engine argument(s) {', '.join(map(repr, unknown))}: an engine takes "
            "envoykit's own (tensor_parallel_size, dtype, max_model_len, log_level, progress) "
            "and those of nnsight's VLLM, vllm.LLM and vllm.AsyncEngineArgs"
        )
