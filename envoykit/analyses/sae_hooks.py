"""Where an SAE reads, in envoykit's words: its (layer, site), from the hook names of
TransformerLens and the module paths of Hugging Face models that SAE files carry, and back.

envoykit's layer n is the stream after n decoder layers (0: the embedding), so
TransformerLens's ``blocks.L.hook_resid_pre`` is envoykit's layer L and
``blocks.L.hook_resid_post`` layer L + 1.
"""

from __future__ import annotations

import re

from envoykit.errors import InvalidRequest

SAE_SITES = ("resid", "resid_mid", "attn", "mlp")
# TransformerLens hook -> (layer offset from the block's number, envoykit site).
_TL_HOOKS = {
    "hook_resid_pre": (0, "resid"),
    "hook_resid_mid": (1, "resid_mid"),
    "hook_resid_post": (1, "resid"),
    "hook_attn_out": (1, "attn"),
    "hook_mlp_out": (1, "mlp"),
}
# The last part of a Hugging Face module path inside a decoder layer -> envoykit site.
_HF_MODULES = {"": "resid", "mlp": "mlp", "self_attn": "attn", "attn": "attn"}
HOOKS_KNOWN = (
    "blocks.L.hook_resid_pre, blocks.L.hook_resid_mid, blocks.L.hook_resid_post, "
    "blocks.L.hook_attn_out, blocks.L.hook_mlp_out (TransformerLens, L from 0), "
    "model.layers.L, model.layers.L.mlp, model.layers.L.self_attn, embed_tokens "
    "(Hugging Face modules)"
)


def site_of_hook(hook: str) -> tuple[int, str]:
    """envoykit's (layer, site) of a TransformerLens hook name or a Hugging Face module path;
    `InvalidRequest` naming the hooks known for anything else."""
    found = re.fullmatch(r"blocks\.(\d+)\.(hook_\w+)", hook)
    if found and found.group(2) in _TL_HOOKS:
        offset, site = _TL_HOOKS[found.group(2)]
        return int(found.group(1)) + offset, site
    if re.fullmatch(r"(model\.)*(language_model\.)?embed_tokens|hook_embed", hook):
        return 0, "resid"
    found = re.fullmatch(r"(?:[\w.]*\.)?(?:layers|h)\.(\d+)(?:\.(\w+))?", hook)
    if found and (found.group(2) or "") in _HF_MODULES:
        return int(found.group(1)) + 1, _HF_MODULES[found.group(2) or ""]
    raise InvalidRequest(
        f"envoykit does not know where hook {hook!r} reads: give site= and layer= "
        f"(sites: {', '.join(SAE_SITES)}); hooks it maps: {HOOKS_KNOWN}"
    )


def tl_hook(layer: int, site: str) -> str:
    """The TransformerLens hook name of envoykit's (layer, site)."""
    if site == "resid":
        return (
            f"blocks.{layer}.hook_resid_pre"
            if layer == 0
            else f"blocks.{layer - 1}.hook_resid_post"
        )
    name = {"resid_mid": "hook_resid_mid", "attn": "hook_attn_out", "mlp": "hook_mlp_out"}[site]
    return f"blocks.{layer - 1}.{name}"
