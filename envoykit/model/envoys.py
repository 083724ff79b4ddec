"""The envoys map: nnsight's `ParallelEnvoy` plus what it misses.

nnsight already makes the value at a column- or row-parallel linear whole while a trace reads
it, and an ad-hoc call on one take and return whole tensors (`ParallelEnvoy`, off the rules
``VLLMFragments`` records). Three gaps remain on a tensor-parallel vLLM engine, and each gives a
refusal or, worse, a silently wrong number:

* **The unembedding.** vLLM's ``ParallelLMHead.forward`` raises on purpose (its weight is
  meant for the sampler), and no fragment rule covers it, so ``model.lm_head(hidden)`` — the
  call a logit lens makes — fails at every TP size. `UnembedEnvoy` routes the call through the
  model's own ``logits_processor``, which applies the head's quant method, all-gathers the
  vocab shards, strips the vocab padding and applies logit scale and soft-cap: the result is
  what the model itself samples from. With tied embeddings the head *is* the embedding module
  (one module, one envoy, two paths), so that envoy tells a lookup (integer ids) from an
  unembedding (float hidden states) by the input's dtype.
* **Merged column layers.** ``qkv_proj`` and ``gate_up_proj`` come back from the all-gather in
  rank order (``[q0,k0,v0,q1,k1,v1]``), unlike TP=1 and the checkpoint (``[q|k|v]``).
  `envoykit.model.checkpoint_order` reorders them when made whole and cuts edits back into
  each rank's own layout, so slicing by head means the same thing at every TP size.
* **Shards nothing gathers.** Modules between a column- and a row-parallel layer that are not
  parallel layers themselves (``mlp.act_fn``, the attention kernel, rotary embedding) hold one
  rank's piece at TP>=2 with no warning. `ShardedEnvoy` refuses reads and writes there with a
  `ShardedValue` naming the nearest whole-valued locations.
* Everything else keeps nnsight's behaviour.

Where each piece lives follows from how nnsight ships trace code: envoys travel to the ranks
*by value* (their modules and the interleaver by reference), so the envoy classes that run are
the client's — `EnvoykitVLLM` builds the client tree with this map — while the fragment rules
belong to each rank's interleaver — `envoykit.model.checkpoint_order.InstallFragments` puts
them there. Nothing here is CPU-specific: the CPU and GPU workers install the same rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.modeling.vllm import VLLM
from nnsight.modeling.vllm.envoys import ParallelEnvoy

from envoykit import _compat as compat
from envoykit.errors import InvalidRequest, ShardedValue
from envoykit.model.config import read_config
from envoykit.model.loader_calls import structure_only
from envoykit.model.readout import Readout, decoder_layers, lm_head_only, unembedding_module
from envoykit.model.vocab_shard import VocabShard


def envoys_map() -> dict:
    """The class entries of the ``envoys=`` map, matched on a module's MRO as nnsight does."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return {
        VocabParallelEmbedding: UnembedEnvoy,
        ColumnParallelLinear: ParallelEnvoy,
        RowParallelLinear: ParallelEnvoy,
    }


# The name prefix of the edit a steered trace installs on the ranks (`Engine.trace(steer=)`).
STEER_EDIT = "envoykit-steer-"


