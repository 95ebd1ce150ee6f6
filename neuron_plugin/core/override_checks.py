"""Checks of `override_neuron_config` values, one key or one vLLM setting at a time.

Each raises `NeuronConfigError` naming the key, its value and the fix;
`core.settings.resolve_settings` runs them before it decides anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.neuron_settings import EngineLimits
from neuron_plugin.core.vllm_flags import flag_problems
from neuron_plugin.core.vllm_neuron_env import environment_problems


def int_setting(override: Mapping[str, Any], key: str) -> int | None:
    value = override.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise NeuronConfigError(
            f"override_neuron_config.{key}={value!r} must be a positive integer; "
            f"fix the value or remove the key."
        )
    return value


def bool_setting(override: Mapping[str, Any], key: str) -> bool | None:
    value = override.get(key)
    if value is not None and not isinstance(value, bool):
        raise NeuronConfigError(f"override_neuron_config.{key}={value!r} must be true or false.")
    return value


_SPECULATION = (
    "speculative decoding is set with vLLM's --speculative-config, from which the plugin "
    'derives NxDI\'s speculation keys (e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4}\', or \'{"model": DRAFT_DIR, '
    '"num_speculative_tokens": 4}\' for NxDI\'s fused speculation, or \'{"method": '
    '"eagle3", "model": HEAD_DIR, "num_speculative_tokens": 4}\' for its EAGLE '
    "speculation); remove the key"
)

# NxDI features this plugin does not drive: any value but null, false or 0 turns the
# feature on in NxDI (an empty chunked_prefill_config object included) and is rejected.
UNSUPPORTED_KEYS = {
    "chunked_prefill_config": (
        "chunked prefill here runs one request's chunk per context-encoding call on the "
        "block-layout (chunk x prefix) graphs, not NxDI's multi-request chunked-prefill "
        "kernel; --enable-chunked-prefill and --max-num-batched-tokens set it up, so "
        "remove chunked_prefill_config"
    ),
    "allow_input_truncation": (
        "a prompt longer than the largest bucket is rejected with HTTP 400 instead of "
        "being truncated; remove allow_input_truncation"
    ),
    "async_mode": (
        "NxDI dispatches it from ModelWrapper._forward (_process_async_inputs -> "
        "nxd_model.forward_async, NxDI 0.9 model_wrapper.py lines 705-707, 1145-1234), "
        "which the plugin replaces to run each graph by its tag (backends/nxd/graphs.py "
        "TaggedGraphs), and answers with NxDI's AsyncTensorWrapper, which the plugin "
        "does not read; steps overlap through vLLM's async scheduling instead (on by "
        "default with on-device sampling), so remove async_mode"
    ),
    "speculation_length": _SPECULATION,
    "enable_fused_speculation": _SPECULATION,
    "enable_eagle_speculation": _SPECULATION,
    "is_eagle3": _SPECULATION,
    "is_medusa": "Medusa heads are not supported; remove the key",
}


def reject_unsupported(limits: EngineLimits, override: Mapping[str, Any]) -> None:
    for key, reason in UNSUPPORTED_KEYS.items():
        if key in override and override[key] not in (None, False, 0):
            raise NeuronConfigError(
                f"override_neuron_config.{key}={override[key]!r} is not supported: {reason}."
            )
    if override.get("padding_side", "right") != "right":
        raise NeuronConfigError(
            f"override_neuron_config.padding_side={override['padding_side']!r}: the "
            f"plugin pads inputs on the right (NxDI's default); remove padding_side."
        )
    if override.get("is_continuous_batching") is False and limits.max_num_seqs > 1:
        raise NeuronConfigError(
            f"override_neuron_config.is_continuous_batching=false contradicts "
            f"max_num_seqs={limits.max_num_seqs}: vLLM batches requests continuously; "
            f"remove is_continuous_batching or pass --max-num-seqs 1."
        )
    sampling = override.get("on_device_sampling_config")
    if sampling is not None and not isinstance(sampling, Mapping):
        raise NeuronConfigError(
            f"override_neuron_config.on_device_sampling_config={sampling!r} must be an "
            f'object of NxDI OnDeviceSamplingConfig fields, e.g. {{"global_topk": 256}}.'
        )


def refuse_what_cannot_work(
    limits: EngineLimits,
    override: Mapping[str, Any],
    environ: Mapping[str, str],
    nxdi_version: str | None,
    architecture: str = "",
) -> None:
    """vLLM flags Neuron cannot honour, vllm-neuron variables set in a way that cannot
    work, and override_neuron_config keys NxDI does not know or values of the wrong type:
    every problem at once, before anything else is decided."""
    # pydantic comes with vLLM; the backend runner's environment never resolves settings.
    from neuron_plugin.core.override_schema import override_problems

    problems = (
        flag_problems(limits.vllm_flags, architecture)
        + environment_problems(environ, enable_chunked_prefill=limits.enable_chunked_prefill)
        + override_problems(override, nxdi_version)
    )
    if problems:
        raise NeuronConfigError(" ".join(problems))


def context_buckets_fit(override: Mapping[str, Any], limits: EngineLimits) -> None:
    """Without max_context_length the longest prompt is max_model_len: name the limit the
    user set, not NxDI's key they never wrote."""
    buckets = override.get("context_encoding_buckets")
    if "max_context_length" in override or not buckets or max(buckets) <= limits.max_model_len:
        return
    raise NeuronConfigError(
        f"override_neuron_config.context_encoding_buckets={list(buckets)} has "
        f"{max(buckets)}, above max_model_len={limits.max_model_len} (no prompt is longer); "
        f"remove buckets above {limits.max_model_len} or raise --max-model-len."
    )


def agree(override: Mapping[str, Any], key: str, vllm_name: str, vllm_value: Any) -> None:
    """NxDI keys that duplicate a vLLM setting must match it: vLLM's value wins nowhere
    silently, so a mismatch is an error rather than an overwrite."""
    if key in override and override[key] != vllm_value:
        raise NeuronConfigError(
            f"override_neuron_config.{key}={override[key]!r} contradicts vLLM's "
            f"{vllm_name}={vllm_value!r}; remove the key (the plugin derives it from "
            f"vLLM) or pass --{vllm_name.replace('_', '-')} {override[key]}."
        )
