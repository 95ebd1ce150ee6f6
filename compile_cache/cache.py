"""The compile cache: verified lookups, one build per key, atomic publication.

`get_or_build` is the whole protocol: look up (verifying every file), on a miss take the
key's lock (a file lock on one host, an S3 lease across hosts), look again because
another process may have finished meanwhile, quarantine what failed verification, sweep
leftovers of dead builds, build into an empty staging folder, hash every file into a
record, and publish atomically. An interrupted build leaves only a staging folder that
no lookup ever reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compile_cache.errors import EntryCorrupt, UnknownKey
from compile_cache.explain import miss_reason, nearest
from compile_cache.locks import acquire
from compile_cache.manifest import cache_key, check_key, is_key
from compile_cache.pruning import plan_prune
from compile_cache.record import Record, new_record
from compile_cache.stores import Store, open_store
from compile_cache.stores.local import FILES

logger = logging.getLogger("compile_cache")

Log = Callable[[str], None]


@dataclass(frozen=True)
class Entry:
    """A verified entry: `path` is a local folder holding exactly the recorded files."""

    key: str
    path: Path
    record: Record


@dataclass(frozen=True)
class CacheResult:
    """What `get_or_build` returns; `reason` is one log-ready line ("hit", or "miss: ...")."""

    path: Path
    key: str
    hit: bool
    reason: str


@dataclass(frozen=True)
class EntryInfo:
    """One entry as listed: its record and when it was last used."""

    record: Record
    last_used: float

    @property
    def key(self) -> str:
        return self.record.key

    @property
    def size(self) -> int:
        return self.record.size

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {"key": r.key, "size": r.size, "files": len(r.files), "created": r.created,
                "last_used": self.last_used, "created_by": r.created_by,
                "build_seconds": r.build_seconds, "manifest": r.manifest}


@dataclass(frozen=True)
class VerifyResult:
    key: str
    ok: bool
    problem: str | None = None
    quarantined: bool = False


@dataclass(frozen=True)
class PruneReport:
    removed: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept_bytes: int = 0
    swept: list[str] = field(default_factory=list)
    purged_quarantine: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Found:
    entry: Entry | None = None
    record: Record | None = None
    problem: EntryCorrupt | None = None


class _Say:
    """Routes messages to a caller's callable, or to the `compile_cache` logger."""

    def __init__(self, log: Log | None):
        self.info = logger.info if log is None else log
        self.warning = logger.warning if log is None else log