class EnvoykitVLLM(VLLM):
    """nnsight's VLLM with envoykit's envoys map, shard guard and worker class.

    The shard guard's entries are exact module paths, found on the structure-only tree
    that ``_load`` builds; the envoy tree is built from the map right after, so the paths
    are added to the same map object in between. The model's `Readout` is found on that
    tree too, before any rank starts, so a model envoykit cannot read fails fast.

    ``request_guard`` wraps every run of the engine (a trace as much as a lens): the owning
    `Engine` puts its lock, its `EngineDead` translation and its interrupt handling there.
    """

    request_guard: Callable[[], AbstractContextManager] = contextlib.nullcontext

    def __init__(self, *args: Any, worker_cls: str, tensor_parallel_size: int, **kwargs: Any):
        self._WORKER_CLS = worker_cls
        self._envoys_map = envoys_map()
        self._split = tensor_parallel_size
        super().__init__(
            *args, envoys=self._envoys_map, tensor_parallel_size=tensor_parallel_size, **kwargs
        )

    def __getstate__(self) -> dict:
        # Trace code ships this envoy to the ranks by value; the guard is the owner's.
        state = super().__getstate__()
        state.pop("request_guard", None)
        return state

    def _load_meta(self, repo_id: str, **kwargs: Any) -> torch.nn.Module:
        # vLLM's loader post-processes the tree it builds, and on the CPU a mixture of experts
        # prepacks its expert weights for the fused kernel there
        # (`CPUUnquantizedExperts.process_weights_after_loading`), ops with no meta kernel:
        # every MoE model's build raised. They fill an ``empty_like`` of the weight in place,
        # so on meta there is nothing to do; for the length of this build, in this process
        # only, they do nothing on meta tensors. The ranks pack their real weights as before.
        with compat.moe_meta_kernels(), structure_only():
            meta_model = super()._load_meta(repo_id, **kwargs)
        config = read_config(repo_id)
        architecture = (config.get("architectures") or [type(meta_model).__name__])[0]
        self.readout = Readout.find(meta_model, architecture, config)
        return meta_model

    def _load(self, repo_id: str, **kwargs: Any) -> torch.nn.Module:
        meta_model = super()._load(repo_id, **kwargs)
        guard_shards(self._envoys_map, meta_model, self._split)
        return meta_model

    def _call(self, prompts: list, params: list, lora_requests: list, **kwargs: Any) -> Any:
        """nnsight's call without vLLM's per-call progress bars (two per lens in a notebook).

        A steered trace's edit (`STEER_EDIT`) runs only in the request that names it, and is
        cleared once that request has run; every other request runs every other edit."""
        with self.request_guard():
            named = kwargs.get("edits")
            if named is None:
                kwargs["edits"] = [
                    edit.name
                    for edit in compat.installed_edits(self)
                    if edit.name is not None and not edit.name.startswith(STEER_EDIT)
                ]
            try:
                mediators = compat.attach_mediators(self, params, **kwargs)
                outputs = self.vllm_entrypoint.generate(
                    prompts, sampling_params=params, lora_request=lora_requests, use_tqdm=False
                )
            finally:
                if named and any(name.startswith(STEER_EDIT) for name in named):
                    self.clear_steer_edits()
            self._collect(mediators, outputs)
        return outputs

    def clear_steer_edits(self) -> None:
        """Clear every steered trace's edit still installed (one whose trace never ran)."""
        for edit in compat.installed_edits(self):
            if edit.name is not None and edit.name.startswith(STEER_EDIT):
                edit.clear()

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        """Re-raise envoykit's own errors from the ranks as themselves.

        nnsight brings a rank's exception back as a ``RuntimeError`` carrying the original
        type's name; for the errors envoykit raises on purpose the caller gets the class it
        can catch (``except ek.ShardedValue``), with the same message.
        """
        for output in outputs:
            raise_as_envoykit(getattr(output, "nnsight_error", None) or {})
        compat.collect_saves(mediators, outputs)


_RAISED_ON_RANKS = {cls.__name__: cls for cls in (InvalidRequest, ShardedValue)}


def raise_as_envoykit(error: dict) -> None:
    """Raise the error a rank reported (nnsight's ``{"type_name", "message"}``) as
    envoykit's own class, if it is one of envoykit's refusals; else return."""
    known = _RAISED_ON_RANKS.get(error.get("type_name", ""))
    if known is not None:
        raise known(error.get("message", ""))


def guard_shards(envoys_map: dict, meta_model: torch.nn.Module, split: int) -> None:
    """At TP > 1, map every location that holds one rank's piece to `ShardedEnvoy`."""
    if split > 1:
        envoys_map.update(dict.fromkeys(sharded_paths(meta_model), ShardedEnvoy))


