"""What an engine's ranks hold of what clients send them: tuned lenses and SAEs, each known by
its key, least recently used first, so that an engine sends each once and its ranks' memory
stays bounded."""

from __future__ import annotations


class InstalledTranslators:
    """Which tuned lenses an engine's ranks hold, least recently used first.

    Each tuned lens is ``n_layers * d_model**2`` floats on every rank (40 MB on demo, about
    2 GB on a 7B model), so the ranks keep at most `LIMIT`: installing another drops the
    least recently used, and using an evicted one installs it again.
    """

    LIMIT = 2

    def __init__(self) -> None:
        self._keys: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def keep_for(self, key: str) -> tuple[str, ...] | None:
        """None if ``key`` is installed (marked as just used); else the keys the ranks keep
        beside it, to send with its install."""
        if key in self._keys:
            self._keys.remove(key)
            self._keys.append(key)
            return None
        return tuple(self._keys[-(self.LIMIT - 1) :]) if self.LIMIT > 1 else ()

    def installed(self, key: str, kept: tuple[str, ...]) -> None:
        """Record that the ranks now hold ``kept`` and ``key``, and nothing else."""
        self._keys = [*kept, key]

    def clear(self) -> None:
        """The ranks hold none (a fresh start)."""
        self._keys = []


class InstalledSAEs(InstalledTranslators):
    """Which SAEs an engine's ranks hold (each rank its slice), least recently used first:
    at most `LIMIT`, which is also the most one request may read."""

    LIMIT = 8
