"""`SAE`: a sparse autoencoder of one site of a model, as envoykit reads, checks and ships it.

An SAE here is SAELens's arithmetic: ``acts = act(x' @ W_enc + b_enc)`` with ``x' = x -
b_dec`` when ``apply_b_dec_to_input`` (and ``x`` first scaled to norm ``sqrt(d_in)`` under
``normalize_activations="constant_norm_rescale"``, or standardised per token under
``"layer_norm"``), and ``x_hat = acts @ W_dec + b_dec`` (mapped back where the input was
normalised).
The activation is ReLU ("relu", SAELens's "standard"), JumpReLU (ReLU where the
pre-activation is above a per-feature threshold) or TopK (the k largest pre-activations per
token, then ReLU). `envoykit.analyses.sae_files` reads SAELens's, sparsify's and Gemma
Scope's files into one; `envoykit.ranks.sae` runs it on the ranks, each holding its slice of
the features.

Where it reads: envoykit's (layer, site), taken from the SAE's hook name
(`envoykit.analyses.sae_hooks`) or given.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from envoykit.analyses.sae_hooks import SAE_SITES
from envoykit.errors import InvalidRequest
from envoykit.ranks.sae import normalized
from envoykit.results import safetensors_file

if TYPE_CHECKING:
    from envoykit.analyses.base import EngineBase
    from envoykit.runtime.info import ModelInfo

ARCHITECTURES = ("relu", "jumprelu", "topk")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")


@dataclass(frozen=True, eq=False)
class SAE:
    """A sparse autoencoder of the stream at (``layer``, ``site``), float32 on the CPU.

    ``W_enc`` ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``, ``W_dec`` ``[d_sae, d_in]``,
    ``b_dec`` ``[d_in]``; ``threshold`` ``[d_sae]`` for JumpReLU, ``k`` for TopK.
    ``model_name``: the model it was trained on, checked against an engine's unless
    ``model_check`` is False. ``source``: where it was read from. Checked on construction:
    shapes, a supported architecture, finite weights.
    """

    architecture: str
    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    layer: int
    site: str = "resid"
    threshold: torch.Tensor | None = None
    k: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    hook_name: str | None = None
    model_name: str | None = None
    model_check: bool = True
    source: str = "memory"
    key: str = field(init=False)

    def __post_init__(self) -> None:
        tensors = {
            name: _float32(name, getattr(self, name))
            for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
            if getattr(self, name) is not None
        }
        for name, value in tensors.items():
            object.__setattr__(self, name, value)
        self._check()
        config, blob = self.to_wire()
        object.__setattr__(self, "key", hashlib.sha256(config.encode() + blob).hexdigest()[:16])

    def _check(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise InvalidRequest(
                f"SAE architecture {self.architecture!r} is not supported: envoykit reads "
                f"{', '.join(ARCHITECTURES)} (SAELens's standard is relu)"
            )
        if self.normalize_activations not in NORMALIZATIONS:
            raise InvalidRequest(
                f"normalize_activations={self.normalize_activations!r} is not supported: "
                f"envoykit applies {', '.join(NORMALIZATIONS)}"
            )
        if self.site not in SAE_SITES:
            raise InvalidRequest(
                f"an SAE's site is one of {', '.join(SAE_SITES)}, not {self.site!r}"
            )
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise InvalidRequest(f"an SAE's layer is an integer >= 0, not {self.layer!r}")
        if self.layer == 0 and self.site != "resid":
            raise InvalidRequest("layer 0 (the embedding) has only the 'resid' site")
        d_in, d_sae = self.W_enc.shape if self.W_enc.dim() == 2 else (-1, -1)
        expected = {
            "W_enc": (d_in, d_sae),
            "b_enc": (d_sae,),
            "W_dec": (d_sae, d_in),
            "b_dec": (d_in,),
            "threshold": (d_sae,),
        }
        for name, shape in expected.items():
            value = getattr(self, name)
            if value is None:
                continue
            if tuple(value.shape) != shape or d_in < 1 or d_sae < 1:
                raise InvalidRequest(
                    f"the SAE's {name} has shape {tuple(value.shape)}, expected {shape} for "
                    f"W_enc of shape {tuple(self.W_enc.shape)} ([d_in, d_sae])"
                )
            if not bool(torch.isfinite(value).all()):
                raise InvalidRequest(
                    f"the SAE's {name} holds NaN or infinite values ({self.source})"
                )
        if self.architecture == "jumprelu" and self.threshold is None:
            raise InvalidRequest("a JumpReLU SAE needs its threshold")
        if self.architecture == "topk" and (
            isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= d_sae
        ):
            raise InvalidRequest(f"a TopK SAE's k is an integer in 1..{d_sae}, not {self.k!r}")

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[1])

    def __repr__(self) -> str:
        k = f", k={self.k}" if self.k is not None else ""
        return (
            f"SAE({self.architecture}{k}, {self.d_in} -> {self.d_sae} features, layer {self.layer} "
            f"{self.site!r}, key={self.key})"
        )

    # -- reading and writing --------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        site: str | None = None,
        layer: int | None = None,
        model_check: bool = True,
    ) -> SAE:
        """Read an SAE from SAELens's files (``cfg.json`` + ``sae_weights.safetensors``),
        sparsify's (``cfg.json`` + ``sae.safetensors``) or Gemma Scope's (``params.npz``).
        ``site``/``layer`` override where its hook name says it reads (Gemma Scope's files
        name no hook: give ``layer``). ``model_check=False``: use it on a model of another
        name."""
        from envoykit.analyses.sae_files import read

        return cls(**read(Path(path), site=site, layer=layer, model_check=model_check))

    @classmethod
    def from_sae_lens(cls, sae: Any, *, site: str | None = None, layer: int | None = None) -> SAE:
        """Wrap a live SAELens ``SAE`` object (sae-lens installed beside envoykit)."""
        from envoykit.analyses.sae_files import from_sae_lens

        return cls(**from_sae_lens(sae, site=site, layer=layer))

    def save(self, path: str | Path) -> Path:
        """Write this SAE in SAELens's format (``cfg.json`` + ``sae_weights.safetensors``),
        which SAELens's ``SAE.load_from_disk`` opens; the directory."""
        from envoykit.analyses.sae_files import write_sae_lens

        return write_sae_lens(Path(path), self.config(), self._tensors())

    def to_wire(self) -> tuple[str, bytes]:
        """What the ranks install (`envoykit.ranks.sae.unpack`): a JSON config and the
        tensors as safetensors bytes."""
        from safetensors.torch import save as save_tensors

        config = json.dumps(
            {
                "architecture": self.architecture,
                "k": self.k,
                "apply_b_dec_to_input": self.apply_b_dec_to_input,
                "normalize_activations": self.normalize_activations,
            },
            sort_keys=True,
        )
        return config, save_tensors(self._tensors())

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
        return {
            name: getattr(self, name).contiguous()
            for name in names
            if getattr(self, name) is not None
        }

    def config(self) -> dict[str, Any]:
        """Every field but the tensors: what `SAE(**config, **tensors)` needs besides them."""
        return {name: getattr(self, name) for name in _CONFIG_FIELDS}

    def to_bytes(self) -> bytes:
        """The whole SAE as one safetensors blob, its tensors and (in the metadata) every
        other field: what a connection sends a server, data only (no pickle), read back by
        `from_bytes` with the same key."""
        from safetensors.torch import save as save_tensors

        config = json.dumps(self.config())
        return save_tensors(self._tensors(), metadata={_METADATA_KEY: config})

    @classmethod
    def from_bytes(cls, blob: bytes) -> SAE:
        """Read what `to_bytes` wrote; `InvalidRequest` unless it is an SAE envoykit wrote,
        with the fields and tensors an SAE has (checked again as any SAE is on construction).
        Safetensors, not pickle: reading it runs nothing."""
        tensors, config = safetensors_file.read(blob, _METADATA_KEY, "an SAE sent by envoykit")
        if not isinstance(config, dict) or set(config) != set(_CONFIG_FIELDS):
            found = sorted(config) if isinstance(config, dict) else type(config).__name__
            raise InvalidRequest(
                f"not an SAE sent by envoykit: its fields are {found}, not {sorted(_CONFIG_FIELDS)}"
            )
        for name, kinds in _CONFIG_FIELDS.items():
            value = config[name]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise InvalidRequest(f"not an SAE sent by envoykit: its {name} is {value!r}")
        required = {"W_enc", "b_enc", "W_dec", "b_dec"}
        if not required <= set(tensors) <= required | {"threshold"}:
            raise InvalidRequest(
                f"an SAE holds W_enc, b_enc, W_dec, b_dec (and threshold), not {sorted(tensors)}"
            )
        return cls(**tensors, **config)

    # -- on the client ----------------------------------------------------------------------

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` of ``x`` ``[..., d_in]``, on the client (in
        ``x``'s floating dtype; the engine computes the same on its ranks)."""
        dtype = x.dtype if x.is_floating_point() else torch.float32
        x = normalized(x.to(dtype), self.normalize_activations)[0]
        if self.apply_b_dec_to_input:
            x = x - self.b_dec.to(dtype)
        pre = x @ self.W_enc.to(dtype) + self.b_enc.to(dtype)
        if self.architecture == "topk":
            assert self.k is not None  # `_check`: a TopK SAE has its k
            top = pre.topk(int(self.k), dim=-1)
            return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        acts = pre.relu()
        if self.architecture == "jumprelu":
            assert self.threshold is not None  # `_check`: a JumpReLU SAE has its threshold
            acts = acts * (pre > self.threshold.to(dtype))
        return acts

    def decode(self, acts: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction ``acts @ W_dec + b_dec``; under ``constant_norm_rescale`` scaled
        back to the norm of the input ``x`` it encodes."""
        dtype = acts.dtype
        out = acts @ self.W_dec.to(dtype) + self.b_dec.to(dtype)
        if self.normalize_activations == "none":
            return out
        if x is None:
            raise InvalidRequest("this SAE normalises its input: decode(acts, x) needs x")
        scale, shift = normalized(x.to(dtype), self.normalize_activations)[1:]
        return out * scale + shift

    def direction(self, feature: int) -> torch.Tensor:
        """The decoder row of ``feature``: the direction it writes into the stream."""
        return self.W_dec[self.check_feature(feature)].clone()

    def check_feature(self, feature: Any) -> int:
        """``feature`` as a feature id of this SAE (numpy integers accepted)."""
        import numpy as np

        if isinstance(feature, (bool, np.bool_)) or not isinstance(feature, (int, np.integer)):
            raise InvalidRequest(f"a feature is an integer id, not {feature!r}")
        if not 0 <= int(feature) < self.d_sae:
            raise InvalidRequest(
                f"feature {int(feature)} is out of range: this SAE has {self.d_sae} "
                f"(0..{self.d_sae - 1})"
            )
        return int(feature)

    def check_engine(self, info: ModelInfo) -> None:
        """Refuse this SAE on an engine it does not fit: another width, a layer past the
        model's, or (unless ``model_check`` is False) another model's name."""
        if self.d_in != info.d_model:
            raise InvalidRequest(
                f"this SAE reads {self.d_in} numbers (d_in) but {info.name} has d_model="
                f"{info.d_model}: it belongs to another model"
            )
        if self.layer > info.n_layers:
            raise InvalidRequest(
                f"this SAE reads layer {self.layer}, past {info.name}'s {info.n_layers} layers"
            )
        if self.model_check and self.model_name and not same_model(self.model_name, info):
            raise InvalidRequest(
                f"this SAE was trained on {self.model_name!r}, not {info.name!r}: load it with "
                "model_check=False to use it anyway"
            )

    def describe(self) -> dict[str, Any]:
        """What a result's ``meta`` records of this SAE."""
        return {
            "key": self.key,
            "architecture": self.architecture,
            "d_sae": self.d_sae,
            "k": self.k,
            "layer": self.layer,
            "site": self.site,
            "hook_name": self.hook_name,
            "source": self.source,
        }


# What `SAE.to_bytes` writes in the metadata beside the tensors: each field, and the types
# `SAE.from_bytes` accepts for it (bool only where named: it is an int to isinstance).
_METADATA_KEY = "envoykit.sae"
_CONFIG_FIELDS: dict[str, tuple[type, ...]] = {
    "architecture": (str,),
    "k": (int, type(None)),
    "apply_b_dec_to_input": (bool,),
    "normalize_activations": (str,),
    "layer": (int,),
    "site": (str,),
    "hook_name": (str, type(None)),
    "model_name": (str, type(None)),
    "model_check": (bool,),
    "source": (str,),
}


def same_model(name: str, info: ModelInfo) -> bool:
    """Whether an SAE's model name names the engine's model (by its name, or its checkpoint's
    last path part, ignoring case and an organisation prefix)."""

    def short(text: str) -> str:
        return text.rstrip("/").rsplit("/", 1)[-1].lower()

    names = {short(info.name), short(str(info.path))}
    return short(name) in names


def _float32(name: str, value: Any) -> torch.Tensor:
    import numpy as np

    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.array(value))
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise InvalidRequest(
            f"the SAE's {name} must be a floating-point tensor, not {type(value).__name__}"
        )
    # A copy of its own: the key hashes these numbers, and a caller's tensor may change later.
    return value.detach().to("cpu", torch.float32, copy=True).contiguous()


def as_saes(sae: Any) -> list[SAE]:
    """One SAE or a list of them, as a list; anything else refused."""
    items = [sae] if isinstance(sae, SAE) else list(sae) if isinstance(sae, (list, tuple)) else None
    if not items or any(not isinstance(item, SAE) for item in items):
        raise InvalidRequest(
            f"features take an ek.SAE or a list of them (ek.SAE.load(path)), not {sae!r}"
        )
    return items


def require(engine: EngineBase, sae: SAE) -> str:
    """``sae`` checked against ``engine``'s model and installed on its ranks; its key."""
    if not isinstance(sae, SAE):
        raise InvalidRequest(f"expected an ek.SAE, not {type(sae).__name__}")
    sae.check_engine(engine.info)
    engine.readout.require("SAE features")
    engine._require_sites([sae.site])
    return engine._install_sae(sae)
