"""File operations inside a store that never follow a symbolic link.

Anyone who can write to a store can plant a link where the cache later creates, writes,
renames or deletes something (a lock file, a quarantine note, a last-used marker, a
staging or entry folder) and so make the cache write outside the store. Every path
inside a store is therefore opened one component at a time from the store's root with
O_NOFOLLOW (openat(2) through `dir_fd`), and final files are opened with O_NOFOLLOW as
well; a link found on the way raises UnsafePathError naming it. The store root itself
is the user's configuration and may be a link.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from compile_cache.errors import UnsafePathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def _link_error(path: Path) -> UnsafePathError:
    try:
        target = f" to {os.readlink(path)}"
    except OSError:
        target = ""
    return UnsafePathError(
        str(path),
        f"is a symbolic link{target} or not a directory; the "
        "compile cache never follows links inside its store (someone with "
        "write access to the store put it there): remove it",
    )


@contextmanager
def directory(root: Path, parts: Sequence[str] = (), *, create: bool = False) -> Iterator[int]:
    """A file descriptor of `root/parts...`, each component opened without following
    links (created when `create`); FileNotFoundError if a component is missing."""
    fd = (
        os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if not create
        else _open_root(root)
    )
    try:
        for i, part in enumerate(parts):
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                # Created concurrently: opened below like any other.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                child = _open_child_dir(fd, part, root.joinpath(*parts[: i + 1]))
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_error(root.joinpath(*parts[: i + 1])) from err
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _open_root(root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_child_dir(parent: int, name: str, path: Path) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _link_error(path) from err
        raise


def open_file(dir_fd: int, name: str, flags: int, path: Path, mode: int = 0o644) -> int:
    """os.open of `name` in `dir_fd` that refuses a link (UnsafePathError naming `path`)."""
    try:
        return os.open(name, flags | _FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _link_error(path) from err
        raise


def read_bytes(root: Path, parts: Sequence[str]) -> bytes | None:
    """The content of the regular file `root/parts...`, None if it does not exist."""
    try:
        with directory(root, parts[:-1]) as dfd:
            fd = open_file(dfd, parts[-1], os.O_RDONLY, root.joinpath(*parts))
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_new(root: Path, parts: Sequence[str], data: bytes) -> None:
    """Create `root/parts...` holding `data`, replacing whatever entry had that name (a
    planted link is removed, never followed)."""
    with directory(root, parts[:-1], create=True) as dfd:
        _unlink_quietly(dfd, parts[-1])
        fd = open_file(dfd, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, root.joinpath(*parts))
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def touch(root: Path, parts: Sequence[str]) -> None:
    """Set the mtime of the marker file `root/parts...` to now, creating it; a link or
    other non-regular file in its place is replaced by a regular file. The folder must
    exist (FileNotFoundError otherwise)."""
    path = root.joinpath(*parts)
    with directory(root, parts[:-1]) as dfd:
        try:
            fd = open_file(dfd, parts[-1], os.O_WRONLY | os.O_CREAT, path)
        except (UnsafePathError, IsADirectoryError):
            remove(root, parts)
            fd = open_file(dfd, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, path)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def lstat(root: Path, parts: Sequence[str]) -> os.stat_result | None:
    """lstat of `root/parts...` reached without following links; None if absent."""
    try:
        with directory(root, parts[:-1]) as dfd:
            return os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def is_dir(root: Path, parts: Sequence[str]) -> bool:
    """True for a real directory (not a link to one)."""
    st = lstat(root, parts)
    return st is not None and stat.S_ISDIR(st.st_mode)


def is_file(root: Path, parts: Sequence[str]) -> bool:
    """True for a real regular file (not a link to one)."""
    try:
        st = lstat(root, parts)
    except UnsafePathError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode)


def listdir(root: Path, parts: Sequence[str]) -> list[str]:
    """Names in the directory `root/parts...`; [] if it does not exist."""
    try:
        with directory(root, parts) as dfd:
            return os.listdir(dfd)
    except FileNotFoundError:
        return []


def rename(root: Path, src: Sequence[str], dst: Sequence[str]) -> None:
    """Rename `root/src...` to `root/dst...` (creating dst's folder) without following a
    link in either folder; the renamed item itself is moved as it is, never followed."""
    with directory(root, src[:-1]) as sfd, directory(root, dst[:-1], create=True) as dfd:
        os.rename(src[-1], dst[-1], src_dir_fd=sfd, dst_dir_fd=dfd)


def remove(root: Path, parts: Sequence[str]) -> bool:
    """Delete `root/parts...`: a folder with everything in it, or a file or link (a link
    is deleted, never its target). False if it did not exist."""
    try:
        with directory(root, parts[:-1]) as dfd:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                # rmtree with dir_fd walks by file descriptors and never follows links.
                shutil.rmtree(parts[-1], dir_fd=dfd, onerror=_gone_is_fine)
            else:
                os.unlink(parts[-1], dir_fd=dfd)
    except FileNotFoundError:
        return False
    return True


def _gone_is_fine(function: object, path: str, excinfo: tuple) -> None:
    """rmtree error handler: something removed concurrently is what we wanted."""
    if not issubclass(excinfo[0], FileNotFoundError):
        raise excinfo[1]


def _unlink_quietly(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(name, dir_fd=dfd, onerror=_gone_is_fine)


def tree_size(folder: Path) -> tuple[int, int, float]:
    """(regular files, bytes, newest mtime) under `folder`, links not followed; zeros if
    the folder is gone. Used to report the progress of a build."""
    files = size = 0
    newest = 0.0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
                newest = max(newest, st.st_mtime)
    return files, size, newest
