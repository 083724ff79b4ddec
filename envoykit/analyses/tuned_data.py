"""What a tuned lens trains on, brought to this process: the model's head (final norm and
unembedding, `gather_head`), the residual streams of texts at every layer (`layer_streams`),
and texts cut into pieces and batches (`cut_pieces`, `batches_of`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from envoykit import _compat as compat
from envoykit._compat import Tokenizer
from envoykit.errors import InvalidRequest
from envoykit.model.readout import at, norm_parameters, walk

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase

_HEAD_CHUNK = 8192
_SEQUENCE_TOKENS = 128


@dataclass(frozen=True)
class Head:
    """The model's readout, gathered whole on the client: final norm and unembedding."""

    weight: torch.Tensor  # [vocab, d_model]
    gain: torch.Tensor  # [d_model]
    bias: torch.Tensor  # [d_model], zeros for an RMS norm
    eps: float
    centered: bool  # a LayerNorm: the mean is subtracted first
    head_bias: torch.Tensor  # [vocab], zeros for a head without one
    soft_cap: float | None
    logit_scale: float

    def log_probs(self, stream: torch.Tensor) -> torch.Tensor:
        """``log_softmax`` of the logits the model would give for ``stream`` ``[T, d]``."""
        if self.centered:
            stream = stream - stream.mean(-1, keepdim=True)
        scale = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = stream * scale * self.gain + self.bias
        logits = normed @ self.weight.T + self.head_bias
        if self.soft_cap:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return torch.log_softmax(logits * self.logit_scale, -1)


def cut_pieces(tokenizer: Tokenizer, texts: Sequence[str]) -> list[tuple[str, int]]:
    """Texts cut into sequences of 8 to `_SEQUENCE_TOKENS` tokens: ``(text, tokens)``."""
    usable = [] if isinstance(texts, str) else [t for t in texts if isinstance(t, str)]
    if not any(t.strip() for t in usable):
        raise InvalidRequest("a tuned lens needs a non-empty list of texts")
    pieces = []
    for text in usable:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), _SEQUENCE_TOKENS):
            chunk = ids[start : start + _SEQUENCE_TOKENS]
            if len(chunk) >= 8:
                pieces.append((tokenizer.decode(chunk), len(chunk)))
    return pieces


def batches_of(
    tokenizer: Tokenizer, texts: Sequence[str], batch_tokens: int, seed: int, held_out: float
) -> tuple[list[list[tuple[str, int]]], list[str]]:
    """`cut_pieces` shuffled with ``seed``: a ``held_out`` share of them (at least one, at most
    two batches' tokens) apart, the rest grouped into training batches of about
    ``batch_tokens`` (each piece with its token count)."""
    pieces = cut_pieces(tokenizer, texts)
    random.Random(seed).shuffle(pieces)
    # A held-out share, but no more than two batches of tokens: it is measured every few
    # steps, over the whole vocabulary at every layer.
    count, tokens = 0, 0
    while count < max(1, round(held_out * len(pieces))) and tokens < 2 * batch_tokens:
        tokens += pieces[count][1]
        count += 1
    kept, pieces = [text for text, _ in pieces[:count]], pieces[count:]
    if sum(n for _, n in pieces) < batch_tokens:
        raise InvalidRequest(
            f"the texts hold {sum(n for _, n in pieces)} tokens, fewer than one batch "
            f"(batch_tokens={batch_tokens}): give more text or a smaller batch"
        )
    batches: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    count = 0
    for text, n in pieces:
        current.append((text, n))
        count += n
        if count >= batch_tokens:
            batches.append(current)
            current, count = [], 0
    return batches, kept


def layer_streams(engine: EngineBase, texts: Sequence[str]) -> torch.Tensor:
    """``[n_layers + 1, tokens, d_model]`` float32: the residual stream after the embedding and
    every layer, whole, for ``texts`` (one invoke each), joined along tokens."""
    import nnsight

    model, readout = engine.model, engine.readout
    readout.require("the tuned lens")
    reads = {layer: {"resid"} for layer in range(engine.info.n_layers + 1)}
    with engine.exclusive(), model.trace(temperature=0.0, max_tokens=1) as tracer:
        for text in texts:
            with tracer.invoke(text):
                streams = walk(readout, at(model, readout.layers), reads, {})
                stacked = nnsight.save(
                    torch.stack([h if r is None else h + r for h, r in streams]).float().cpu()
                )
    pieces = stacked if len(texts) > 1 else [stacked]
    return torch.cat(list(pieces), dim=1)


def gather_head(engine: EngineBase) -> Head:
    """The unembedding and its bias (whole, in chunks of rows), the final norm's affine map
    (`envoykit.model.readout.norm_parameters`), the logit soft-cap and scale: what the final
    distribution is computed from."""
    import nnsight

    model, readout, vocab = engine.model, engine.readout, engine.info.vocab
    d_model = engine.info.d_model
    rows, biases = [], []
    with engine.exclusive():
        for start in range(0, vocab, _HEAD_CHUNK):
            ids = torch.arange(start, min(vocab, start + _HEAD_CHUNK))
            with model.trace("The", temperature=0.0, max_tokens=1):
                head = at(model, readout.unembedding)
                part = nnsight.save(head.rows(ids).float().cpu())
                bias = nnsight.save(head.bias_of(ids).float().cpu())
            rows.append(part)
            biases.append(bias)
        with model.trace("The", temperature=0.0, max_tokens=1):
            norm = at(model, readout.final_norm)
            like = at(model, readout.layers)[0].output
            like = (like[0] if isinstance(like, tuple) else like).float()
            affine = norm_parameters(norm, d_model, like)
            affine = nnsight.save({key: value.cpu() for key, value in affine.items()})
    processor = compat.envoy_module(model).logits_processor
    return Head(
        torch.cat(rows),
        affine["gain"],
        affine["bias"],
        float(affine["eps"]),
        bool(affine["centered"]),
        torch.cat(biases),
        processor.soft_cap,
        float(processor.scale),
    )