class UnembedEnvoy(ParallelEnvoy):
    """The embedding and the LM head: whole ids in, whole embeddings or whole logits out."""

    def __call__(self, *args: Any, hook: bool = False, **kwargs: Any) -> Any:
        """Look up token ids, or unembed hidden states ``[tokens, d_model] -> [tokens, vocab]``.

        Float input means hidden states: they go through the model's own logits processor,
        the same call its ``compute_logits`` makes, so the result equals the logits the model
        samples from. Integer input is a lookup; vLLM's embedding forward already all-reduces
        the masked per-rank lookups into the whole embedding.
        """
        (value,) = args
        if not value.is_floating_point():
            if compat.envoy_module(self) is lm_head_only(compat.envoy_module(self.root)):
                raise InvalidRequest(
                    f"{self.path} is the model's LM head (a separate unembedding matrix): it "
                    "takes hidden states [tokens, d_model], not token ids"
                )
            return super().__call__(*args, hook=hook, **kwargs)
        root = compat.envoy_module(self.root)
        module = compat.envoy_module(self)
        if module is not unembedding_module(root):
            raise InvalidRequest(
                f"{self.path} is an input embedding, not the model's unembedding: it takes "
                "integer token ids; unembed hidden states with model.lm_head(...)"
            )
        return root.logits_processor(module, value, head_bias(module))

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Whole rows ``[n, d_model]`` of the unembedding matrix for ``token_ids``, any TP.

        Direct logit attribution needs the targets' rows, not full-vocab logits. They are a
        vocab-parallel lookup in the head's own weight: each rank looks up the ids it holds,
        the others give zeros, one all-reduce sums them. That is the embedding's forward;
        vLLM's ``ParallelLMHead`` refuses its own (the weight is meant for the sampler), so
        the base class's forward is called on the head directly.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        module = unembedding_module(compat.envoy_module(self.root))
        return VocabParallelEmbedding.forward(module, token_ids.to(module.weight.device))

    def bias_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The head's bias ``[n]`` for ``token_ids`` (zeros for a head without one), whole at
        any TP: each rank holds its slice of the bias, the others give zeros, and one
        all-gather sums them, as `rows` does for the weight."""
        module = unembedding_module(compat.envoy_module(self.root))
        bias = head_bias(module)
        ids = token_ids.to(module.weight.device)
        if bias is None:
            return torch.zeros(ids.shape, dtype=module.weight.dtype, device=ids.device)
        shard = self.vocab_shard()
        local = ids - shard.start
        held = (local >= 0) & (local < shard.size)
        values = torch.where(held, bias[local.clamp(0, shard.size - 1)], 0.0)
        return shard.gather(values.float()).sum(0)

    def vocab_shard(self) -> VocabShard:
        """This rank's slice of the unembedding, for reductions that need no whole logits
        (`vocab_shard_of` the model this envoy belongs to)."""
        return vocab_shard_of(compat.envoy_module(self.root))


def vocab_shard_of(root: torch.nn.Module) -> VocabShard:
    """This rank's slice of ``root``'s unembedding (``root``: the model's torch module on a
    rank), for reductions that need no whole logits.

    The slice's logits come from the model's own logits processor without its gather
    (quant method, soft-cap and logit scale applied as for sampling); the rank's padding
    columns, past its last real token, are cut off. The exchange is the tensor-parallel
    group's all-gather, on whatever device and backend the engine uses.
    """
    module = unembedding_module(root)
    indices = module.shard_indices
    size = indices.num_org_elements

    bias = head_bias(module)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return root.logits_processor(module, hidden, bias, skip_gather=True)[..., :size]

    # Rank 0's slice: the padding is at the end of the vocabulary.
    largest = min(indices.num_org_elements_padded, module.org_vocab_size)
    return VocabShard(logits, indices.org_vocab_start_index, size, gather_ranks, largest)


def first_rank() -> bool:
    """Whether this rank is the first of its tensor-parallel group (the only one at TP=1)."""
    from vllm.distributed import get_tp_group

    return bool(get_tp_group().rank_in_group == 0)


def rank_share(count: int) -> range:
    """Which of ``count`` equal jobs, that every rank could do alike, are this rank's: every
    ``tp``-th from its own number. Where ranks share cores, one rank's extra work stalls the
    others at the next collective, so work that need not be one rank's is spread."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return range(group.rank_in_group, count, group.world_size)


