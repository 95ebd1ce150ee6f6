"""An entry's files as the loader will read them: checked where nobody else can change
them, else a private copy verified from the bytes copied.

The loader (NxDI, the reference backend) opens an entry's files again by path after the
store checked them. In a folder only this user (or root) can write, nothing can change
between the check and the load. In a store others can write (a shared filesystem, a
group-writable folder) another writer could swap a checked file for a forged one in
between: there the loader gets a copy in a new private folder, each file read once,
through no link, and hashed as it is copied, so what is loaded is what was verified.
The copy costs the entry's size in the temporary folder until the process exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from compile_cache import safe_fs
from compile_cache.digests import hash_stream
from compile_cache.errors import EntryCorrupt
from compile_cache.paths import safe_relpath
from compile_cache.record import Record

# Group- or other-writable: someone else may replace or rewrite what is below.
SHARED_BITS = stat.S_IWGRP | stat.S_IWOTH


def _foreign(info: os.stat_result, uid: int) -> bool:
    return info.st_uid not in (uid, 0) or bool(info.st_mode & SHARED_BITS)


def others_can_change(root: Path, parts: Sequence[str]) -> bool:
    """Whether a user other than this one (or root) could change a file below
    `root/parts...`: a folder on the way or below, or a file, that another user owns or
    that group or others may write. Links are not followed (a link below counts as
    foreign: it is refused when read anyway)."""
    uid = os.geteuid()
    chain = [root, *(root.joinpath(*parts[: i + 1]) for i in range(len(parts)))]
    if any(_foreign(os.lstat(path), uid) for path in chain):
        return True
    for folder, dirs, files in os.walk(chain[-1]):
        for name in [*dirs, *files]:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISLNK(info.st_mode) or _foreign(info, uid):
                return True
    return False


def verified_copy(source: Path, record: Record) -> Path:
    """The record's files copied from `source` into a new private folder, each hashed as
    it is copied; EntryCorrupt naming the first that differs from the record (the copy
    is then removed)."""
    target = Path(tempfile.mkdtemp(prefix=f"neuron-cache-{record.key[:16]}-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    try:
        for rel, expected in record.files.items():
            parts = safe_relpath(rel).parts
            with safe_fs.directory(source, parts[:-1]) as dfd:
                fd = safe_fs.open_file(dfd, parts[-1], os.O_RDONLY, source / rel)
            dest = target.joinpath(*parts)
            dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with os.fdopen(fd, "rb") as src, open(dest, "xb") as out:
                digest, size = hash_stream(src, out)
            if (digest, size) != (expected.sha256, expected.size):
                raise EntryCorrupt(
                    record.key,
                    f"file {rel} differs from its record ({size} bytes, sha256 "
                    f"{digest[:12]}...; expected {expected.size}, {expected.sha256[:12]}...)",
                    rel,
                )
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target
