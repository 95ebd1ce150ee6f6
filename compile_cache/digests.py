"""File digests and the scan of an artifact folder.

Entries hold regular files and directories only: a link (even one that stays inside)
is refused, so entries mirror unchanged to S3, which has no links, and a tampered entry
cannot redirect a read outside itself.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from compile_cache.errors import UnsafePathError

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a regular file, refusing to follow a link at the last component."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_files(paths: Mapping[str, Path]) -> dict[str, str]:
    """Digests of many files, hashed on a few threads (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return dict(zip(paths, pool.map(sha256_file, paths.values()), strict=True))


def scan_tree(root: Path) -> dict[str, Path]:
    """Every regular file under `root` by its relative POSIX path; raises
    UnsafePathError naming the first link or special file found."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise UnsafePathError(
                    rel,
                    f"is a symbolic link to {os.readlink(path)} (entries hold regular files only)",
                )
            if stat.S_ISREG(mode):
                found[rel] = path
            elif not stat.S_ISDIR(mode):
                raise UnsafePathError(rel, "is not a regular file or directory")
    return dict(sorted(found.items()))


def hash_stream(reader: BinaryIO, out: BinaryIO | None = None) -> tuple[str, int]:
    """sha256 and size of everything `reader` yields, copied to `out` if given."""
    digest = hashlib.sha256()
    size = 0
    while chunk := reader.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if out is not None:
            out.write(chunk)
    return digest.hexdigest(), size
