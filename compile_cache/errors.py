"""The errors this package raises on purpose; each message names the value and the fix."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every deliberate compile-cache error."""


class ManifestError(CacheError, ValueError):
    """A manifest field cannot be part of a cache key (not JSON, not canonical)."""


class StoreError(CacheError):
    """A store URL is invalid or the store cannot be reached."""


class UnsafePathError(CacheError, ValueError):
    """A path inside an entry could name a location outside the entry."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path!r} {problem}")
        self.path = path
        self.problem = problem


class BuildOutputError(CacheError, ValueError):
    """What a build wrote cannot be cached (nothing written, links, special files)."""


class UnknownKey(CacheError, LookupError):
    """No entry (or more than one) matches the key or key prefix given."""


class LockTimeout(CacheError, TimeoutError):
    """Waiting for another process's compile of the same key took too long."""


class EntryCorrupt(CacheError):
    """An entry failed verification; it must never be loaded."""

    def __init__(self, key: str, problem: str, file: str | None = None):
        super().__init__(f"entry {key}: {problem}")
        self.key = key
        self.problem = problem
        self.file = file


class EntryUntrusted(EntryCorrupt):
    """An entry is not signed by a key this host trusts (unsigned, signed by an unknown
    key, or altered after signing); it must never be loaded."""


class StoreUnreachable(StoreError):
    """The store could not be reached (network, endpoint or service outage)."""


class StoreFull(CacheError):
    """The disk holding a store (or the read cache) ran out of space."""
