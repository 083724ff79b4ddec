"""Where a model reads out its prediction: decoder layers, final norm, unembedding.

Found once on the structure-only (meta) model the client builds, before any rank starts,
and frozen: the lens, attribution and patching code take a `Readout` (plain module paths)
instead of reaching back into the engine, so they work the same on an in-process engine and
on any other holder of an envoy tree.

Inside a decoder layer, the sub-layer sites are read at two places that exist in every
pre-norm architecture vLLM ships (Llama, Mistral, Qwen, Gemma 1-3):

* the **MLP's pre-norm** is called as ``norm(attn_out, resid_pre)`` (vLLM's fused add-norm):
  its first input is what the attention block writes into the stream (after Gemma's
  post-attention norm), and the two inputs sum to the stream between the blocks;
* the **layer's output** is ``(mlp_out, resid_mid)``: what the MLP block writes, and the
  stream before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from envoykit.errors import InvalidRequest

# The norm in front of the MLP, by the names vLLM's pre-norm decoder layers give it (Gemma 2
# and 3 normalise the attention output with ``post_attention_layernorm`` and call
# ``pre_feedforward_layernorm(hidden, residual)``; Llama-like layers fuse both into one).
_MLP_PRENORM_NAMES = ("pre_feedforward_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class Readout:
    """Module paths of a model's readout; `at` turns a path into an envoy.

    ``mlp_prenorm`` is the name of the MLP's pre-norm inside a decoder layer, or None when
    the layer has none that envoykit recognises (sub-layer sites are then refused).
    """

    layers: str
    final_norm: str
    unembedding: str
    mlp_prenorm: str | None
    n_layers: int

    @classmethod
    def find(cls, meta_model: torch.nn.Module) -> Readout:
        """The readout of ``meta_model``; `InvalidRequest` when it has no recognisable one."""
        layers_path, layers = decoder_layers(meta_model)
        parent_path = layers_path.rpartition(".")[0]
        parent = meta_model.get_submodule(parent_path) if parent_path else meta_model
        norms = [name for name, _ in parent.named_children() if "norm" in name]
        if not norms:
            raise InvalidRequest(f"{type(meta_model).__name__} has no final norm beside its layers")
        final_norm = f"{parent_path}.{norms[-1]}" if parent_path else norms[-1]
        if hasattr(meta_model, "lm_head"):
            unembedding = "lm_head"
        else:
            head = unembedding_module(meta_model)
            unembedding = next(
                name
                for name, module in meta_model.named_modules(remove_duplicate=False)
                if module is head
            )
        children = {name for name, _ in layers[0].named_children()}
        prenorm = next((name for name in _MLP_PRENORM_NAMES if name in children), None)
        return cls(layers_path, final_norm, unembedding, prenorm, len(layers))

    def require_sublayers(self) -> None:
        """Refuse sub-layer sites on a layer whose MLP pre-norm was not found."""
        if self.mlp_prenorm is None:
            raise InvalidRequest(
                "this model's decoder layers have no MLP pre-norm named "
                f"{' or '.join(_MLP_PRENORM_NAMES)}: only the 'resid' site is available"
            )


def at(root: Any, path: str) -> Any:
    """The envoy (or module) at a dotted ``path`` below ``root``."""
    node = root
    for part in path.split("."):
        node = getattr(node, part)
    return node


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The longest ``ModuleList`` in the model: its decoder layers, and its path."""
    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise InvalidRequest(f"{type(model).__name__} has no list of decoder layers")
    return max(lists, key=lambda item: len(item[1]))


def unembedding_module(root: torch.nn.Module) -> torch.nn.Module:
    """The module whose weight maps hidden states to vocabulary logits.

    ``lm_head`` where the model has one (with tied embeddings it is the embedding module
    itself); models that always tie (Gemma) call their logits processor with
    ``model.embed_tokens`` and have no ``lm_head`` attribute.
    """
    head = getattr(root, "lm_head", None)
    return head if head is not None else root.model.embed_tokens


def lm_head_only(root: torch.nn.Module) -> torch.nn.Module | None:
    """``lm_head`` when it is a module of its own, not the tied embedding."""
    head = getattr(root, "lm_head", None)
    embed = getattr(getattr(root, "model", None), "embed_tokens", None)
    return head if head is not None and head is not embed else None
