"""Per-key mutual exclusion: the waiting loop shared by all lock kinds, and the file
lock that serialises compiles on one host.

flock(2) locks are released by the kernel when their holder dies, even by SIGKILL, so a
crashed compile never leaves a stale local lock. Lock files are never deleted: deleting
one while another process has it open would let two processes hold "the" lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from compile_cache.errors import LockTimeout
from compile_cache.record import owner_label

REPORT_EVERY = 30.0


class KeyLock(Protocol):
    """What `acquire` needs from a lock: a non-blocking attempt and a description of
    the current holder for progress lines and timeout messages."""

    poll_interval: float

    def try_acquire(self) -> bool: ...

    def holder(self) -> str: ...

    def release(self) -> None: ...


def acquire(lock: KeyLock, *, what: str, timeout: float,
            on_wait: Callable[[str], None]) -> float:
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
                "process, or point VLLM_NEURON_CACHE_URL at another store")
        if now >= next_report:
            on_wait(f"waiting for {what}: being compiled by {lock.holder()} "
                    f"(waited {waited:.0f} s, timeout {timeout:.0f} s)")
            next_report = now + REPORT_EVERY
        time.sleep(min(lock.poll_interval, max(timeout - waited, 0.0)))
    return time.monotonic() - started


class FileLock:
    """An exclusive flock on `path`; the holder writes its host:pid into the file."""

    poll_interval = 0.1

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"owner": owner_label(), "since": time.time()}).encode(), 0)
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_bytes())
            return (f"{info['owner']} (since "
                    f"{time.strftime('%H:%M:%S', time.localtime(info['since']))})")
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