def gather_ranks(value: torch.Tensor) -> torch.Tensor:
    """``[ranks, *value.shape]``: every rank's ``value`` in rank order, the same on every
    rank (the tensor-parallel group's all-gather, on whatever device and backend the engine
    uses; a collective, so every rank must call it, in the same order)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    value = value.unsqueeze(0).contiguous()
    if group.world_size == 1:
        return value
    # A gather only copies bytes: float64 and int64, which the CPU backend's shared-memory
    # gather lacks, travel as the float32 words of the same bytes.
    wide = value.dtype in (torch.float64, torch.int64)
    words = value.view(torch.float32) if wide else value
    return group.all_gather(words, dim=0).view(value.dtype)


def head_bias(module: torch.nn.Module) -> torch.Tensor | None:
    """The LM head's bias (GPT-J's; this rank's slice of it), which vLLM's models pass to
    their logits processor beside the head; None for a head without one."""
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


class ShardedEnvoy(Envoy):
    """A location that holds one rank's piece at TP>=2: reads and writes are refused."""

    def _refuse(self, side: str) -> None:
        column, row = _parallel_siblings(compat.envoy_module(self))
        if row is not None:  # a block whose sum over the ranks happens after it
            hints = [f"{self.path}.{row}.output"]
        else:
            parent = self.parent
            column, row = (
                (None, None) if parent is None else _parallel_siblings(compat.envoy_module(parent))
            )
            hints = [
                f"{parent.path}.{name}.{where}"
                for name, where in ((column, "output"), (row, "input"))
                if name is not None
            ]
        raise ShardedValue(
            f"{self.path}.{side} holds one rank's piece of the tensor at this tensor-parallel "
            "size, and nothing gathers it. Read a whole-valued location nearby instead: "
            f"{' or '.join(hints) or 'the enclosing block'} (or start the engine with "
            "tensor_parallel_size=1)."
        )

    @property
    def output(self) -> Any:
        self._refuse("output")

    @output.setter
    def output(self, value: Any) -> None:
        self._refuse("output")

    @property
    def input(self) -> Any:
        self._refuse("input")

    @input.setter
    def input(self, value: Any) -> None:
        self._refuse("input")

    @property
    def inputs(self) -> Any:
        self._refuse("input")

    @inputs.setter
    def inputs(self, value: Any) -> None:
        self._refuse("input")


def _parallel_siblings(block: torch.nn.Module) -> tuple[str | None, str | None]:
    """Names of the column- and row-parallel children of ``block``, if it has both."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    column = row = None
    for name, child in block.named_children():
        if isinstance(child, ColumnParallelLinear) and not child.gather_output:
            column = column or name
        elif isinstance(child, RowParallelLinear) and child.input_is_parallel:
            row = row or name
    return column, row


def sharded_paths(model: torch.nn.Module) -> list[str]:
    """Module paths whose values are one rank's piece when the model is sharded.

    A block with a column-parallel layer (output split by feature) and a row-parallel layer
    (input split by feature) computes on pieces between the two; its other children hold
    those pieces. Children that themselves contain parallel layers are blocks of their own.
    A block whose row-parallel layer does not sum over the ranks (``reduce_results=False``:
    Qwen2-MoE's shared expert, Cohere's attention and MLP, parallel Falcon's) returns one
    rank's partial sum: the block's own output is a piece too.
    """
    from vllm.model_executor.layers.linear import LinearBase

    found = []
    for block_name, block in model.named_modules():
        column, row = _parallel_siblings(block)
        if column is None or row is None:
            continue
        if block_name and not getattr(block.get_submodule(row), "reduce_results", True):
            found.append(block_name)
        for name, child in block.named_children():
            if name in (column, row):
                continue
            if any(isinstance(m, LinearBase) for m in child.modules()):
                continue
            found.append(f"{block_name}.{name}" if block_name else name)
    return found


@dataclass(frozen=True)
class Location:
    """A location whose value is whole at every TP size.

    ``kind`` is one of ``embed``, ``layer`` (a decoder layer's output: the residual stream
    is ``output[0] + output[1]``), ``attn`` (attention output projection), ``mlp`` (MLP
    output projection), ``proj`` (a column-parallel projection, in checkpoint order),
    ``norm``, ``lm_head``. ``layer`` is the decoder layer index, or None outside the layers.
    """

    path: str
    kind: str
    layer: int | None


def whole_locations(model: torch.nn.Module) -> list[Location]:
    """Every location of ``model`` whose value is whole at any TP size, in module order."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    layers_path, layers = decoder_layers(model)
    index = {id(layer): i for i, layer in enumerate(layers)}
    found: list[Location] = []
    current: int | None = None
    for path, module in model.named_modules():
        if not path:
            continue
        prefix = f"{layers_path}."
        if path.startswith(prefix):
            current = int(path[len(prefix) :].split(".")[0])
        elif current is not None:
            current = None
        if id(module) in index:
            kind = "layer"
        elif isinstance(module, ParallelLMHead):
            kind = "lm_head"
        elif isinstance(module, VocabParallelEmbedding):
            kind = "embed"
        elif isinstance(module, RowParallelLinear):
            kind = "attn" if "attn" in path.rsplit(".", 2)[-2] else "mlp"
        elif isinstance(module, ColumnParallelLinear):
            kind = "proj"
        elif "norm" in type(module).__name__.lower():
            kind = "norm"
        else:
            continue
        found.append(Location(path, kind, current))
    return found
