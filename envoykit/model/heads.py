"""Where a model's attention heads are: the kernel that receives each layer's queries and
keys, and the projection the heads write through.

vLLM gives every decoder layer with standard attention one ``Attention`` module (its own
models and the layers it runs through its Transformers backend alike): its inputs are the
queries and keys *after* rotary embedding and any q/k norm, ``[tokens, heads * head_size]``
on each rank, which holds a contiguous slice of the heads. Its output goes into a
row-parallel projection (``o_proj``, ``c_proj``, ``dense``, ``out_proj``) whose input columns
are the heads in order. `HeadLayout` names both, found on the structure-only model by class,
not by name. Multi-head latent attention (DeepSeek) and ALiBi have no such kernel input to
read a pattern from: `HeadLayout.find` says why instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadLayout:
    """The attention of a model's decoder layers, as paths inside one layer.

    ``attention`` is vLLM's attention kernel module, ``output`` the row-parallel projection
    its heads feed; ``n_heads``, ``n_kv_heads`` and ``head_size`` are the whole model's.
    ``windows[i]`` is layer ``i + 1``'s sliding window (None: full attention).
    """

    attention: str
    output: str
    n_heads: int
    n_kv_heads: int
    head_size: int
    windows: tuple[int | None, ...]

    @classmethod
    def find(cls, layers: torch.nn.ModuleList, architecture: str) -> HeadLayout | str:
        """The layout of ``layers`` (a structure-only model's), or why there is none."""
        from vllm.model_executor.layers.attention.attention import Attention

        kernels = [
            (name, module)
            for name, module in layers[0].named_modules()
            if type(module) is Attention
        ]
        if len(kernels) != 1:
            return (
                f"{architecture}'s layers have no standard attention kernel (multi-head latent "
                "attention, or another scheme) whose queries and keys a pattern is made of"
            )
        name, kernel = kernels[0]
        if getattr(kernel.impl, "alibi_slopes", None) is not None:
            return f"{architecture} adds ALiBi position biases, which patterns do not model"
        output = _output_projection(layers[0], name, kernel.num_heads * kernel.head_size)
        if output is None:
            return f"{architecture}'s attention heads feed no row-parallel output projection"
        windows = []
        for layer in layers:
            module = layer.get_submodule(name)
            if type(module) is not Attention:
                return f"{architecture}'s layers do not all have the same attention"
            windows.append(module.sliding_window)
        return cls(
            name, output, kernel.num_heads, kernel.num_kv_heads, kernel.head_size, tuple(windows)
        )


def _output_projection(layer: torch.nn.Module, kernel: str, width: int) -> str | None:
    """The row-parallel child of the kernel's block whose input is ``width`` wide: the
    heads, concatenated."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    block = kernel.rpartition(".")[0]
    parent = layer.get_submodule(block) if block else layer
    for name, child in parent.named_children():
        if isinstance(child, RowParallelLinear) and child.input_size == width:
            return f"{block}.{name}" if block else name
    return None
