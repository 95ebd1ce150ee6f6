"""The schema of `override_neuron_config`: every key NxDI's NeuronConfig reads, its type
and range, per supported NxDI release. A misspelt key would otherwise reach NxDI, which
logs it and carries on, so unknown keys are refused with the closest known key named.

Where the facts come from: the `kwargs.pop(name, default)` calls of `NeuronConfig`,
`MoENeuronConfig`, `MultimodalVisionNeuronConfig`, `OnDeviceSamplingConfig` and
`ChunkedPrefillConfig` in `models/config.py` of neuronx-distributed-inference 0.7.14366
(tag v0.7.14366, fcb5a86), 0.8 (cd3abf3) and 0.9 (c63afe0), plus the router keys
`MoENeuronConfig` forwards to neuronx-distributed's `RouterConfig.from_kwargs`. A key's
type follows its NxDI default (a key defaulting to None may be null); keys this plugin
interprets are typed as it reads them (bucket grids, block counts). Releases only add
keys (0.7 -> 0.9), so a release's keys are the 0.7 set plus `ADDED_IN` up to it.

This module holds facts and messages only; `core.settings.resolve_settings` decides.
pydantic is vLLM's dependency: only vLLM's side resolves settings, so the backend
runner's environment never imports this module.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
)

NXDI_RELEASES = ("0.7", "0.8", "0.9")
PREFIX = "override_neuron_config"

_STRICT = ConfigDict(extra="forbid", strict=True)
_Positive = Annotated[StrictInt, Field(gt=0)]
_Count = Annotated[StrictInt, Field(ge=0)]

# kind -> (type, what the message says a value must be)
_KINDS: dict[str, tuple[Any, str]] = {
    "bool": (StrictBool, "true or false"),
    "positive": (_Positive, "a positive integer"),
    "count": (_Count, "a whole number >= 0"),
    "number": (StrictFloat, "a number"),
    "positive_number": (Annotated[StrictFloat, Field(gt=0)], "a number > 0"),
    "probability": (Annotated[StrictFloat, Field(gt=0, le=1)], "a number in (0, 1]"),
    "text": (StrictStr, "a string"),
    "dtype": (
        Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"],
        "one of 'float32', 'float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2'",
    ),
    "padding_side": (Literal["left", "right"], "'left' or 'right'"),
    "cast_type": (Literal["config", "as-declared"], "'config' or 'as-declared'"),
    "grid": (
        Annotated[list[_Positive], Field(min_length=1)],
        "a non-empty list of positive integers in increasing order, e.g. [128, 512, 2048]",
    ),
    "prefix_grid": (list[_Count], "a list of whole numbers >= 0, e.g. [0, 512, 2048]"),
    "list": (list, "a list"),
    "object": (dict[str, Any], "an object"),
    "any": (Any, "any value"),
}

# NeuronConfig keys (and the MoE / multimodal subclasses' keys) by kind; a trailing "?"
# marks a key whose NxDI default is None, which may therefore be null.
_NXDI_KEYS = {
    "bool": """
        allow_input_truncation apply_seq_ids_mask async_mode attn_block_cte_nki_kernel_enabled
        attn_block_tkg_nki_kernel_cache_update attn_block_tkg_nki_kernel_cascaded_attention
        attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb attn_block_tkg_nki_kernel_enabled
        attn_block_tkg_nki_kernel_use_online_softmax attn_tkg_builtin_kernel_enabled
        attn_tkg_nki_kernel_enabled bucket_n_active_tokens disable_argmax_kernel
        disable_kv_cache_tiling disable_normalize_top_k_affinities disable_numeric_cc_token
        eagle_rolling_buffer_kernel_enabled early_expert_affinity_modulation enable_bucketing
        enable_cte_modular_flow enable_eagle_draft_input_norm enable_eagle_speculation
        enable_fused_speculation enable_output_completion_notifications
        enable_spill_reload_dge enable_ve_data_parallel flash_decoding_enabled fused_qkv
        fused_rmsnorm_skip_gamma fused_shared_experts glu_mlp is_block_kv_layout
        is_continuous_batching is_eagle3 is_eagle_draft is_full_model_shuffled is_medusa
        is_mxfp4_compute is_prefix_caching k_cache_transposed kv_cache_quant
        layer_boundary_markers lm_head_pad mlp_kernel_enabled mlp_kernel_fuse_residual_add
        mlp_tkg_nki_kernel_enabled moe_mask_padded_tokens on_cpu out_proj_kernel_enabled
        output_logits overrides_torch_dtype pre_rope_rmsnorm qk_layernorm
        qkv_cte_nki_kernel_fuse_rope qkv_kernel_enabled qkv_kernel_fuse_residual_add
        qkv_kernel_nbsd_layout qkv_nki_kernel_enabled quantized quantized_mlp_kernel_enabled
        return_expert_index return_router_logits rmsnorm_quantize_kernel_enabled
        save_sharded_checkpoint sequence_parallel_enabled
        shared_experts_sequence_parallel_enabled skip_sharding skip_vision skip_warmup
        strided_context_parallel_kernel_enabled switch_cc transpose_shared_experts_weights
        use_index_calc_kernel vocab_parallel
        attn_kernel_enabled? expert_mlp_nki_kernel_enabled? moe_fused_nki_kernel_enabled?
        router_topk_nki_kernel_enabled? shared_mlp_nki_kernel_enabled?""",
    "positive": """
        attention_dp_degree batch_size cc_pipeline_tiling_factor cp_degree ctx_batch_size
        ep_degree kv_cache_batch_size lm_head_pad_alignment_size max_batch_size
        max_context_length max_length mlp_cp_degree moe_ep_degree moe_tp_degree
        n_active_tokens n_positions pa_block_size pa_num_blocks pp_degree seq_len
        seq_len_threshold_for_cc_tiling spec_batch_size tkg_batch_size tp_degree
        weight_gather_seq_len_threshold
        local_ranks_size? logical_nc_config? logical_neuron_cores? padded_hidden_size?
        padded_intermediate_size? scratchpad_page_size? windowed_context_encoding_size?
        world_size?""",
    "count": """
        kv_cache_padding_size medusa_speculation_length num_medusa_heads speculation_length
        start_rank_id max_new_tokens?""",
    "number": """
        hidden_act_bias hidden_act_scaling_factor quantize_clamp_bound capacity_factor?
        gate_clamp_lower_limit? gate_clamp_upper_limit? up_clamp_lower_limit?
        up_clamp_upper_limit?""",
    "text": """
        attn_cls ep_dispatch_cc_option glu_type quantization_dtype quantization_scale_dtype
        quantization_type router_act_fn activation_quantization_type?
        quantized_checkpoints_path? target?""",
    "dtype": "torch_dtype router_dtype attention_dtype? rpl_reduce_dtype?",
    "padding_side": "padding_side",
    "cast_type": "cast_type",
    "grid": "context_encoding_buckets token_generation_buckets token_generation_batches",
    "prefix_grid": "prefix_buckets",
    "list": """
        buckets weights_to_skip_layout_optimization draft_model_modules_to_not_convert?
        modules_to_not_convert?""",
    "object": """
        blockwise_matmul_config dma_order_config? hybrid_sharding_config? kv_quant_config?
        lora_config? router_config? tensor_capture_config? tensor_replacement_config?
        token_tree_config?""",
    "any": "medusa_tree? quantization_block_axis? quantization_block_size?",
}

# Keys a release added; every other key is in all of NXDI_RELEASES.
ADDED_IN = {
    "0.8": frozenset(
        {
            "attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb",
            "disable_argmax_kernel",
            "dma_order_config",
            "eagle_rolling_buffer_kernel_enabled",
            "ep_dispatch_cc_option",
            "kv_quant_config",
            "token_generation_batches",
            "weights_to_skip_layout_optimization",
        }
    ),
    "0.9": frozenset({"enable_ve_data_parallel"}),
}

# Keys this plugin reads that NeuronConfig does not take, their kind, and what they do
# (the generated reference says it: core.override_reference).
PLUGIN_KEYS = {
    "bucket_set": "text",
    "is_chunked_prefill": "bool",
    "max_batch_buckets": "positive",
    "token_generation_logits_buckets": "grid",
    "vision_buckets": "grid",
}
PLUGIN_KEY_MEANINGS = {
    "bucket_set": "a named bucket set, expanded into the grid keys before resolution",
    "is_chunked_prefill": (
        "NxDI derives it from chunked_prefill_config; here it must agree with "
        "--enable-chunked-prefill"
    ),
    "max_batch_buckets": (
        "at most this many decode batch sizes in the default token_generation_batches "
        "(powers of two up to max_num_seqs, thinned evenly beyond it; default 6). 1: one "
        "decode batch size, max_num_seqs, so every decode step computes max_num_seqs rows. "
        "Each size adds one token-generation graph per token_generation_buckets length"
    ),
    "token_generation_logits_buckets": (
        "nxd with on-device sampling: the context lengths whose token-generation graphs "
        "get a logits twin, which a decode step with a host-sampled row runs (the first "
        "that fits its longest row). Default: the largest token-generation length alone "
        "(one NEFF more; such a step runs there whatever its rows' lengths); list shorter "
        "lengths of token_generation_buckets to widen it (one NEFF each, and host-sampled "
        "steps run at their own length). Must hold the largest length"
    ),
    "vision_buckets": (
        "vision-language models: the vision encoder's graphs, in patches per image "
        "(multiples of spatial_merge_size squared); an image runs in the first that holds "
        "it. Default: powers of two from the processor's smallest image to its largest "
        "(max_pixels / patch_size squared). A larger image is refused with a 400"
    ),
}


def value_description(kind: str, nullable: bool) -> str:
    """What a value of this kind must be, as refusals and the reference say it."""
    says = _KINDS[kind][1]
    return f"{says} or null" if nullable else says


def _field(kind: str, nullable: bool, description: str | None = None) -> tuple[Any, Any]:
    annotation = _KINDS[kind][0]
    if nullable:
        annotation = annotation | None
    return annotation, Field(
        default=None, description=description or value_description(kind, nullable)
    )


def _sub_config(name: str, kinds: Mapping[str, str]) -> type[BaseModel]:
    fields = {key: _field(kind, False) for key, kind in kinds.items()}
    # pydantic's stub: mypy matches a **dict against __config__/__base__ as well
    return create_model(  # type: ignore[call-overload]  # pydantic's **fields stub
        name, __config__=_STRICT, **fields
    )


# NxDI's nested configs by field (OnDeviceSamplingConfig.sampling_dp_degree is 0.8+),
# typed so that a refusal names the field rather than a Python type.
_SUB_CONFIGS: dict[str, type[BaseModel]] = {
    "on_device_sampling_config": _sub_config(
        "OnDeviceSamplingConfig",
        {
            "do_sample": "bool",
            "dynamic": "bool",
            "deterministic": "bool",
            "top_k": "positive",
            "top_p": "probability",
            "temperature": "positive_number",
            "global_topk": "positive",
            "on_device_sampling_config": "bool",
            "top_k_kernel_enabled": "bool",
            "sampling_dp_degree": "positive",
        },
    ),
    "chunked_prefill_config": _sub_config(
        "ChunkedPrefillConfig",
        {
            "max_num_seqs": "count",
            "tkg_model_enabled": "bool",
            "kernel_q_tile_size": "positive",
            "kernel_kv_tile_size": "positive",
        },
    ),
}
_SUB_CONFIG_SAYS = {
    "on_device_sampling_config": "an object of NxDI OnDeviceSamplingConfig fields, e.g. "
    '{"global_topk": 256}, or null (off)',
    "chunked_prefill_config": "an object of NxDI ChunkedPrefillConfig fields",
}


def sub_config_fields() -> dict[str, list[str]]:
    """NxDI's nested configs the schema checks, and their fields."""
    return {key: list(model.model_fields) for key, model in _SUB_CONFIGS.items()}


