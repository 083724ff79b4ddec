"""Where a model reads out its prediction, and how its residual stream is read and written.

`Readout.find` runs once on the structure-only (meta) model the client builds, before any
rank starts: it names the decoder layers, the final norm and the unembedding by the model's
own structure, and takes the layer family (`envoykit.model.families`) from the checkpoint's
architecture. The lens, attribution, patching, the sweep, compare and the tuned lens read and
write the stream only through `walk` and `normalize` below, which run inside traces on
every rank alike; so one convention per family decides what "the stream after layer 7", "the
stream between its blocks" and "what its attention wrote" are, on every architecture it
accepts. An architecture without a family is refused by every analysis, with what still
works (plain traces), instead of being guessed.

Sites of a layer, per family (``pre``: the stream before the layer, ``mid``: between its
blocks, ``post``: after it):

* pair families (Llama, Gemma 2/3): the MLP pre-norm is called ``norm(attn_write, pre)``
  (vLLM's fused add-norm) and the layer returns ``(mlp_write, mid)``: the writes are read
  there directly and the stream as the pair, normalised with the fused norm as vLLM does;
* sequential single-stream families: ``mid`` is the pre-norm's (or the MLP's) input, and the
  writes are what the stream gained: ``attn = mid - pre``, ``mlp = post - mid`` (with their
  multipliers and post-norms included, since they are what the stream gained);
* parallel families: no ``mid``; the attention's write is its output (summed over the ranks
  where the model reduces it later), and ``mlp = post - pre - attn``.

A row is ``(value, residual)``: the stream is ``value + residual`` when ``residual`` is a
tensor (a pair, normalised with the fused norm), else ``value`` alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from envoykit.errors import InvalidRequest
from envoykit.model.families import MLP_INPUT, PAIR, REFUSED, STREAM, Family, family_of
from envoykit.model.heads import HeadLayout

Row = tuple[torch.Tensor, "torch.Tensor | None"]
# Names the final norm goes by, beside the decoder layers (GPT-2, GPT-J and Falcon: ln_f).
_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


@dataclass(frozen=True)
class Cell:
    """A checked stream location: layer number (0 = the embedding), site, token position.

    Site ``"head"`` is one attention head's slice of its output projection's input (``head``
    its number over the whole model); its ``position`` may be None: every position.
    """

    layer: int
    site: str
    position: int | None
    head: int | None = None


@dataclass(frozen=True)
class Write:
    """A value to write into a run at ``cell``: ``value`` and, for a pair family's streams,
    ``residual`` (each ``[d_model]``); the stream there becomes their sum. At a head cell
    ``value`` is ``[head_size]``, or None for the head's own mean over the run's positions
    (a mean ablation)."""

    cell: Cell
    value: torch.Tensor | None
    residual: torch.Tensor | None = None


@dataclass(frozen=True)
class Addition:
    """A vector added to the stream at ``cell`` (site "resid" or "resid_mid"; its position
    unused), at ``positions`` of the run's rows (None: every row), each row optionally
    rescaled to its norm before the addition (``norm_match``). Steering
    (`envoykit.analyses.steering`) is made of these; ``vector`` is ``[d_model]`` float32 with
    the scale applied.

    Written in float32 on the stream's device. For a pair family the stream is
    ``hidden + residual``: the sum, steered, goes into ``hidden`` and the residual becomes
    zero, which the next layer's (or the final norm's) fused add turns back into the stream.
    """

    cell: Cell
    vector: torch.Tensor
    positions: tuple[int, ...] | None = None
    norm_match: bool = False
    # The vector on each device it met: moved once per request, not at every generated step.
    on: dict[torch.device, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def vector_on(self, device: torch.device) -> torch.Tensor:
        if device not in self.on:
            self.on[device] = self.vector.to(device)
        return self.on[device]

    def apply(self, first: torch.Tensor, second: torch.Tensor | None) -> None:
        rows = slice(None) if self.positions is None else list(self.positions)
        stream = first[rows].float() if second is None else first[rows].float() + second[rows]
        steered = stream + self.vector_on(stream.device)
        if self.norm_match:
            norms = steered.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            steered = steered * (stream.norm(dim=-1, keepdim=True) / norms)
        first[rows] = steered.to(first.dtype)
        if second is not None:
            second[rows] = 0


@dataclass(frozen=True)
class Readout:
    """Module paths of a model's readout and its layer family; `at` turns a path into an
    envoy.

    ``family`` is None for an architecture envoykit does not read (see `require`).
    ``prenorm`` and ``attn`` are the names, inside a decoder layer, of the module whose
    input is the stream between the blocks and of the attention module, where the family
    reads them. ``heads`` is where the attention heads are (`envoykit.model.heads`), or a
    sentence saying why a pattern cannot be read (`require_heads`).
    """

    architecture: str
    layers: str
    final_norm: str
    unembedding: str
    n_layers: int
    family: Family | None
    prenorm: str | None = None
    attn: str | None = None
    heads: HeadLayout | str = "its heads were not looked for"

    @classmethod
    def find(cls, meta_model: torch.nn.Module, architecture: str, config: dict) -> Readout:
        """The readout of ``meta_model``; `InvalidRequest` when it has no recognisable one."""
        layers_path, layers = decoder_layers(meta_model)
        parent_path = layers_path.rpartition(".")[0]
        parent = meta_model.get_submodule(parent_path) if parent_path else meta_model
        children = {name for name, _ in parent.named_children()}
        norm = next((name for name in _FINAL_NORMS if name in children), None)
        if norm is None:
            raise InvalidRequest(
                f"{architecture} has no final norm beside its layers (looked for "
                f"{', '.join(_FINAL_NORMS)} in {parent_path or 'the model'})"
            )
        final_norm = f"{parent_path}.{norm}" if parent_path else norm
        head = unembedding_module(meta_model)
        unembedding = next(
            name
            for name, module in meta_model.named_modules(remove_duplicate=False)
            if module is head
        )
        family = family_of(architecture, config)
        inside = {name for name, _ in layers[0].named_modules() if name}
        prenorm = attn = None
        if family is not None:
            prenorm = next((name for name in family.prenorm if name in inside), None)
            attn = next((name for name in family.attn if name in inside), None)
            missing = (family.prenorm and prenorm is None) or (family.attn and attn is None)
            if missing or (family.mid == MLP_INPUT and "mlp" not in inside):
                family = None  # not the layer its architecture promises: read nothing
        return cls(
            architecture,
            layers_path,
            final_norm,
            unembedding,
            len(layers),
            family,
            prenorm,
            attn,
            HeadLayout.find(layers, architecture),
        )

    def require(self, what: str = "this analysis") -> Family:
        """The family, or `InvalidRequest` saying what works on an architecture without one."""
        if self.family is None:
            why = REFUSED.get(self.architecture, "envoykit has no readout contract for its layers")
            raise InvalidRequest(
                f"{what} is not available on {self.architecture}: {why} (`envoykit models` "
                "lists the architectures envoykit reads). Plain traces still work: "
                "with engine.trace(prompt): ..."
            )
        return self.family

    def require_heads(self, what: str = "attention patterns") -> HeadLayout:
        """The head layout, or `InvalidRequest` saying why ``what`` cannot be read here."""
        self.require(what)
        if isinstance(self.heads, str):
            raise InvalidRequest(f"{what} are not available on {self.architecture}: {self.heads}")
        return self.heads

    def require_sites(self, sites: Sequence[str]) -> None:
        """Refuse a site this model's layers do not have (no stream between parallel
        blocks)."""
        family = self.require("the lens")
        if "resid_mid" in sites and family.parallel:
            raise InvalidRequest(
                f"{self.architecture} runs attention and MLP in parallel from the same input: "
                "there is no stream between them ('resid_mid'); 'attn', 'mlp' and 'resid' "
                "are available"
            )


def at(root: Any, path: str) -> Any:
    """The envoy (or module) at a dotted ``path`` below ``root``."""
    node = root
    for part in path.split("."):
        node = getattr(node, part)
    return node


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder layers and their path: the longest ``ModuleList`` beside the model's
    embedding (a vision tower's blocks are not its language model's layers)."""
    lists = [
        (p, m)
        for p, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and _has_embedding_beside(model, p)
    ]
    if not lists:
        raise InvalidRequest(f"{type(model).__name__} has no list of decoder layers")
    return max(lists, key=lambda item: len(item[1]))


