"""Tuned-lens translators on the ranks: installed once per engine, applied inside traces.

A tuned lens's translators (one ``d_model x d_model`` matrix and bias per layer: 40 MB for
the demo model) would be most of every trace's payload if they travelled with the trace
code. Instead each rank keeps them in this module's `INSTALLED`, keyed by a content hash
(a few at most: the engine names those to keep with each install):
the owning engine sends them once through vLLM's ``collective_rpc`` (the worker method
`TranslatorStore.envoykit_install_translators`), and trace code names only the key.
"""

from __future__ import annotations

import torch
from safetensors.torch import load as load_tensors

from envoykit.model.readout import stream_of

# key -> {lens layer: (A [d, d], b [d])}, in each rank process.
INSTALLED: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}


def unpack(
    blob: bytes, device: torch.device | str = "cpu"
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Translators from the safetensors bytes `envoykit.analyses.tuned.TunedLens.to_bytes`
    writes, on ``device`` (the rank's: moved once, at install, not at every translation)."""
    tensors = {name: tensor.to(device) for name, tensor in load_tensors(blob).items()}
    layers = sorted({int(name.split(".")[1]) for name in tensors})
    return {layer: (tensors[f"A.{layer}"], tensors[f"b.{layer}"]) for layer in layers}


def translate(key: str, layer: int, stream: torch.Tensor) -> torch.Tensor:
    """Inside a trace on a rank: ``stream + stream @ A.T + b`` with layer ``layer``'s
    installed translator (float32, then back to the stream's dtype). The translator is on
    the rank's device already (`unpack`); ``.to`` is then no copy."""
    weight, bias = INSTALLED[key][layer]
    x = stream.float()
    return (x + x @ weight.to(x.device).T + bias.to(x.device)).to(stream.dtype)


def translated(
    streams: list[tuple[torch.Tensor, torch.Tensor | None]],
    rows: list[tuple[int, str]],
    key: str,
    n_layers: int,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Inside a trace: the lens rows with every residual-stream row before the last layer
    translated (the last layer's stream is the model's output and stays exact)."""
    out = []
    for (layer, site), (hidden, residual) in zip(rows, streams):
        if site == "resid" and layer < n_layers:
            out.append((translate(key, layer, stream_of(hidden, residual)), None))
        else:
            out.append((hidden, residual))
    return out


class TranslatorStore:
    """Worker mixin: the RPC that installs translators in this rank's `INSTALLED`."""

    def envoykit_install_translators(
        self, key: str, blob: bytes, keep: tuple[str, ...] = ()
    ) -> int:
        """Install ``key`` and drop every other translator but ``keep``: the owning engine
        decides what its ranks hold (`envoykit.analyses.installed.InstalledTranslators`)."""
        for other in [k for k in INSTALLED if k != key and k not in keep]:
            del INSTALLED[other]
        if key not in INSTALLED:
            INSTALLED[key] = unpack(blob, getattr(self, "device", "cpu"))
        return len(INSTALLED[key])
