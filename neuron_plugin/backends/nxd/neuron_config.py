"""The resolved settings as NxDI's NeuronConfig keyword arguments.

NxDI gets explicit bucket lists, always with `enable_bucketing=True`, so it compiles
exactly the graphs the settings list (bucketing "off" is a one-bucket grid). NxDI adds
prefix length 0 to the prefix grid itself, so it is not passed. Every key NxDI would
drop, and every passed-through key the backend needs set otherwise, is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings

# Passed-through NeuronConfig keys the backend completes rather than replaces.
MERGED_KEYS = frozenset({"on_device_sampling_config"})


def neuron_config_kwargs(settings: NeuronSettings) -> dict[str, Any]:
    """NeuronConfig(**kwargs) for the settings (see the module docstring for why); a
    passed-through override_neuron_config key that the plugin sets differently is an
    error rather than a silent overwrite."""
    s = settings
    derived: dict[str, Any] = {
        "tp_degree": s.tp_degree,
        "batch_size": s.max_num_seqs,
        "ctx_batch_size": s.ctx_batch_size,
        "tkg_batch_size": s.max_num_seqs,
        # NxDI requires every token-generation bucket <= seq_len; in the block layout the
        # largest is max_model_len rounded up to whole KV blocks (settings.resolve_grids).
        "seq_len": max(s.max_model_len, s.token_generation_buckets[-1]),
        "max_context_length": s.max_context_length,
        "torch_dtype": s.dtype,
        "padding_side": "right",
        "is_continuous_batching": s.passthrough.get("is_continuous_batching", s.max_num_seqs > 1),
        "enable_bucketing": True,
        "context_encoding_buckets": list(s.context_encoding_buckets),
        "token_generation_buckets": list(s.token_generation_buckets),
        "is_block_kv_layout": s.is_block_layout,
        "is_prefix_caching": s.is_block_layout,
    }
    if s.is_block_layout:
        derived.update(
            prefix_buckets=[p for p in s.prefix_buckets if p != 0],
            pa_num_blocks=s.num_blocks,
            pa_block_size=s.block_size,
        )
    if batch_bucketing(s):
        derived["token_generation_batches"] = list(s.token_generation_batches)
    if s.on_device_sampling:
        derived["on_device_sampling_config"] = on_device_sampling_config(
            s.passthrough.get("on_device_sampling_config") or {}, s.global_topk
        )
        # Logits as well as tokens from the context-encoding graphs (one row a call)
        # and the token-generation logits graphs, so requests on-device sampling cannot
        # serve are sampled on the host from the same call; the other token-generation
        # graphs return tokens alone (graphs.add_logits_graphs).
        derived["output_logits"] = True
    clashes = sorted(
        k
        for k in derived
        if k in s.passthrough and k not in MERGED_KEYS and s.passthrough[k] != derived[k]
    )
    if clashes:
        raise NeuronConfigError(
            "; ".join(
                f"override_neuron_config.{k}={s.passthrough[k]!r} but the nxd backend "
                f"needs {derived[k]!r}"
                for k in clashes
            )
            + "; remove the key(s) (output_logits must stay on with on-device sampling)."
        )
    return {**s.passthrough, **derived}


def on_device_sampling_config(user: Mapping[str, Any], global_topk: int) -> dict[str, Any]:
    """The user's OnDeviceSamplingConfig fields with the resolved global_topk and
    `dynamic=True` (as vllm-neuron sets it): NxDI's Sampler is argmax unless do_sample
    or dynamic is set, and without dynamic it applies the temperature and top-p traced
    at compile time instead of each row's (NxDI modules/generation/sampling.py Sampler).
    `deterministic` stays the user's (default False: a fixed 0.5 draw otherwise)."""
    if user.get("dynamic", True) is not True:
        raise NeuronConfigError(
            f"override_neuron_config.on_device_sampling_config.dynamic="
            f"{user['dynamic']!r}: NxDI's on-device sampler then ignores each request's "
            f"temperature and top-p (greedy unless do_sample is set); remove dynamic "
            f"(the nxd backend sets it to true)."
        )
    return {
        **user,
        "global_topk": global_topk,
        "dynamic": True,
        "deterministic": bool(user.get("deterministic", False)),
    }


def unknown_kwargs(neuron_config: object, kwargs: Mapping[str, Any]) -> list[str]:
    """Keys NeuronConfig dropped (it logs and ignores unknown keys): an older NxDI
    would otherwise silently compile other graphs than the settings list."""
    return sorted(k for k in kwargs if not hasattr(neuron_config, k))


def batch_bucketing(settings: NeuronSettings) -> bool:
    """Whether NxDI gets token_generation_batches (its 0.8+ 2-D token-generation path)."""
    return tuple(settings.token_generation_batches) != (settings.max_num_seqs,)
