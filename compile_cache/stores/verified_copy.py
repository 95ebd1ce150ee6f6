"""An entry's files as the loader will read them: checked where nobody else can change
them, else a private copy verified from the bytes copied, made once and reused.

The loader (NxDI, the reference backend) opens an entry's files again by path after the
store checked them. Where nobody but this user (or root) can change anything on the way
from `/` to the files, nothing can change between the check and the load
(`others_can_change`; a world-writable sticky folder such as /tmp counts as safe for a
child this user owns). In a store others can write (a shared filesystem, a
group-writable folder) another writer could swap a checked file for a forged one in
between: there the loader gets a private copy, each file read once through no link and
hashed as it is copied, so what is loaded is what was verified.

The copies live in this user's cache (`settings.verified_copies_dir`, a folder only this
user may change), one folder per store, named by the entry's key and its files' digests
(`<key>.<digest>`), so a copy serves every later start of the same entry after
`record.check_files` re-reads it (what a private store's in-place load costs), instead of
the entry's whole size written again each start (the pre-sharded weights of a 70B model
are ~140 GB). A file this user owns that nobody else may write is linked rather than
copied where the filesystem allows (its content can change only by this user; the
link's inode is checked to be the one read). Liveness is kernel flocks, released even
by SIGKILL (`locks.try_lock_file`): every process using a copy holds a shared lock on
`<name>.lock` until it exits, the one process creating it an exclusive lock on
`<name>.write`. Each materialisation sweeps the store's copies nobody holds whose entry
is gone from the store or was replaced, and partial copies of dead creators; a process
id would not do (PID namespaces of containers sharing the folder reuse ids).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import stat
import uuid
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import BinaryIO

from compile_cache import safe_fs
from compile_cache.digests import hash_stream
from compile_cache.errors import EntryCorrupt, StoreError
from compile_cache.locks import hold_lock_file, remove_lock, try_lock_file
from compile_cache.paths import safe_relpath
from compile_cache.record import Record, check_files

# Group- or other-writable: someone else may replace or rewrite what is below.
SHARED_BITS = stat.S_IWGRP | stat.S_IWOTH
PARTIAL = ".partial-"
# name -> the shared lock this process holds on a copy it uses, until it exits
_IN_USE: dict[Path, int] = {}


def _ours(info: os.stat_result, uid: int) -> bool:
    return info.st_uid in (uid, 0)


def _foreign(info: os.stat_result, uid: int) -> bool:
    return not _ours(info, uid) or bool(info.st_mode & SHARED_BITS)


def _lets_others_replace(folder: os.stat_result, child: os.stat_result, uid: int) -> bool:
    """Whether users other than this one could rename or replace `child` in `folder`:
    they own the folder or may write it, unless it is sticky and the child ours."""
    if not _ours(folder, uid):
        return True
    sticky_guard = bool(folder.st_mode & stat.S_ISVTX) and _ours(child, uid)
    return bool(folder.st_mode & SHARED_BITS) and not sticky_guard


def others_can_change(root: Path, parts: Sequence[str]) -> bool:
    """Whether a user other than this one (or root) could change a file below
    `root/parts...`: a folder from `/` down to it that lets them replace the next one
    (`_lets_others_replace`), or a folder or file at or below it that another user owns
    or that group or others may write. Below the (resolved) root, links are not
    followed (a link counts as foreign: it is refused when read anyway)."""
    uid = os.geteuid()
    target = root.resolve().joinpath(*parts)
    chain = [*reversed(target.parents), target]
    infos = [os.lstat(path) for path in chain]
    if any(stat.S_ISLNK(info.st_mode) or not _ours(info, uid) for info in infos):
        return True
    if any(_lets_others_replace(d, c, uid) for d, c in itertools.pairwise(infos)):
        return True
    if infos[-1].st_mode & SHARED_BITS:
        return True
    for folder, dirs, files in os.walk(target):
        for name in [*dirs, *files]:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISLNK(info.st_mode) or _foreign(info, uid):
                return True
    return False


def content_name(record: Record) -> str:
    """`<key>.<16 hex of the files' digests>`: one name per entry content."""
    body = "".join(f"{rel}\0{f.sha256}\0{f.size}\0" for rel, f in sorted(record.files.items()))
    return f"{record.key}.{hashlib.sha256(body.encode()).hexdigest()[:16]}"


def store_copies(copies: Path, store_root: Path) -> Path:
    """The folder of one store's copies under `copies`, which must be private."""
    copies.mkdir(mode=0o700, parents=True, exist_ok=True)
    if others_can_change(copies, ()):
        raise StoreError(
            f"the folder for verified copies of shared cache entries, {copies}, can be "
            f"changed by other users; make it this user's alone (chmod 700 on it and its "
            f"parents) or point XDG_CACHE_HOME elsewhere"
        )
    folder = copies / hashlib.sha256(str(store_root.resolve()).encode()).hexdigest()[:16]
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def verified_copy(source: Path, record: Record, folder: Path, live: Collection[str]) -> Path:
    """The record's files from `source` as a private copy in `folder` (store_copies): the
    one a previous start made, re-read and checked, else a new one hashed as it is made;
    EntryCorrupt naming the first file that differs from the record (the new copy is
    then removed). `live`: the store's entry keys (copies of other keys are swept)."""
    name = content_name(record)
    copy = folder / name
    writing = hold_lock_file(folder, (f"{name}.write",))
    try:
        if copy not in _IN_USE:
            _IN_USE[copy] = hold_lock_file(folder, (f"{name}.lock",), shared=True)
        _clear_partials(folder, name)
        if safe_fs.lstat(folder, (name,)) is not None:
            try:
                check_files(copy, record)
            except EntryCorrupt as err:
                _discard_damaged(folder, name, err)
        if safe_fs.lstat(folder, (name,)) is None:
            _copy_verified(source, record, folder, name)
    finally:
        remove_lock(folder, (f"{name}.write",), writing)
    sweep(folder, live, keep=name)
    return copy