class CompileCache:
    """Lookups, builds and housekeeping over one store."""

    def __init__(self, store: Store | None = None, *, log: Log | None = None):
        self.store = store if store is not None else open_store()
        self._log = log

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, manifest: Mapping[str, Any]) -> Entry | None:
        """The verified entry of `manifest`, or None. An entry that fails verification
        is quarantined (never returned) so the next build replaces it."""
        key = cache_key(manifest)
        found = self._find(key)
        if found.problem is not None:
            self._quarantine(key, found.record, found.problem, _Say(self._log))
        return found.entry

    def _find(self, key: str) -> _Found:
        try:
            record = self.store.get_record(key)
        except EntryCorrupt as err:
            return _Found(problem=err)
        if record is None:
            return _Found()
        try:
            path = self.store.materialize(record)
        except EntryCorrupt as err:
            return _Found(record=record, problem=err)
        self.store.touch(key)
        return _Found(entry=Entry(key, path, record), record=record)

    def _quarantine(self, key: str, record: Record | None, problem: EntryCorrupt,
                    say: _Say) -> None:
        moved = self.store.quarantine(key, record.id if record else None, problem.problem)
        say.warning(f"compile cache: entry {key} in {self.store.url} failed verification: "
                    f"{problem.problem}; "
                    + ("moved it to quarantine, it will be rebuilt" if moved
                       else "it was already replaced or removed"))

    def get_or_build(self, manifest: Mapping[str, Any], build: Callable[[Path], None], *,
                     wait_timeout: float = 7200.0, log: Log | None = None) -> CacheResult:
        """A local verified folder of `manifest`'s artifacts, calling `build(folder)` to
        write them into an empty folder only if no process has built them yet. At most
        one process per key builds at a time; the others wait up to `wait_timeout`
        seconds (LockTimeout after) and then load what it published."""
        say = _Say(self._log if log is None else log)
        key = cache_key(manifest)
        found = self._find(key)
        if found.entry is not None:
            return CacheResult(found.entry.path, key, True, "hit")
        lock = self.store.lock(key)
        waited = acquire(lock, what=f"compile-cache key {key} in {self.store.url}",
                         timeout=wait_timeout, on_wait=say.info)
        try:
            found = self._find(key)
            if found.entry is not None:
                return CacheResult(found.entry.path, key, True,
                                   f"hit: built by another process while this one waited "
                                   f"{waited:.0f} s")
            if found.problem is not None:
                self._quarantine(key, found.record, found.problem, say)
                reason = f"miss: entry {key} quarantined: {found.problem.problem}"
            else:
                reason = "miss: " + miss_reason(key, self.store.url,
                                                 nearest(manifest, self._manifests()))
            for leftover in self.store.sweep(held_key=key):
                say.info(f"compile cache: removed leftover of an interrupted build: {leftover}")
            path = self._build(dict(manifest), key, build, say)
            return CacheResult(path, key, False, reason)
        finally:
            lock.release()

    def _build(self, manifest: dict[str, Any], key: str, build: Callable[[Path], None],
               say: _Say) -> Path:
        with self.store.staging(key) as staging:
            started = time.monotonic()
            try:
                build(staging / FILES)
            except BaseException:
                say.warning(f"compile cache: build of {key} failed; nothing was published")
                raise
            record = new_record(manifest, staging / FILES,
                                build_seconds=round(time.monotonic() - started, 3))
            path = self.store.publish(record, staging)
        self.store.touch(key)
        say.info(f"compile cache: published {key} ({len(record.files)} files, "
                 f"{record.size} bytes) in {self.store.url}")
        return path

    def _manifests(self) -> list[tuple[str, dict[str, Any]]]:
        return [(info.key, info.record.manifest) for info in self.list_entries()]

    def explain(self, manifest: Mapping[str, Any], limit: int = 3) -> dict[str, Any]:
        """Whether `manifest` has an entry (its record, not its file contents: use
        `verify` for those) and, if not, the nearest entries and the fields that differ."""
        key = cache_key(manifest)
        result: dict[str, Any] = {"key": key, "store": self.store.url, "hit": False,
                                  "problem": None, "entry": None, "nearest": []}
        try:
            record = self.store.get_record(key)
        except EntryCorrupt as err:
            record, result["problem"] = None, err.problem
        if record is not None:
            result.update(hit=True, entry=EntryInfo(record, record.created).to_dict())
            return result
        ranked = nearest(manifest, self._manifests(), limit)
        result["reason"] = miss_reason(key, self.store.url, ranked)
        result["nearest"] = [{"key": k, "differs": d} for k, d in ranked]
        return result

    # -- housekeeping -----------------------------------------------------------------
    def touch(self, key: str) -> None:
        """Mark `key` as used now (lookups do this on every hit)."""
        self.store.touch(check_key(key))

    def list_entries(self) -> list[EntryInfo]:
        """Every entry whose record parses (files not verified), oldest use first."""
        used = self.store.last_used_times()
        infos = []
        for key in self.store.list_keys():
            try:
                record = self.store.get_record(key)
            except EntryCorrupt as err:
                logger.warning("compile cache: skipping entry %s: %s", key, err.problem)
                continue
            if record is not None:
                infos.append(EntryInfo(record, used.get(key, record.created)))
        return sorted(infos, key=lambda i: (i.last_used, i.key))

    def entry_info(self, key: str) -> EntryInfo:
        """The listing of one entry; UnknownKey if absent."""
        record = self.store.get_record(self.resolve_key(key))
        if record is None:
            raise UnknownKey(f"no entry {key} in {self.store.url}")
        return EntryInfo(record, self.store.last_used_times().get(record.key, record.created))

    def resolve_key(self, prefix: str) -> str:
        """The one key starting with `prefix` (keys are long to type)."""
        if is_key(prefix):
            return prefix
        matches = [k for k in self.store.list_keys() if prefix and k.startswith(prefix)]
        if len(matches) != 1:
            raise UnknownKey(f"{prefix!r} matches {len(matches)} entries in {self.store.url}; "
                             "give more of the key (see `neuron-cache ls`)")
        return matches[0]

    def verify(self, keys: list[str] | None = None) -> list[VerifyResult]:
        """Hash every file of every entry (or of `keys`); quarantine failures."""
        results = []
        for key in keys if keys is not None else self.store.list_keys():
            record = None
            try:
                record = self.store.get_record(check_key(key))
                if record is None:
                    results.append(VerifyResult(key, False, "no such entry"))
                    continue
                self.store.check(record)
                results.append(VerifyResult(key, True))
            except EntryCorrupt as err:
                moved = self.store.quarantine(key, record.id if record else None,
                                              err.problem)
                results.append(VerifyResult(key, False, err.problem, moved))
        return results

    def prune(self, max_size_bytes: int | None = None, max_age_seconds: float | None = None,
              *, dry_run: bool = False) -> PruneReport:
        """Remove entries unused for `max_age_seconds`, then least recently used ones
        until the store fits `max_size_bytes`; also sweep leftovers of dead builds and
        delete quarantined entries. `dry_run` only reports the entries."""
        infos = self.list_entries()
        doomed = set(plan_prune(infos, max_size_bytes=max_size_bytes,
                                max_age_seconds=max_age_seconds, now=time.time()))
        freed = sum(i.size for i in infos if i.key in doomed)
        kept = sum(i.size for i in infos) - freed
        if dry_run:
            return PruneReport(sorted(doomed), freed, kept)
        for key in sorted(doomed):
            self.store.remove(key)
        return PruneReport(sorted(doomed), freed, kept, self.store.sweep(),
                           self.store.purge_quarantine())

    def remove(self, key: str) -> bool:
        """Delete one entry; False if it did not exist."""
        return self.store.remove(check_key(key))
