"""A work folder of its own for every NxD compile, so that compiles of different
configurations on one host (two models on an inf2.48xlarge, parallel precompiles; the
compile cache locks per key only) never share one.

NxD compiles through one folder per process: NxDI reads `BASE_COMPILE_WORK_DIR` (default
`/tmp/nxd_model/`) when it builds its ModelWrappers (model_wrapper.py line 82) and its
ModelBuilder (application_base.py get_builder, ef2731e line 150), and neuronx-distributed's
`ModelBuilder.trace` deletes that folder, writes every bucket's HLO and NEFF under it and
reads the NEFFs back into the traced model (trace/model_builder.py 0.18 lines 544-545,
717-760, build_nxd_model 1053-1060); neuronx-cc compiles in a subfolder of it and takes
its own scratch files from the temporary folder (`TMPDIR`). Two compiles sharing the
default delete and overwrite each other's NEFFs: a failed compile at best, another
configuration's graphs at worst.

`compile_work_dir` gives each compile a new folder under the operator's
`BASE_COMPILE_WORK_DIR` where set (else the system's temporary folder) and points both
variables there while NxDI builds and compiles the model; the environment is the
process's, so compiles within one process take turns. The folder is removed after a
compile that succeeds, and kept (named in the log, neuronx-cc's log-neuron-cc.txt is
in it) after one that fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from neuron_plugin import plugin_logger

logger = plugin_logger(__name__)

WORK_DIR_ENV = "BASE_COMPILE_WORK_DIR"
# One compile's environment at a time in a process (os.environ is shared by its threads).
_LOCK = threading.Lock()


@contextmanager
def compile_work_dir() -> Iterator[Path]:
    """BASE_COMPILE_WORK_DIR and TMPDIR pointed at a new folder for one compile (module
    docstring); both restored after."""
    with _LOCK:
        parent = os.environ.get(WORK_DIR_ENV) or tempfile.gettempdir()
        Path(parent).mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="nxd-compile-", dir=parent))
        scratch = work / "tmp"
        scratch.mkdir()
        saved = {name: os.environ.get(name) for name in (WORK_DIR_ENV, "TMPDIR")}
        # NxDI joins file names onto it: a trailing separator, as its default has
        os.environ[WORK_DIR_ENV] = os.path.join(str(work), "")
        os.environ["TMPDIR"] = str(scratch)
        try:
            yield work
        except BaseException:
            logger.error("NxD compile failed; its work folder is kept: %s", work)
            raise
        else:
            shutil.rmtree(work, ignore_errors=True)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
