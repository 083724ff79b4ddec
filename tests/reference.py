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
def residual_streams(path: str, ids: list[int]) -> torch.Tensor:
    """``[n_layers + 1, positions, d_model]`` the residual stream of token ``ids`` before the
    first layer (row 0) and after each layer, before the final norm."""
    model, _ = load(path)
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
    return torch.stack([s[0] for s in streams])


@torch.no_grad()
def lens_logits(path: str, prompt: str) -> tuple[torch.Tensor, list[int]]:
    """``[n_layers + 1, positions, vocab]`` logits (row 0 = embedding) and the prompt's ids."""
    _, tokenizer = load(path)
    ids = tokenizer(prompt)["input_ids"]
    return stream_logits(path, residual_streams(path, ids)), ids


@torch.no_grad()
def stream_logits(path: str, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own final norm, unembedding and logit soft-cap (if any) on ``hidden``."""
    model, _ = load(path)
    logits = model.lm_head(model.model.norm(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


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


@torch.no_grad()
def sublayer_streams(path: str, prompt: str) -> dict[str, torch.Tensor]:
    """Per decoder layer, ``[n_layers, positions, d_model]``: the stream between attention
    and MLP (``resid_mid``, the input of the MLP's pre-norm), the attention block's write
    (``attn``) and the MLP block's write (``mlp``); plus the embedding and the final stream.

    Read with forward hooks on the modules transformers runs: the MLP pre-norm is
    ``pre_feedforward_layernorm`` where the layer has one (Gemma 2), else
    ``post_attention_layernorm``; the blocks' writes are the outputs of ``self_attn`` and
    ``mlp`` (Gemma 2: of the norms that follow them).
    """
    model, tokenizer = load(path)
    ids = tokenizer(prompt)["input_ids"]
    found: dict[str, list[torch.Tensor]] = {"resid_mid": [], "attn": [], "mlp": []}
    handles = []

    def keep(name, take):
        return lambda module, args, output: found[name].append(take(args, output)[0])

    for layer in model.model.layers:
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        prenorm = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        handles.append(prenorm.register_forward_hook(keep("resid_mid", lambda a, o: a[0])))
        attn = layer.post_attention_layernorm if gemma else layer.self_attn
        mlp = layer.post_feedforward_layernorm if gemma else layer.mlp
        first = lambda a, o: o[0] if isinstance(o, tuple) else o  # noqa: E731
        handles.append(attn.register_forward_hook(keep("attn", first)))
        handles.append(mlp.register_forward_hook(keep("mlp", first)))
    final: list[torch.Tensor] = []
    handles.append(model.model.norm.register_forward_hook(lambda m, a, o: final.append(a[0][0])))
    embedded: list[torch.Tensor] = []
    handles.append(
        model.model.layers[0].register_forward_pre_hook(
            lambda m, a, k: embedded.append((a[0] if a else k["hidden_states"])[0]),
            with_kwargs=True,
        )
    )
    try:
        model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    out = {name: torch.stack(values) for name, values in found.items()}
    return {**out, "embed": embedded[0], "final": final[0]}


@torch.no_grad()
def sublayer_logits(path: str, prompt: str, site: str) -> torch.Tensor:
    """``[n_layers, positions, vocab]`` lens logits of one sub-layer site, each row through
    the final norm on its own, the head and the soft-cap, as transformers computes them."""
    model, _ = load(path)
    logits = model.lm_head(model.model.norm(sublayer_streams(path, prompt)[site]))
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def attribution(path: str, prompt: str, targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct logit attribution ``[1 + 2 * n_layers, positions, targets]`` (embed, attn 1,
    mlp 1, …) with the final norm's scale frozen on the final stream, and the pre-soft-cap
    logits ``[positions, targets]``, in float32 transformers."""
    model, _ = load(path)
    streams = sublayer_streams(path, prompt)
    norm = model.model.norm
    gain = norm.weight + 1 if "Gemma" in type(norm).__name__ else norm.weight
    final = streams["final"]
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    scale = torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + eps)
    parts = [streams["embed"]]
    for attn, mlp in zip(streams["attn"], streams["mlp"]):
        parts += [attn, mlp]
    rows = model.lm_head.weight[targets]
    values = (torch.stack(parts) * scale * gain) @ rows.T
    logits = model.lm_head(norm(final))[:, targets]
    return values, logits


@torch.no_grad()
def patched_final_logits(
    path: str, source: str, target: str, layer: int, source_pos: int, target_pos: int, site: str
) -> torch.Tensor:
    """Final-layer logits ``[positions, vocab]`` of ``target`` with the stream after decoder
    layer ``layer`` (1-based; ``site`` "resid"), or that layer's MLP or attention output
    (``site`` "mlp", "attn"), at ``target_pos`` replaced by ``source``'s at ``source_pos``:
    forward hooks on plain transformers, float32."""
    model, tokenizer = load(path)
    block = model.model.layers[layer - 1]
    module = {"resid": block, "mlp": block.mlp, "attn": block.self_attn}[site]
    captured: list[torch.Tensor] = []

    def first(output):
        return output[0] if isinstance(output, tuple) else output

    handle = module.register_forward_hook(lambda m, a, out: captured.append(first(out)[0].clone()))
    try:
        model(torch.tensor([tokenizer(source)["input_ids"]]))
    finally:
        handle.remove()
    value = captured[0][source_pos]

    def replace(m, a, out):
        first(out)[0, target_pos] = value
        return out

    handle = module.register_forward_hook(replace)
    try:
        logits = model(torch.tensor([tokenizer(target)["input_ids"]])).logits[0]
    finally:
        handle.remove()
    return logits.float()


@torch.no_grad()
def steered_logits(
    path: str,
    ids: list[int],
    layer: int,
    vector: torch.Tensor,
    norm_match: bool = False,
    positions: list[int] | None = None,
    site: str = "resid",
) -> torch.Tensor:
    """Final logits ``[positions, vocab]`` of the token sequence ``ids`` with ``vector`` added
    to the stream after decoder layer ``layer`` (1-based; 0 = the embedding; ``site``
    "resid_mid": between its attention and MLP, through the MLP norm's input) at
    ``positions`` (None: every one), each steered row rescaled to its old norm with
    ``norm_match``: a forward hook on plain transformers, float32. One pass over the whole
    sequence steers each position as a generation's step does."""
    model, _ = load(path)
    rows = slice(None) if positions is None else positions

    def steer(stream: torch.Tensor) -> torch.Tensor:
        before = stream[0, rows].clone()
        after = before + vector
        if norm_match:
            after = after * before.norm(dim=-1, keepdim=True) / after.norm(dim=-1, keepdim=True)
        stream[0, rows] = after
        return stream

    if layer == 0:
        handle = model.model.embed_tokens.register_forward_hook(lambda m, a, out: steer(out))
    elif site == "resid_mid":
        norm = model.model.layers[layer - 1].post_attention_layernorm
        handle = norm.register_forward_pre_hook(lambda m, args: (steer(args[0]),))
    else:

        def after_layer(module, args, out):
            steer(out[0] if isinstance(out, tuple) else out)
            return out

        handle = model.model.layers[layer - 1].register_forward_hook(after_layer)
    try:
        return model(torch.tensor([ids])).logits[0].float()
    finally:
        handle.remove()


@torch.no_grad()
def steered_greedy(
    path: str, prompt: str, layer: int, vector: torch.Tensor, tokens: int, **kwargs
) -> list[int]:
    """``tokens`` greedy token ids after ``prompt`` under `steered_logits`'s hook (no stop
    token: the caller cuts where the engine stopped)."""
    _, tokenizer = load(path)
    ids = list(tokenizer(prompt)["input_ids"])
    start = len(ids)
    for _ in range(tokens):
        ids.append(int(steered_logits(path, ids, layer, vector, **kwargs)[-1].argmax()))
    return ids[start:]
