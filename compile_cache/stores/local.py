"""A store in a local (or shared-filesystem) directory.

Layout under the root:
    entries/<key>/entry.json   the record; present only once files/ is complete
    entries/<key>/files/...    the artifacts
    entries/<key>/last-used    its mtime is the last hit
    staging/<name>/, <name>.lock   builds and downloads in progress (flock = alive)
    quarantine/<key>.<id>/     entries that failed verification, with reason.txt
    locks/<key>.lock           per-key compile locks
    neuronx-cc/                neuronx-cc's own per-graph cache (see compiler_cache)
Publication is one rename of a complete staging folder into entries/. No fsync: a torn
write after a power loss fails verification and is rebuilt, never loaded.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compile_cache.digests import copy_hashed
from compile_cache.errors import EntryCorrupt
from compile_cache.locks import FileLock
from compile_cache.manifest import check_key, is_key
from compile_cache.paths import join_inside
from compile_cache.record import Record, check_files, parse_record
from compile_cache.stores.base import Store

RECORD = "entry.json"
FILES = "files"
LAST_USED = "last-used"


class LocalStore(Store):
    """Entries as folders; see the module docstring for the layout."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _entry(self, key: str) -> Path:
        return self.root / "entries" / check_key(key)

    def files_path(self, key: str) -> Path:
        return self._entry(key) / FILES

    def list_keys(self) -> list[str]:
        try:
            names = os.listdir(self.root / "entries")
        except FileNotFoundError:
            return []
        return sorted(n for n in names
                      if is_key(n) and (self.root / "entries" / n / RECORD).is_file())

    def get_record(self, key: str) -> Record | None:
        try:
            data = (self._entry(key) / RECORD).read_bytes()
        except FileNotFoundError:
            return None
        return parse_record(data, key)

    def last_used_times(self) -> dict[str, float]:
        times = {}
        for key in self.list_keys():
            try:
                times[key] = (self._entry(key) / LAST_USED).stat().st_mtime
            except FileNotFoundError:
                pass  # never used since publication
        return times

    def touch(self, key: str) -> None:
        try:
            (self._entry(key) / LAST_USED).touch()
        except FileNotFoundError:
            pass  # removed concurrently: nothing left to keep warm
        except PermissionError:
            pass  # a read-only shared cache still serves; it just cannot track use

    def check(self, record: Record) -> None:
        check_files(self.files_path(record.key), record)

    def materialize(self, record: Record) -> Path:
        self.check(record)
        return self.files_path(record.key)

    @contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        name = f"{check_key(key)}.{uuid.uuid4().hex}"
        alive = FileLock(self.root / "staging" / f"{name}.lock")
        alive.try_acquire()  # a fresh name: nobody else can hold it
        folder = self.root / "staging" / name
        try:
            (folder / FILES).mkdir(parents=True)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            alive.path.unlink(missing_ok=True)
            alive.release()

    def publish(self, record: Record, staging: Path) -> Path:
        (staging / RECORD).write_bytes(record.to_json())
        target = self._entry(record.key)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, target)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            existing = self.get_record(record.key)
            if existing is None:
                raise
            return self.materialize(existing)
        return target / FILES

    def import_entry(self, record: Record, files: Path) -> bool:
        if self.get_record(record.key) is not None:
            return False
        with self.staging(record.key) as staging:
            for rel, expected in record.files.items():
                with join_inside(files, rel).open("rb") as src:
                    digest, _ = copy_hashed(src, join_inside(staging / FILES, rel))
                if digest != expected.sha256:
                    raise EntryCorrupt(record.key, f"file {rel} changed while being "
                                       "copied (digest mismatch)", rel)
            self.publish(record, staging)
        return True

    def quarantine(self, key: str, record_id: str | None, problem: str) -> bool:
        try:
            current = self.get_record(key)
            if current is None:
                return False
            current_id: str | None = current.id
        except EntryCorrupt:
            current_id = None
        if current_id != record_id:
            return False
        target = self.root / "quarantine" / f"{key}.{record_id or uuid.uuid4().hex}"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self._entry(key), target)
        except FileNotFoundError:
            return False
        (target / "reason.txt").write_text(
            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {problem}\n")
        return True

    def remove(self, key: str) -> bool:
        doomed = self.root / "staging" / f"{key}.removed.{uuid.uuid4().hex}"
        doomed.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self._entry(key), doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def lock(self, key: str) -> FileLock:
        return FileLock(self.root / "locks" / f"{check_key(key)}.lock")

    def sweep(self, held_key: str | None = None) -> list[str]:
        """Staging folders whose owner is gone (its flock is free). Liveness comes from
        the lock, so `held_key` needs no special case here."""
        staging = self.root / "staging"
        try:
            names = {n.removesuffix(".lock") for n in os.listdir(staging)}
        except FileNotFoundError:
            return []
        swept = []
        for name in sorted(names):
            alive = FileLock(staging / f"{name}.lock")
            if not alive.path.exists() or alive.try_acquire():
                shutil.rmtree(staging / name, ignore_errors=True)
                alive.path.unlink(missing_ok=True)
                alive.release()
                swept.append(str(staging / name))
        return swept

    def purge_quarantine(self) -> list[str]:
        folder = self.root / "quarantine"
        purged = sorted(str(p) for p in folder.iterdir()) if folder.is_dir() else []
        for path in purged:
            shutil.rmtree(path, ignore_errors=True)
        return purged

    def child_url(self, name: str) -> str:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
