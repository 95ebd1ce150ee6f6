"""A full disk as an error that says where, and how many bytes were needed.

Without this a build or download that fills the disk surfaces as whatever the writer
makes of ENOSPC (a bare OSError, or worse an abort in a C++ stream), with no word of the
store. The staging folder it wrote into is removed as the error leaves the staging
context, so the store is left as it was.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from compile_cache.errors import StoreFull
from compile_cache.settings import CACHE_URL_ENV, LOCAL_DIR_ENV
from compile_cache.units import format_size

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_out_of_space(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, is ENOSPC or EDQUOT."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _NO_SPACE:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _free_bytes(path: Path) -> int:
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    return shutil.disk_usage(existing).free


def out_of_space(disk: Path, doing: str, needed: str) -> StoreFull:
    """The error for a full disk under `disk` while `doing` ("building entry K"), with
    `needed` saying how many bytes it takes ("it needs 123 bytes")."""
    free = _free_bytes(disk)
    return StoreFull(
        f"no space left on the device holding the compile cache {disk} while {doing}: "
        f"{needed}, and {free} bytes ({format_size(free)}) are free there; nothing was "
        f"published. Free space there (e.g. `neuron-cache prune --max-size SIZE`) or point "
        f"{CACHE_URL_ENV} ({LOCAL_DIR_ENV} for the read cache of an S3 store) at a larger "
        "disk"
    )
