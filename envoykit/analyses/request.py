"""Checking a lens request on the client, before anything reaches the ranks.

A bad request must never become a hang, a raw traceback from a rank, or a silently wrong
number: everything a rank would trip on is checked here against the model's shape and the
tokenizer, and refused with an `InvalidRequest` that says what is valid.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from envoykit._compat import Tokenizer
from envoykit.errors import InvalidRequest
from envoykit.results.lens import SITES

# The forms a request takes from a researcher, each checked whole by the normalisers below
# (anything else is an `InvalidRequest` naming what is valid). Integers may be Python's or
# numpy's, alone or in a list, tuple, range or array, as they come out of an analysis.
Integers = int | np.integer | Sequence[int | np.integer] | np.ndarray
LayerSpec = int | str | range | Sequence[int | str] | None  # numbers, "embed", "all"
PositionSpec = Integers | None  # token positions, negative from the end; None: every one
HeadSpec = Integers | None  # head numbers over the whole model; None: every head
TargetSpec = str | int | np.integer | Sequence[str | int | np.integer] | np.ndarray
Documents = Iterable[str] | Iterable[Sequence[int]]  # texts, or token ids taken as they are
REDUCE_DTYPES = ("float32", "float64")
# A lens row: (layer number, site); layer 0 (the embedding) has only "resid".
Row = tuple[int, str]


@dataclass(frozen=True)
class Target:
    label: str
    token_id: int
    token: str


@dataclass(frozen=True)
class LensRequest:
    """A validated lens request: prompts tokenized, layers and positions normalised."""

    prompts: tuple[str, ...]
    prompt_ids: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]
    rows: tuple[Row, ...]
    positions: tuple[int, ...] | None
    top_k: int
    targets: tuple[Target, ...]
    generate: int
    reduce_dtype: str


def build_request(
    tokenizer: Tokenizer,
    n_layers: int,
    vocab: int,
    max_model_len: int,
    prompt: str | Sequence[str],
    *,
    layers: LayerSpec = None,
    positions: PositionSpec = None,
    top_k: int = 10,
    targets: TargetSpec = (),
    generate: int = 0,
    sites: str | Sequence[str] = ("resid",),
    reduce_dtype: str = "float32",
) -> LensRequest:
    prompts = normalise_prompts(prompt)
    generate = check_count("generate", generate, minimum=0)
    prompt_ids = tuple(token_ids(tokenizer, p) for p in prompts)
    for text, ids in zip(prompts, prompt_ids):
        if not ids:
            raise InvalidRequest(f"prompt {text!r} tokenizes to no tokens")
        if len(ids) + generate > max_model_len:
            raise InvalidRequest(
                f"prompt of {len(ids)} tokens plus generate={generate} exceeds the engine's "
                f"max_model_len={max_model_len}: shorten the prompt or start the Engine with a "
                "larger max_model_len"
            )
    top_k = check_count("top_k", top_k, minimum=1)
    if top_k > vocab:
        raise InvalidRequest(f"top_k={top_k} exceeds the vocabulary size ({vocab})")
    if reduce_dtype not in REDUCE_DTYPES:
        raise InvalidRequest(f"reduce_dtype must be one of {REDUCE_DTYPES}, not {reduce_dtype!r}")
    picked = normalise_layers(layers, n_layers)
    return LensRequest(
        prompts=prompts,
        prompt_ids=prompt_ids,
        layers=picked,
        rows=lens_rows(picked, normalise_sites(sites)),
        positions=normalise_positions(positions, min(len(ids) for ids in prompt_ids)),
        top_k=top_k,
        targets=tuple(_target(tokenizer, vocab, t) for t in as_list(targets)),
        generate=generate,
        reduce_dtype=reduce_dtype,
    )


def one_prompt(
    tokenizer: Tokenizer, prompt: Any, max_model_len: int, what: str
) -> tuple[str, tuple[int, ...]]:
    """A single prompt for ``what`` ("attribute", "attention"), checked, and its token ids."""
    if not isinstance(prompt, str):
        raise InvalidRequest(f"{what} takes one prompt (a string), not {type(prompt).__name__}")
    (prompt,) = normalise_prompts(prompt)
    ids = token_ids(tokenizer, prompt, max_model_len)
    if not ids:
        raise InvalidRequest(f"prompt {prompt!r} tokenizes to no tokens")
    return prompt, ids


def token_ids(tokenizer: Tokenizer, text: str, max_model_len: int | None = None) -> tuple[int, ...]:
    """``text``'s token ids as the engine runs them (special tokens added as vLLM adds
    them), the one place a prompt is tokenized; with ``max_model_len``, refused past it
    here rather than by vLLM mid-trace."""
    ids = tuple(tokenizer(text)["input_ids"])
    if max_model_len is not None and len(ids) > max_model_len:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens exceeds the engine's max_model_len={max_model_len}"
        )
    return ids


def check_head(head: Any, n_heads: int, what: str) -> int:
    """Head ``head`` (0-based over the whole model, negative from the end) as a number in
    ``0..n_heads-1``; `InvalidRequest` naming ``what`` asked for it otherwise."""
    number = integer(head)
    if number is None:
        raise InvalidRequest(f"{what} head must be an integer, not {head!r}")
    head = number
    if not -n_heads <= head < n_heads:
        raise InvalidRequest(
            f"{what} head {head!r} is out of range: this model has {n_heads} heads "
            f"(0..{n_heads - 1})"
        )
    return head % n_heads


def normalise_prompts(prompt: Any) -> tuple[str, ...]:
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequest(
            f"prompt must be a string or a non-empty list of strings, not {type(prompt).__name__}"
        )
    for p in prompts:
        if not isinstance(p, str):
            raise InvalidRequest(f"each prompt must be a string, not {type(p).__name__}")
        if not p.strip():
            raise InvalidRequest("the prompt is empty: give the text whose lens you want")
    return tuple(prompts)


def integer(value: Any) -> int | None:
    """``value`` as a Python int if it is an integer (a numpy or one-element torch integer
    too, as researchers pass from their arrays), else None; a bool is not an integer here."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:  # a float, a string, a float tensor
        return None


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, if it is an integer (a numpy one too) of at least ``minimum``."""
    whole = integer(value)
    if whole is None or whole < minimum:
        raise InvalidRequest(f"{name} must be an integer >= {minimum}, not {value!r}")
    return whole


def as_list(value: Any) -> list:
    """``value`` as a list: a string or an integer is a list of one; a list, tuple or range
    its items; a numpy array or scalar, or a tensor, its items as Python values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, int)):
        return [value]
    if isinstance(value, (list, tuple, range)):
        return list(value)
    raise InvalidRequest(
        f"expected a string, an integer or a list of them, not {type(value).__name__}"
    )


