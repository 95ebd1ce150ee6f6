"""Model loading through the compile cache: look up, compile on a miss, publish, load.

The cache key covers everything that changes the compiled graphs (architecture config,
graph-relevant settings, bucket grids, target, versions) and nothing that does not, so a
second start with the same configuration compiles nothing and a changed bucket grid is a
miss whose reason names the field.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from compile_cache.cache import CacheResult, CompileCache
from compile_cache.manifest import make_manifest
from compile_cache.stores import open_store
from neuron_plugin.backends.base import Backend, graph_specs
from neuron_plugin.config import GRID_KEYS, NeuronSettings
from neuron_plugin.inputs import padding_inputs
from neuron_plugin import plugin_logger

logger = plugin_logger(__name__)

# Settings that do not change a compiled graph: excluded from the cache key so that
# toggling them never forces a recompile.
_RUNTIME_ONLY = frozenset({"backend", "architecture", "kv_layout_reason", "skip_warmup",
                           "dtype", *GRID_KEYS})


def make_backend(settings: NeuronSettings, model_dir: str | Path) -> Backend:
    """The backend the settings name; NxD imports stay inside its module."""
    if settings.backend == "reference":
        from neuron_plugin.backends.reference.backend import ReferenceBackend

        return ReferenceBackend(settings, model_dir)
    from neuron_plugin.backends.nxd import NxDBackend

    return NxDBackend(settings, model_dir)


def cache_manifest(settings: NeuronSettings, backend: Backend) -> dict[str, Any]:
    """The canonical description of what would be compiled (the cache key's input)."""
    fields = backend.cache_manifest_fields()
    neuron_config = {k: v for k, v in settings.to_dict().items() if k not in _RUNTIME_ONLY}
    return make_manifest(
        backend=settings.backend,
        model_config=fields["model_config"],
        neuron_config=neuron_config,
        buckets={key: list(getattr(settings, key)) for key in GRID_KEYS},
        target=fields["target"],
        versions=fields["versions"],
        compiler_flags=fields["compiler_flags"],
        weights_fingerprint=fields["weights_fingerprint"],
        dtype=settings.dtype,
    )


def compile_into_cache(backend: Backend, cache: CompileCache,
                       show_progress: bool = False) -> CacheResult:
    """Return a verified local folder of compiled graphs, compiling only on a miss."""
    manifest = cache_manifest(backend.settings, backend)
    total = len(graph_specs(backend.settings))

    def build(folder: Path) -> None:
        logger.info("compiling %d graphs for %s backend into the compile cache", total,
                    backend.name)
        started = time.perf_counter()
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="compiling buckets", unit="graph")
        try:
            backend.compile(folder, progress=(lambda name: bar.update(1)) if bar else None)
        finally:
            if bar is not None:
                bar.close()
        logger.info("compiled %d graphs in %.1f s", total, time.perf_counter() - started)

    result = cache.get_or_build(manifest, build)
    if result.hit:
        logger.info("compile cache hit: key %s, loading %d compiled graphs from %s",
                    result.key, total, result.path)
    else:
        logger.info("compile cache %s; compiled and published %d graphs under key %s",
                    result.reason, total, result.key)
    return result


def load_backend(settings: NeuronSettings, model_dir: str | Path,
                 cache_url: str | None = None) -> tuple[Backend, CacheResult]:
    """Build, compile-or-fetch, and load the backend for one configuration."""
    backend = make_backend(settings, model_dir)
    cache = CompileCache(open_store(cache_url))
    result = compile_into_cache(backend, cache)
    backend.load(result.path)
    if not settings.skip_warmup:
        started = time.perf_counter()
        for graph in graph_specs(settings):
            backend.forward(padding_inputs(settings, graph.phase, graph.shape))
        logger.info("warm-up: ran each of %d graphs once in %.2f s (skip_warmup=true "
                    "skips it)", len(graph_specs(settings)), time.perf_counter() - started)
    return backend, result