def _parse_keys() -> dict[str, tuple[str, bool]]:
    keys: dict[str, tuple[str, bool]] = {}
    for kind, names in _NXDI_KEYS.items():
        for name in names.split():
            keys[name.rstrip("?")] = (kind, name.endswith("?"))
    return keys


NXDI_KEYS: dict[str, tuple[str, bool]] = _parse_keys()  # key -> (kind, nullable)
_ALL_KEYS = frozenset(NXDI_KEYS) | set(_SUB_CONFIGS)

# vLLM settings written as override keys by mistake (the AWS guide's own example does),
# with the flag that sets them: the plugin derives NxDI's value from vLLM's.
VLLM_SETTINGS = {
    "enable_prefix_caching": "--enable-prefix-caching / --no-enable-prefix-caching",
    "enable_chunked_prefill": "--enable-chunked-prefill / --no-enable-chunked-prefill",
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "num_gpu_blocks_override": "--num-gpu-blocks-override",
    "tensor_parallel_size": "--tensor-parallel-size",
    "dtype": "--dtype",
}
# Keys vllm-neuron reads itself (not NeuronConfig keys), with why they cannot work here.
VLLM_NEURON_KEYS = {
    "text_neuron_config": "it configures vllm-neuron's image-to-text models, and this "
    "plugin serves text-only decoder models",
    "vision_neuron_config": "it configures vllm-neuron's image-to-text models, and this "
    "plugin serves text-only decoder models",
}


