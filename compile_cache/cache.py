"""The compile cache: verified lookups, one build per key, atomic publication.

`get_or_build` is the whole protocol: look up (checking the record's signature against
the trusted keys, then every file against the record), on a miss take the key's lock (a
file lock on one host, an S3 lease across hosts), look again because another process may
have finished meanwhile, quarantine what failed verification, sweep leftovers of dead
builds, build into an empty staging folder, hash every file into a record, sign it, and
publish atomically. An interrupted build leaves only a staging folder that no lookup
ever reads. A host that may not publish to a shared store (no configured signing key)
builds into its read cache instead; when S3 is unreachable the read cache serves what
it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compile_cache.disk_space import is_out_of_space, out_of_space
from compile_cache.errors import EntryCorrupt, EntryUntrusted, StoreUnreachable, UnknownKey
from compile_cache.explain import miss_reason, nearest
from compile_cache.locks import KeyLock, acquire
from compile_cache.manifest import cache_key, check_key, is_key
from compile_cache.pruning import plan_prune
from compile_cache.record import Record, new_record
from compile_cache.safe_fs import tree_size
from compile_cache.settings import ON_UNTRUSTED_ENV, SIGNING_KEY_ENV
from compile_cache.signing import Trust
from compile_cache.stores import Store, open_store
from compile_cache.stores.local import FILES

logger = logging.getLogger("compile_cache")

# Where messages go: a callable taking one line, or a logger (info and warning levels).
Log = Callable[[str], None] | logging.Logger


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
    # False when the entry is only in this host's read cache (not published to, or not
    # found in, the configured store).
    in_store: bool = True


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
        return {
            "key": r.key,
            "size": r.size,
            "files": len(r.files),
            "created": r.created,
            "last_used": self.last_used,
            "created_by": r.created_by,
            "build_seconds": r.build_seconds,
            "manifest": r.manifest,
            "signed_by": r.signature.key_id if r.signature else None,
        }


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
    """Routes messages to a caller's callable or logger, or to the `compile_cache`
    logger."""

    def __init__(self, log: Log | None):
        target = logger if log is None else log
        self.info: Callable[[str], None]
        self.warning: Callable[[str], None]
        if isinstance(target, logging.Logger):
            self.info, self.warning = target.info, target.warning
        else:
            self.info = self.warning = target


class CompileCache:
    """Lookups, builds and housekeeping over one store. `trust` (default: from the
    environment, see compile_cache.signing) decides which entries are loaded and signs
    what this process publishes."""

    def __init__(
        self, store: Store | None = None, *, log: Log | None = None, trust: Trust | None = None
    ):
        self.store = store if store is not None else open_store()
        self.trust = trust if trust is not None else Trust.from_env()
        self._log = log

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, manifest: Mapping[str, Any]) -> Entry | None:
        """The verified entry of `manifest`, or None. An entry that fails verification
        is quarantined (never returned) so the next build replaces it."""
        key = cache_key(manifest)
        found = self._find(self.store, key)
        if found.problem is not None:
            self._refuse(self.store, key, found.record, found.problem, _Say(self._log))
        return found.entry

    def _find(self, store: Store, key: str) -> _Found:
        """The entry of `key` in `store` if it is trusted and every file verifies."""
        try:
            record = store.get_record(key)
        except EntryCorrupt as err:
            return _Found(problem=err)
        if record is None:
            return _Found()
        try:
            self.trust.check(record)
            path = self._materialize(store, record)
        except EntryCorrupt as err:
            return _Found(record=record, problem=err)
        store.touch(key)
        return _Found(entry=Entry(key, path, record), record=record)

    @staticmethod
    def _materialize(store: Store, record: Record) -> Path:
        try:
            return store.materialize(record)
        except OSError as err:
            if is_out_of_space(err):
                raise out_of_space(
                    store.disk,
                    f"copying entry {record.key} from {store.url}",
                    f"it needs {record.size} bytes",
                ) from err
            raise

    def _may_publish(self, store: Store) -> bool:
        """Hosts sign what they publish; a shared store only takes a configured key."""
        return not store.shared or self.trust.publishes_to_shared_stores

    def _target(self) -> Store:
        """Where this host's builds go: the store, or the read cache of a shared store
        this host may not publish to."""
        if self._may_publish(self.store) or self.store.read_cache is None:
            return self.store
        return self.store.read_cache

    def _refuse(
        self, store: Store, key: str, record: Record | None, problem: EntryCorrupt, say: _Say
    ) -> bool:
        """Log why the entry of `key` is not used and quarantine it, unless it is only
        untrusted and this host could not publish a replacement (so a misconfigured
        host never moves a fleet's entries aside). True if it was moved."""
        if isinstance(problem, EntryUntrusted) and not self._may_publish(store):
            say.warning(
                f"compile cache: refusing entry {key} in {store.url}: "
                f"{problem.problem}; it stays there ({SIGNING_KEY_ENV} is not set, "
                "so this host does not replace entries of a shared store)"
            )
            return False
        moved = store.quarantine(key, record.id if record else None, problem.problem)
        say.warning(
            f"compile cache: entry {key} in {store.url} failed verification: "
            f"{problem.problem}; "
            + (
                "moved it to quarantine, it will be rebuilt"
                if moved
                else "it was already replaced or removed"
            )
        )
        return moved

    def _check_policy(self, key: str, found: _Found) -> None:
        if isinstance(found.problem, EntryUntrusted) and self.trust.on_untrusted == "fail":
            raise EntryUntrusted(
                key,
                f"{found.problem.problem}. Refusing to build or load "
                f"it because {ON_UNTRUSTED_ENV}=fail: remove the entry "
                f"(neuron-cache rm {key} --store {self.store.url}) or set "
                f"{ON_UNTRUSTED_ENV}=rebuild to compile instead",
            )

    def get_or_build(
        self,
        manifest: Mapping[str, Any],
        build: Callable[[Path], None],
        *,
        wait_timeout: float = 7200.0,
        log: Log | None = None,
    ) -> CacheResult:
        """A local verified folder of `manifest`'s artifacts, calling `build(folder)` to
        write them into an empty folder only if no process has built them yet. At most
        one process per key builds at a time; the others wait up to `wait_timeout`
        seconds (LockTimeout after) and then load what it published. If the store is
        unreachable, a trusted copy in its read cache is used; otherwise
        StoreUnreachable says so in one line."""
        say = _Say(self._log if log is None else log)
        key = cache_key(manifest)
        try:
            return self._get_or_build(manifest, key, build, wait_timeout, say)
        except StoreUnreachable as err:
            return self._from_read_cache(key, err, say)

    def _from_read_cache(self, key: str, err: StoreUnreachable, say: _Say) -> CacheResult:
        cache = self.store.read_cache
        if cache is None:
            raise err
        found = self._find(cache, key)
        if found.entry is None:
            raise StoreUnreachable(
                f"{err}; the read cache {cache.url} holds no usable entry {key} either: "
                f"retry when the store is reachable, or pre-warm hosts with "
                f"`neuron-cache pull {self.store.url}` while it is"
            ) from err
        say.warning(f"compile cache: {err}; using entry {key} from the read cache {cache.url}")
        return CacheResult(
            found.entry.path,
            key,
            True,
            f"hit: from the read cache {cache.url} ({self.store.url} unreachable)",
            in_store=False,
        )

    def _get_or_build(
        self,
        manifest: Mapping[str, Any],
        key: str,
        build: Callable[[Path], None],
        wait_timeout: float,
        say: _Say,
    ) -> CacheResult:
        found = self._find(self.store, key)
        if found.entry is not None:
            return CacheResult(found.entry.path, key, True, "hit")
        self._check_policy(key, found)
        target = self._target()
        if target is not self.store and (own := self._find(target, key)).entry is not None:
            return CacheResult(
                own.entry.path,
                key,
                True,
                f"hit: built earlier by this host, in its read cache {target.url}",
                in_store=False,
            )
        lock = target.lock(key)
        waited = acquire(
            lock,
            what=f"compile-cache key {key} in {target.url}",
            timeout=wait_timeout,
            on_wait=say.info,
        )
        try:
            found = self._find(self.store, key)
            if found.entry is not None:
                return CacheResult(
                    found.entry.path,
                    key,
                    True,
                    f"hit: built by another process while this one waited {waited:.0f} s",
                )
            if target is not self.store:
                own = self._find(target, key)
                if own.entry is not None:
                    return CacheResult(
                        own.entry.path,
                        key,
                        True,
                        f"hit: built by another process of this host while "
                        f"this one waited {waited:.0f} s",
                        in_store=False,
                    )
                if own.problem is not None:
                    self._refuse(target, key, own.record, own.problem, say)
            if found.problem is not None:
                self._check_policy(key, found)
                moved = self._refuse(self.store, key, found.record, found.problem, say)
                reason = (
                    f"miss: entry {key} {'quarantined' if moved else 'refused'}: "
                    f"{found.problem.problem}"
                )
            else:
                reason = "miss: " + miss_reason(
                    key, self.store.url, nearest(manifest, self._manifests())
                )
            if target is not self.store:
                reason += (
                    f"; building into this host's read cache {target.url} only "
                    f"({SIGNING_KEY_ENV} is not set, so this host does not publish "
                    f"to {self.store.url})"
                )
            for leftover in target.sweep(held_key=key):
                say.info(f"compile cache: removed leftover of an interrupted build: {leftover}")
            path = self._build(target, lock, dict(manifest), key, build, say)
            return CacheResult(path, key, False, reason, in_store=target is self.store)
        finally:
            lock.release()

    def _build(
        self,
        target: Store,
        lock: KeyLock,
        manifest: dict[str, Any],
        key: str,
        build: Callable[[Path], None],
        say: _Say,
    ) -> Path:
        with target.staging(key) as staging:
            lock.building(staging / FILES)
            started = time.monotonic()
            try:
                build(staging / FILES)
                record = self.trust.sign(
                    new_record(
                        manifest,
                        staging / FILES,
                        build_seconds=round(time.monotonic() - started, 3),
                    )
                )
                path, served = target.publish(record, staging)
            except BaseException as err:
                say.warning(f"compile cache: build of {key} failed; nothing was published")
                if is_out_of_space(err):
                    written = tree_size(staging)[1]
                    raise out_of_space(
                        target.disk,
                        f"building entry {key}",
                        f"the build had written {written} bytes when the "
                        "disk filled up, so it needs more than that",
                    ) from err
                raise
        if served.id != record.id:
            self.trust.check(served)  # another process published first: its entry is used
        target.touch(key)
        say.info(
            f"compile cache: published {key} ({len(record.files)} files, "
            f"{record.size} bytes) in {target.url}"
        )
        return path

    def _manifests(self) -> list[tuple[str, dict[str, Any]]]:
        return [(info.key, info.record.manifest) for info in self.list_entries()]

    def explain(self, manifest: Mapping[str, Any], limit: int = 3) -> dict[str, Any]:
        """Whether `manifest` has an entry (its record, not its file contents: use
        `verify` for those) and, if not, the nearest entries and the fields that differ."""
        key = cache_key(manifest)
        result: dict[str, Any] = {
            "key": key,
            "store": self.store.url,
            "hit": False,
            "problem": None,
            "entry": None,
            "nearest": [],
        }
        try:
            record = self.store.get_record(key)
            if record is not None:
                self.trust.check(record)
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
            raise UnknownKey(
                f"{prefix!r} matches {len(matches)} entries in {self.store.url}; "
                "give more of the key (see `neuron-cache ls`)"
            )
        return matches[0]

    def verify(self, keys: list[str] | None = None) -> list[VerifyResult]:
        """Check the signature and hash every file of every entry (or of `keys`);
        quarantine failures (untrusted entries of a shared store only on hosts that may
        publish there) and entry folders without a record."""
        incomplete = set(self.store.incomplete_keys())
        results = []
        for key in keys if keys is not None else sorted(set(self.store.list_keys()) | incomplete):
            record = None
            try:
                record = self.store.get_record(check_key(key))
                if record is None:
                    results.append(self._verify_missing(key, key in incomplete))
                    continue
                self.trust.check(record)
                self.store.check(record)
                results.append(VerifyResult(key, True))
            except EntryCorrupt as err:
                moved = (
                    not isinstance(err, EntryUntrusted) or self._may_publish(self.store)
                ) and self.store.quarantine(key, record.id if record else None, err.problem)
                results.append(VerifyResult(key, False, err.problem, moved))
        return results

    def _verify_missing(self, key: str, incomplete: bool) -> VerifyResult:
        if not incomplete:
            return VerifyResult(key, False, "no such entry")
        problem = (
            "entry folder without a record: left by an interrupted or tampered write, never loaded"
        )
        return VerifyResult(key, False, problem, self.store.quarantine(key, None, problem))

    def prune(
        self,
        max_size_bytes: int | None = None,
        max_age_seconds: float | None = None,
        *,
        dry_run: bool = False,
    ) -> PruneReport:
        """Remove entries unused for `max_age_seconds`, then least recently used ones
        until the store fits `max_size_bytes`; also sweep leftovers of dead builds and
        delete quarantined entries. `dry_run` only reports the entries."""
        infos = self.list_entries()
        doomed = set(
            plan_prune(
                infos,
                max_size_bytes=max_size_bytes,
                max_age_seconds=max_age_seconds,
                now=time.time(),
            )
        )
        freed = sum(i.size for i in infos if i.key in doomed)
        kept = sum(i.size for i in infos) - freed
        if dry_run:
            return PruneReport(sorted(doomed), freed, kept)
        for key in sorted(doomed):
            self.store.remove(key)
        return PruneReport(
            sorted(doomed), freed, kept, self.store.sweep(), self.store.purge_quarantine()
        )

    def remove(self, key: str) -> bool:
        """Delete one entry; False if it did not exist."""
        return self.store.remove(check_key(key))
