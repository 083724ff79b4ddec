"""An independent logit lens in plain transformers (float32, CPU), for comparison.

It shares no code with envoykit: hooks on the decoder layers collect the residual stream,
the model's own final norm and unembedding turn it into logits, and the model's own logit
soft-cap (if any) is applied.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@functools.cache
def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def lens_logits(path: str, prompt: str) -> tuple[torch.Tensor, list[int]]:
    """``[n_layers + 1, positions, vocab]`` logits (row 0 = embedding) and the prompt's ids."""
    model, tokenizer = load(path)
    ids = tokenizer(prompt)["input_ids"]
    layers = model.model.layers
    streams: list[torch.Tensor] = []

    def before_first(module, args, kwargs):
        streams.append(args[0] if args else kwargs["hidden_states"])

    def after(module, args, output):
        streams.append(output[0] if isinstance(output, tuple) else output)

    handles = [layers[0].register_forward_pre_hook(before_first, with_kwargs=True)]
    handles += [layer.register_forward_hook(after) for layer in layers]
    try:
        model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    hidden = torch.stack([s[0] for s in streams])
    logits = model.lm_head(model.model.norm(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float(), ids


@torch.no_grad()
def module_output(path: str, prompt: str, module_path: str) -> torch.Tensor:
    """The output of one module (first element if a tuple) for ``prompt``."""
    model, tokenizer = load(path)
    captured = []
    handle = model.get_submodule(module_path).register_forward_hook(
        lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        model(torch.tensor([tokenizer(prompt)["input_ids"]]))
    finally:
        handle.remove()
    return captured[0][0]