def nxdi_release(version: str | None) -> str | None:
    """The supported release ("0.8") of an installed NxDI version ("0.8.16251"), or None
    when unknown (not installed here, or newer than the releases read)."""
    if not version:
        return None
    release = ".".join(version.split(".")[:2])
    return release if release in NXDI_RELEASES else None


def release_keys(release: str | None) -> frozenset[str]:
    """Keys NxDI `release` reads; None: every supported release's keys."""
    later = [
        keys
        for added, keys in ADDED_IN.items()
        if release is not None and NXDI_RELEASES.index(added) > NXDI_RELEASES.index(release)
    ]
    return _ALL_KEYS.difference(*later)


@functools.cache
def _schema(release: str | None) -> type[BaseModel]:
    fields = {key: _field(*NXDI_KEYS[key]) for key in release_keys(release) if key in NXDI_KEYS}
    fields.update({key: _field(kind, False) for key, kind in PLUGIN_KEYS.items()})
    fields.update(
        {
            key: (model | None, Field(default=None, description=_SUB_CONFIG_SAYS[key]))
            for key, model in _SUB_CONFIGS.items()
        }
    )
    # pydantic's stub: mypy matches a **dict against __config__/__base__ as well
    return create_model(  # type: ignore[call-overload]  # pydantic's **fields stub
        "OverrideNeuronConfig", __config__=_STRICT, **fields
    )


