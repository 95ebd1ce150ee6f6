"""Validation of paths recorded inside entries.

Entry records come from a store anyone with write access could tamper with, and their
paths are joined onto local folders when files are verified or downloaded, so a path
that could leave the entry is refused before it is ever joined.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from compile_cache.errors import UnsafePathError


def safe_relpath(rel: str) -> PurePosixPath:
    """`rel` as a relative POSIX path with no `..`, `.`, empty, absolute or backslash
    components; raises UnsafePathError otherwise."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(str(rel), "is empty or not a string")
    if rel.startswith("/"):
        raise UnsafePathError(rel, "is absolute")
    if "\\" in rel or "\0" in rel:
        raise UnsafePathError(rel, "contains a backslash or NUL")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise UnsafePathError(rel, "has an empty, '.' or '..' component")
    return PurePosixPath(rel)


def join_inside(root: Path, rel: str) -> Path:
    """`root/rel` after validating `rel` (links are checked where files are read)."""
    return root.joinpath(*safe_relpath(rel).parts)
