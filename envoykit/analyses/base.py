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

import functools
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from envoykit import _compat as compat
from envoykit.analyses import selfcheck
from envoykit.analyses.in_flight import LensesInFlight
from envoykit.errors import InvalidRequest
from envoykit.model.readout import Readout

if TYPE_CHECKING:
    from envoykit.analyses.sae import SAE
    from envoykit.analyses.tuned import TunedLens
    from envoykit.runtime.info import ModelInfo


class EngineBase:
    """What analyses read from an engine; subclasses provide `model`, `info` and `exclusive`."""

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

    def _greedy(self, prompt: str, max_tokens: int) -> Any:
        """vLLM's completion output of a greedy generation (in process, or on a server)."""
        raise NotImplementedError

    def _steered_trace(self, additions: Any, prompts: tuple, kwargs: dict) -> Any:
        """A trace of ``prompts`` with ``additions`` at every step; engines that can install
        a block on their ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot steer a trace")

    def fingerprint(self) -> dict[str, Any]:
        """This model's fingerprint (`envoykit.analyses.tuned.fingerprint`), measured once."""
        from envoykit.analyses.tuned import fingerprint

        found = getattr(self, "_fingerprint", None)
        if found is None:
            found = self._fingerprint = fingerprint(self)
        return found

    def _require_sae(self, sae: SAE) -> str:
        """``sae`` checked against this model and installed on the ranks; its key."""
        from envoykit.analyses.sae import SAE

        if not isinstance(sae, SAE):
            raise InvalidRequest(f"expected an ek.SAE, not {type(sae).__name__}")
        sae.check_engine(self.info)
        self.readout.require("SAE features")
        self._require_sites([sae.site])
        return self._install_sae(sae)

    def _install_sae(self, sae: SAE) -> str:
        """Make ``sae``'s slices available on the ranks; its key. Engines that can reach
        their ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot install SAEs on its ranks")

    def _install_translator(self, translator: TunedLens) -> str:
        """Make ``translator`` available on the ranks; its key. Engines that can reach their
        ranks override this."""
        raise InvalidRequest(f"{type(self).__name__} cannot install tuned-lens translators")

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

        return whole_locations(compat.envoy_module(self.model))