def _has_embedding_beside(model: torch.nn.Module, path: str) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    return any(isinstance(child, VocabParallelEmbedding) for child in parent.children())


def unembedding_module(root: torch.nn.Module) -> torch.nn.Module:
    """The module whose weight maps hidden states to vocabulary logits: ``lm_head`` where the
    model has one (with tied embeddings vLLM gives it the embedding's weight); models that
    always tie (Gemma 2, Cohere) call their logits processor with the input embedding."""
    head = getattr(root, "lm_head", None)
    if head is not None:
        return head
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return next(m for m in root.modules() if isinstance(m, VocabParallelEmbedding))


def lm_head_only(root: torch.nn.Module) -> torch.nn.Module | None:
    """``lm_head`` when it is a module of its own, not the input embedding."""
    head = getattr(root, "lm_head", None)
    return head if head is not None and head is not input_embedding(root) else None


def input_embedding(root: torch.nn.Module) -> torch.nn.Module:
    """The token embedding the model reads its input with."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    return next(
        m
        for m in root.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    )


# -- inside a trace, on every rank ------------------------------------------------------------


def normalize(norm: Any, value: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """A row through the model's final norm as the model calls it: a pair with the fused
    add-norm (vLLM's last step), a single stream on its own (a norm that returns a tuple, as
    Cohere's, gives its first element).

    On copies: vLLM's fused add-norm works in place on CUDA, and the model's own forward must
    not see it.
    """
    if residual is not None:
        return norm(value.clone(), residual.clone())[0]
    out = norm(value.clone())
    return out[0] if isinstance(out, tuple) else out


def stream_of(
    value: torch.Tensor, residual: torch.Tensor | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The residual stream a row of `walk` stands for: vLLM's decoder layers hand on the
    pair ``(hidden, residual)``, whose sum is the stream (the next layer's fused add-norm
    adds them), or the stream itself where ``residual`` is None. ``dtype``: both are cast
    before the sum, so a bfloat16 pair sums in float32 instead of rounding to bfloat16."""
    if dtype is not None:
        value = value.to(dtype)
        residual = None if residual is None else residual.to(dtype)
    return value if residual is None else value + residual


def walk(
    readout: Readout,
    layer_list: Any,
    reads: dict[int, set[str]],
    writes: Mapping[int, Sequence[Write | Addition]],
    heads: dict[int, torch.Tensor] | None = None,
) -> list[Row]:
    """Walk the layers in the model's order, make ``writes`` in place, and read each layer's
    ``reads`` sites as rows ``[T, d_model]``, in the order the model computes them (per
    layer: attn, resid_mid, mlp, resid). Layer 0 is the embedding (only "resid").

    A layer whose reads include ``"heads"`` also puts, into ``heads``, the input of its
    heads' output projection as this rank holds it: ``[T, local heads * head_size]``, its
    slice of the heads (`HeadLayout`), read before anything else of the layer."""
    family = readout.require()
    walker = _Walker(readout, family, layer_list, reads, writes)
    rows = walker.run()
    if heads is not None:
        heads.update(walker.heads)
    return rows


class _Walker:
    """One `walk`: the streams kept from layer to layer where a family needs them."""

    def __init__(self, readout, family, layer_list, reads, writes) -> None:
        self.readout, self.family, self.layer_list = readout, family, layer_list
        self.reads, self.writes = reads, writes
        self.rows: list[Row] = []
        self.stream: torch.Tensor | None = None  # the stream after the last layer walked
        self.keep: set[int] = set()  # layers whose stream the next layer needs
        self.heads: dict[int, torch.Tensor] = {}  # layer -> this rank's heads, concatenated

    def run(self) -> list[Row]:
        wanted = set(self.reads) | set(self.writes)
        if self.family.output != PAIR:
            # A write's share of the stream is measured from the stream before its layer.
            self.keep = {n - 1 for n in wanted if n > 0 and self._needs_before(n)}
            wanted |= self.keep
        for number in sorted(wanted):
            if number == 0:
                self._embedding()
            elif self.family.output == PAIR:
                self._pair_layer(number)
            else:
                self._stream_layer(number)
        return self.rows

    def _sites(self, number: int) -> set[str]:
        return self.reads.get(number, set()) | {w.cell.site for w in self.writes.get(number, [])}

    def _needs_before(self, number: int) -> bool:
        sites = self._sites(number)
        return "attn" in sites or (self.family.parallel and "mlp" in sites)

    def _embedding(self) -> None:
        embedded = _tokens(layer_input(self.layer_list[0]))
        _write(embedded, None, self.writes.get(0, []), ("resid",))
        self.stream = embedded.clone()
        if self.reads.get(0):
            self.rows.append((self.stream, None))

    def _stream_writes(self, number: int) -> list[Write | Addition]:
        """The writes into a layer's stream (a head's go into its projection's input)."""
        return [w for w in self.writes.get(number, []) if w.cell.site != "head"]

    def _read_heads(self, number: int, layer: Any) -> None:
        """Write a layer's head cells, then read its heads where asked: the output
        projection's input, whole (``[T, heads * head_size]``, heads in order) at any TP."""
        edits = [
            w for w in self.writes.get(number, []) if isinstance(w, Write) and w.cell.site == "head"
        ]
        read = "heads" in self.reads.get(number, ())
        if not edits and not read:
            return
        layout = self.readout.require_heads("per-head values")
        projection = at(layer, layout.output)
        value = projection.input
        if edits:
            value = value.clone()
            tokens = _tokens(value)
            for item in edits:
                head = item.cell.head
                assert head is not None  # a head cell is made with its head's number
                columns = slice(head * layout.head_size, (head + 1) * layout.head_size)
                rows = slice(None) if item.cell.position is None else item.cell.position
                new = tokens[:, columns].mean(0) if item.value is None else item.value.to(tokens)
                tokens[rows, columns] = new
            projection.input = value
        if read:
            self.heads[number] = _tokens(value).clone()

    def _pair_layer(self, number: int) -> None:
        layer = self.layer_list[number - 1]
        self._read_heads(number, layer)
        sites, here = self._sites(number), self._stream_writes(number)
        available: dict[str, Row] = {}
        if sites & {"attn", "resid_mid"}:
            written, before = getattr(layer, self.readout.prenorm).inputs[0][:2]
            _write(written, before, here, ("attn", "resid_mid"))
            written, before = written.clone(), before.clone()
            available |= {"attn": (written, None), "resid_mid": (written, before)}
        if sites & {"mlp", "resid"}:
            hidden, residual = layer.output[:2]
            _write(hidden, residual, here, ("mlp", "resid"))
            hidden, residual = hidden.clone(), residual.clone()
            available |= {"mlp": (hidden, None), "resid": (hidden, residual)}
        self._emit(number, available)

    def _stream_layer(self, number: int) -> None:
        layer = self.layer_list[number - 1]
        self._read_heads(number, layer)
        sites, here = self._sites(number), self._stream_writes(number)
        before = self.stream
        wanted: dict[str, Row] = {}
        mid = attn = None
        if self.family.parallel and sites & {"attn", "mlp"}:
            attn = self._attention_write(layer)
            wanted["attn"] = (attn, None)
        elif not self.family.parallel and sites & {"attn", "resid_mid", "mlp"}:
            place = _tokens(self._mid_input(layer))
            for item in here:
                if isinstance(item, Addition):
                    if item.cell.site == "resid_mid":
                        item.apply(place, None)
                elif item.cell.site == "resid_mid":
                    place[item.cell.position] = _stream_value(item).to(place)
                elif item.cell.site == "attn":
                    assert before is not None  # kept for a layer with an attn cell: _needs_before
                    value = before[item.cell.position] + _stream_value(item)
                    place[item.cell.position] = value.to(place)
            mid = place.clone()
            if before is not None:
                wanted["attn"] = (mid - before, None)
            wanted["resid_mid"] = (mid, None)
        if sites & {"mlp", "resid"} or number in self.keep or (self.family.parallel and sites):
            output = layer.output
            place = _tokens(output if self.family.output == STREAM else output[0])
            for item in here:
                if isinstance(item, Addition):
                    if item.cell.site == "resid":
                        item.apply(place, None)
                    continue
                p, value = item.cell.position, _stream_value(item).to(place)
                if item.cell.site == "resid":
                    place[p] = value
                elif item.cell.site == "mlp" and mid is not None:
                    place[p] = value + mid[p]
                elif item.cell.site == "mlp":
                    # A parallel family: its attn write is read, the stream before it kept.
                    assert before is not None and attn is not None
                    place[p] = value + (before[p] + attn[p])
                elif item.cell.site == "attn" and self.family.parallel:
                    assert attn is not None  # read for a parallel layer with an attn cell
                    place[p] = place[p] + value - attn[p]
            post = place.clone()
            base = mid if mid is not None else (before + attn if attn is not None else None)
            if base is not None:
                wanted["mlp"] = (post - base, None)
            wanted["resid"] = (post, None)
            self.stream = post
        self._emit(number, wanted)

    def _mid_input(self, layer: Any) -> torch.Tensor:
        module = layer.mlp if self.family.mid == MLP_INPUT else getattr(layer, self.readout.prenorm)
        return module.inputs[0][0]

    def _attention_write(self, layer: Any) -> torch.Tensor:
        """What the attention block adds to the stream: the output of the family's module
        (whole at any TP), with the bias a projection built with ``skip_bias_add`` returns
        beside it (Falcon's)."""
        out = at(layer, self.readout.attn).output
        value, extra = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        value = _tokens(value).clone()
        return value + extra if isinstance(extra, torch.Tensor) else value

    def _emit(self, number: int, available: dict[str, Row]) -> None:
        for site in ("attn", "resid_mid", "mlp", "resid"):
            if site in self.reads.get(number, set()):
                if site not in available:
                    raise InvalidRequest(f"site {site!r} of layer {number} cannot be read here")
                self.rows.append(available[site])


# Where a norm keeps its epsilon, by the names vLLM's and transformers' norms give it.
_EPSILONS = ("variance_epsilon", "eps", "variance_eps", "epsilon")


def norm_parameters(norm: Any, d_model: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The final norm's affine map, read off the norm itself by calling it (RMSNorm, Gemma's
    ``1 + weight``, LayerNorm with or without weights all answer the same probes): ``gain``
    and ``bias`` ``[d_model]``, ``eps`` and ``centered`` (1.0 for a norm that subtracts the
    mean, 0.0 for an RMS norm), float32 tensors on ``like``'s device.

    Probes: the zero vector gives the bias; a vector of alternating +-1 (mean 0, mean square
    1) gives ``gain / sqrt(1 + eps)``; shifting it by a constant changes nothing only for a
    centring norm. An epsilon the norm does not name is measured from one more probe.
    """
    signs = torch.ones(1, d_model, device=like.device, dtype=like.dtype)
    signs[..., 1::2] = -1.0

    def call(x: torch.Tensor) -> torch.Tensor:
        out = norm(x)
        return (out[0] if isinstance(out, tuple) else out).float()

    bias = call(torch.zeros_like(signs))[0]
    unit = call(signs)[0] - bias
    named = (getattr(norm, name, None) for name in _EPSILONS)
    eps = next((value for value in named if value is not None), None)
    if eps is None:  # (LN(c u) - b) / (LN(u) - b) = c sqrt(1 + eps) / sqrt(c^2 + eps)
        c = 1e-2
        ratio = ((call(signs * c)[0] - bias) / unit).mean()
        eps = (c * c * (1 - ratio**2) / (ratio**2 - c * c)).clamp_min(0.0)
    eps = torch.as_tensor(eps, dtype=torch.float32, device=like.device)
    gain = unit * torch.sqrt(1.0 + eps) / signs[0].float()
    shifted = call(signs + 3.0)[0] - bias
    centered = ((shifted - unit).abs().amax() <= 1e-3 * unit.abs().amax()).float()
    return {"gain": gain, "bias": bias, "eps": eps, "centered": centered}


def rank_inputs(envoy: Any) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` this rank's module at ``envoy`` is called with, as they are:
    one rank's piece at TP > 1, where the shard guard refuses them to trace code and a
    parallel layer's envoy makes them whole. For rank-side code that knows it holds a piece
    and reduces or gathers what it makes of it (the patterns and writes of this rank's
    attention heads)."""
    from nnsight.intervention.interleaver import Mediator

    return Mediator.value(f"{envoy.path}.input")


def layer_input(layer: Any) -> torch.Tensor:
    """The hidden states a decoder layer is called with: its first floating-point argument
    (after ``positions`` in most native layers, first in GPT-2, GPT-OSS and the Transformers
    backend), or its ``hidden_states`` keyword."""
    args, kwargs = layer.inputs
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            return arg
    return kwargs["hidden_states"]


def _tokens(value: torch.Tensor) -> torch.Tensor:
    """``[T, d]`` (a view) of a value the Transformers backend's layers hold as
    ``[1, T, d]``."""
    return value[0] if value.dim() == 3 else value


def _write(
    first: torch.Tensor,
    second: torch.Tensor | None,
    writes: Sequence[Write | Addition],
    sites: tuple[str, ...],
) -> None:
    """Overwrite, in place, the cells of ``sites`` in the pair (or the stream) the model is
    about to use."""
    for item in writes:
        if item.cell.site not in sites:
            continue
        if isinstance(item, Addition):
            item.apply(first, second)
        else:
            first[item.cell.position] = _stream_value(item).to(first)
            if item.residual is not None and second is not None:
                second[item.cell.position] = item.residual.to(second)


def _stream_value(write: Write) -> torch.Tensor:
    """The value of a write into the stream: None only at a head cell (a mean ablation),
    which goes into the heads' projection (`_Walker._read_heads`), never into the stream."""
    assert write.value is not None, "a head cell's mean ablation reached the stream"
    return write.value


def writes_by_layer(writes: Sequence[Write | Addition]) -> dict[int, list[Write | Addition]]:
    """Writes (and additions) grouped by layer number, as `walk` takes them."""
    layers: dict[int, list[Write | Addition]] = {}
    for item in writes:
        layers.setdefault(item.cell.layer, []).append(item)
    return layers


def at_step(additions: Sequence[Addition], step: int) -> list[Addition]:
    """The additions a generation step makes: all of them in the prompt's own pass (step
    0), then only those at every position (each later step runs one new token)."""
    return list(additions) if step == 0 else [a for a in additions if a.positions is None]
