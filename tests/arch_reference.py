"""The readout of any architecture in plain transformers (float32, CPU), for the matrix tests.

Shares no code with envoykit, and runs in a process of its own (`reference`): building an
engine's structure-only model through vLLM's Transformers backend decorates transformers'
own model classes in that process (OLMo's, GPT-NeoX's), after which they no longer load
outside vLLM. Forward hooks on the Hugging Face modules collect, per decoder
layer, the stream before and after it and one more value: the stream between attention and
MLP where the layer has one (the input of its MLP pre-norm, or of the MLP itself in OLMo 2's
post-norm layers), or, where attention and MLP run in parallel, the attention block's output.
The blocks' writes follow from those (what the stream gained). Logits are the model's own
final norm and head with the model's own logit scaling and soft-cap; at the last layer they
must equal the model's output logits (`lens_logits` checks it).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# The MLP pre-norm of a sequential layer, by the names transformers' layers give it.
_PRENORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2")
# The attention block of a parallel layer.
_ATTENTIONS = ("attn", "attention", "self_attn", "self_attention")


PROB_TOL = 1e-4  # probability, float32 on both sides


def probs(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), -1).numpy()


def assert_lens_matches(res, logits: torch.Tensor) -> None:
    """A lens result's rows against reference logits ``[rows, T, vocab]``: the reference's
    probabilities at the engine's top-k ids, the engine's top-k probabilities against the
    reference's own top k (so a wrong token at rank 2..k fails), the top-k token sets where
    the reference's k-th and (k+1)-th are not tied, top-1 where the first two are not, and
    entropy."""
    p = probs(logits)
    want = np.take_along_axis(p, res.top_ids, -1)
    np.testing.assert_allclose(res.top_probs, want, atol=PROB_TOL, rtol=0)
    k = res.top_ids.shape[-1]
    best = np.argsort(-p, -1, kind="stable")[..., : k + 1]
    best_probs = np.take_along_axis(p, best, -1)
    np.testing.assert_allclose(res.top_probs, best_probs[..., :k], atol=PROB_TOL, rtol=0)
    apart = best_probs[..., k - 1] - best_probs[..., k] > PROB_TOL
    np.testing.assert_array_equal(
        np.sort(res.top_ids, -1)[apart], np.sort(best[..., :k], -1)[apart]
    )
    decided = best_probs[..., 0] - best_probs[..., 1] > PROB_TOL
    np.testing.assert_array_equal(res.top_ids[..., 0][decided], best[..., 0][decided])
    entropy = -(p * np.log(np.clip(p, 1e-300, None))).sum(-1)
    np.testing.assert_allclose(res.entropy, entropy, atol=1e-3, rtol=1e-4)


@functools.cache
def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _children(model) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    base = model.base_model
    layers = next(getattr(base, n) for n in ("layers", "h") if hasattr(base, n))
    norm = next(getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm") if hasattr(base, n))
    return layers, norm


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def head_logits(model, normed: torch.Tensor) -> torch.Tensor:
    """What the model's head makes of normalised streams: its logits, scaled and capped as
    its own forward does."""
    config = model.config
    logits = model.get_output_embeddings()(normed)
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if model.config.model_type == "cohere":
        logits = logits * config.logit_scale
    cap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def streams(path: str, prompt: str, parallel: bool) -> dict[str, torch.Tensor]:
    """``embed`` ``[T, d]``, ``post`` ``[n_layers, T, d]`` (the stream after each layer),
    ``mid`` (between the blocks) or, with ``parallel``, ``attn`` (the attention's output),
    and ``logits`` (the model's own output), for ``prompt``."""
    model, tokenizer = load(path)
    layers, _ = _children(model)
    found: dict[str, list[torch.Tensor]] = {"embed": [], "post": [], "mid": [], "attn": []}
    handles = [
        layers[0].register_forward_pre_hook(
            lambda m, a, k: found["embed"].append((a[0] if a else k["hidden_states"])[0].clone()),
            with_kwargs=True,
        )
    ]
    for layer in layers:
        handles.append(
            layer.register_forward_hook(lambda m, a, o: found["post"].append(_first(o)[0].clone()))
        )
        if parallel:
            attn = next(getattr(layer, n) for n in _ATTENTIONS if hasattr(layer, n))
            handles.append(
                attn.register_forward_hook(
                    lambda m, a, o: found["attn"].append(_first(o)[0].clone())
                )
            )
        else:
            name = next((n for n in _PRENORMS if hasattr(layer, n)), None)
            if model.config.model_type == "olmo2":
                name = "mlp"
            handles.append(
                getattr(layer, name).register_forward_pre_hook(
                    lambda m, a: found["mid"].append(a[0][0].clone())
                )
            )
    ids = tokenizer(prompt)["input_ids"]
    try:
        logits = model(torch.tensor([ids])).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    out = {key: torch.stack(values) for key, values in found.items() if values}
    out["embed"] = out["embed"][0]
    return {**out, "logits": logits.float(), "ids": torch.tensor(ids)}


def sites(path: str, prompt: str, parallel: bool) -> dict[str, torch.Tensor]:
    """``[n_layers, T, d]`` per site: ``resid`` (after the layer), ``resid_mid`` (sequential
    layers only), ``attn`` and ``mlp`` (what each block added to the stream)."""
    got = streams(path, prompt, parallel)
    post = got["post"]
    pre = torch.cat([got["embed"][None], post[:-1]])
    if parallel:
        attn = got["attn"]
        return {"resid": post, "attn": attn, "mlp": post - pre - attn, "embed": got["embed"]}
    mid = got["mid"]
    return {
        "resid": post,
        "resid_mid": mid,
        "attn": mid - pre,
        "mlp": post - mid,
        "embed": got["embed"],
    }


@torch.no_grad()
def lens_logits(path: str, prompt: str, parallel: bool) -> torch.Tensor:
    """``[n_layers + 1, T, vocab]``: the embedding and every layer's stream through the final
    norm and head; the last row is checked against the model's own logits."""
    model, _ = load(path)
    _, norm = _children(model)
    got = streams(path, prompt, parallel)
    hidden = torch.cat([got["embed"][None], got["post"]])
    logits = head_logits(model, norm(hidden))
    torch.testing.assert_close(logits[-1], got["logits"], atol=2e-5, rtol=2e-5)
    return logits


@torch.no_grad()
def site_logits(path: str, prompt: str, parallel: bool, site: str) -> torch.Tensor:
    """``[n_layers, T, vocab]``: one site's values, each row through the final norm on its
    own and the head."""
    model, _ = load(path)
    _, norm = _children(model)
    return head_logits(model, norm(sites(path, prompt, parallel)[site]))


@torch.no_grad()
def patched_logits(path: str, source: str, target: str, layer: int, position: int) -> torch.Tensor:
    """The target's output logits ``[T, vocab]`` with the stream after decoder layer ``layer``
    (1-based) at ``position`` replaced by the source's there."""
    model, tokenizer = load(path)
    layers, _ = _children(model)
    captured: list[torch.Tensor] = []
    handle = layers[layer - 1].register_forward_hook(
        lambda m, a, o: captured.append(_first(o)[0, position].clone())
    )
    try:
        model(torch.tensor([tokenizer(source)["input_ids"]]))
    finally:
        handle.remove()

    def replace(m, a, o):
        _first(o)[0, position] = captured[0]
        return o

    handle = layers[layer - 1].register_forward_hook(replace)
    try:
        return model(torch.tensor([tokenizer(target)["input_ids"]])).logits[0].float()
    finally:
        handle.remove()


def steering_vector(d_model: int) -> torch.Tensor:
    """The matrix's steering vector: seeded, norm 4."""
    v = torch.randn(d_model, generator=torch.Generator().manual_seed(0))
    return v * (4.0 / v.norm())


@torch.no_grad()
def steered_logits(path: str, prompt: str, layer: int, norm_match: bool) -> torch.Tensor:
    """Output logits ``[T, vocab]`` with `steering_vector` added to the stream after decoder
    layer ``layer`` (1-based) at every position, each row rescaled to its old norm with
    ``norm_match``."""
    model, tokenizer = load(path)
    layers, _ = _children(model)
    vector = steering_vector(model.config.hidden_size)

    def add(m, a, o):
        stream = _first(o)
        before = stream[0].clone()
        after = before + vector
        if norm_match:
            after = after * before.norm(dim=-1, keepdim=True) / after.norm(dim=-1, keepdim=True)
        stream[0] = after
        return o

    handle = layers[layer - 1].register_forward_hook(add)
    try:
        return model(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0].float()
    finally:
        handle.remove()


@torch.no_grad()
def attentions(path: str, prompt: str) -> torch.Tensor | None:
    """``[n_layers, heads, T, T]``: transformers' eager attention weights
    (``output_attentions=True``); None where the model gives none."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    _, tokenizer = load(path)
    out = model(torch.tensor([tokenizer(prompt)["input_ids"]]), output_attentions=True)
    if not out.attentions or any(a is None for a in out.attentions):
        return None
    return torch.stack([a[0] for a in out.attentions]).float()


# The projection an attention block's heads write through, by the names transformers gives it.
_OUTPUT_PROJECTIONS = ("o_proj", "c_proj", "dense", "out_proj")


def _output_projection(layer) -> torch.nn.Module:
    attn = next(getattr(layer, n) for n in _ATTENTIONS if hasattr(layer, n))
    return next(getattr(attn, n) for n in _OUTPUT_PROJECTIONS if hasattr(attn, n))


@torch.no_grad()
def head_edited_logits(path: str, target: str, layer: int, head: int, edit: str, source: str = ""):
    """The target's output logits ``[T, vocab]`` with head ``head`` (0-based) of decoder
    layer ``layer`` (1-based) edited at its output projection's input: ``"patch"`` copies the
    source's head at the last position into the target's last position, ``"zero"`` and
    ``"mean"`` replace it at every position by zeros or by its mean over the positions."""
    model, tokenizer = load(path)
    layers, _ = _children(model)
    projection = _output_projection(layers[layer - 1])
    size = model.config.hidden_size // model.config.num_attention_heads
    size = getattr(model.config, "head_dim", None) or size
    columns = slice(head * size, (head + 1) * size)
    captured: list[torch.Tensor] = []
    if edit == "patch":
        handle = projection.register_forward_pre_hook(
            lambda m, a: captured.append(a[0][0, -1, columns].clone())
        )
        try:
            model(torch.tensor([tokenizer(source)["input_ids"]]))
        finally:
            handle.remove()

    def change(m, a):
        x = a[0].clone()
        if edit == "patch":
            x[0, -1, columns] = captured[0]
        elif edit == "zero":
            x[0, :, columns] = 0.0
        else:
            x[0, :, columns] = x[0, :, columns].mean(0)
        return (x, *a[1:])

    handle = projection.register_forward_pre_hook(change)
    try:
        return model(torch.tensor([tokenizer(target)["input_ids"]])).logits[0].float()
    finally:
        handle.remove()


SITES = {"parallel": ("attn", "mlp"), "sequential": ("attn", "resid_mid", "mlp")}


@functools.cache
@torch.no_grad()
def _tuned_logits(path: str, prompt: str, parallel: bool, translators: str) -> torch.Tensor:
    """``[n_layers + 1, T, vocab]`` in float64: transformers' streams, each before the last
    layer's through its translator (``x + x @ A.T + b``, read from the safetensors file
    ``translators``), then the final norm and head. The last layer's stream is untranslated,
    as the tuned lens leaves it."""
    from safetensors.torch import load_file

    got = streams(path, prompt, parallel)
    hidden = torch.cat([got["embed"][None], got["post"]]).double()
    tensors = load_file(translators)
    rows = []
    for layer, x in enumerate(hidden):
        if f"A.{layer}" in tensors and layer < len(hidden) - 1:
            weight, bias = tensors[f"A.{layer}"].double(), tensors[f"b.{layer}"].double()
            x = x + x @ weight.T + bias
        rows.append(x)
    model = load(path)[0].double()
    _, norm = _children(model)
    return head_logits(model, norm(torch.stack(rows)))


def tuned_logits(path: str, prompt: str, parallel: bool, translators: bytes) -> torch.Tensor:
    """`_tuned_logits` of the translators in ``translators`` (a tuned lens's ``to_bytes``),
    computed in a fresh process as `reference` is."""
    with tempfile.TemporaryDirectory() as folder:
        blob, out = Path(folder) / "translators.safetensors", Path(folder) / "tuned.pt"
        blob.write_bytes(translators)
        args = ["tuned", path, prompt, str(int(parallel)), str(blob), str(out)]
        done = subprocess.run(
            [sys.executable, __file__, *args], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return torch.load(out)


def reference(path: str, prompt: str, other: str, parallel: bool) -> dict:
    """Everything the matrix tests compare against, computed in a fresh process: ``lens``
    ``[n_layers + 1, T, vocab]``, ``streams`` (the embedding and each layer's stream before
    the final norm, ``[n_layers + 1, T, d]``), ``sites`` (site -> ``[n_layers, T, vocab]``),
    ``patched`` (``other``'s logits with ``prompt``'s stream after layer 2 at the last position),
    ``soft_cap`` (the model's final logit soft-cap, or None), ``attentions`` (eager
    attention weights ``[n_layers, heads, T, T]``, or None), and ``steered`` /
    ``steered_norm`` (``prompt``'s logits steered after layer 2, `steered_logits`), and
    ``site_streams`` (site -> ``[n_layers, T, d]``: the stream, or a block's write, `sites`)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "reference.pt"
        args = [path, prompt, other, str(int(parallel)), str(out)]
        done = subprocess.run(
            [sys.executable, __file__, *args], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return torch.load(out)


def _main(path: str, prompt: str, other: str, parallel: str, out: str) -> None:
    flag = parallel == "1"
    model, _ = load(path)
    names = SITES["parallel" if flag else "sequential"]
    stream = streams(path, prompt, flag)
    torch.save(
        {
            "lens": lens_logits(path, prompt, flag),
            "streams": torch.cat([stream["embed"][None], stream["post"]]),
            "sites": {site: site_logits(path, prompt, flag, site) for site in names},
            "patched": patched_logits(path, prompt, other, layer=2, position=-1),
            "soft_cap": getattr(model.config, "final_logit_softcapping", None),
            "attentions": attentions(path, prompt),
            "head_patched": head_edited_logits(path, other, 2, 1, "patch", source=prompt),
            "head_zero": head_edited_logits(path, prompt, 2, 1, "zero"),
            "head_mean": head_edited_logits(path, prompt, 2, 1, "mean"),
            "steered": steered_logits(path, prompt, 2, norm_match=False),
            "steered_norm": steered_logits(path, prompt, 2, norm_match=True),
            "site_streams": {k: v for k, v in sites(path, prompt, flag).items() if k != "embed"},
        },
        out,
    )


if __name__ == "__main__":
    if sys.argv[1] == "tuned":
        path, prompt, parallel, blob, out = sys.argv[2:]
        torch.save(_tuned_logits(path, prompt, parallel == "1", blob), out)
    else:
        _main(*sys.argv[1:])