def _discard_damaged(folder: Path, name: str, problem: EntryCorrupt) -> None:
    """Remove this user's copy `name` that no longer matches its record (the store's
    entry is not at fault), unless another process uses it: StoreError then."""
    copy = folder / name
    os.close(_IN_USE.pop(copy))
    alone = try_lock_file(folder, (f"{name}.lock",))
    if alone is None:
        _IN_USE[copy] = hold_lock_file(folder, (f"{name}.lock",), shared=True)
        raise StoreError(
            f"the verified copy {copy} no longer matches its entry ({problem}) and another "
            f"process uses it: stop that process and remove the folder"
        )
    safe_fs.remove(folder, (name,))
    os.close(alone)
    _IN_USE[copy] = hold_lock_file(folder, (f"{name}.lock",), shared=True)


def _clear_partials(folder: Path, name: str) -> None:
    """Partial copies of `name` left by a creator that died (the caller holds its
    `.write` lock, so no other creator is at work)."""
    for entry in safe_fs.listdir(folder, ()):
        if entry.startswith(f"{name}{PARTIAL}"):
            safe_fs.remove(folder, (entry,))


def _copy_verified(source: Path, record: Record, folder: Path, name: str) -> None:
    partial = f"{name}{PARTIAL}{uuid.uuid4().hex}"
    with safe_fs.directory(folder) as fd:
        os.mkdir(partial, 0o700, dir_fd=fd)
    try:
        for rel, expected in record.files.items():
            parts = safe_relpath(rel).parts
            with (
                safe_fs.directory(source, parts[:-1]) as sfd,
                safe_fs.directory(folder, (partial, *parts[:-1]), create=True) as dfd,
            ):
                fd = safe_fs.open_file(sfd, parts[-1], os.O_RDONLY, source / rel)
                with os.fdopen(fd, "rb") as src:
                    digest, size = _place(src, sfd, dfd, parts[-1], folder / partial / rel)
            if (digest, size) != (expected.sha256, expected.size):
                raise EntryCorrupt(
                    record.key,
                    f"file {rel} differs from its record ({size} bytes, sha256 "
                    f"{digest[:12]}...; expected {expected.size}, {expected.sha256[:12]}...)",
                    rel,
                )
        safe_fs.rename(folder, (partial,), (name,))
    except BaseException:
        safe_fs.remove(folder, (partial,))
        raise


def _place(src: BinaryIO, sfd: int, dfd: int, file: str, dest: Path) -> tuple[str, int]:
    """`file` of the source folder `sfd` into the folder `dfd`: linked where only this
    user can change its content and the link is the inode `src` reads, else copied;
    the sha256 and size of what `src` read."""
    held = os.fstat(src.fileno())
    uid = os.geteuid()
    if stat.S_ISREG(held.st_mode) and not _foreign(held, uid):
        try:
            os.link(file, file, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES):
                raise
        else:
            linked = os.stat(file, dir_fd=dfd, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) == (held.st_dev, held.st_ino):
                return hash_stream(src)
            os.unlink(file, dir_fd=dfd)  # swapped since it was opened: copy what was read
    out_fd = safe_fs.open_file(dfd, file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dest, 0o600)
    with os.fdopen(out_fd, "wb") as out:
        return hash_stream(src, out)


def sweep(folder: Path, live: Collection[str], keep: str) -> list[str]:
    """Copies in `folder` nobody uses whose entry is gone from the store (`live` keys)
    or replaced (another copy of its key is `keep`), with their partials and lock
    files; the names removed."""
    removed = []
    key = keep.split(".", 1)[0]
    names = {
        n.split(PARTIAL, 1)[0].removesuffix(".lock").removesuffix(".write")
        for n in safe_fs.listdir(folder, ())
    }
    for name in sorted(names - {keep}):
        name_key = name.split(".", 1)[0]
        if name_key in live and name_key != key:
            continue
        if _remove_unused(folder, name):
            removed.append(name)
    return removed


def _remove_unused(folder: Path, name: str) -> bool:
    users = try_lock_file(folder, (f"{name}.lock",))
    if users is None:
        return False
    writer = try_lock_file(folder, (f"{name}.write",))
    if writer is None:
        os.close(users)
        return False
    for entry in safe_fs.listdir(folder, ()):
        if entry == name or entry.startswith(f"{name}{PARTIAL}"):
            safe_fs.remove(folder, (entry,))
    remove_lock(folder, (f"{name}.write",), writer)
    remove_lock(folder, (f"{name}.lock",), users)
    return True
