"""What every holder of an engine offers: lens, attribution, patching, comparison, traces.

`EngineSurface` is the request side of `Engine`, written against three things only — the
envoy tree (``model``), the model's shape (``info``) and a guard that gives the engine to
one request at a time (``exclusive``) — so an engine in this process and one reached through
a server offer the same methods with the same checks and the same results. The computing
itself lives in the other modules of `envoykit.analyses`: lens, attribution, patching and
sweep take the envoy tree, a `Readout` and the engine's guard; compare, tuned and selfcheck,
which may trace two engines or need a tokenizer and shape, take engines.

One rule for the guard: the analysis holds it, around each of its traces, and no caller
holds it for a callee. An analysis given an envoy tree takes ``guard`` (the engine's
`exclusive`, uncalled); one given an engine holds ``engine.exclusive()``. Between two traces
the guard is free, so a long sweep lets other requests in.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from envoykit.analyses import selfcheck
from envoykit.analyses.in_flight import LensesInFlight
from envoykit.errors import Cancelled, InvalidRequest
from envoykit.model.readout import Readout, writes_by_layer
from envoykit.ranks.cancel import is_cancellation

if TYPE_CHECKING:
    from envoykit.analyses.patching import Ablate, Patch
    from envoykit.analyses.sae import SAE
    from envoykit.analyses.steering import Steer
    from envoykit.analyses.tuned import TunedLens
    from envoykit.results.activations import Activations
    from envoykit.results.attention import AttentionResult
    from envoykit.results.attribution import AttributionResult
    from envoykit.results.compare import CompareResult
    from envoykit.results.corpus import CorpusLensResult
    from envoykit.results.steering import Generation, SteeringVector, SteerSweepResult
    from envoykit.results.sweep import SweepResult
    from envoykit.runtime.info import ModelInfo


class EngineSurface:
    """The request side of an engine; subclasses provide `model`, `info` and `exclusive`."""

    @property
    def model(self) -> Any:
        raise NotImplementedError

    @property
    def info(self) -> ModelInfo:
        raise NotImplementedError

    def exclusive(self) -> AbstractContextManager:
        raise NotImplementedError

    @functools.cached_property
    def _lenses_in_flight(self) -> LensesInFlight:
        return LensesInFlight()

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def cancel(self, thread: threading.Thread | None = None) -> str | None:
        """Stop a lens in flight, started on another thread (the explorer's Run, a
        notebook's background work): the ranks stop it before its next chunk of reductions
        (`envoykit.ranks.cancel`), and it raises `ek.Cancelled`. The engine serves the next
        request as usual. ``thread``: the thread whose lens to stop; without it, the lens on
        the ranks now (or the one lens waiting for them). Returns the stopped lens's cancel
        key, None (falsy) when no such lens was in flight."""
        key = self._lenses_in_flight.key(thread)
        if key is not None:
            self._raise_cancel_flag(key)
        return key

    def _raise_cancel_flag(self, key: str) -> None:
        """Put up the cancel flag of lens ``key`` where its ranks look."""
        raise NotImplementedError

    def _lower_cancel_flag(self, key: str) -> None:
        """The lens of ``key`` has ended: its flag, if up, is of no further use."""

    @property
    def readout(self) -> Readout:
        """Where this model's decoder layers, final norm and unembedding live."""
        return self.model.readout

    def generate(
        self, prompt: str, max_tokens: int = 16, *, steer: Steer | Sequence[Steer] | None = None
    ) -> Generation:
        """Greedy continuation of ``prompt``: a `Generation`, the text itself (a ``str``)
        with its ``token_ids``. Plain vLLM generation, or with ``steer`` (an `ek.Steer`, or a
        list of them, which add up) the steered one, every step steered on the ranks; its
        ``meta["steer"]`` says so."""
        from envoykit.results.steering import Generation

        steers = self._steers(steer)
        if not steers:
            prompt, _, max_tokens = self._generation_ids(prompt, max_tokens)  # not by vLLM
            output = self._greedy(prompt, max_tokens)
            return Generation(output.text, output.token_ids)
        (ids,), meta, _ = self._steered_ids(prompt, [steers], max_tokens)
        return Generation(self.tokenizer.decode(ids, skip_special_tokens=True), ids, meta)

    def generate_ids(
        self, prompt: str, max_tokens: int = 16, *, steer: Steer | Sequence[Steer] | None = None
    ) -> list[int]:
        """Token ids of the greedy continuation of ``prompt`` (steered with ``steer``)."""
        return list(self.generate(prompt, max_tokens, steer=steer).token_ids)

    def _greedy(self, prompt: str, max_tokens: int) -> Any:
        """vLLM's completion output of a greedy generation (in process, or on a server)."""
        raise NotImplementedError

    def _steers(self, steer: Any) -> list[Steer]:
        """``steer`` as a list, each `SteeringVector` in it checked against this model."""
        from envoykit.analyses.sae import Clamp
        from envoykit.analyses.steering import as_steers
        from envoykit.results.identity import check_same_model

        steers = as_steers(steer)
        for item in steers:
            if isinstance(item, Clamp):
                self._require_sae(item.sae)
                continue
            model = getattr(item.vector, "model", None)
            if model is not None:
                check_same_model(
                    dict(model),
                    self.fingerprint(),
                    "this steering vector was built",
                    "build one on this model",
                )
        if steers:
            self.readout.require("steering")
            self._require_sites([item.site for item in steers])
        return steers

    def fingerprint(self) -> dict[str, Any]:
        """This model's fingerprint (`envoykit.analyses.tuned.fingerprint`), measured once."""
        from envoykit.analyses.tuned import fingerprint

        found = getattr(self, "_fingerprint", None)
        if found is None:
            found = self._fingerprint = fingerprint(self)
        return found

    def _steered_ids(
        self,
        prompt: str,
        runs: Sequence[Sequence[Steer]],
        max_tokens: int,
        lens: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> tuple[list[list[int]], dict[str, Any], list[dict[str, Any]] | None]:
        """Greedy ids of ``prompt`` under each run's steers (one trace), cut at the stop
        token as plain generation is, the meta of a result of the last run, and with
        ``lens`` = (layers, target ids) each run's lens at the last prompt position
        (`steering.generated_ids`; else None)."""
        from envoykit.analyses import steering

        info = self.info
        prompt, ids, max_tokens = self._generation_ids(prompt, max_tokens)
        planned = [
            steering.plan_additions(steers, info.n_layers, info.d_model, len(ids))
            for steers in runs
        ]
        where = None if lens is None else (*lens, len(ids) - 1)
        found, stats = steering.generated_ids(
            self.model, self.readout, prompt, planned, max_tokens, self.exclusive, where
        )
        stops = steering.stop_ids(self.tokenizer)
        meta = {**self._result_meta(), "steer": [s.describe() for s in runs[-1]]}
        meta.pop("vocab")
        result = [steering.until_stop(run, stops) for run in found]
        return result, meta, stats

    def _generation_ids(self, prompt: Any, max_tokens: Any) -> tuple[str, tuple[int, ...], int]:
        """A generation's prompt, its ids and ``max_tokens``, checked against the context."""
        from envoykit.analyses.request import check_count, one_prompt

        limit = self.info.max_model_len
        prompt, ids = one_prompt(self.tokenizer, prompt, limit, "generate")
        max_tokens = check_count("max_tokens", max_tokens, 1)
        if len(ids) + max_tokens > limit:
            raise InvalidRequest(
                f"prompt of {len(ids)} tokens plus max_tokens={max_tokens} exceeds the engine's "
                f"max_model_len={limit}"
            )
        return prompt, ids, max_tokens

    def trace(
        self, *prompts: Any, steer: Steer | Sequence[Steer] | None = None, **kwargs: Any
    ) -> Any:
        """nnsight's trace on this engine; greedy and one new token unless told otherwise.

        Its run is serialised with every other request and guarded like `lens`: a dead
        engine raises `EngineDead`, an interrupt aborts what it left in flight.
        ``steer``: `ek.Steer`s (at every position: ``positions=None``) added to the stream
        of every invoke at every step, before the trace's own code sees it.
        """
        kwargs.setdefault("temperature", 0.0)
        kwargs.setdefault("max_tokens", 1)
        steers = self._steers(steer)
        if not steers:
            return self.model.trace(*prompts, **kwargs)
        from envoykit.analyses.steering import plan_additions

        info = self.info
        additions = plan_additions(steers, info.n_layers, info.d_model, None)
        return self._steered_trace(additions, prompts, kwargs)

    def _steered_trace(self, additions: Any, prompts: tuple, kwargs: dict) -> Any:
        """A trace of ``prompts`` with ``additions`` at every step; engines that can install
        a block on their ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot steer a trace")

    def lens(
        self,
        prompt: str | list[str],
        *,
        layers: Any = None,
        positions: Any = None,
        top_k: int = 10,
        targets: Any = (),
        generate: int = 0,
        sites: str | Sequence[str] = ("resid",),
        reduce_dtype: str = "float32",
        patch: Patch | Ablate | Sequence[Patch | Ablate] | None = None,
        compare: bool = False,
        translator: TunedLens | None = None,
        steer: Steer | Sequence[Steer] | None = None,
        splice: SAE | None = None,
        keep_error: bool = False,
    ) -> Any:
        """Logit lens of ``prompt`` in one forward pass, reduced on the ranks.

        ``layers``: None/"all" (decoder layers 1..n), numbers (negative from the end), a
        range, and/or "embed" (layer 0). ``sites``: any of "resid" (after the layer),
        "resid_mid" (between its attention and MLP), "attn" and "mlp" (what that block
        writes, normalised on its own: see `envoykit.analyses.lens`); one row per layer and site.
        ``targets``: strings (their first token) or token ids. ``generate=N`` also lenses
        the N greedily generated tokens. ``reduce_dtype``: precision of the reductions on
        the ranks ("float32", or "float64"). A list of prompts gives a list of results
        (one trace). ``patch``: an `ek.Patch`, an `ek.Ablate` (a head removed) or a list of
        them; the result is the lens of the patched run (see `envoykit.analyses.patching`),
        and its ``meta["patches"]`` says so.
        ``compare=True`` with two prompts gives their `CompareResult` (`envoykit.analyses.compare`).
        ``translator``: a `TunedLens` of this model; the residual-stream rows go through its
        translators on the ranks (a tuned lens), and ``meta["lens"]`` says "tuned".
        ``steer``: an `ek.Steer` or a list of them (they add up); the lens is that of the
        steered run (with ``generate=N``, of the steered generation), ``meta["steer"]`` says so.
        An `ek.Clamp` (SAE features set to values) is accepted as a ``patch`` or a ``steer``.
        ``splice``: an `ek.SAE` of a residual-stream site; the model runs with the SAE's
        reconstruction in place of the stream there, at every position and step (with
        ``keep_error``, plus the SAE's error), and ``meta["splice"]`` says so.

        Returns a `LensResult` (a list of them for a list of prompts).
        """
        from envoykit.analyses import lens, patching, request

        if compare:
            ignored = {
                "translator": translator is not None,
                "generate": generate != 0,
                "reduce_dtype": reduce_dtype != "float32",
                "steer": steer is not None,
                "splice": splice is not None,
                # (each cell's top-1 of both runs: its own statistics, of no top-k)
                "top_k": top_k != 10,
            }
            refuse_with_compare([name for name, given in ignored.items() if given])
            return self._compare_prompts(prompt, layers, positions, targets, sites, patch)
        info = self.info
        req = request.build_request(
            self.tokenizer,
            info.n_layers,
            info.vocab,
            info.max_model_len,
            prompt,
            layers=layers,
            positions=positions,
            top_k=top_k,
            targets=targets,
            generate=generate,
            sites=sites,
            reduce_dtype=reduce_dtype,
        )
        clamps, patch = split_clamps(patch)
        if clamps:
            steer = [*as_list_of(steer), *clamps]
        patches = patching.as_patches(patch)
        plan = self._patch_plan(req, patches)
        self.readout.require("the lens")
        self._require_sites([site for _, site in req.rows] + [p.site for p in patches])
        key = None if translator is None else self._translator_for(req, translator)
        meta = self._result_meta()
        if key is not None:
            meta.update(lens="tuned", translator=key)
        if patches:
            meta["patches"] = [dataclasses.asdict(p) for p in patches]
        steers = self._steers(steer)
        additions = self._additions(steers, req)
        if additions:
            meta["steer"] = [item.describe() for item in steers]
        if splice is not None and len(req.prompts) != 1:
            raise InvalidRequest("a splice lens runs one prompt, not a list of them")
        model, readout, guard = self.model, self.readout, self.exclusive
        # Registered before the sources are read: a cancel heard meanwhile stops the lens
        # at its first chunk.
        in_flight = self._lenses_in_flight
        with in_flight.lens() as cancel:
            writes = patching.source_writes(model, readout, plan, guard)
            fidelity = None
            if splice is not None:
                edit = self._splice(splice, keep_error)
                meta["splice"] = {**splice.describe(), "keep_error": keep_error}
                plain = writes_by_layer([*writes, *additions])
                fidelity = lens.Fidelity(uuid.uuid4().hex, (*req.prompt_ids[0][1:], -1), plain)
                additions = [*additions, edit]
            try:
                results = lens.run(
                    model,
                    readout,
                    req,
                    meta,
                    in_flight.guard(cancel, guard),
                    writes=writes,
                    translator=key,
                    additions=additions,
                    cancel=cancel,
                    fidelity=fidelity,
                )
            except Exception as error:
                if is_cancellation(error, cancel):
                    raise Cancelled(
                        "the lens was cancelled (engine.cancel()); the engine is ready for "
                        "the next request"
                    ) from None
                raise
            finally:
                self._lower_cancel_flag(cancel)
        return results if isinstance(prompt, (list, tuple)) else results[0]

    def features(
        self,
        prompt: str | Sequence[str],
        sae: SAE | Sequence[SAE],
        *,
        top_k: int = 16,
        features: Any = None,
    ) -> Any:
        """SAE features of ``prompt``, each rank encoding its own slice of the features (see
        `envoykit.analyses.features`). ``sae``: an `ek.SAE` or a list of them (read in one
        trace). ``top_k``: features kept per token. ``features``: ids (of one SAE) whose
        activation at every token is returned too (`FeatureResult.activation`).

        Returns a `FeatureResult` (a list of them for a list of SAEs; for a list of prompts,
        a list of those).
        """
        from envoykit.analyses import features as reading

        self.readout.require("SAE features")
        req = reading.build_request(
            self.tokenizer, self.info, prompt, sae, top_k=top_k, features=features
        )
        self._require_sites([item.site for item in req.saes])
        for item in req.saes:
            self._install_sae(item)
        found = reading.run(self.model, self.readout, req, self._result_meta(), self.exclusive)
        per_prompt = [items if isinstance(sae, (list, tuple)) else items[0] for items in found]
        return per_prompt if isinstance(prompt, (list, tuple)) else per_prompt[0]

    def attribute_features(
        self,
        prompt: str,
        sae: SAE,
        targets: str | int | Sequence[str | int],
        *,
        positions: int | Sequence[int] | None = None,
        top_k: int = 10,
    ) -> Any:
        """Each SAE feature's direct effect on the targets' logits: its activation times
        its decoder row, through the final norm frozen on the final stream (as `attribute`
        does). Returns a `FeatureAttributionResult` of the ``top_k`` features by absolute
        effect per position and target, whose features, error and decoder bias add up to
        the effect of the SAE's site itself."""
        from envoykit.analyses import features as reading

        self.readout.require("feature attribution")
        selfcheck.require(self.info, "attribution")
        req = reading.build_attribution_request(
            self.tokenizer, self.info, prompt, sae, targets, positions=positions, top_k=top_k
        )
        self._require_sae(req.sae)
        return reading.attribute(self.model, self.readout, req, self._result_meta(), self.exclusive)

    def feature_logits(self, sae: SAE, features: int | Sequence[int], *, k: int = 10) -> Any:
        """The ``k`` tokens each feature's decoder direction raises and lowers most (its
        logit effects), computed on the ranks against their vocabulary slices: a
        `FeatureLogitsResult`."""
        from envoykit.analyses import features as reading

        (sae,) = reading.as_saes(sae)
        many = isinstance(features, (list, tuple, range)) or hasattr(features, "__array__")
        ids = [sae.check_feature(f) for f in (features if many else [features])]
        if not ids:
            raise InvalidRequest("feature_logits needs at least one feature id")
        k = reading.check_count("k", int(k) if hasattr(k, "__index__") else k, 1)
        self._require_sae(sae)
        return reading.logit_effects(
            self.model,
            self.readout,
            sae,
            ids,
            min(k, self.info.vocab),
            self._result_meta(),
            self.exclusive,
        )

    def _require_sae(self, sae: SAE) -> str:
        """``sae`` checked against this model and installed on the ranks; its key."""
        from envoykit.analyses.sae import SAE

        if not isinstance(sae, SAE):
            raise InvalidRequest(f"expected an ek.SAE, not {type(sae).__name__}")
        sae.check_engine(self.info)
        self.readout.require("SAE features")
        self._require_sites([sae.site])
        return self._install_sae(sae)

    def _splice(self, sae: SAE, keep_error: bool) -> Any:
        """The edit of a splice lens, its SAE installed."""
        from envoykit.analyses.steering import plan_splice

        edit = plan_splice(sae, self.info.n_layers, keep_error)
        self._require_sae(sae)
        return edit

    def _install_sae(self, sae: SAE) -> str:
        """Make ``sae``'s slices available on the ranks; its key. Engines that can reach
        their ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot install SAEs on its ranks")

    def _patch_plan(self, req: Any, patches: list[Patch | Ablate]) -> Any:
        """Where each patch writes in the one prompt of ``req`` (`patching.plan_writes`)."""
        from envoykit.analyses import patching

        if len(req.prompts) != 1 and patches:
            raise InvalidRequest("a patch goes into one target prompt, not a list of them")
        ids = req.prompt_ids[0] if patches else ()
        return patching.plan_writes(
            self.tokenizer, patches, ids, self.info.n_layers, self._heads(patches)
        )

    def _additions(self, steers: Sequence[Steer], req: Any) -> list:
        """The checked additions of ``steers`` (`_steers`) into the one prompt of ``req``."""
        from envoykit.analyses.steering import plan_additions

        if not steers:
            return []
        if len(req.prompts) != 1:
            raise InvalidRequest("a steer goes into one prompt, not a list of them")
        info = self.info
        return plan_additions(steers, info.n_layers, info.d_model, len(req.prompt_ids[0]))

    def _heads(self, patches: Sequence[Patch | Ablate]) -> tuple[int, int] | None:
        """The model's (heads, head size) when a patch names a head; refused where its heads
        cannot be read."""
        if not any(p.site == "head" for p in patches):
            return None
        layout = self.readout.require_heads("head patching and ablation")
        return layout.n_heads, layout.head_size

    def _translator_for(self, req: Any, translator: TunedLens) -> str:
        """The key of ``translator`` installed on the ranks, for a request of stream rows."""
        if any(site != "resid" for _, site in req.rows):
            raise InvalidRequest(
                "tuned-lens translators are trained for the residual stream after each "
                "layer: use sites=('resid',) with a translator"
            )
        return self._install_translator(translator)

    def _install_translator(self, translator: TunedLens) -> str:
        """Make ``translator`` available on the ranks; its key. Engines that can reach their
        ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot install tuned-lens translators")

    def _compare_prompts(
        self, prompts: Any, layers: Any, positions: Any, targets: Any, sites: Any, patch: Any
    ) -> CompareResult:
        from envoykit.analyses.compare import compare

        if not isinstance(prompts, (list, tuple)) or len(prompts) != 2:
            raise InvalidRequest("compare=True compares two prompts: lens([a, b], compare=True)")
        if patch is not None or tuple(sites) != ("resid",):
            raise InvalidRequest(
                "compare=True compares the residual stream of two plain prompts; for a patched "
                "run use ek.compare((engine, prompt), (engine, prompt, patch))"
            )
        a, b = prompts
        return compare((self, a), (self, b), layers=layers, positions=positions, targets=targets)

    def attention(
        self,
        prompt: str,
        *,
        layers: Any = None,
        heads: Any = None,
        queries: Any = None,
        top_k: int | None = None,
    ) -> AttentionResult:
        """Attention patterns of ``prompt``, each computed on the rank that holds its head.

        ``layers``: decoder layers as in `lens` (None: every one; the embedding has none).
        ``heads``: head numbers over the whole model (None: every head; negatives count from
        the end). ``queries``: token positions whose patterns are kept (None: every one).
        ``top_k``: keep only each query's k most attended keys (for long prompts).

        Returns an `AttentionResult` ``[layers, heads, queries, keys]``, equal to the
        model's own attention weights (transformers' eager ``output_attentions``).
        """
        from envoykit.analyses import attention

        layout = self.readout.require_heads()
        info = self.info
        req = attention.build_request(
            self.tokenizer,
            layout,
            info.n_layers,
            info.max_model_len,
            prompt,
            layers=layers,
            heads=heads,
            queries=queries,
            top_k=top_k,
        )
        return attention.run(self.model, self.readout, req, self._result_meta(), self.exclusive)

    def attribute(
        self,
        prompt: str,
        targets: str | int | Sequence[str | int],
        *,
        positions: int | Sequence[int] | None = None,
        heads: bool = False,
    ) -> AttributionResult:
        """Direct logit attribution: how much the embedding and each layer's attention and
        MLP write into each target's final logit, at each position (see
        `envoykit.analyses.attribution`). Targets must be single tokens (strings or ids).
        ``heads=True`` also splits each layer's attention contribution into its heads,
        each computed on the rank that holds it (``head_values``).

        Returns an `AttributionResult` whose ``values.sum(0)`` equals its ``logits`` (and
        whose heads add up to their layer's attention row).
        """
        from envoykit.analyses import attribution

        self.readout.require("attribution")
        selfcheck.require(self.info, "attribution")
        if heads is True:
            self.readout.require_heads("per-head attributions")
        info = self.info
        req = attribution.build_request(
            self.tokenizer, info.vocab, info.max_model_len, prompt, targets, positions, heads
        )
        return attribution.run(self.model, self.readout, req, self._result_meta(), self.exclusive)

    def patch_sweep(
        self,
        source: str,
        target: str,
        *,
        layers: Any = None,
        positions: Any = None,
        site: str = "resid",
        metric: str = "prob",
        target_token: str | int,
        other_token: str | int | None = None,
        batch: int = 8,
        progress: bool = True,
        steer: Steer | Sequence[Steer] | None = None,
    ) -> SweepResult:
        """Causal tracing: patch ``source``'s stream into ``target`` at every (layer,
        position) and measure the target's next token at its last position. With
        ``site="head"``, every (layer, head) instead: each copy takes one head's output from
        the source at every position of ``positions`` (default all), a layers x heads map.

        Both prompts must tokenize to the same length (position p is copied to position p).
        ``metric``: "prob" (``target_token``'s probability) or "logit_diff" (its logit minus
        ``other_token``'s). Runs ``batch`` patched copies of the target per trace (one
        invoke each), reduced on the ranks to one number each, with a progress bar; an
        interrupt stops it between batches and leaves the engine usable. ``steer``: steers
        made in every target run (the clean one included), not in the source's;
        ``meta["steer"]`` says so.
        """
        from envoykit.analyses import steering, sweep

        info = self.info
        req = sweep.build_request(
            self.tokenizer,
            info.n_layers,
            info.vocab,
            source,
            target,
            layers=layers,
            positions=positions,
            site=site,
            metric=metric,
            target_token=target_token,
            other_token=other_token,
            batch=batch,
            n_heads=None if isinstance(self.readout.heads, str) else self.readout.heads.n_heads,
        )
        self._require_sites([site])
        steers = self._steers(steer)
        additions = steering.plan_additions(
            steers, info.n_layers, info.d_model, len(req.target_ids)
        )
        meta = self._result_meta()
        if steers:
            meta["steer"] = [item.describe() for item in steers]
        return sweep.run(self.model, self.readout, req, meta, self.exclusive, progress, additions)

    def steering_vector(
        self,
        positive: str | Sequence[str],
        negative: str | Sequence[str],
        layer: int | str,
        *,
        site: str = "resid",
        position: int | None = -1,
        progress: bool = True,
    ) -> SteeringVector:
        """The contrastive mean difference of the stream at (``layer``, ``site``): its mean
        over the ``positive`` prompts minus its mean over the ``negative`` ones, at token
        ``position`` of each prompt (default the last; None: the mean over its positions).
        Many prompts per trace; each sends back its ``d_model`` numbers only.

        Returns a `SteeringVector` carrying this model's fingerprint: ``ek.Steer(vector,
        vector.layer, scale=...)`` steers with it, and ``save``/``load`` keep it.
        """
        from envoykit.analyses import steering
        from envoykit.results.steering import SteeringVector

        info = self.info
        positive, negative = steering.check_prompt_lists(positive, negative)
        number = steering.check_site(layer, site, info.n_layers)
        self.readout.require("steering vectors")
        self._require_sites([site])
        lengths = [len(self.tokenizer(p)["input_ids"]) for p in (*positive, *negative)]
        if position is not None:
            shortest = min(lengths)
            if (
                isinstance(position, bool)
                or not isinstance(position, int)
                or not (-shortest <= position < shortest)
            ):
                raise InvalidRequest(
                    f"position {position!r} is not a token position of every prompt (the "
                    f"shortest has {shortest} tokens); position=None takes each prompt's mean"
                )
        if max(lengths) > info.max_model_len:
            raise InvalidRequest(f"a prompt exceeds max_model_len={info.max_model_len}")
        plus, minus = steering.mean_difference(
            self.model,
            self.readout,
            positive,
            negative,
            number,
            site,
            position,
            self.exclusive,
            progress,
        )
        return SteeringVector(
            vector=(plus - minus).astype("float32"),
            layer=number,
            site=site,
            position=position,
            positive=positive,
            negative=negative,
            model=self.fingerprint(),
            meta={k: v for k, v in self._result_meta().items() if k != "vocab"},
        )

    def steer_sweep(
        self,
        prompt: str,
        steer: Steer,
        *,
        scales: Sequence[float],
        max_tokens: int = 16,
        targets: Any = (),
        layers: Any = None,
        batch: int = 8,
        progress: bool = True,
    ) -> SteerSweepResult:
        """``steer`` at each of ``scales``: every scale's greedy continuation of ``prompt``
        and the lens probability of ``targets`` at the prompt's last position at every layer
        of ``layers`` (as in `lens`), after steering. ``batch`` scales per trace (one invoke
        each), with a progress bar over scales.

        Returns a `SteerSweepResult`; its ``meta["steer"]`` is ``steer`` at scale 1.
        """
        from tqdm.auto import tqdm

        from envoykit.analyses import request, steering
        from envoykit.results.steering import SteerSweepResult

        if not isinstance(steer, steering.Steer):
            raise InvalidRequest(f"steer_sweep sweeps one ek.Steer, not {type(steer).__name__}")
        scales = steering.check_scales(scales)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidRequest(f"batch must be an integer >= 1, not {batch!r}")
        info = self.info
        picked = request.normalise_layers(layers, info.n_layers)
        found = [
            request.single_token_target(self.tokenizer, info.vocab, t)
            for t in request.as_list(targets)
        ]
        self._steers(steer)  # the scales differ, nothing else: one check for every run
        runs = [[steer.scaled(scale)] for scale in scales]
        ids, stats, meta = [], [], {}
        with tqdm(total=len(runs), desc="steer sweep", unit="scale", disable=not progress) as bar:
            for start in range(0, len(runs), batch):
                chunk = runs[start : start + batch]
                got, meta, chunk_stats = self._steered_ids(
                    prompt, chunk, max_tokens, (picked, [t.token_id for t in found])
                )
                ids += got
                stats += chunk_stats
                bar.update(len(chunk))
        meta["steer"] = [steer.scaled(1.0).describe()]
        decode = self.tokenizer.decode
        return SteerSweepResult(
            prompt=prompt,
            scales=scales,
            texts=[decode(run, skip_special_tokens=True) for run in ids],
            token_ids=ids,
            layers=list(picked),
            target_labels=[t.label for t in found],
            target_tokens=[t.token for t in found],
            target_probs=[s["target_probs"][:, 0].numpy() for s in stats],
            top_tokens=[[decode([int(i)]) for i in s["top_ids"][:, 0, 0]] for s in stats],
            meta=meta,
        )

    def collect(
        self,
        texts: Any,
        *,
        out: str,
        layers: Any = None,
        sites: str | Sequence[str] = ("resid",),
        positions: Any = None,
        dtype: str = "bfloat16",
        max_length: int | None = None,
        batch_tokens: int = 4096,
        progress: bool = True,
    ) -> Activations:
        """Save the whole activations of a corpus to the store ``out`` (a directory; see
        `envoykit.results.activations`), many documents per trace, with a progress bar in
        tokens/s; returns the store as `Activations`.

        ``texts``: a list or any iterable of documents (read lazily, so memory holds one
        batch whatever the corpus's size): strings, or lists of token ids taken as they are.
        ``layers``/``sites``: as in `lens`, one stored row each: the residual stream whole
        ("resid", "resid_mid", summed as the model adds it) or what a block writes ("attn",
        "mlp"). ``positions``: None (every token) or positions counted in each piece
        (negative from its end); a piece without one skips it. ``dtype``: what is stored
        ("bfloat16", "float16" or "float32"). A document longer than ``max_length``
        (default: the engine's context) is cut into consecutive pieces, each its own
        context; ``position`` stays counted from the document's start. ``batch_tokens``:
        about how many tokens one trace prefills, and one shard holds (whole documents;
        memory holds one batch).

        Resumable: run it again with the same arguments after an interrupt or a killed
        kernel, and it continues after the last whole shard. A store of another model,
        corpus or settings at ``out`` is refused and left as it is. ``progress``: a tqdm bar
        in tokens/s (True), none (False), or your own bar (`corpus.progress_bar`).
        """
        from envoykit.analyses import collect, corpus, request
        from envoykit.results.activations import Activations, StoreWriter, as_rows

        info = self.info
        self.readout.require("collect")
        rows = request.lens_rows(
            request.normalise_layers(layers, info.n_layers), request.normalise_sites(sites)
        )
        self._require_sites([site for _, site in rows])
        if dtype not in collect.STORE_DTYPES:
            raise InvalidRequest(f"dtype must be one of {collect.STORE_DTYPES}, not {dtype!r}")
        picked = None if positions is None else _corpus_positions(positions)
        length = corpus.check_max_length(max_length, info.max_model_len)
        batch = request.check_count("batch_tokens", batch_tokens, minimum=1)
        documents = corpus.documents(texts)
        total = corpus.total_tokens(self.tokenizer, texts, info.vocab)
        settings = {
            "model": self.fingerprint(),
            "rows": as_rows(rows),
            "positions": picked,
            "dtype": dtype,
            "max_length": length,
        }
        writer = StoreWriter.open(out, settings)
        with corpus.progress_bar(progress, "collect", total) as bar:
            if total is not None and writer.documents_done:  # a rerun: those are done
                stored = texts[: writer.documents_done]
                bar.update(corpus.total_tokens(self.tokenizer, stored, info.vocab))
            collect.run(
                self.model,
                self.readout,
                self.tokenizer,
                documents,
                writer,
                rows,
                picked,
                dtype,
                length,
                batch,
                info.vocab,
                self.exclusive,
                bar,
            )
        return Activations.open(out)

    def lens_corpus(
        self,
        texts: Any,
        *,
        layers: Any = None,
        top_k: int = 1,
        translator: TunedLens | None = None,
        max_length: int | None = None,
        batch_tokens: int = 4096,
        confidence: float = 0.95,
        n_boot: int = 1000,
        seed: int = 0,
        progress: bool = True,
    ) -> CorpusLensResult:
        """The logit lens over a corpus: per layer, mean KL(final ‖ layer), mean entropy,
        top-k agreement with the final layer and top-k accuracy against the actual next
        token, with bootstrap intervals over documents (`CorpusLensResult`). Many documents
        per trace; only four sums per layer and document come back from the ranks.

        ``texts``, ``max_length``, ``batch_tokens``: as in `collect`. ``layers``: as in `lens`.
        ``translator``: a `TunedLens` of this model (the tuned lens's statistics).
        ``progress``: as in `collect`.
        """
        from envoykit.analyses import corpus, corpus_lens, request
        from envoykit.results.corpus import CorpusLensResult

        info = self.info
        self.readout.require("the lens")
        picked = request.normalise_layers(layers, info.n_layers)
        top_k = request.check_count("top_k", top_k, minimum=1)
        if top_k > info.vocab:
            raise InvalidRequest(f"top_k={top_k} exceeds the vocabulary size ({info.vocab})")
        n_boot = request.check_count("n_boot", n_boot, minimum=1)
        if not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise InvalidRequest(f"confidence lies in (0, 1), not {confidence!r}")
        length = corpus.check_max_length(max_length, info.max_model_len)
        batch = request.check_count("batch_tokens", batch_tokens, minimum=1)
        documents = corpus.documents(texts)
        total = corpus.total_tokens(self.tokenizer, texts, info.vocab)
        meta = self._result_meta()
        meta.pop("vocab")
        key = None
        if translator is not None:
            key = self._install_translator(translator)
            meta.update(lens="tuned", translator=key)
        with corpus.progress_bar(progress, "corpus lens", total) as bar:
            sums, counts = corpus_lens.run(
                self.model,
                self.readout,
                self.tokenizer,
                documents,
                picked,
                top_k,
                key,
                length,
                batch,
                info.vocab,
                self.exclusive,
                bar,
            )
        if not len(counts):
            raise InvalidRequest("the corpus tokenizes to no tokens: its documents are all empty")
        return CorpusLensResult(
            layers=picked,
            top_k=top_k,
            document_sums=sums,
            document_counts=counts,
            confidence=confidence,
            n_boot=n_boot,
            seed=seed,
            meta={"lens": "logit", **meta},
        )

    def feature_stats(
        self,
        texts: Any,
        sae: SAE,
        *,
        contexts: int = 20,
        window: int = 16,
        out: str | None = None,
        max_length: int | None = None,
        batch_tokens: int = 4096,
        progress: bool = True,
    ) -> Any:
        """Every feature of ``sae`` over a corpus: firing frequency, mean and maximum
        activation, a histogram, and its ``contexts`` max-activating contexts (a window of
        ``window`` tokens each, the feature's activation at every one), reduced on the ranks
        (see `envoykit.analyses.feature_stats`). Returns a `FeatureStats`.

        ``texts``, ``max_length``, ``batch_tokens``, ``progress``: as in `collect`. ``out``:
        a directory to keep the statistics in (`ek.FeatureStats.open` reads it back), written
        as the run goes; run the same call again after an interrupt and it continues.
        """
        from envoykit.analyses import corpus
        from envoykit.analyses import feature_stats as stats
        from envoykit.results.feature_stats import StatsWriter

        info = self.info
        req = stats.build_request(
            info,
            sae,
            contexts=contexts,
            window=window,
            max_length=max_length,
            batch_tokens=batch_tokens,
        )
        self._require_sae(req.sae)
        documents = corpus.documents(texts)
        total = corpus.total_tokens(self.tokenizer, texts, info.vocab)
        meta = {**self._result_meta(), "sae": req.sae.describe()}
        meta.pop("vocab")
        settings = {
            "model": self.fingerprint(),
            "sae": req.sae.key,
            "contexts": req.contexts,
            "window": req.window,
            "max_length": req.max_length,
        }
        writer = None if out is None else StatsWriter.open(out, settings)
        with corpus.progress_bar(progress, "feature stats", total) as bar:
            if total is not None and writer is not None and writer.index["tokens"]:
                bar.update(writer.index["tokens"])
            return stats.run(
                self.model,
                self.readout,
                self.tokenizer,
                documents,
                req,
                info.vocab,
                meta,
                writer,
                self.exclusive,
                bar,
            )

    def _require_sites(self, sites: Sequence[str]) -> None:
        """Refuse what this model's layers cannot give, or what the self-check disabled."""
        self.readout.require_sites(sites)
        selfcheck.require(self.info, "lens")
        if any(site != "resid" for site in sites):
            selfcheck.require(self.info, "sites")

    def _result_meta(self) -> dict[str, Any]:
        """What every result records about the engine that produced it."""
        info = self.info
        return {"model": info.name, "tp": info.tp, "dtype": info.dtype, "vocab": info.vocab}

    def locations(self) -> list:
        """Every location whose value is whole at any TP size (`envoykit.model.envoys.Location`)."""
        from envoykit.model.envoys import whole_locations

        return whole_locations(self.model._module)


def _corpus_positions(positions: Any) -> list[int]:
    """Positions of a corpus request: integers counted in each piece (negative from its
    end), checked here since pieces differ in length."""
    from envoykit.analyses.request import as_list

    picked = as_list(list(positions) if isinstance(positions, range) else positions)
    if not picked or any(isinstance(p, bool) or not isinstance(p, int) for p in picked):
        raise InvalidRequest(
            f"positions are integers (negative from each document's end), not {positions!r}"
        )
    return sorted(set(picked))


def refuse_with_compare(names: Sequence[str]) -> None:
    """``compare=True`` compares the plain logit lens of two prompts in float64 on the ranks:
    an option it would drop is refused, not ignored."""
    if names:
        raise InvalidRequest(
            f"compare=True does not take {', '.join(f'{n}=' for n in names)}: it compares the "
            "logit lens of two prompts' own tokens (in float64 on the ranks); run engine.lens "
            "on each prompt with those options instead"
        )


def split_clamps(patch: Any) -> tuple[list, Any]:
    """The `ek.Clamp`s among a lens's ``patch`` (they are steers: edits of the stream by
    SAE features), and the rest of it."""
    from envoykit.analyses.sae import Clamp

    items = as_list_of(patch)
    clamps = [item for item in items if isinstance(item, Clamp)]
    if not clamps:
        return [], patch
    rest = [item for item in items if not isinstance(item, Clamp)]
    return clamps, rest or None


def as_list_of(value: Any) -> list:
    """None, one object or a list of them, as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
