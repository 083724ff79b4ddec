"""Reading and writing the SAE files researchers have: each read gives the keyword arguments
of `envoykit.analyses.sae.SAE`, which checks them, and a write takes its fields and tensors.

envoykit reads the formats itself rather than depending on sae-lens (36 more packages,
among them TransformerLens, datasets and wandb) or sparsify:

* SAELens 6: ``cfg.json`` (``architecture``, ``d_in``, ``d_sae``, ``apply_b_dec_to_input``,
  ``normalize_activations``, ``k`` for TopK, ``metadata.hook_name``/``model_name``; SAELens 5
  kept those two at the top level, and named TopK's k in ``activation_fn_kwargs``) and
  ``sae_weights.safetensors`` (``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``, JumpReLU's
  ``threshold``);
* EleutherAI's sparsify: ``cfg.json`` (``k``, ``d_in``, ``num_latents``...) and
  ``sae.safetensors`` (``encoder.weight`` ``[latents, d_in]``, ``encoder.bias``, ``W_dec``,
  ``b_dec``), in a directory named after its hookpoint (``layers.10``); its TopK encodes
  ``x - b_dec``, as SAELens's TopK with ``apply_b_dec_to_input``;
* Gemma Scope: ``params.npz`` (``W_enc``, ``W_dec``, ``b_enc``, ``b_dec``, ``threshold``),
  JumpReLU without ``b_dec`` subtracted from the input; its files name no hook.

Anything else (gated SAEs, transcoders, sparsify's skip connection) is refused, naming what
is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from envoykit.analyses.sae_hooks import site_of_hook, tl_hook
from envoykit.errors import InvalidRequest

# The keyword arguments of an `SAE`: its tensors, where it reads, and its options.
SAEArguments = dict[str, Any]

_SAE_LENS_WEIGHTS = "sae_weights.safetensors"
_SPARSIFY_WEIGHTS = "sae.safetensors"
_GEMMA_SCOPE = "params.npz"
# SAELens's names of the architectures envoykit reads.
_SAE_LENS_ARCHITECTURES = {
    "standard": "relu",
    "relu": "relu",
    "jumprelu": "jumprelu",
    "topk": "topk",
}


def read(path: Path, *, site: str | None, layer: int | None, model_check: bool) -> SAEArguments:
    """The SAE at ``path`` (a directory, or a ``params.npz`` file), whatever its format."""
    if path.is_file() and path.name.endswith(".npz"):
        return _gemma_scope(path, site, layer, model_check)
    if not path.is_dir():
        raise InvalidRequest(f"no SAE at {path}: give the directory holding its files")
    if (path / _SAE_LENS_WEIGHTS).exists():
        return _sae_lens(path, site, layer, model_check)
    if (path / _SPARSIFY_WEIGHTS).exists():
        return _sparsify(path, site, layer, model_check)
    if (path / _GEMMA_SCOPE).exists():
        return _gemma_scope(path / _GEMMA_SCOPE, site, layer, model_check)
    inner = sorted(p.name for p in path.iterdir() if (p / _SPARSIFY_WEIGHTS).exists())
    if len(inner) == 1:  # a sparsify run of one hookpoint
        return _sparsify(path / inner[0], site, layer, model_check)
    if inner:
        raise InvalidRequest(
            f"{path} holds sparsify SAEs of several hookpoints ({', '.join(inner)}): load one "
            f"of them, e.g. ek.SAE.load('{path / inner[0]}')"
        )
    raise InvalidRequest(
        f"{path} holds no SAE envoykit reads: SAELens's cfg.json + {_SAE_LENS_WEIGHTS}, "
        f"sparsify's cfg.json + {_SPARSIFY_WEIGHTS}, or Gemma Scope's {_GEMMA_SCOPE}"
    )


def _sae_lens(path: Path, site: str | None, layer: int | None, model_check: bool) -> SAEArguments:
    cfg = _config(path)
    metadata = cfg.get("metadata") or {}
    name = cfg.get("architecture", "standard")
    architecture = _SAE_LENS_ARCHITECTURES.get(name)
    if architecture is None:
        raise InvalidRequest(
            f"{path}: SAELens architecture {name!r} is not supported; envoykit reads "
            f"{', '.join(sorted(_SAE_LENS_ARCHITECTURES))}"
        )
    tensors = _tensors(path / _SAE_LENS_WEIGHTS)
    k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
    if architecture == "topk" and cfg.get("rescale_acts_by_decoder_norm"):
        tensors = _fold_decoder_norm(tensors)
    hook = metadata.get("hook_name", cfg.get("hook_name"))
    if metadata.get("hook_head_index", cfg.get("hook_head_index")) is not None:
        raise InvalidRequest(f"{path}: an SAE of one attention head's hook is not supported")
    return _build(
        path,
        architecture,
        tensors,
        hook,
        site,
        layer,
        model_check,
        k=None if k is None else int(k),
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        normalize_activations=cfg.get("normalize_activations") or "none",
        model_name=metadata.get("model_name", cfg.get("model_name")),
    )


def _fold_decoder_norm(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A TopK SAE with ``rescale_acts_by_decoder_norm`` as the plain TopK SAE that encodes
    and decodes the same: SAELens multiplies the pre-activations by each decoder row's norm
    and divides the activations by it before decoding, which is ``W_enc`` and ``b_enc``
    scaled by the norms and ``W_dec``'s rows by their inverse."""
    norms = tensors["W_dec"].norm(dim=-1)
    return {
        **tensors,
        "W_enc": tensors["W_enc"] * norms,
        "b_enc": tensors["b_enc"] * norms,
        "W_dec": tensors["W_dec"] / norms.unsqueeze(-1),
    }


