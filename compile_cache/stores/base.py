"""The interface every store implements, so the cache logic is written once."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path

from compile_cache.locks import KeyLock
from compile_cache.record import Record


class Store(ABC):
    """A place entries live. Entries are immutable once published; a published entry
    is replaced only after it has been quarantined or removed."""

    url: str
    # Whether other hosts read this store: only a configured signing key (one a fleet
    # can trust) publishes to a shared store; see compile_cache.signing.
    shared: bool

    @property
    @abstractmethod
    def disk(self) -> Path:
        """The local directory this store writes into (the read cache for S3)."""

    @property
    def read_cache(self) -> Store | None:
        """A local store holding copies of this store's entries, used when this store is
        unreachable and for builds of hosts that may not publish here; None if local."""
        return None

    @abstractmethod
    def list_keys(self) -> list[str]:
        """Keys of the published entries (records not yet validated)."""

    def incomplete_keys(self) -> list[str]:
        """Keys whose entry is present but has no record (never visible; quarantined by
        `verify`, swept by `sweep`)."""
        return []

    @abstractmethod
    def get_record(self, key: str) -> Record | None:
        """The published record of `key`, None if absent; EntryCorrupt if malformed."""

    @abstractmethod
    def last_used_times(self) -> dict[str, float]:
        """Epoch seconds of the last hit of every entry used since publication."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """Record a hit now, for least-recently-used pruning."""

    @abstractmethod
    def check(self, record: Record) -> None:
        """Hash every stored file of `record`; EntryCorrupt names the first bad one."""

    @abstractmethod
    def materialize(self, record: Record) -> Path:
        """A local folder holding exactly `record`'s files, each verified against its
        digest; EntryCorrupt (naming the file) if the store's copy is bad."""

    @abstractmethod
    def staging(self, key: str) -> AbstractContextManager[Path]:
        """A fresh local folder with an empty `files/` inside, for building or
        downloading `key`; removed on exit unless `publish` consumed it. A staging
        folder whose process died is removed by `sweep`."""

    @abstractmethod
    def publish(self, record: Record, staging: Path) -> tuple[Path, Record]:
        """Make `staging/files` visible as `record` atomically; return the local folder
        to load from and the record it holds (another process's entry of the same key
        if that published first)."""

    @abstractmethod
    def import_entry(self, record: Record, files: Path) -> bool:
        """Publish a copy of the verified folder `files` (from another store) under
        `record`; False if this store already had the key."""

    @abstractmethod
    def quarantine(self, key: str, record_id: str | None, problem: str) -> bool:
        """Move the entry aside if its current record still has `record_id` (None: a
        record that does not parse); False if it was already replaced or gone."""

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Delete the entry (record first, so it is never half-visible)."""

    @abstractmethod
    def lock(self, key: str) -> KeyLock:
        """The lock that makes one process compile `key` while others wait."""

    @abstractmethod
    def sweep(self, held_key: str | None = None) -> list[str]:
        """Remove leftovers of interrupted builds that no live process owns. With
        `held_key` (whose lock the caller holds) a store may limit itself to that key's
        leftovers and skip any grace period."""

    @abstractmethod
    def purge_quarantine(self) -> list[str]:
        """Delete quarantined entries (kept until then for inspection)."""

    @abstractmethod
    def child_url(self, name: str) -> str:
        """The URL or directory of a sibling area `name` inside this store (created
        for local stores), e.g. for neuronx-cc's own per-graph cache."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
