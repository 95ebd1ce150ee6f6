"""A work folder of its own for every NxD compile, so that compiles of different
configurations on one host (two models on an inf2.48xlarge, parallel precompiles; the
compile cache locks per key only) never share one.

NxD compiles through one folder per process: NxDI reads `BASE_COMPILE_WORK_DIR` (default
`/tmp/nxd_model/`) when it builds its ModelWrappers (model_wrapper.py line 82) and its
ModelBuilder (application_base.py get_builder, ef2731e line 150), and neuronx-distributed's
`ModelBuilder.trace` deletes that folder, writes every bucket's HLO and NEFF under it and
reads the NEFFs back into the traced model (trace/model_builder.py 0.17 and 0.18 lines
544-545, 717-760, build_nxd_model 1053-1060); neuronx-cc compiles in a subfolder of it,
writes its log there (`log-neuron-cc.txt`, model_builder.py 79 and 643-644) and takes its
own scratch files from the temporary folder (`TMPDIR`). Two compiles sharing the default
delete and overwrite each other's NEFFs: a failed compile at best, another
configuration's graphs at worst.

`compile_work_dir` gives each compile a new folder under the operator's
`BASE_COMPILE_WORK_DIR` where set (else the system's temporary folder) and points the
variables at two folders inside it while NxDI builds and compiles the model: `work/`
for NxD, which deletes it, and `tmp/` for neuronx-cc's TMPDIR, beside it, never inside
what NxD deletes. Python's own temporary folder is resolved before TMPDIR changes, so
the process's temporary files (the EAGLE head NxDI loads, `backend._draft_dir`) never
land in the compile's folder. The environment is the process's, so compiles within one
process take turns.

The folder is removed after a compile that succeeds. After one that fails, or one whose
process died (its flock on `<folder>.lock` gone: the OOM killer ends many compiles on
small hosts), only neuron-cc's logs are kept, in a `nxd-failed-*` folder, the newest
FAILED_KEPT of them (gigabytes of HLO and partial NEFFs each otherwise, forever).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compile_cache.errors import UnsafePathError
from compile_cache.locks import hold_lock_file, remove_lock, try_lock_file
from neuron_plugin import plugin_logger

logger = plugin_logger(__name__)

WORK_DIR_ENV = "BASE_COMPILE_WORK_DIR"
RUNNING = "nxd-compile-"
FAILED = "nxd-failed-"
LOG_NAME = "log-neuron-cc.txt"  # neuronx-distributed model_builder.py LOG_FILE_DEFAULT_NAME
FAILED_KEPT = 3
# One compile's environment at a time in a process (os.environ is shared by its threads).
_LOCK = threading.Lock()


@contextmanager
def compile_work_dir() -> Iterator[Path]:
    """BASE_COMPILE_WORK_DIR and TMPDIR pointed at a new folder's `work/` and `tmp/` for
    one compile (module docstring); both restored after."""
    with _LOCK:
        tempfile.gettempdir()  # this process's own temporary folder, resolved first
        parent = Path(os.environ.get(WORK_DIR_ENV) or tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        sweep(parent)
        folder = Path(tempfile.mkdtemp(prefix=RUNNING, dir=parent))
        lock = (f"{folder.name}.lock",)
        alive = hold_lock_file(parent, lock)  # a fresh name: held at once
        (folder / "tmp").mkdir()
        saved = {name: os.environ.get(name) for name in (WORK_DIR_ENV, "TMPDIR")}
        # NxDI joins file names onto it: a trailing separator, as its default has
        os.environ[WORK_DIR_ENV] = os.path.join(str(folder / "work"), "")
        os.environ["TMPDIR"] = str(folder / "tmp")
        try:
            yield folder
        except BaseException:
            _keep_failed(folder)
            raise
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            remove_lock(parent, lock, alive)
            prune_failed(parent)


def _keep_failed(folder: Path) -> None:
    try:
        logger.error("NxD compile failed; neuronx-cc's logs are kept in %s", keep_logs(folder))
    except OSError as exc:  # the compile's own error is the one to raise
        logger.error("NxD compile failed; its folder %s could not be cleared: %s", folder, exc)


def keep_logs(folder: Path) -> Path:
    """The compile folder reduced to neuronx-cc's logs (at their paths; links removed,
    never followed) and renamed `nxd-failed-*`; its new path."""
    for dirpath, dirnames, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            path = Path(dirpath, name)
            if name != LOG_NAME or path.is_symlink():
                path.unlink(missing_ok=True)
        for name in dirnames:
            path = Path(dirpath, name)
            if path.is_symlink():
                path.unlink()
            elif not any(path.iterdir()):
                path.rmdir()
    kept = folder.with_name(FAILED + folder.name.removeprefix(RUNNING))
    folder.rename(kept)
    os.utime(kept)  # when it failed, for prune_failed
    return kept


def sweep(parent: Path) -> None:
    """Compile folders under `parent` whose process died (nobody holds their lock):
    reduced to their logs like a failed compile's."""
    for lock in parent.glob(f"{RUNNING}*.lock"):
        try:
            held = try_lock_file(parent, (lock.name,))
        except (OSError, UnsafePathError):
            continue  # another user's (a shared BASE_COMPILE_WORK_DIR), or a planted link
        if held is None:
            continue  # a live compile
        folder = parent / lock.name.removesuffix(".lock")
        try:
            if folder.is_dir() and not folder.is_symlink():
                logger.warning(
                    "NxD compile folder %s belongs to a compile that was killed; its "
                    "logs are kept in %s",
                    folder,
                    keep_logs(folder),
                )
        except OSError as exc:  # another user's, in a shared BASE_COMPILE_WORK_DIR
            logger.warning("cannot clear the killed compile's folder %s: %s", folder, exc)
        remove_lock(parent, (lock.name,), held)


def prune_failed(parent: Path) -> None:
    """All but the newest FAILED_KEPT failed compiles' folders under `parent` removed."""
    failed = [p for p in parent.glob(f"{FAILED}*") if p.is_dir() and not p.is_symlink()]
    failed.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in failed[FAILED_KEPT:]:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