def _sparsify(path: Path, site: str | None, layer: int | None, model_check: bool) -> SAEArguments:
    cfg = _config(path)
    for option in ("skip_connection", "transcode"):
        if cfg.get(option):
            raise InvalidRequest(f"{path}: a sparsify SAE with {option} is not supported")
    if cfg.get("activation", "topk") != "topk":
        raise InvalidRequest(
            f"{path}: sparsify activation {cfg['activation']!r} is not supported (topk is)"
        )
    tensors = _tensors(path / _SPARSIFY_WEIGHTS)
    missing = {"encoder.weight", "encoder.bias", "W_dec", "b_dec"} - set(tensors)
    if missing:
        raise InvalidRequest(f"{path / _SPARSIFY_WEIGHTS} lacks {', '.join(sorted(missing))}")
    weights = {
        "W_enc": tensors["encoder.weight"].T,
        "b_enc": tensors["encoder.bias"],
        "W_dec": tensors["W_dec"],
        "b_dec": tensors["b_dec"],
    }
    return _build(
        path,
        "topk",
        weights,
        path.name,
        site,
        layer,
        model_check,
        k=int(cfg["k"]),
        apply_b_dec_to_input=True,
        normalize_activations="none",
        model_name=_sparsify_model(path),
    )


def _sparsify_model(path: Path) -> str | None:
    """The model a sparsify run trained on: its run's ``config.json`` one folder up."""
    try:
        return json.loads((path.parent / "config.json").read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None


def _gemma_scope(
    path: Path, site: str | None, layer: int | None, model_check: bool
) -> SAEArguments:
    import numpy as np

    if layer is None:
        raise InvalidRequest(
            f"{path}: Gemma Scope's files name no hook: give layer= (and site=, 'resid' for "
            "its residual-stream SAEs; envoykit's layer n is the stream after n layers, so "
            "Gemma Scope's layer_12 is layer=13)"
        )
    try:
        with np.load(path) as found:
            arrays = {name: found[name] for name in found.files}
    except (OSError, ValueError, EOFError) as error:
        raise InvalidRequest(f"{path} is not a readable .npz file: {error}") from None
    return _build(
        path,
        "jumprelu",
        {name: torch.from_numpy(np.array(value)) for name, value in arrays.items()},
        None,
        site or "resid",
        layer,
        model_check,
        apply_b_dec_to_input=False,
        normalize_activations="none",
        model_name=None,
    )


def _build(
    path: Path,
    architecture: str,
    tensors: dict[str, torch.Tensor],
    hook: str | None,
    site: str | None,
    layer: int | None,
    model_check: bool,
    **options: Any,
) -> SAEArguments:
    """The SAE of ``tensors``, placed by ``hook`` unless ``site``/``layer`` say otherwise."""
    needed = {"W_enc", "b_enc", "W_dec", "b_dec"} | (
        {"threshold"} if architecture == "jumprelu" else set()
    )
    missing = needed - set(tensors)
    if missing:
        raise InvalidRequest(f"{path}: the SAE's weights lack {', '.join(sorted(missing))}")
    if hook is not None and (site is None or layer is None):
        hook_layer, hook_site = site_of_hook(hook)
        layer = hook_layer if layer is None else layer
        site = hook_site if site is None else site
    if layer is None:
        raise InvalidRequest(f"{path}: the SAE names no hook: give layer= (and site=)")
    return dict(
        architecture=architecture,
        W_enc=tensors["W_enc"],
        b_enc=tensors["b_enc"],
        W_dec=tensors["W_dec"],
        b_dec=tensors["b_dec"],
        threshold=tensors.get("threshold") if architecture == "jumprelu" else None,
        layer=layer,
        site=site or "resid",
        hook_name=hook,
        model_check=model_check,
        source=str(path),
        **options,
    )


def _config(path: Path) -> dict:
    try:
        return json.loads((path / "cfg.json").read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"{path} has no cfg.json beside its weights") from None
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"{path / 'cfg.json'} is not valid JSON: {error}") from None


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated or corrupt one is refused by name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise InvalidRequest(f"{path} is not a readable safetensors file: {error}") from None