def _closest(word: str, known: set[str] | frozenset[str]) -> str | None:
    normalized = word.replace("-", "_").lower()
    if normalized in known:
        return normalized
    found = difflib.get_close_matches(normalized, sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None


def _unknown_key(key: str, value: Any, release: str | None, version: str | None) -> str:
    where = f"{PREFIX}.{key}={value!r}"
    if key in VLLM_SETTINGS:
        return (
            f"{where} is a vLLM setting, not an NxDI key: set it with vLLM's "
            f"{VLLM_SETTINGS[key]} and remove it here (the plugin derives NxDI's "
            f"values from vLLM's)."
        )
    if key in VLLM_NEURON_KEYS:
        return f"{where} is not supported: {VLLM_NEURON_KEYS[key]}; remove {key}."
    if key in _ALL_KEYS:
        added = next(r for r, keys in ADDED_IN.items() if key in keys)
        return (
            f"{where} needs NxDI {added} or newer, but the installed NxDI is {version} "
            f"(release {release}), which ignores it; upgrade NxDI or remove {key}."
        )
    suggestion = _closest(key, release_keys(release) | set(PLUGIN_KEYS))
    hint = (
        f"did you mean {suggestion}?"
        if suggestion
        else "remove it (the keys are NxDI NeuronConfig's: every accepted key is listed in "
        "docs/configuration/override-neuron-config.md)."
    )
    releases = f"NxDI {release}" if release else f"NxDI {NXDI_RELEASES[0]}-{NXDI_RELEASES[-1]}"
    return f"{where} is not a key of {releases}'s NeuronConfig nor of this plugin; {hint}"


def _describe(
    model: type[BaseModel], loc: tuple[Any, ...], override: Mapping[str, Any]
) -> tuple[str, Any, str]:
    """(dotted key, its value, what it must be) for a pydantic error location: the
    sub-config field when the error is inside one, else the top-level key."""
    key = str(loc[0])  # a field name: the top level is a mapping
    sub = _SUB_CONFIGS.get(key)
    field = sub.model_fields.get(str(loc[1])) if sub is not None and len(loc) > 1 else None
    if field is not None:
        return f"{key}.{loc[1]}", override[key][loc[1]], field.description or "valid"
    return key, override[key], model.model_fields[key].description or "valid"


def override_problems(override: Mapping[str, Any], nxdi_version: str | None = None) -> list[str]:
    """What is wrong with `override_neuron_config`, one message per key (empty: valid):
    keys unknown to the installed NxDI release (every supported release when
    `nxdi_version` is None), values of the wrong type or out of range."""
    release = nxdi_release(nxdi_version)
    known = release_keys(release) | set(PLUGIN_KEYS)
    problems = [
        _unknown_key(key, value, release, nxdi_version)
        for key, value in override.items()
        if key not in known
    ]
    model = _schema(release)
    try:
        model.model_validate({k: v for k, v in override.items() if k in known})
    except ValidationError as exc:
        seen = set()
        for error in exc.errors():
            loc = error["loc"]
            if error["type"] == "extra_forbidden":  # a field inside a sub-config
                parent, field = str(loc[0]), loc[-1]
                fields = set(_SUB_CONFIGS[parent].model_fields)
                suggestion = _closest(str(field), fields)
                problems.append(
                    f"{PREFIX}.{parent}.{field} is not a field of NxDI's "
                    f"{_SUB_CONFIGS[parent].__name__}; "
                    + (
                        f"did you mean {suggestion}?"
                        if suggestion
                        else f"use one of {', '.join(sorted(fields))}."
                    )
                )
                continue
            name, value, says = _describe(model, loc, override)
            if name not in seen:
                seen.add(name)
                problems.append(
                    f"{PREFIX}.{name}={value!r} must be {says}; fix the value or remove the key."
                )
    return problems