def normalise_layers(layers: LayerSpec, n_layers: int) -> tuple[int, ...]:
    """Sorted, distinct layer numbers: 0 is the embedding, ``i`` the output of layer ``i``.

    ``None``/``"all"`` is every decoder layer (1..n); ``"embed"`` adds the embedding;
    negative numbers count from the end (-1 is layer n).
    """
    if layers is None or (isinstance(layers, str) and layers == "all"):
        return tuple(range(1, n_layers + 1))
    picked = set()
    for layer in as_list(layers):
        if isinstance(layer, str) and layer == "embed":
            picked.add(0)
            continue
        if isinstance(layer, str) and layer == "all":
            picked.update(range(1, n_layers + 1))
            continue
        given = integer(layer)
        if given is None:
            raise InvalidRequest(f"a layer is an integer, 'embed' or 'all', not {layer!r}")
        number = given + n_layers + 1 if given < 0 else given
        if not 0 <= number <= n_layers:
            raise InvalidRequest(
                f"layer {given} does not exist: the model has {n_layers} layers "
                f"(0 = embedding, 1..{n_layers}; negative numbers count back from {n_layers})"
            )
        picked.add(number)
    if not picked:
        raise InvalidRequest("no layers picked")
    return tuple(sorted(picked))


def normalise_sites(sites: str | Sequence[str]) -> tuple[str, ...]:
    """Distinct sites in the model's order; `InvalidRequest` naming the valid ones."""
    picked = set(as_list(sites))
    unknown = sorted(str(site) for site in picked - set(SITES))
    if unknown:
        raise InvalidRequest(
            f"unknown site(s) {', '.join(map(repr, unknown))}: a site is one of {SITES} "
            "('resid' after the layer, 'resid_mid' between attention and MLP, 'attn'/'mlp' "
            "what that block writes)"
        )
    if not picked:
        raise InvalidRequest(f"no sites picked: give one or more of {SITES}")
    return tuple(site for site in SITES if site in picked)


def lens_rows(layers: Sequence[int], sites: Sequence[str]) -> tuple[Row, ...]:
    """Every (layer, site) pair, sorted as the model computes them; the embedding (layer 0)
    is a stream with no blocks, so only its 'resid' row exists."""
    rows = tuple(
        (layer, site) for layer in layers for site in sites if layer > 0 or site == "resid"
    )
    if not rows:
        raise InvalidRequest(
            f"layers {list(layers)} have none of the sites {list(sites)}: the embedding "
            "(layer 0) has only the 'resid' site"
        )
    return rows


def normalise_positions(positions: PositionSpec, length: int) -> tuple[int, ...] | None:
    if positions is None:
        return None
    picked = set()
    for pos in as_list(positions):
        number = integer(pos)
        if number is None or not -length <= number < length:
            raise InvalidRequest(
                f"position {pos if number is None else number!r} is outside the prompt: it "
                f"has {length} tokens (0..{length - 1}, or -{length}..-1 from the end)"
            )
        picked.add(number % length)
    if not picked:
        raise InvalidRequest("no positions picked")
    return tuple(sorted(picked))


def _target(tokenizer: Tokenizer, vocab: int, target: Any) -> Target:
    """A target token: an id (a numpy integer too), or the first token of a string's
    tokenization."""
    token_id = integer(target)
    if token_id is not None:
        if not 0 <= token_id < vocab:
            raise InvalidRequest(
                f"target token id {token_id} is outside the vocabulary 0..{vocab - 1}"
            )
        return Target(label=str(token_id), token_id=token_id, token=tokenizer.decode([token_id]))
    if not isinstance(target, str):
        raise InvalidRequest(f"a target is a string or a token id, not {type(target).__name__}")
    ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InvalidRequest(f"target {target!r} tokenizes to nothing: give a non-empty token")
    return Target(label=target, token_id=ids[0], token=tokenizer.decode([ids[0]]))


def single_token_target(tokenizer: Tokenizer, vocab: int, target: Any) -> Target:
    """A target that is exactly one token: a string of several tokens is refused, with its
    tokenization shown, where taking its first token would silently answer another question
    (attribution of a logit is per token)."""
    if isinstance(target, str):
        pieces = describe_target(tokenizer, target)
        if len(pieces) > 1:
            raise InvalidRequest(
                f"target {target!r} is {len(pieces)} tokens ({pieces}): give one token, e.g. "
                f"{pieces[0]!r}, or its token id"
            )
    return _target(tokenizer, vocab, target)


def describe_target(tokenizer: Tokenizer, text: str) -> list[str]:
    """How ``text`` tokenizes, token by token (the lens uses the first)."""
    return [tokenizer.decode([i]) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