def from_sae_lens(sae: Any, *, site: str | None, layer: int | None) -> SAEArguments:
    """`SAE` of a live SAELens object: its config and its parameters."""
    cfg = sae.cfg.to_dict() if hasattr(sae.cfg, "to_dict") else dict(vars(sae.cfg))
    state = {name: value.detach() for name, value in sae.state_dict().items()}
    metadata = cfg.get("metadata") or {}
    if not isinstance(metadata, dict):
        metadata = dict(vars(metadata))
    name = cfg.get("architecture", type(sae).__name__.removesuffix("SAE").lower() or "standard")
    architecture = _SAE_LENS_ARCHITECTURES.get(name)
    if architecture is None:
        raise InvalidRequest(
            f"SAELens architecture {name!r} is not supported; envoykit reads "
            f"{', '.join(sorted(_SAE_LENS_ARCHITECTURES))}"
        )
    return _build(
        Path("<sae_lens object>"),
        architecture,
        state,
        metadata.get("hook_name", cfg.get("hook_name")),
        site,
        layer,
        True,
        k=cfg.get("k"),
        apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
        normalize_activations=cfg.get("normalize_activations") or "none",
        model_name=metadata.get("model_name", cfg.get("model_name")),
    )


def write_sae_lens(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """An SAE as SAELens 6 saves one (``cfg.json`` + ``sae_weights.safetensors``), from its
    fields (`SAE.config`) and tensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    architecture = config["architecture"]
    d_in, d_sae = tensors["W_enc"].shape
    hook = config["hook_name"] or tl_hook(config["layer"], config["site"])
    cfg: dict[str, Any] = {
        "architecture": {"relu": "standard"}.get(architecture, architecture),
        "d_in": int(d_in),
        "d_sae": int(d_sae),
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": config["apply_b_dec_to_input"],
        "normalize_activations": config["normalize_activations"],
        "reshape_activations": "none",
        "metadata": {
            "model_name": config["model_name"],
            "hook_name": hook,
            "hook_head_index": None,
        },
    }
    if architecture == "topk":
        cfg["k"] = config["k"]
        cfg["rescale_acts_by_decoder_norm"] = False
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / _SAE_LENS_WEIGHTS)
    (path / "cfg.json").write_text(json.dumps(cfg, indent=2))
    return path
