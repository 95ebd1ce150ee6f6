"""Model loading through the compile cache: look up, compile on a miss, publish, load.

The cache key covers everything that changes the compiled graphs (architecture config,
graph-relevant settings, bucket grids, target, versions) and nothing that does not, so a
second start with the same configuration compiles nothing and a changed bucket grid is a
miss whose reason names the field.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compile_cache.cache import CacheResult, CompileCache
from compile_cache.manifest import make_manifest
from compile_cache.stores import open_store
from neuron_plugin import plugin_logger
from neuron_plugin.backends.base import (
    Backend,
    LoadedBackend,
    Progress,
    graph_specs,
    run_graph_once,
)
from neuron_plugin.core.settings import GRID_KEYS, NeuronSettings

if TYPE_CHECKING:
    # mypy holds each implementation to the contract it serves (backends/base.py).
    from neuron_plugin.backends.nxd.backend import NxDBackend
    from neuron_plugin.backends.reference.backend import ReferenceBackend
    from neuron_plugin.backends.runner.client import RunnerBackend

    _IN_PROCESS: tuple[type[Backend], ...] = (ReferenceBackend, NxDBackend)
    _ACROSS_PROCESSES: type[LoadedBackend] = RunnerBackend

logger = plugin_logger(__name__)

# Settings that do not change a compiled graph: excluded from the cache key so that
# toggling them never forces a recompile.
_RUNTIME_ONLY = frozenset(
    {
        "backend",
        "architecture",
        "kv_layout_reason",
        "skip_warmup",
        "backend_python",
        "dp_degree",
        "rank_cores",
        "max_num_seqs_reason",
        "token_generation_batches_reason",
        "exact_sampling",
        "logits_buckets_note",
        # The draft's folder: its config (and, where embedded, its weights' fingerprint)
        # is in the backend's fields instead, so a moved draft keeps its artifacts.
        "draft_model",
        "dtype",
        *GRID_KEYS,
        # keyed as the logits graphs it gives, where there are any (cache_manifest)
        "token_generation_logits_buckets",
        # adapters held on the host: no graph holds them
        "max_cpu_loras",
    }
)


_LORA_KEYS = ("max_loras", "max_lora_rank", "lora_target_modules", "lora_options")


def make_backend(settings: NeuronSettings, model_dir: str | Path) -> Backend:
    """The backend the settings name; NxD imports stay inside its module."""
    if settings.backend == "reference":
        from neuron_plugin.backends.reference.backend import ReferenceBackend

        return ReferenceBackend(settings, model_dir)
    from neuron_plugin.backends.nxd.backend import NxDBackend

    return NxDBackend(settings, model_dir)


def cache_manifest(settings: NeuronSettings, backend: Backend) -> dict[str, Any]:
    """The canonical description of what would be compiled (the cache key's input)."""
    fields = backend.cache_manifest_fields()
    neuron_config = {k: v for k, v in settings.to_dict().items() if k not in _RUNTIME_ONLY}
    if "quantized_checkpoints_path" in settings.passthrough:
        # Where the quantized weights are changes no graph (their layout, from the other
        # quantization keys, does); the checkpoint is weights, loaded at start.
        neuron_config["passthrough"] = {
            k: v for k, v in settings.passthrough.items() if k != "quantized_checkpoints_path"
        }
    if settings.max_loras:
        # The key covers the adapter slots' shapes, never the adapters' folders: NxDI
        # loads those given at start as weights, not into the graphs (see core.lora);
        # where the artifacts embed weights (save_sharded_checkpoint) their content is in
        # the backend's weights fingerprint.
        neuron_config["lora_options"] = {
            k: v for k, v in settings.lora_options.items() if k != "lora_ckpt_paths"
        }
    else:  # absent without LoRA, so the keys of other configurations stay put
        for key in _LORA_KEYS:
            neuron_config.pop(key, None)
    if not settings.vision_buckets:  # a text model: absent, so its keys stay put
        neuron_config.pop("vision_buckets", None)
    logits_shapes = settings.token_generation_logits_shapes()
    if logits_shapes:  # graphs of their own (absent elsewhere, so those keys stay put)
        neuron_config["token_generation_logits_shapes"] = [list(s) for s in logits_shapes]
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


def compile_into_cache(
    backend: Backend, cache: CompileCache, progress: Progress | None = None
) -> CacheResult:
    """Return a verified local folder of compiled graphs, compiling only on a miss. Each
    compiled graph is logged (name, n of N, elapsed), so a serve-time miss shows where
    it is; `progress` also gets each graph's name (precompile's progress bar)."""
    manifest = cache_manifest(backend.settings, backend)
    total = len(graph_specs(backend.settings))

    def build(folder: Path) -> None:
        logger.info(
            "compiling %d graphs for %s backend into the compile cache", total, backend.name
        )
        started = time.perf_counter()
        done = 0

        def compiled(name: str) -> None:
            nonlocal done
            done += 1
            logger.info(
                "compiled graph %s (%d of %d), %.1f s so far",
                name,
                done,
                total,
                time.perf_counter() - started,
            )
            if progress is not None:
                progress(name)

        backend.compile(folder, progress=compiled)
        logger.info("compiled %d graphs in %.1f s", total, time.perf_counter() - started)

    # The plugin's logger, which vLLM configures: waiting for another process's or host's
    # compile (who, since when, progress) and refusals are visible in the serving log.
    result = cache.get_or_build(manifest, build, log=logger)
    if result.hit:
        logger.info(
            "compile cache hit: key %s, loading %d compiled graphs from %s",
            result.key,
            total,
            result.path,
        )
    else:
        logger.info(
            "compile cache %s; compiled and %s %d graphs under key %s",
            result.reason,
            "published" if result.in_store else "kept on this host",
            total,
            result.key,
        )
    return result


def load_backend(
    settings: NeuronSettings, model_dir: str | Path, cache_url: str | None = None
) -> tuple[Backend, CacheResult]:
    """Build, compile-or-fetch, and load the backend for one configuration."""
    backend = make_backend(settings, model_dir)
    cache = CompileCache(open_store(cache_url))
    result = compile_into_cache(backend, cache)
    backend.load(result.path)
    if not settings.skip_warmup:
        started = time.perf_counter()
        for graph in graph_specs(settings):
            run_graph_once(backend, graph)
        logger.info(
            "warm-up: ran each of %d graphs once in %.2f s (skip_warmup=true skips it)",
            len(graph_specs(settings)),
            time.perf_counter() - started,
        )
    return backend, result


def open_backend(
    settings: NeuronSettings,
    model_dir: str | Path,
    cache_url: str | None = None,
    looked_up: Callable[[CacheResult], None] | None = None,
) -> LoadedBackend:
    """The loaded backend: in this process, or in a runner process started under
    `settings.backend_python` (the Neuron SDK's interpreter). `looked_up` hears how the
    compile cache answered (the worker counts hits and misses)."""
    backend: LoadedBackend
    if not settings.backend_python:
        backend, result = load_backend(settings, model_dir, cache_url)
    else:
        from neuron_plugin.backends.runner.client import RunnerBackend

        runner = backend = RunnerBackend(settings, model_dir)
        try:
            result = runner.load(cache_url)
        except BaseException:
            runner.close()
            raise
    if looked_up is not None:
        looked_up(result)
    return backend


def compile_configuration(
    settings: NeuronSettings,
    model_dir: str | Path,
    cache_url: str | None = None,
    progress: Progress | None = None,
) -> CacheResult:
    """Compile-or-fetch without loading (precompile), where the backend runs: in this
    process, or in its runner (whose progress arrives as log lines, not callbacks)."""
    if not settings.backend_python:
        return compile_into_cache(
            make_backend(settings, model_dir), CompileCache(open_store(cache_url)), progress
        )
    from neuron_plugin.backends.runner.client import RunnerBackend

    backend = RunnerBackend(settings, model_dir)
    try:
        return backend.compile(cache_url)
    finally:
        backend.close()


def quantize_configuration(settings: NeuronSettings, model_dir: str | Path) -> dict[str, Any]:
    """Write the configuration's quantized checkpoint where the backend runs (NxDI's own
    path on the nxd backend); what was written."""
    if not settings.backend_python:
        return make_backend(settings, model_dir).quantize()
    from neuron_plugin.backends.runner.client import RunnerBackend

    backend = RunnerBackend(settings, model_dir)
    try:
        return backend.quantize()
    finally:
        backend.close()


def configuration_manifest(settings: NeuronSettings, model_dir: str | Path) -> dict[str, Any]:
    """The cache manifest of a configuration, computed where the backend runs (its
    versions are part of it)."""
    if not settings.backend_python:
        return cache_manifest(settings, make_backend(settings, model_dir))
    from neuron_plugin.backends.runner.client import RunnerBackend

    backend = RunnerBackend(settings, model_dir)
    try:
        return backend.manifest()
    finally:
        backend.close()
