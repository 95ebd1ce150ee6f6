"""Which entries to delete under size and age limits (least recently used first)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Usage(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def last_used(self) -> float: ...


def plan_prune(
    entries: Sequence[Usage],
    *,
    max_size_bytes: int | None = None,
    max_age_seconds: float | None = None,
    now: float,
) -> list[str]:
    """Keys to remove: every entry unused for longer than `max_age_seconds`, then the
    least recently used until the rest fit in `max_size_bytes`."""

    def stale(entry: Usage) -> bool:
        return max_age_seconds is not None and now - entry.last_used > max_age_seconds

    by_age = sorted(entries, key=lambda e: (e.last_used, e.key))
    doomed = [e.key for e in by_age if stale(e)]
    kept = [e for e in by_age if not stale(e)]
    total = sum(e.size for e in kept)
    for entry in kept:
        if max_size_bytes is None or total <= max_size_bytes:
            break
        doomed.append(entry.key)
        total -= entry.size
    return doomed
