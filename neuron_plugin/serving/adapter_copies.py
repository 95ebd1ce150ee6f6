"""The verified copies of LoRA adapters: a private folder of this worker's in the temp
folder, one subfolder per adapter, named by the SHA-256 of its files.

A copy is written only after every check of the adapter passed (`AdapterStore.read`),
and the copies hold at most `max_bytes` in all (VLLM_NEURON_LORA_COPIES_MAX_BYTES;
default: four times what the adapters a worker can use at once take at the largest
size its slots hold): a new copy evicts the least recently used copies whose adapters
are not held, in a slot, pinned or used by the step, and an adapter whose copy was
evicted is read from its own folder again, and checked again, when it is next needed.
An adapter whose copy cannot fit beside the ones in use is refused, naming the setting.

The folder is removed when the worker stops. A worker killed before (SIGKILL, OOM)
leaves it behind, so each new worker sweeps the temp folder at start: it removes a
`vllm-neuron-lora-*` folder only when it is a real directory of this user (never a
link, never another user's) whose owner is gone, which it knows from the folder's
`owner.lock`: the owner holds an flock on it for its whole life (the kernel drops it
when the process dies, whatever killed it), and a folder becomes visible under its
name only once that lock is held. Folders without the lock file (older versions) are
left alone. Removal walks by file descriptors and never follows a link (`safe_fs`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import Collection, Mapping
from pathlib import Path

from compile_cache import safe_fs
from neuron_plugin import plugin_logger
from neuron_plugin.core.adapters import AdapterError
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.serving.adapter_files import CONFIG, SAFETENSORS, AdapterFiles

logger = plugin_logger(__name__)

PREFIX = "vllm-neuron-lora-"
OWNER = "owner.lock"
MAX_BYTES_ENV = "VLLM_NEURON_LORA_COPIES_MAX_BYTES"
# In-use copies at most: every held adapter (--max-cpu-loras) and every slot's
# (--max-loras); the default budget holds this many times that.
DEFAULT_ROOM = 4


def max_bytes_setting(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """The copies' budget: VLLM_NEURON_LORA_COPIES_MAX_BYTES, else `default`."""
    given = environ.get(MAX_BYTES_ENV, "").strip()
    if not given:
        return default
    if not given.isdigit() or int(given) <= 0:
        raise NeuronConfigError(
            f"{MAX_BYTES_ENV}={given!r} must be a positive number of bytes (the most the "
            f"verified copies of LoRA adapters may take in the temp folder; default "
            f"{default:,}); fix or unset it."
        )
    return int(given)


def _owner_gone(parent_fd: int, name: str) -> bool:
    """Whether the folder `name`'s owner is gone: its lock file can be locked. A folder
    without one (an older version's, or one being created) is never taken for gone."""
    try:
        folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:  # a link, not a directory, or gone meanwhile
        return False
    try:
        lock = os.open(
            OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder
        )
    except OSError:
        return False
    finally:
        os.close(folder)
    try:
        if not stat.S_ISREG(os.fstat(lock).st_mode):
            return False
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    finally:
        os.close(lock)


def sweep_stale(parent: Path) -> list[str]:
    """Remove the copies folders in `parent` that workers killed before stopping left
    (module docstring); the names removed."""
    removed = []
    uid = os.geteuid()
    with os.scandir(parent) as entries:
        candidates = [e.name for e in entries if e.name.startswith(PREFIX)]
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in candidates:
            try:
                info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            if _owner_gone(parent_fd, name):
                try:
                    safe_fs.remove(parent, (name,))
                except OSError as exc:
                    logger.warning("LoRA: cannot remove the stale copies folder %s/%s: %s",
                                   parent, name, exc)  # fmt: skip
                    continue
                removed.append(name)
    finally:
        os.close(parent_fd)
    if removed:
        logger.info(
            "LoRA: removed %d adapter-copy folders of workers that are gone from %s",
            len(removed),
            parent,
        )
    return removed


class PrivateCopies:
    """Verified adapter files in this worker's private folder, by digest, within a
    budget (module docstring)."""

    def __init__(self, max_bytes: int, parent: str | Path | None = None):
        parent = Path(parent if parent is not None else tempfile.gettempdir())
        sweep_stale(parent)
        self.max_bytes = max_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, LRU first
        # Locked before it is visible under its name: a sweep never takes it for gone.
        new = Path(tempfile.mkdtemp(prefix=f".{PREFIX}new-", dir=parent))  # mode 0700
        self._lock = os.open(
            new / OWNER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.root = parent / f"{PREFIX}{uuid.uuid4().hex}"
        os.rename(new, self.root)

    @property
    def used_bytes(self) -> int:
        return sum(self._sizes.values())

    def folder(self, digest: str) -> Path:
        """Where the copy of the files of `digest` is (or will be) kept."""
        return self.root / digest

    def keep(self, files: AdapterFiles, in_use: Collection[str], who: str) -> list[str]:
        """Write the copy of `files` (once per digest), evicting the least recently used
        copies not `in_use` to stay within the budget; the digests evicted."""
        digest = files.digest
        if digest in self._sizes:
            self._sizes.move_to_end(digest)
            return []
        size = len(files.config) + len(files.weights)
        evicted = self._make_room(size, {*in_use, digest}, who)
        staging = Path(tempfile.mkdtemp(dir=self.root))
        for name, data in ((CONFIG, files.config), (SAFETENSORS, files.weights)):
            fd = os.open(
                staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
            )
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        os.rename(staging, self.folder(digest))
        self._sizes[digest] = size
        return evicted

    def _make_room(self, size: int, keep: set[str], who: str) -> list[str]:
        evictable = [d for d in self._sizes if d not in keep]
        kept = self.used_bytes - sum(self._sizes[d] for d in evictable)
        if kept + size > self.max_bytes:
            raise AdapterError(
                f"{who}: its verified copy ({size:,} bytes) does not fit beside the copies "
                f"of the adapters in use ({kept:,} bytes) within {MAX_BYTES_ENV}="
                f"{self.max_bytes:,}; raise it, or load fewer adapters at once"
            )
        evicted = []
        for digest in evictable:
            if self.used_bytes + size <= self.max_bytes:
                break
            del self._sizes[digest]
            safe_fs.remove(self.root, (digest,))
            evicted.append(digest)
        if evicted:
            logger.info("LoRA: evicted %d adapter copies (%s)", len(evicted), MAX_BYTES_ENV)
        return evicted

    def read(self, digest: str, who: str) -> AdapterFiles:
        """The files kept for `digest`, AdapterError (naming `who`) unless they are there
        and are the ones verified."""
        folder = self.folder(digest)
        try:
            files = AdapterFiles(
                config=_read_kept(folder / CONFIG), weights=_read_kept(folder / SAFETENSORS)
            )
        except OSError as exc:
            raise AdapterError(
                f"{who}: its verified copy in {folder} cannot be read ({exc}); load the "
                f"adapter again"
            ) from None
        if files.digest != digest:
            raise AdapterError(
                f"{who}: its verified copy in {folder} changed after it was verified "
                f"(something else writes this worker's private directory); load the "
                f"adapter again"
            )
        if digest in self._sizes:
            self._sizes.move_to_end(digest)
        return files

    def close(self) -> None:
        """Remove the folder (the worker stops)."""
        with contextlib.suppress(FileNotFoundError):
            safe_fs.remove(self.root.parent, (self.root.name,))
        os.close(self._lock)


def _read_kept(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read()
