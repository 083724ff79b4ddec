"""What every analysis reads from an engine: the envoy tree, the model's shape, the guard,
cancel, the fingerprint, the sites a model can give, SAEs and translators on the ranks, and
the meta every result records.

`EngineBase` is written against three things only: the envoy tree (``model``), the model's
shape (``info``) and a guard that gives the engine to one request at a time
(``exclusive``). An analysis takes an `EngineBase`; `envoykit.analyses.surface.EngineSurface`
adds the analyses' entry functions as methods. Keeping the two apart keeps the imports one
way: the analyses import this module, and the surface imports the analyses.

One rule for the guard: the analysis holds it, around each of its traces, and no caller
holds it for a callee. An analysis given an envoy tree takes ``guard`` (the engine's
`exclusive`, uncalled); one given an engine holds ``engine.exclusive()``. Between two traces
the guard is free, so a long sweep lets other requests in.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from envoykit import _compat as compat
from envoykit.analyses.in_flight import LensesInFlight
from envoykit.errors import Cancelled, InvalidRequest
from envoykit.model.readout import Readout, at

if TYPE_CHECKING:
    from envoykit.runtime.info import ModelInfo

# How many rows of the unembedding a model's fingerprint hashes.
FINGERPRINT_ROWS = 64


class EngineBase:
    """What analyses read from an engine; subclasses provide `model`, `info` and `exclusive`."""

    # The lens, bound by the surface (`envoykit.analyses.lens.lens`): a tuned lens measures
    # itself with it. Declared here, not imported, as the lens's module imports this one.
    lens: Callable[..., Any]
    # Whether the ranks run on this machine as this process's user: a collection's ranks then
    # write each shard's rows into the store themselves (`envoykit.analyses.collect`).
    _ranks_see_this_disk = True

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
        (`envoykit.ranks.cancel`), and it raises `ek.Cancelled`; the corpus lens and a
        steered generation (or ``generate(..., cancellable=True)``) stop the same way,
        between two steps. The engine serves the next request as usual. ``thread``: the
        thread whose lens to stop; without it, the lens on the ranks now (or the one lens
        waiting for them). Returns the stopped lens's cancel key, None (falsy) when no such
        lens was in flight."""
        key = self._lenses_in_flight.key(thread)
        if key is not None:
            self._raise_cancel_flag(key)
        return key

    @contextlib.contextmanager
    def _cancellable(
        self, what: str = "the lens"
    ) -> Iterator[tuple[str, Callable[[], AbstractContextManager]]]:
        """A cancel key for the work on the ranks that the calling thread runs inside this
        block, and the engine's guard that records it while held: `cancel` from another
        thread stops that work at its next chunk, and the block raises `Cancelled` naming
        ``what``. Registered before the block's first trace, so a cancel heard before it
        stops it at its first chunk."""
        # Imported here: imported with the module, it made a killed rank's EngineDead reach
        # the caller 2-5 s later instead of within 1-2 s (tests/test_faults.py, six runs),
        # for a reason not found; the lens's module imports it at module level unharmed.
        from envoykit.ranks.cancel import is_cancellation

        in_flight = self._lenses_in_flight
        with in_flight.lens() as key:
            try:
                yield key, in_flight.guard(key, lambda: self._stoppable(key))
            except Exception as error:
                if is_cancellation(error, key):
                    raise Cancelled(
                        f"{what} was cancelled (engine.cancel()); the engine is ready for the "
                        "next request"
                    ) from None
                raise
            finally:
                self._lower_cancel_flag(key)

    def _stoppable(self, key: str) -> AbstractContextManager:
        """The engine's guard for the work of cancel key ``key``: `exclusive`. An engine
        that steps vLLM in this process also stops between two steps there."""
        return self.exclusive()

    def _raise_cancel_flag(self, key: str) -> None:
        """Put up the cancel flag of lens ``key`` where its ranks look."""
        raise NotImplementedError

    def _lower_cancel_flag(self, key: str) -> None:
        """The lens of ``key`` has ended: its flag, if up, is of no further use."""

    @property
    def readout(self) -> Readout:
        """Where this model's decoder layers, final norm and unembedding live."""
        return self.model.readout

    def _greedy(self, prompt: str, max_tokens: int) -> Any:
        """vLLM's completion output of a greedy generation (in process, or on a server)."""
        raise NotImplementedError

    def _steered_trace(self, additions: Any, prompts: tuple, kwargs: dict) -> Any:
        """A trace of ``prompts`` with ``additions`` at every step; engines that can install
        a block on their ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot steer a trace")

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this model (`envoykit.results.identity`), measured once: its name
        and shape, and a hash of `FINGERPRINT_ROWS` rows of its unembedding rounded to
        bfloat16."""
        import nnsight

        found = getattr(self, "_fingerprint", None)
        if found is None:
            model, readout = self.model, self.readout
            ids = fingerprint_ids(self.info.vocab)
            with self.exclusive(), model.trace("The", temperature=0.0, max_tokens=1):
                rows = nnsight.save(at(model, readout.unembedding).rows(ids).float().cpu())
            found = self._fingerprint = fingerprint_of(self.info, rows)
        return found

    def _install_sae(self, sae: Any) -> str:
        """Make ``sae``'s slices available on the ranks; its key. Engines that can reach
        their ranks override this (``sae``: an `envoykit.analyses.sae.SAE`, named only
        there, since the analyses' modules import this one)."""
        raise InvalidRequest(f"{type(self).__name__} cannot install SAEs on its ranks")

    def _install_translator(self, translator: Any) -> str:
        """Make ``translator`` available on the ranks; its key. Engines that can reach their
        ranks override this (``translator``: an `envoykit.analyses.tuned.TunedLens`, named
        only there)."""
        raise InvalidRequest(f"{type(self).__name__} cannot install tuned-lens translators")

    def _require_sites(self, sites: Sequence[str]) -> None:
        """Refuse what this model's layers cannot give, or what the self-check disabled."""
        self.readout.require_sites(sites)
        self.info.require("lens")
        if any(site != "resid" for site in sites):
            self.info.require("sites")

    def _result_meta(self) -> dict[str, Any]:
        """What every result records about the engine that produced it."""
        info = self.info
        return {"model": info.name, "tp": info.tp, "dtype": info.dtype, "vocab": info.vocab}

    def locations(self) -> list:
        """Every location whose value is whole at any TP size (`envoykit.model.envoys.Location`)."""
        from envoykit.model.envoys import whole_locations

        return whole_locations(compat.envoy_module(self.model))


def fingerprint_ids(vocab: int) -> torch.Tensor:
    """The token ids whose unembedding rows `EngineBase.fingerprint` hashes."""
    return torch.linspace(0, vocab - 1, FINGERPRINT_ROWS).long()


def fingerprint_of(info: ModelInfo, rows: torch.Tensor) -> dict[str, Any]:
    """The fingerprint of a model of `ModelInfo` ``info`` whose `fingerprint_ids` rows of
    the unembedding are ``rows``."""
    digest = hashlib.sha256(rows.bfloat16().view(torch.int16).numpy().tobytes()).hexdigest()
    return {
        "name": info.name,
        "n_layers": info.n_layers,
        "d_model": info.d_model,
        "vocab": info.vocab,
        "head_hash": digest,
    }
