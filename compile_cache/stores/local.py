"""A store in a local (or shared-filesystem) directory.

Layout under the root:
    entries/<key>/entry.json   the record; present only once files/ is complete
    entries/<key>/files/...    the artifacts
    entries/<key>/last-used    its mtime is the last hit
    staging/<name>/, <name>.lock   builds and downloads in progress (flock = alive)
    quarantine/<key>.<id>.<n>/ entries that failed verification, with reason.txt
    locks/<key>.lock           per-key compile locks
    neuronx-cc/                neuronx-cc's own per-graph cache (see compiler_cache)
Publication is one rename of a complete staging folder into entries/, so an entry
folder without entry.json is never work in progress: it is swept (and moved aside when
a build needs its place). No fsync: a torn write after a power loss fails verification
and is rebuilt, never loaded. Every path below the root is reached without following
links (`compile_cache.safe_fs`), so a link planted in the store cannot redirect a write.
An entry others may write is handed to the loader as a private verified copy, made once
per entry content in this user's cache and reused (`stores.verified_copy`): no one can
swap a file between its check and its load.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from compile_cache import safe_fs
from compile_cache.digests import hash_stream
from compile_cache.errors import EntryCorrupt, UnsafePathError
from compile_cache.locks import FileLock
from compile_cache.manifest import check_key, is_key
from compile_cache.paths import join_inside, safe_relpath
from compile_cache.record import Record, check_files, parse_record
from compile_cache.settings import verified_copies_dir
from compile_cache.stores.base import Store
from compile_cache.stores.verified_copy import (
    others_can_change,
    store_copies,
    verified_copy,
)

RECORD = "entry.json"
FILES = "files"
LAST_USED = "last-used"


class LocalStore(Store):
    """Entries as folders; see the module docstring for the layout."""

    shared = False

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    @property
    def disk(self) -> Path:
        return self.root

    def files_path(self, key: str) -> Path:
        return self.root / "entries" / check_key(key) / FILES

    def _keys(self, complete: bool) -> list[str]:
        return sorted(
            n
            for n in safe_fs.listdir(self.root, ("entries",))
            if is_key(n) and safe_fs.is_file(self.root, ("entries", n, RECORD)) == complete
        )

    def list_keys(self) -> list[str]:
        return self._keys(complete=True)

    def incomplete_keys(self) -> list[str]:
        return self._keys(complete=False)

    def get_record(self, key: str) -> Record | None:
        try:
            data = safe_fs.read_bytes(self.root, ("entries", check_key(key), RECORD))
        except UnsafePathError as err:
            raise EntryCorrupt(key, f"unsafe entry: {err}") from err
        except IsADirectoryError as err:
            raise EntryCorrupt(key, f"{RECORD} is a directory") from err
        return None if data is None else parse_record(data, key)

    def last_used_times(self) -> dict[str, float]:
        times = {}
        for key in self.list_keys():
            try:
                found = safe_fs.lstat(self.root, ("entries", key, LAST_USED))
            except UnsafePathError:
                continue  # replaced by a link meanwhile: the next lookup quarantines it
            if found is not None and stat.S_ISREG(found.st_mode):
                times[key] = found.st_mtime
        return times

    def touch(self, key: str) -> None:
        try:
            safe_fs.touch(self.root, ("entries", check_key(key), LAST_USED))
        except (FileNotFoundError, UnsafePathError):
            pass  # removed or replaced concurrently: nothing left to keep warm
        except PermissionError:
            pass  # a read-only shared cache still serves; it just cannot track use

    def check(self, record: Record) -> None:
        try:
            with safe_fs.directory(self.root, ("entries", record.key, FILES)):
                pass
        except UnsafePathError as err:
            raise EntryCorrupt(record.key, f"unsafe entry: {err}") from err
        except FileNotFoundError as err:
            raise EntryCorrupt(record.key, "artifact folder is missing") from err
        check_files(self.files_path(record.key), record)

    def materialize(self, record: Record) -> Path:
        """The entry's files for the loader: checked in place where only this user can
        change them, else this user's verified copy (stores.verified_copy)."""
        parts = ("entries", record.key, FILES)
        try:
            shared = others_can_change(self.root, parts)
        except FileNotFoundError as err:
            raise EntryCorrupt(record.key, "artifact folder is missing") from err
        if not shared:
            self.check(record)
            return self.files_path(record.key)
        try:
            copies = store_copies(verified_copies_dir(), self.root)
            return verified_copy(self.files_path(record.key), record, copies, self.list_keys())
        except UnsafePathError as err:
            raise EntryCorrupt(record.key, f"unsafe file: {err}", err.path) from err
        except FileNotFoundError as err:
            raise EntryCorrupt(record.key, f"a file is missing ({err.filename})") from err

    @contextmanager
    def staging(self, key: str) -> Iterator[Path]:
        name = f"{check_key(key)}.{uuid.uuid4().hex}"
        alive = FileLock(self.root, ("staging", f"{name}.lock"))
        alive.try_acquire()  # a fresh name: nobody else can hold it
        try:
            with safe_fs.directory(self.root, ("staging", name, FILES), create=True):
                pass
            yield self.root / "staging" / name
        finally:
            safe_fs.remove(self.root, ("staging", name))
            safe_fs.remove(self.root, ("staging", f"{name}.lock"))
            alive.release()

    def write_artifact(self, staging: Path, rel: str, reader: BinaryIO) -> tuple[str, int]:
        """Stream `reader` into the new file `rel` of a staging folder (never through a
        link); return its sha256 and size."""
        parts = (FILES, *safe_relpath(rel).parts)
        with safe_fs.directory(staging, parts[:-1], create=True) as dfd:
            fd = safe_fs.open_file(
                dfd, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, staging.joinpath(*parts)
            )
        with os.fdopen(fd, "wb") as out:
            return hash_stream(reader, out)

    def _staging_name(self, staging: Path) -> str:
        if staging.parent != self.root / "staging":
            raise ValueError(f"{staging} is not a staging folder of {self.url}")
        return staging.name

    def publish(self, record: Record, staging: Path) -> tuple[Path, Record]:
        name = self._staging_name(staging)
        safe_fs.write_new(self.root, ("staging", name, RECORD), record.to_json())
        try:
            safe_fs.rename(self.root, ("staging", name), ("entries", record.key))
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            existing = self.get_record(record.key)
            if existing is not None:
                return self.materialize(existing), existing
            self._discard(record.key)  # a folder without a record holds nothing visible
            safe_fs.rename(self.root, ("staging", name), ("entries", record.key))
        return self.files_path(record.key), record

    def import_entry(self, record: Record, files: Path) -> bool:
        if self.get_record(record.key) is not None:
            return False
        with self.staging(record.key) as staging:
            for rel, expected in record.files.items():
                fd = os.open(join_inside(files, rel), os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as src:
                    digest, _ = self.write_artifact(staging, rel, src)
                if digest != expected.sha256:
                    raise EntryCorrupt(
                        record.key, f"file {rel} changed while being copied (digest mismatch)", rel
                    )
            self.publish(record, staging)
        return True

    def quarantine(self, key: str, record_id: str | None, problem: str) -> bool:
        if safe_fs.lstat(self.root, ("entries", check_key(key))) is None:
            return False
        try:
            current = self.get_record(key)
            current_id = current.id if current is not None else None
        except EntryCorrupt:
            current_id = None
        if current_id != record_id:
            return False
        name = f"{key}.{record_id or 'unreadable'}.{uuid.uuid4().hex[:8]}"
        try:
            safe_fs.rename(self.root, ("entries", key), ("quarantine", name))
        except FileNotFoundError:
            return False
        if safe_fs.is_dir(self.root, ("quarantine", name)):
            safe_fs.write_new(
                self.root,
                ("quarantine", name, "reason.txt"),
                f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {problem}\n".encode(),
            )
        else:  # a link or file in place of an entry folder: nothing worth inspecting
            safe_fs.remove(self.root, ("quarantine", name))
        return True

    def remove(self, key: str) -> bool:
        return self._discard(check_key(key), "removed")

    def _discard(self, key: str, why: str = "incomplete") -> bool:
        """Move entries/<key> out of sight in one rename, then delete it."""
        doomed = f"{key}.{why}.{uuid.uuid4().hex}"
        try:
            safe_fs.rename(self.root, ("entries", key), ("staging", doomed))
        except FileNotFoundError:
            return False
        safe_fs.remove(self.root, ("staging", doomed))
        return True

    def lock(self, key: str) -> FileLock:
        return FileLock(self.root, ("locks", f"{check_key(key)}.lock"))

    def sweep(self, held_key: str | None = None) -> list[str]:
        """Staging folders whose owner is gone (its flock is free) and entry folders
        without a record. Liveness comes from the lock, so `held_key` needs no special
        case here."""
        swept = []
        names = {n.removesuffix(".lock") for n in safe_fs.listdir(self.root, ("staging",))}
        for name in sorted(names):
            lock_parts = ("staging", f"{name}.lock")
            found = safe_fs.lstat(self.root, lock_parts)
            alive = FileLock(self.root, lock_parts)
            if found is not None and stat.S_ISREG(found.st_mode) and not alive.try_acquire():
                continue
            try:
                safe_fs.remove(self.root, ("staging", name))
                safe_fs.remove(self.root, lock_parts)
            finally:
                alive.release()
            swept.append(str(self.root / "staging" / name))
        for key in self.incomplete_keys():
            if self._discard(key):
                swept.append(str(self.root / "entries" / key))
        return swept

    def purge_quarantine(self) -> list[str]:
        purged = []
        for name in sorted(safe_fs.listdir(self.root, ("quarantine",))):
            safe_fs.remove(self.root, ("quarantine", name))
            purged.append(str(self.root / "quarantine" / name))
        return purged

    def child_url(self, name: str) -> str:
        with safe_fs.directory(self.root, (name,), create=True):
            pass
        return str(self.root / name)
