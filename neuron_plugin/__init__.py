"""vLLM platform plugin for AWS Neuron (entry point `vllm.platform_plugins: neuron`).

`register()` decides whether this platform activates. It must never activate by accident
on a plain CPU or GPU host, so it activates only when
1. `VLLM_NEURON_BACKEND` is `nxd` or `reference` (explicit choice of backend), or
2. Neuron devices exist (`/dev/neuron*`): the NxD Inference backend, or
3. the command line says `--device neuron`: NxD on a Neuron host, otherwise the CPU
   reference backend, with one log line saying so and how to choose otherwise, or
4. vLLM has no platform of its own here (none of its built-in platforms activates: the
   `vllm` wheel, a CUDA build, on a host without a GPU, where vLLM alone fails with
   "Device string must not be empty"): the CPU reference backend, saying so.
The decision is written to `VLLM_NEURON_BACKEND` so engine processes started later
(vLLM spawns them) make the same one.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def plugin_logger(name: str) -> logging.Logger:
    """A logger under vLLM's `vllm` logger, so plugin lines share its format and level."""
    return logging.getLogger(f"vllm.{name}")


logger = plugin_logger(__name__)

BACKENDS = ("nxd", "reference")

BACKEND_ENV = "VLLM_NEURON_BACKEND"
# The interpreter of the environment the backend runs in (a runner process); unset: in-process.
BACKEND_PYTHON_ENV = "VLLM_NEURON_BACKEND_PYTHON"
PLATFORM_QUALNAME = "neuron_plugin.platform.NeuronPlatform"


def neuron_devices() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def asks_for_neuron(argv: Sequence[str]) -> bool:
    """True when the command line carries `--device neuron` or `--device=neuron`."""
    for i, arg in enumerate(argv):
        if arg == "--device=neuron":
            return True
        if arg == "--device" and i + 1 < len(argv) and argv[i + 1] == "neuron":
            return True
    return False


def vllm_platform_found() -> bool:
    """Whether one of vLLM's built-in platforms activates on this host, by vLLM's own
    detection (`vllm.platforms.builtin_platform_plugins`; one that raises counts as
    absent, as vLLM counts it)."""
    from vllm.platforms import builtin_platform_plugins

    for detect in builtin_platform_plugins.values():
        try:
            if detect() is not None:
                return True
        except Exception:  # vLLM logs these at debug level and moves on
            continue
    return False


def choose_backend(
    env: Mapping[str, str],
    argv: Sequence[str],
    devices: Sequence[str],
    vllm_has_platform: Callable[[], bool] = lambda: True,
) -> str | None:
    """The backend to run, or None when this platform should stay inactive (pure but
    for `vllm_has_platform`, asked last)."""
    chosen = env.get(BACKEND_ENV, "").strip().lower()
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(
                f"{BACKEND_ENV}={env[BACKEND_ENV]!r} is not a Neuron backend; set it to "
                f"'nxd' (NxD Inference on Neuron devices) or 'reference' (CPU), or unset "
                f"it."
            )
        return chosen
    if devices:
        return "nxd"
    if asks_for_neuron(argv) or not vllm_has_platform():
        return "reference"
    return None


MULTIPROC_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_GUARD = re.compile(r"""__name__\s*==\s*['"]__main__['"]""")


def engine_start_method(main: Any) -> str:
    """spawn, unless the main module is a script without an `if __name__ ==
    "__main__":` guard (vllm-neuron's offline examples have none): a spawned engine
    re-runs such a script and dies in multiprocessing's bootstrapping check, so those
    start the engine with fork, vLLM's own default. Forking once torch's OpenMP pool or
    the Neuron runtime has started in the parent can hang the child (seen here after a
    transformers forward), which is why spawn is preferred wherever it works."""
    path = getattr(main, "__file__", None)
    if not path or not path.endswith(".py"):
        return "spawn"
    try:
        source = Path(path).read_text(errors="replace")
    except OSError:
        return "spawn"
    if _GUARD.search(source):
        return "spawn"
    logger.warning(
        '%s has no `if __name__ == "__main__":` guard, so vLLM\'s engine starts with '
        "fork instead of spawn; add the guard around LLM(...) (spawn is safer once torch "
        "has run in this process), or set %s to choose.",
        path,
        MULTIPROC_ENV,
    )
    return "fork"


def register() -> str | None:
    """vLLM platform-plugin entry point: the platform's qualified name, or None."""
    devices = neuron_devices()
    explicit = os.environ.get(BACKEND_ENV)
    backend = choose_backend(os.environ, sys.argv, devices, vllm_platform_found)
    if backend is None:
        return None
    if MULTIPROC_ENV not in os.environ:  # decided once; engine processes inherit it
        os.environ[MULTIPROC_ENV] = engine_start_method(sys.modules.get("__main__"))
    if not explicit:
        os.environ[BACKEND_ENV] = backend
        if backend == "reference" and asks_for_neuron(sys.argv):
            logger.warning(
                "--device neuron on a host without Neuron devices: serving on the CPU "
                "reference backend (same buckets, KV layouts and compile cache as NxD). "
                "Set %s=nxd on an inf2/trn host, or drop --device neuron to use vLLM's "
                "own platform.",
                BACKEND_ENV,
            )
        elif backend == "reference":
            logger.warning(
                "no Neuron devices here and none of vLLM's own platforms activates (this "
                "vLLM build needs a GPU it cannot find): serving on the neuron platform's "
                "CPU reference backend. Set %s=nxd on an inf2/trn host, or install the "
                "vLLM build for this host's hardware.",
                BACKEND_ENV,
            )
    return PLATFORM_QUALNAME
