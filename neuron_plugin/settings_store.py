"""The bridge between vLLM's config objects and the pure `config.resolve_settings`.

The platform resolves settings once in the process that builds the VllmConfig and stores
them in `additional_config`, which travels with the config to the engine-core process, so
the worker runs exactly what the platform decided and logged.
"""

from __future__ import annotations

import os
from typing import Any

from neuron_plugin import BACKEND_ENV
from neuron_plugin.config import (
    EngineLimits,
    NeuronConfigError,
    NeuronSettings,
    resolve_settings,
)

SETTINGS_KEY = "neuron_settings"
OVERRIDE_KEY = "override_neuron_config"
BUCKET_SET_KEY = "bucket_set"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def engine_limits(vllm_config: Any) -> EngineLimits:
    model, cache, sched = (vllm_config.model_config, vllm_config.cache_config,
                           vllm_config.scheduler_config)
    return EngineLimits(
        max_model_len=model.max_model_len,
        max_num_seqs=sched.max_num_seqs,
        block_size=cache.block_size,
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        max_num_batched_tokens=sched.max_num_batched_tokens,
        dtype=_dtype_name(model.dtype),
        tp_degree=vllm_config.parallel_config.tensor_parallel_size,
        num_gpu_blocks_override=cache.num_gpu_blocks_override,
    )


def with_bucket_set(override: dict[str, Any]) -> dict[str, Any]:
    """Expand `bucket_set: FILE` (a `neuron-buckets tune -o` or configs/buckets/ file)
    into its bucket keys. A key given both inline and in the file is a contradiction."""
    if BUCKET_SET_KEY not in override:
        return override
    from bucketing.files import load_bucket_set

    path = override[BUCKET_SET_KEY]
    loaded = load_bucket_set(path)
    both = sorted(set(loaded) & set(override))
    if both:
        raise NeuronConfigError(
            f"override_neuron_config sets {', '.join(both)} both inline and in "
            f"{BUCKET_SET_KEY}={path}; keep one of them.")
    merged = {k: v for k, v in override.items() if k != BUCKET_SET_KEY}
    merged.update(loaded)
    return merged


def override_neuron_config(vllm_config: Any) -> dict[str, Any]:
    additional = vllm_config.additional_config or {}
    override = additional.get(OVERRIDE_KEY) or {}
    if not isinstance(override, dict):
        raise NeuronConfigError(
            f"additional_config.{OVERRIDE_KEY} must be a JSON object, got "
            f"{type(override).__name__}; pass e.g. --additional-config "
            f"'{{\"{OVERRIDE_KEY}\": {{\"enable_bucketing\": true}}}}'."
        )
    return with_bucket_set(override)


def selected_backend() -> str:
    return os.environ.get(BACKEND_ENV, "nxd")


def resolve_from_vllm_config(vllm_config: Any, backend: str) -> NeuronSettings:
    architecture = (vllm_config.model_config.architectures or ["unknown"])[0]
    return resolve_settings(engine_limits(vllm_config), override_neuron_config(vllm_config),
                            backend=backend, architecture=architecture)


def store_settings(vllm_config: Any, settings: NeuronSettings) -> None:
    if vllm_config.additional_config is None:
        vllm_config.additional_config = {}
    vllm_config.additional_config[SETTINGS_KEY] = settings.to_dict()


def settings_from_vllm_config(vllm_config: Any) -> NeuronSettings:
    stored = (vllm_config.additional_config or {}).get(SETTINGS_KEY)
    if stored is None:
        raise RuntimeError(
            "the Neuron platform did not resolve its settings for this VllmConfig; the "
            "neuron_plugin worker must run under the Neuron platform (check that "
            "'Platform plugin neuron is activated' appears in the log)."
        )
    return NeuronSettings.from_dict(stored)
