"""`CurrentRun`: the lens the explorer shows, with everything it answers, as one value.

Every panel of the explorer derives what it says from the run shown: its notice (a patched
run's), whether it can act (a sweep needs the second prompt), and what it measures at which
rows. Held as separate attributes, a panel could read the request of one run with the result
of another, or keep a notice a later run made wrong. A `CurrentRun` is frozen and replaced
whole by each Run, pin or drop (`LensRuns._lens`), so whatever a panel reads of it belongs to
one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envoykit.analyses.patching import Patch
    from envoykit.analyses.request import Row
    from envoykit.results.lens import LensResult


@dataclass(frozen=True)
class CurrentRun:
    """One lens shown: the ``request`` it answers (`Engine.lens`'s arguments; None for a
    stored result), its ``result``, the ``rows`` picked for it, and in compare mode the
    second prompt ``other``, its ``other_request`` and ``other_result``."""

    result: LensResult
    request: dict[str, Any] | None = None
    rows: tuple[Row, ...] = ()
    other: str | None = None
    other_request: dict[str, Any] | None = None
    other_result: LensResult | None = None

    @property
    def label(self) -> str:
        """What the run was (`LensResult.run_label`): the lens, patched or tuned."""
        return self.result.run_label

    @property
    def patch(self) -> Patch | None:
        """The patch the run was made with (a drop in compare mode), or None."""
        return None if self.request is None else self.request.get("patch")

    @property
    def prompt(self) -> str:
        return self.result.prompt
