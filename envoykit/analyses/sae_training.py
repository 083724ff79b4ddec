"""`train_sae`: a sparse autoencoder trained on stored activations, on this process's CPU.

What it reads: one (layer, site) row of an activation store (`envoykit.results.activations`),
shard by shard, never the whole store; or the same rows as a tensor in memory; or an
engine's activations of ``texts``, collected into a temporary store removed afterwards.
Every row reaches training through `_Reader`, which hands out a fixed number of rows at a
time whatever the shards' boundaries, so a store and its rows in memory give the same
batches in the same order, and the same SAE bit for bit.

The recipe is TopK (Gao et al., 2024, "Scaling and evaluating sparse autoencoders",
arXiv:2406.04093) as EleutherAI's sparsify implements it (eai-sparsify 1.3.3,
``sparsify/sparse_coder.py``, ``sparsify/trainer.py``, ``sparsify/config.py``): the loss is
the batch's fraction of variance unexplained plus 1/32 of the AuxK loss on dead latents
(the paper's coefficient; sparsify's ``auxk_alpha`` defaults to 0 since 1.x); decoder rows
are unit norm, their gradient's component along each row removed before Adam's step;
the encoder starts as the decoder's transpose, ``b_dec`` as the data's mean. The encoder's
backward pass is sparse (only the k picked latents of a token carry a gradient), as
sparsify's fused encoder is on GPU. ReLU is SAELens 6's "standard" recipe (an L1 penalty
on the activations weighted by the decoder rows' norms). ``docs/sae_training.md`` has the
choices and their sources.

Inputs are scaled as SAELens's ``normalize_activations="expected_average_only_in"`` does:
one factor, ``sqrt(d_in) / mean ||x||`` over the training rows, then folded into the saved
weights (``W_enc * s``, ``W_dec / s``, ``b_dec / s``), so the SAE returned reads raw
activations and says ``normalize_activations="none"``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from envoykit.analyses.corpus import progress_bar
from envoykit.analyses.request import check_count
from envoykit.analyses.sae import SAE, SAE_SITES
from envoykit.analyses.sae_files import tl_hook
from envoykit.analyses.tuned_training import over_budget
from envoykit.errors import InvalidRequest
from envoykit.results.activations import Activations, row_key

TRAINED = ("topk", "relu")
DEFAULT_K = 32
# SAELens 6's StandardTrainingSAEConfig.l1_coefficient and its default learning rate.
DEFAULT_L1 = 1.0
RELU_LR = 3e-4
# Gao et al.'s AuxK coefficient; k_aux is d_in // 2 (sparsify's sparse_coder.py).
AUXK_ALPHA = 1 / 32
# Gao et al.'s and sparsify's dead window (tokens); shorter runs use a tenth of theirs.
DEAD_TOKENS = 10_000_000
# The rows kept out of training: the source's last ones, a tenth of them, at most this many.
HELD_OUT_SHARE = 0.1
HELD_OUT_MAX = 4096
# Optimizer steps between two measurements on the held-out rows.
EVAL_EVERY = 20
# Rows per read when the source is checked and measured before training.
READ_ROWS = 8192
# Rows per chunk when the held-out rows are encoded.
EVAL_ROWS = 1024
LOG = "training_log.json"


def train_sae(
    source: Any,
    *,
    layer: int,
    site: str = "resid",
    architecture: str = "topk",
    d_sae: int | None = None,
    expansion: float = 16,
    k: int | None = None,
    l1_coefficient: float | None = None,
    max_seconds: float | None = None,
    max_tokens: int | None = None,
    batch_size: int = 4096,
    lr: float | None = None,
    dead_tokens: int | None = None,
    buffer_tokens: int = 65536,
    seed: int = 0,
    out: str | Path | None = None,
    texts: Any = None,
    progress: Any = True,
) -> SAE:
    """Train an SAE of (``layer``, ``site``) on ``source`` and return it (`SAE`, float32,
    reading raw activations: ``normalize_activations="none"``).

    ``source``: an `Activations` store or its path; a tensor ``[tokens, d_in]`` of the same
    rows in memory (training on it equals training on the store, bit for bit); or an engine,
    whose activations of ``texts`` are collected (float32) into a temporary store, removed
    afterwards. ``architecture``: "topk" (``k`` active latents per token, default 32) or
    "relu" (``l1_coefficient``, default 1.0, SAELens's); ``d_sae`` latents (default
    ``expansion * d_in``).

    The source's last rows (a tenth, at most 4096) are held out: every 20 steps and at the
    end the held-out variance explained is measured, and the SAE returned is the best on
    it. Stops after ``max_tokens`` training tokens (passes over the rows repeat, reshuffled),
    before a step that would end past ``max_seconds`` (counted from the call, collection
    excluded), or after one pass if neither is given. ``batch_size`` tokens per Adam step
    (``lr`` default: sparsify's ``2e-4 / sqrt(d_sae / 2**14)`` for TopK, SAELens's 3e-4 for
    ReLU); ``buffer_tokens`` rows in the shuffle buffer (memory: ``buffer_tokens * d_in``
    floats); a latent is dead, and trained by AuxK, after ``dead_tokens`` tokens without
    firing (default: a tenth of the planned tokens, at most 10M). Deterministic given
    ``seed`` and a token budget (a time budget ends wherever the machine's pace puts it).

    ``out``: a directory to write the SAE to (SAELens's format, `SAE.save`) with
    ``training_log.json`` beside it (the settings and one record per measurement).
    ``progress``: a tqdm bar in tokens (True), none (False), or your own bar.
    """
    engine = None if isinstance(source, (Activations, torch.Tensor, str, os.PathLike)) else source
    if engine is not None and not callable(getattr(engine, "collect", None)):
        raise InvalidRequest(
            f"train_sae reads an ek.Activations store, its path, a tensor [tokens, d_in] or "
            f"an engine (with texts=), not {type(source).__name__}"
        )
    if (engine is None) != (texts is None):
        raise InvalidRequest(
            "texts= is what an engine source collects: give it with source=engine, and only then"
        )
    checked = _check_options(
        architecture=architecture,
        layer=layer,
        site=site,
        d_sae=d_sae,
        expansion=expansion,
        k=k,
        l1_coefficient=l1_coefficient,
        max_seconds=max_seconds,
        max_tokens=max_tokens,
        batch_size=batch_size,
        lr=lr,
        dead_tokens=dead_tokens,
        buffer_tokens=buffer_tokens,
        seed=seed,
        out=out,
    )
    if engine is None:
        return _train(_rows_of(source, checked.layer, checked.site), checked, progress)
    with tempfile.TemporaryDirectory(prefix="envoykit-sae-") as folder:
        store = engine.collect(
            texts,
            out=Path(folder) / "store",
            layers=[checked.layer],
            sites=[checked.site],
            dtype="float32",
            progress=progress,
        )
        return _train(_rows_of(store, checked.layer, checked.site), checked, progress)


# -- the request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    """The checked arguments; what depends on the data (d_sae, k, lr...) is `_Plan`'s."""

    architecture: str
    layer: int
    site: str
    d_sae: int | None
    expansion: float
    k: int | None
    l1_coefficient: float | None
    max_seconds: float | None
    max_tokens: int | None
    batch_size: int
    lr: float | None
    dead_tokens: int | None
    buffer_tokens: int
    seed: int
    out: Path | None


def _check_options(**given: Any) -> _Options:
    """The arguments checked, each refused with what is valid, before anything is read."""
    architecture = given["architecture"]
    if architecture == "jumprelu":
        raise InvalidRequest(
            "training a JumpReLU SAE is not supported (its threshold needs a straight-through "
            "estimator envoykit does not implement): train architecture='topk' or 'relu', or "
            "train JumpReLU with SAELens and load it with ek.SAE.load"
        )
    if architecture not in TRAINED:
        raise InvalidRequest(
            f"train_sae trains architecture 'topk' or 'relu', not {architecture!r}"
        )
    layer = check_count("layer", given["layer"], minimum=0)
    site = given["site"]
    if site not in SAE_SITES:
        raise InvalidRequest(f"site is one of {', '.join(SAE_SITES)}, not {site!r}")
    if layer == 0 and site != "resid":
        raise InvalidRequest("layer 0 (the embedding) has only the 'resid' site")
    d_sae = given["d_sae"]
    if d_sae is not None:
        d_sae = check_count("d_sae", d_sae, minimum=1)
    expansion = _positive("expansion", given["expansion"])
    k, l1 = given["k"], given["l1_coefficient"]
    if architecture == "topk":
        if l1 is not None:
            raise InvalidRequest("l1_coefficient is ReLU's sparsity penalty: a TopK SAE takes k")
        k = check_count("k", DEFAULT_K if k is None else k, minimum=1)
    else:
        if k is not None:
            raise InvalidRequest("k is TopK's: a ReLU SAE's sparsity comes from l1_coefficient")
        l1 = DEFAULT_L1 if l1 is None else _positive("l1_coefficient", l1, zero=True)
    max_seconds = given["max_seconds"]
    if max_seconds is not None:
        max_seconds = _positive("max_seconds", max_seconds)
    max_tokens = given["max_tokens"]
    if max_tokens is not None:
        max_tokens = check_count("max_tokens", max_tokens, minimum=1)
    lr = given["lr"]
    dead = given["dead_tokens"]
    seed = given["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidRequest(f"seed must be an integer, not {seed!r}")
    out = given["out"]
    if out is not None:
        out = Path(out)
        if out.exists() and not out.is_dir():
            raise InvalidRequest(f"out={str(out)!r} is a file: give a directory for the SAE")
    return _Options(
        architecture=architecture,
        layer=layer,
        site=site,
        d_sae=d_sae,
        expansion=expansion,
        k=k,
        l1_coefficient=l1,
        max_seconds=max_seconds,
        max_tokens=max_tokens,
        batch_size=check_count("batch_size", given["batch_size"], minimum=1),
        lr=None if lr is None else _positive("lr", lr),
        dead_tokens=None if dead is None else check_count("dead_tokens", dead, minimum=1),
        buffer_tokens=check_count("buffer_tokens", given["buffer_tokens"], minimum=1),
        seed=seed,
        out=out,
    )


def _positive(name: str, value: Any, zero: bool = False) -> float:
    """``value`` as a float, if it is a finite number above 0 (or at least 0)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise InvalidRequest(f"{name} must be a finite number {bound}, not {value!r}")
    return float(value)


# -- the rows -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:
    """The rows an SAE trains on, in corpus order: blocks of known sizes (a store's shards,
    or one tensor), each loaded only when read."""

    sizes: tuple[int, ...]
    load: Callable[[int], torch.Tensor]
    d_in: int
    where: str
    model_name: str | None

    @property
    def count(self) -> int:
        return sum(self.sizes)

    def pieces(self, start: int, stop: int) -> Iterator[torch.Tensor]:
        """Rows ``start .. stop`` as slices of the blocks that hold them, in order."""
        first = 0
        for block, size in enumerate(self.sizes):
            end = first + size
            if first < stop and end > start:
                values = self.load(block)
                if tuple(values.shape) != (size, self.d_in):
                    raise InvalidRequest(
                        f"{self.where}: block {block} holds {tuple(values.shape)}, not "
                        f"({size}, {self.d_in}) as its index says: collect the store again"
                    )
                yield values[max(start - first, 0) : min(stop, end) - first]
            first = end


def _rows_of(source: Any, layer: int, site: str) -> _Rows:
    """The `_Rows` of a store (or its path) or of a tensor, refused if it cannot train."""
    if isinstance(source, torch.Tensor):
        if source.dim() != 2 or not source.is_floating_point() or source.shape[1] < 1:
            raise InvalidRequest(
                f"a tensor source is [tokens, d_in] floating point, not {tuple(source.shape)} "
                f"{source.dtype}"
            )
        tensor = source.detach().cpu()
        return _Rows((len(tensor),), lambda _: tensor, int(tensor.shape[1]), "the tensor", None)
    store = source if isinstance(source, Activations) else Activations.open(source)
    where = f"the store at {str(store.path)!r}"
    if (layer, site) not in store.rows:
        raise InvalidRequest(
            f"{where} holds no ({layer}, {site!r}) activations: it holds {store.rows}. Train on "
            f"one of those, or collect these with engine.collect(texts, layers=[{layer}], "
            f"sites=[{site!r}], out=...)"
        )
    key, files = row_key(layer, site), store.shard_files

    def load(block: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(files[block]), "pt") as handle:
            return handle.get_tensor(key)

    sizes = tuple(int(shard["tokens"]) for shard in store.index["shards"])
    d_in = int(store.model["d_model"])
    return _Rows(sizes, load, d_in, f"{where} ({layer}, {site!r})", store.model.get("name"))


class _Reader:
    """Rows ``start .. stop`` handed out ``n`` at a time, each time as a new float32 tensor
    whatever the blocks' boundaries: the only way rows reach training, so that the same rows
    stored in shards or held in one tensor give the same numbers in the same memory layout."""

    def __init__(self, rows: _Rows, start: int, stop: int) -> None:
        self._pieces = rows.pieces(start, stop)
        self._rest = torch.empty(0, rows.d_in)
        self.left = stop - start

    def take(self, n: int) -> torch.Tensor:
        parts, need = [], min(n, self.left)
        self.left -= need
        while need:
            if not len(self._rest):
                self._rest = next(self._pieces)
            part = self._rest[:need]
            self._rest = self._rest[len(part) :]
            parts.append(part)
            need -= len(part)
        return torch.cat(parts).float() if parts else torch.empty(0, self._rest.shape[1])


@dataclass(frozen=True)
class _Statistics:
    """What training needs to know of its rows before it starts."""

    mean: torch.Tensor  # [d_in] float64, the training rows' mean
    mean_norm: float


def _statistics(rows: _Rows, n_train: int) -> _Statistics:
    """One read of every row: a non-finite value anywhere is refused, and the training rows'
    mean and mean norm are measured (in float64), before any step."""
    reader = _Reader(rows, 0, rows.count)
    norms, total = 0.0, torch.zeros(rows.d_in, dtype=torch.float64)
    low = high = None
    start = 0
    while reader.left:
        chunk = reader.take(READ_ROWS)
        bad = ~torch.isfinite(chunk).all(1)
        if bool(bad.any()):
            row = start + int(bad.nonzero()[0])
            raise InvalidRequest(
                f"row {row} of {rows.where} holds NaN or infinite values: an SAE cannot train "
                "on them; drop those tokens (or collect the store again)"
            )
        train = chunk[: max(n_train - start, 0)]
        if len(train):
            norms += float(train.norm(dim=1).double().sum())
            total += train.sum(0, dtype=torch.float64)
            low = train.amin(0) if low is None else torch.minimum(low, train.amin(0))
            high = train.amax(0) if high is None else torch.maximum(high, train.amax(0))
        start += len(chunk)
    if torch.equal(low, high):
        raise InvalidRequest(
            f"the {n_train} training rows of {rows.where} are all the same vector: there is "
            "nothing for an SAE to learn"
        )
    return _Statistics(total / n_train, norms / n_train)


def _batches(
    rows: _Rows, n_train: int, batch_size: int, buffer_tokens: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Batches of the training rows (``0 .. n_train``), pass after pass: a shuffle buffer of
    ``buffer_tokens`` rows (at least two batches) is filled in corpus order, permuted with
    ``generator``, and emptied down to half before it is filled again; at a pass's end the
    rest is emitted, the last batch taking the remainder, so every row is seen once a pass."""
    capacity = max(buffer_tokens, 2 * batch_size)
    while True:
        reader = _Reader(rows, 0, n_train)
        buffer = torch.empty(0, rows.d_in)
        while True:
            buffer = torch.cat([buffer, reader.take(capacity - len(buffer))])
            order = torch.randperm(len(buffer), generator=generator)
            if reader.left:
                emit = (len(buffer) - capacity // 2) // batch_size * batch_size
                ends = list(range(batch_size, emit + 1, batch_size))
            else:
                full = max(len(buffer) // batch_size, 1)
                ends = [batch_size * (i + 1) for i in range(full - 1)] + [len(buffer)]
            start = 0
            for end in ends:
                yield buffer[order[start:end]]
                start = end
            buffer = buffer[order[start:]]
            if not reader.left:
                break


# -- the SAE being trained ------------------------------------------------------------------


class _Picked(torch.autograd.Function):
    """The pre-activations ``pre`` of the latents ``picked`` per token (``[tokens, n]``),
    whose gradient reaches only those latents' encoder rows: computed sparsely (an
    embedding bag and a sparse product), where autograd through the dense ``x @ W.T`` would
    multiply mostly zeros. sparsify's fused encoder does the same on GPU. ``bias`` is
    there for its gradient (``pre`` holds it already)."""

    @staticmethod
    def forward(ctx, x, weight, bias, picked, pre):
        ctx.save_for_backward(x, weight, picked)
        return pre.gather(-1, picked)

    @staticmethod
    def backward(ctx, grad):
        x, weight, picked = ctx.saved_tensors
        flat = picked.flatten()
        grad_x = F.embedding_bag(picked, weight, per_sample_weights=grad, mode="sum")
        tokens = torch.arange(len(x)).repeat_interleave(picked.shape[1])
        sparse = torch.sparse_coo_tensor(
            torch.stack([flat, tokens]),
            grad.flatten(),
            (len(weight), len(x)),
            check_invariants=False,
        )
        grad_weight = torch.sparse.mm(sparse, x)
        grad_bias = torch.zeros(len(weight), dtype=grad.dtype).index_add_(0, flat, grad.flatten())
        return grad_x, grad_weight, grad_bias, None, None


@dataclass(frozen=True)
class _Plan:
    """Everything a run is set to, the data's shape included: what the log records."""

    architecture: str
    layer: int
    site: str
    d_in: int
    d_sae: int
    k: int | None
    l1_coefficient: float | None
    lr: float
    batch_size: int
    buffer_tokens: int
    dead_tokens: int
    auxk_alpha: float | None
    max_tokens: int | None
    max_seconds: float | None
    seed: int
    tokens: int
    training_rows: int
    held_out_rows: int
    scale: float
    source: str
    model_name: str | None


class _Model:
    """The SAE's parameters in the normalised space (inputs times `_Plan.scale`), Adam, and
    the tokens since each latent last fired."""

    def __init__(self, plan: _Plan, mean: torch.Tensor, generator: torch.Generator) -> None:
        self.plan = plan
        directions = torch.randn(plan.d_sae, plan.d_in, generator=generator)
        # Unit rows for TopK (Gao et al.); SAELens's decoder_init_norm of 0.1 for ReLU.
        norm = 1.0 if plan.architecture == "topk" else 0.1
        decoder = F.normalize(directions, dim=-1) * norm
        self.W_dec = decoder.requires_grad_()
        self.W_enc = decoder.detach().clone().requires_grad_()  # [d_sae, d_in]: W_enc.T
        self.b_enc = torch.zeros(plan.d_sae, requires_grad=True)
        self.b_dec = (mean * plan.scale).float().requires_grad_()
        self.optimizer = torch.optim.Adam(self.parameters(), lr=plan.lr)
        self.since_fired = torch.zeros(plan.d_sae, dtype=torch.long)

    def parameters(self) -> list[torch.Tensor]:
        return [self.W_enc, self.b_enc, self.W_dec, self.b_dec]

    @property
    def dead(self) -> torch.Tensor:
        return self.since_fired > self.plan.dead_tokens

    def step(self, x: torch.Tensor, mean: torch.Tensor) -> tuple[float, float]:
        """One Adam step on the normalised batch ``x``; its loss and mean L0. The fraction of
        variance unexplained is over the batch's spread about the training rows' ``mean``
        (sparsify uses the batch's own mean: the same for a large batch, and defined for
        one token)."""
        spread = (x - mean).pow(2).sum()
        if self.plan.architecture == "topk":
            loss, acts, picked = self._topk_loss(x, spread)
            fired = picked[acts > 0]
        else:
            loss, acts = self._relu_loss(x)
            fired = (acts > 0).any(0).nonzero().flatten()
        loss.backward()
        with torch.no_grad():
            if self.plan.architecture == "topk":
                # Only the gradient that turns a row moves it; then the rows are unit again.
                grad, rows = self.W_dec.grad, self.W_dec
                grad -= (grad * rows).sum(1, keepdim=True) * rows
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.plan.architecture == "topk":
                eps = torch.finfo(torch.float32).eps
                self.W_dec /= self.W_dec.norm(dim=1, keepdim=True) + eps
            self.since_fired += len(x)
            self.since_fired[fired] = 0
        return float(loss.detach()), float((acts > 0).sum(-1).float().mean())

    def _topk_loss(
        self, x: torch.Tensor, spread: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.plan.k is not None  # `_check_options` gives a TopK run its k
        k = int(self.plan.k)
        centred = x - self.b_dec
        with torch.no_grad():
            pre = torch.addmm(self.b_enc, centred, self.W_enc.T)
        picked = pre.topk(k, dim=-1).indices
        acts = _Picked.apply(centred, self.W_enc, self.b_enc, picked, pre).relu()
        recon = F.embedding_bag(picked, self.W_dec, per_sample_weights=acts, mode="sum")
        error = x - (recon + self.b_dec)
        loss = error.pow(2).sum() / spread
        dead = self.dead
        n_dead = int(dead.sum())
        k_aux = min(self.plan.d_in // 2, n_dead)
        if k_aux:
            # AuxK: the top dead latents reconstruct what the live ones missed, scaled down
            # while few are dead (sparsify's sparse_coder.py, Gao et al. appendix B.1).
            scale = min(n_dead / (self.plan.d_in // 2), 1.0)
            aux = pre.masked_fill(~dead, -math.inf).topk(k_aux, dim=-1).indices
            aux_acts = _Picked.apply(centred, self.W_enc, self.b_enc, aux, pre).relu()
            guess = F.embedding_bag(aux, self.W_dec, per_sample_weights=aux_acts, mode="sum")
            auxk = scale * (guess - error.detach()).pow(2).sum() / spread
            loss = loss + AUXK_ALPHA * auxk
        return loss, acts, picked

    def _relu_loss(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # SAELens 6's StandardTrainingSAE: squared error summed over d_in, mean over tokens,
        # plus the L1 of the activations weighted by the decoder rows' norms.
        acts = ((x - self.b_dec) @ self.W_enc.T + self.b_enc).relu()
        recon = acts @ self.W_dec + self.b_dec
        mse = (x - recon).pow(2).sum(-1).mean()
        sparsity = (acts * self.W_dec.norm(dim=1)).sum(-1).mean()
        assert self.plan.l1_coefficient is not None  # `_check_options` gives a ReLU run one
        return mse + float(self.plan.l1_coefficient) * sparsity, acts

    @torch.no_grad()
    def unexplained(self, held_out: torch.Tensor, spread: float) -> float:
        """The fraction of the (normalised) held-out rows' variance left unexplained."""
        error = 0.0
        for chunk in held_out.split(EVAL_ROWS):
            acts = self._encode(chunk)
            recon = acts @ self.W_dec + self.b_dec
            error += float((chunk - recon).pow(2).sum(dtype=torch.float64))
        return error / spread

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        pre = (x - self.b_dec) @ self.W_enc.T + self.b_enc
        if self.plan.architecture == "relu":
            return pre.relu()
        assert self.plan.k is not None  # `_check_options` gives a TopK run its k
        top = pre.topk(int(self.plan.k), dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())

    def state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).detach().clone() for name in _STATE}

    def sae(self, state: dict[str, torch.Tensor]) -> SAE:
        """``state`` as the SAE of raw activations: the input scale folded into the weights."""
        plan, s = self.plan, self.plan.scale
        return SAE(
            architecture=plan.architecture,
            W_enc=(state["W_enc"].T * s).contiguous(),
            b_enc=state["b_enc"],
            W_dec=state["W_dec"] / s,
            b_dec=state["b_dec"] / s,
            layer=plan.layer,
            site=plan.site,
            k=plan.k,
            apply_b_dec_to_input=True,
            normalize_activations="none",
            hook_name=tl_hook(plan.layer, plan.site),
            model_name=plan.model_name,
            source=f"trained on {plan.source}",
        )


_STATE = ("W_enc", "b_enc", "W_dec", "b_dec")


# -- the run --------------------------------------------------------------------------------


def _plan(rows: _Rows, options: _Options, n_train: int, scale: float) -> _Plan:
    """The run's settings, those that depend on the data checked against it."""
    d_sae = options.d_sae or max(1, round(options.expansion * rows.d_in))
    if options.k is not None and options.k > d_sae:
        raise InvalidRequest(f"k is at most d_sae ({d_sae}) latents, not {options.k}")
    topk = options.architecture == "topk"
    lr = options.lr or (2e-4 / math.sqrt(d_sae / 2**14) if topk else RELU_LR)
    planned = options.max_tokens or n_train
    dead = options.dead_tokens or min(DEAD_TOKENS, max(planned // 10, options.batch_size))
    return _Plan(
        architecture=options.architecture,
        layer=options.layer,
        site=options.site,
        d_in=rows.d_in,
        d_sae=d_sae,
        k=options.k,
        l1_coefficient=options.l1_coefficient,
        lr=lr,
        batch_size=options.batch_size,
        buffer_tokens=options.buffer_tokens,
        dead_tokens=dead,
        auxk_alpha=AUXK_ALPHA if topk else None,
        max_tokens=options.max_tokens,
        max_seconds=options.max_seconds,
        seed=options.seed,
        tokens=rows.count,
        training_rows=n_train,
        held_out_rows=rows.count - n_train,
        scale=scale,
        source=rows.where,
        model_name=rows.model_name,
    )


def _train(rows: _Rows, options: _Options, progress: Any) -> SAE:
    started = time.monotonic()
    if rows.count < 3:
        raise InvalidRequest(
            f"{rows.where} holds {rows.count} tokens: an SAE needs at least 3 (two to train "
            "on, one held out); collect more text"
        )
    held = max(1, min(HELD_OUT_MAX, round(HELD_OUT_SHARE * rows.count)))
    n_train = rows.count - held
    stats = _statistics(rows, n_train)
    plan = _plan(rows, options, n_train, math.sqrt(rows.d_in) / stats.mean_norm)
    generator = torch.Generator().manual_seed(plan.seed)
    model = _Model(plan, stats.mean, generator)
    mean = (stats.mean * plan.scale).float()
    held_out = _Reader(rows, n_train, rows.count).take(held) * plan.scale
    spread = float((held_out - held_out.mean(0)).pow(2).sum(dtype=torch.float64))
    batches = _batches(rows, n_train, plan.batch_size, plan.buffer_tokens, generator)
    # Tokens to train on: the budget's, one pass's when no budget is given, or none known.
    limit = plan.max_tokens or (None if plan.max_seconds else n_train)

    records: list[dict[str, Any]] = []
    best: tuple[float, dict[str, torch.Tensor] | None] = (math.inf, None)
    steps = tokens = 0
    since = {"loss": 0.0, "l0": 0.0, "steps": 0}

    def measure() -> None:
        nonlocal best
        fvu = model.unexplained(held_out, spread)
        done = max(since["steps"], 1)
        records.append(
            {
                "step": steps,
                "tokens": tokens,
                "seconds": round(time.monotonic() - started, 3),
                "loss": since["loss"] / done if since["steps"] else None,
                "l0": since["l0"] / done if since["steps"] else None,
                "held_out_fvu": fvu,
                "held_out_variance_explained": 1.0 - fvu,
                "dead_fraction": float(model.dead.float().mean()),
            }
        )
        since.update(loss=0.0, l0=0.0, steps=0)
        if fvu < best[0]:
            best = (fvu, model.state())

    measure()  # the initial SAE is the first candidate
    stopped = "max_tokens" if plan.max_tokens else "one pass"
    with progress_bar(progress, "train sae", limit) as bar:
        # At least one step, however long the set-up took of a time budget; after it, no
        # step that would end past the budget at the pace of the steps so far.
        stepping = time.monotonic()
        while limit is None or tokens < limit:
            budget = plan.max_seconds
            if budget and steps and over_budget(started, stepping, steps, budget):
                stopped = "max_seconds"
                break
            batch = next(batches)
            if limit is not None:
                batch = batch[: limit - tokens]
            loss, l0 = model.step(batch * plan.scale, mean)
            steps += 1
            tokens += len(batch)
            since["loss"] += loss
            since["l0"] += l0
            since["steps"] += 1
            if steps % EVAL_EVERY == 0:
                measure()
            bar.update(len(batch))
            _show(bar, loss, l0, records[-1])
        if since["steps"]:
            measure()
            _show(bar, loss, l0, records[-1])
    # The first measurement (a finite fraction: the rows were checked finite) beat the inf.
    assert best[1] is not None
    sae = model.sae(best[1])
    if options.out is not None:
        _write(options.out, sae, plan, records, stopped)
    return sae


def _show(bar: Any, loss: float, l0: float, record: dict[str, Any]) -> None:
    """The bar's figures: the last step's loss and L0, the last measurement's held-out
    variance explained and dead fraction."""
    bar.set_postfix(
        loss=f"{loss:.3f}",
        l0=f"{l0:.1f}",
        ve=f"{record['held_out_variance_explained']:.3f}",
        dead=f"{record['dead_fraction']:.2f}",
        refresh=False,
    )


def _write(out: Path, sae: SAE, plan: _Plan, records: list[dict[str, Any]], stopped: str) -> None:
    """The SAE in SAELens's format and, beside it, the log of its training."""
    sae.save(out)
    best = min(records, key=lambda record: record["held_out_fvu"])
    log = {"settings": asdict(plan), "stopped": stopped, "best": best, "records": records}
    (out / LOG).write_text(json.dumps(log, indent=1))
