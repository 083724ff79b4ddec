"""What an engine runs and how it may be split: `ModelInfo`, the valid tensor-parallel sizes,
and the check of an engine's arguments, all answered from the checkpoint's config before any
process starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envoykit import _compat as compat
from envoykit.errors import InvalidRequest
from envoykit.runtime import platform

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The context an engine gets unasked: the model's own, at most this (vLLM's memory for the
# KV cache is sized by it).
MAX_MODEL_LEN_CAP = 1024


@dataclass(frozen=True)
class EngineOption:
    """An option that chooses an engine, declared once: `Engine` and `envoykit serve` take it
    as ``keyword`` with ``default``, and the command line as ``flag``."""

    keyword: str
    flag: str
    default: Any
    help: str
    type: Callable[[str], Any] = str  # what argparse reads the flag's text with


ENGINE_OPTIONS = {
    option.keyword: option
    for option in (
        EngineOption("model", "--model", "demo", "built-in name, local dir or hub id"),
        EngineOption(
            "tensor_parallel_size",
            "--tp",
            None,
            "tensor-parallel size (default: the largest that gives every rank a core or GPU)",
            int,
        ),
        EngineOption("dtype", "--dtype", "auto", f"one of {', '.join(DTYPES)}"),
        EngineOption(
            "max_model_len",
            "--max-model-len",
            None,
            f"context length (default: the model's, at most {MAX_MODEL_LEN_CAP})",
            int,
        ),
        EngineOption("log_level", "--log-level", "ERROR", "what of vLLM's log reaches the screen"),
    )
}
# The defaults, by keyword: the signatures of `Engine` and `envoykit.serve.server.serve` use
# these, so that the Python API, the server and the command line start the same engine.
DEFAULT_MODEL = ENGINE_OPTIONS["model"].default
DEFAULT_DTYPE = ENGINE_OPTIONS["dtype"].default
DEFAULT_LOG_LEVEL = ENGINE_OPTIONS["log_level"].default


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
    # The self-check at load (`envoykit.analyses.selfcheck`): the checks that passed, and
    # (check, why) for those that failed; both empty when it was not run.
    validated: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # As JSON brings them from a server: lists.
        object.__setattr__(self, "validated", tuple(self.validated))
        object.__setattr__(self, "failed", tuple(tuple(item) for item in self.failed))

    def require(self, what: str) -> None:
        """Refuse ``what`` (an analysis) if a check of the self-check at load that it relies
        on failed, naming the check and why it failed."""
        failed = dict(self.failed)
        for check in _CHECKS_NEEDED.get(what, ()):
            reason = failed.get(check)
            if reason is not None:
                raise InvalidRequest(
                    f"{what} is disabled on this engine: the self-check at load failed its "
                    f"{check!r} check ({reason})"
                )


# The self-check's checks each analysis relies on (`envoykit.analyses.selfcheck`).
_CHECKS_NEEDED = {
    "lens": ("lens",),
    "attribution": ("attribution", "sites"),
    "sites": ("sites",),
}


# Config keys by meaning, in the spellings of the configs transformers ships (GPT-2 and
# GPT-J say n_head and n_embd, Falcon num_kv_heads, MoE models give expert widths).
_KEYS = {
    "n_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "vocab": ("vocab_size",),
    "n_heads": ("num_attention_heads", "n_head", "num_heads"),
    "n_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "max_positions": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}
_WORDS = {
    "n_layers": "number of layers",
    "d_model": "hidden size",
    "vocab": "vocabulary size",
    "n_heads": "number of attention heads",
}
# Widths a tensor-parallel split cuts: each must divide by the TP size.
_WIDTHS = (
    "intermediate_size",
    "n_inner",
    "ffn_hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a checkpoint's config that envoykit needs, under one set of names."""

    n_layers: int
    d_model: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    widths: tuple[int, ...]
    max_positions: int | None

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """Read ``config`` (a config.json as a dict); a multimodal model's text config.

        Refuses a config that lacks a number envoykit needs, naming the keys it looked for.
        """
        text = config.get("text_config") or config
        if config.get("multi_query") and not _first(text, _KEYS["n_kv_heads"]):
            text = {**text, "num_kv_heads": 1}  # Falcon's multi-query attention: one KV head

        def need(meaning: str) -> int:
            value = _first(text, _KEYS[meaning])
            if value is None:
                keys = " or ".join(repr(k) for k in _KEYS[meaning])
                raise InvalidRequest(
                    f"this checkpoint's config has no {_WORDS[meaning]} ({keys}): "
                    "envoykit cannot tell the model's shape"
                )
            return int(value)

        heads = need("n_heads")
        kv = _first(text, _KEYS["n_kv_heads"]) or heads
        widths = tuple(int(text[k]) for k in _WIDTHS if isinstance(text.get(k), int))
        return cls(
            n_layers=need("n_layers"),
            d_model=need("d_model"),
            vocab=need("vocab"),
            n_heads=heads,
            n_kv_heads=int(kv),
            widths=widths,
            max_positions=_first(text, _KEYS["max_positions"]),
        )

    def valid_tp_sizes(self) -> list[int]:
        """TP sizes vLLM can split this model into: heads and MLP widths must divide, and KV
        heads divide or are replicated (TP a multiple of them)."""
        heads, kv = self.n_heads, self.n_kv_heads
        return [
            tp
            for tp in range(1, heads + 1)
            if heads % tp == 0
            and (kv % tp == 0 or tp % kv == 0)
            and all(width % tp == 0 for width in self.widths)
        ]


def _first(config: dict, keys: tuple[str, ...]) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


def valid_tp_sizes(config: dict) -> list[int]:
    """TP sizes vLLM can split the model of ``config`` into (see `ModelShape`)."""
    return ModelShape.from_config(config).valid_tp_sizes()


def choose_tp(config: dict, requested: int | None, platform_name: str) -> int:
    """The requested TP size, checked; or the largest the model allows that gives every rank
    a device of its own (a GPU, or a CPU core: see `platform.default_ranks`)."""
    shape = ModelShape.from_config(config)
    valid = shape.valid_tp_sizes()
    limit = platform.max_ranks(platform_name)
    if requested is None:
        fitting = [tp for tp in valid if tp <= platform.default_ranks(platform_name)]
        return max(fitting) if fitting else 1
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise InvalidRequest(f"tensor_parallel_size must be a positive integer, not {requested!r}")
    if requested not in valid:
        raise InvalidRequest(
            f"tensor_parallel_size={requested} does not split this model: its "
            f"{shape.n_heads} attention heads, {shape.n_kv_heads} KV heads and "
            f"MLP widths {list(shape.widths)} must divide evenly. Valid sizes: {valid}"
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

    from nnsight.modeling.vllm import VLLM
    from vllm import LLM
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {field.name for field in dataclasses.fields(AsyncEngineArgs)} | compat.envoy_options()
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
