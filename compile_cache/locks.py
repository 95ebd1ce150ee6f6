"""Per-key mutual exclusion: the waiting loop shared by all lock kinds, the file lock
that serialises compiles on one host, and `try_lock_file`, the flock by which a folder's
owner shows it is alive (a sweep removes what no live process holds).

flock(2) locks are released by the kernel when their holder dies, even by SIGKILL, so a
crashed compile never leaves a stale local lock. Lock files are never deleted: deleting
one while another process has it open would let two processes hold "the" lock (except
through `try_lock_file`, whose holders re-check that the name still is their file). They are
opened without following links (a planted link is an error naming it, never a write
elsewhere). The holder writes who it is, since when, and which folder it is building
into the file, so a waiter can say who it waits for and how far that build has got.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from compile_cache.errors import LockTimeout, UnsafePathError
from compile_cache.paths import safe_relpath
from compile_cache.record import owner_label
from compile_cache.safe_fs import directory, is_dir, open_file, read_bytes, remove, tree_size
from compile_cache.units import format_size

REPORT_EVERY = 30.0


class KeyLock(Protocol):
    """What `acquire` needs from a lock: a non-blocking attempt and a description of
    the current holder for progress lines and timeout messages."""

    poll_interval: float

    def try_acquire(self) -> bool: ...

    def building(self, folder: Path) -> None:
        """Tell waiters that the holder now writes its artifacts into `folder`."""

    def holder(self) -> str: ...

    def release(self) -> None: ...


def acquire(lock: KeyLock, *, what: str, timeout: float, on_wait: Callable[[str], None]) -> float:
    """Block until `lock` is held; return the seconds waited. Reports progress through
    `on_wait` when waiting starts and every REPORT_EVERY seconds; raises LockTimeout
    after `timeout` seconds."""
    started = time.monotonic()
    next_report = started
    while not lock.try_acquire():
        now = time.monotonic()
        waited = now - started
        if waited >= timeout:
            raise LockTimeout(
                f"timed out after {waited:.0f} s waiting for {what}, held by "
                f"{lock.holder()}. Another process is still compiling this configuration "
                "(or is hung): wait longer (get_or_build(wait_timeout=...)), stop that "
                "process, or point VLLM_NEURON_CACHE_URL at another store"
            )
        if now >= next_report:
            on_wait(
                f"waiting for {what}: being compiled by {lock.holder()} "
                f"(waited {waited:.0f} s, timeout {timeout:.0f} s)"
            )
            next_report = now + REPORT_EVERY
        time.sleep(min(lock.poll_interval, max(timeout - waited, 0.0)))
    return time.monotonic() - started


def progress_text(files: int, size: int) -> str:
    """'3 files (1.2M) written so far' for waiting lines."""
    if not files:
        return "no artifact written yet"
    return f"{files} file{'s' if files != 1 else ''} ({format_size(size)}) written so far"


def since_text(epoch: float) -> str:
    """'since 14:02:11' in this host's local time."""
    return f"since {time.strftime('%H:%M:%S', time.localtime(epoch))}"


class FileLock:
    """An exclusive flock on the file `root/parts...`; the holder writes its host:pid,
    the time it took the lock and the folder it builds into."""

    poll_interval = 0.1

    def __init__(self, root: Path, parts: tuple[str, ...]):
        self.root = root
        self.parts = parts
        self.path = root.joinpath(*parts)
        self._fd: int | None = None
        self._since = 0.0

    def try_acquire(self) -> bool:
        with directory(self.root, self.parts[:-1], create=True) as dfd:
            fd = open_file(dfd, self.parts[-1], os.O_RDWR | os.O_CREAT, self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        self._since = time.time()
        self._describe({})
        return True

    def _describe(self, extra: dict[str, str]) -> None:
        if self._fd is None:
            return  # only the holder describes the lock
        info = {"owner": owner_label(), "since": self._since, **extra}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(info).encode(), 0)

    def building(self, folder: Path) -> None:
        self._describe({"building": folder.relative_to(self.root).as_posix()})

    def holder(self) -> str:
        try:
            info = json.loads(read_bytes(self.root, self.parts) or b"")
            text = f"{info['owner']} ({since_text(info['since'])}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"
        progress = self._progress(info.get("building"))
        return text + (f"; {progress}" if progress else "") + ")"

    def _progress(self, building: object) -> str | None:
        """How much the holder's build has written, measured in its staging folder (the
        only place a lock file may point to: it lives in the store, anyone could edit it)."""
        try:
            parts = safe_relpath(building).parts if isinstance(building, str) else ()
            if parts[:1] != ("staging",) or not is_dir(self.root, parts):
                return None
        except UnsafePathError:
            return None
        files, size, newest = tree_size(self.root.joinpath(*parts))
        last = f", the last {max(time.time() - newest, 0):.0f} s ago" if newest else ""
        return progress_text(files, size) + last

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def try_lock_file(root: Path, parts: tuple[str, ...], *, shared: bool = False) -> int | None:
    """The descriptor of an flock on the file `root/parts...` (created 0600, reached
    without following a link), shared or exclusive; None while another process holds a
    conflicting one. The kernel drops the lock when its holder dies, even by SIGKILL. A
    lock whose file its holder removed meanwhile (`remove_lock`) is taken again on the
    new file, so holders may remove their lock files."""
    return _lock_file(root, parts, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)


def hold_lock_file(root: Path, parts: tuple[str, ...], *, shared: bool = False) -> int:
    """try_lock_file's lock, waiting for a conflicting holder to let go."""
    fd = _lock_file(root, parts, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    if fd is None:  # a blocking flock returns only once it holds the lock
        raise RuntimeError(f"flock on {root.joinpath(*parts)} returned without the lock")
    return fd


def _lock_file(root: Path, parts: tuple[str, ...], mode: int) -> int | None:
    while True:
        with directory(root, parts[:-1], create=True) as dfd:
            fd = open_file(dfd, parts[-1], os.O_RDWR | os.O_CREAT, root.joinpath(*parts), 0o600)
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                named = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            held = os.fstat(fd)
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                return fd
            os.close(fd)


def remove_lock(root: Path, parts: tuple[str, ...], fd: int) -> None:
    """Remove the lock file `root/parts...` whose exclusive lock `fd` holds, then let go."""
    remove(root, parts)
    os.close(fd)
