"""Many invokes' lenses sent in one exchange: where each invoke of a trace keeps its part
until the last of its group has come.

The corpus lens prefills a batch of documents, one invoke each, and each invoke's lens makes
an exchange between the ranks (`envoykit.ranks.vocab_parallel`). Ranks that share cores
each wait at every exchange for the one descheduled, so a batch's 32 exchanges cost more
than their bytes. A lens without targets needs nothing of the other ranks until its
statistics are combined (`envoykit.ranks.lens.lens_messages`), so each invoke leaves its
messages here and the invoke that completes its group exchanges the whole group's at once.

Which invoke completes a group is whichever runs last on the rank: the ranks run the same
invokes in the same order, so every rank makes the same exchange at the same point, without
relying on that order being the invokes' own.
"""

from __future__ import annotations

from typing import Any

# Group key -> {index in the group: what that invoke left}.
_WAITING: dict[str, dict[int, Any]] = {}
# Groups kept unfinished at once: one whose trace failed before it completed is dropped
# when a newer one pushes it out.
_KEPT = 16


def arrive(key: str, index: int, size: int, part: Any) -> list[Any] | None:
    """Leave invoke ``index``'s ``part`` of group ``key`` (``size`` invokes); the group's
    parts in index order for the invoke that completes it, None for every other one."""
    group = _WAITING.setdefault(key, {})
    while len(_WAITING) > _KEPT:
        del _WAITING[next(iter(_WAITING))]
    group[index] = part
    if len(group) < size:
        return None
    del _WAITING[key]
    return [group[i] for i in range(size)]
