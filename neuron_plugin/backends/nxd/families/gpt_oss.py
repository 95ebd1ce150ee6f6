"""gpt-oss on NxDI: openai's MXFP4 checkpoint as shipped, contiguous layout only (its
own KV cache manager), even layers windowed (modeling_gpt_oss.py get_updated_configs),
and the config keys NxDI hard-codes or requires."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd.families import NxDFamily, Text, layers, one_decode_length
from neuron_plugin.backends.nxd.families.llama import short_bucket_problems
from neuron_plugin.backends.nxd.support import (
    COMMON,
    EQUAL,
    REFUSED,
    WINDOWED_SPECULATION,
    Support,
    by_release,
)
from neuron_plugin.core.settings import NeuronSettings

# gpt-oss config values NxDI 0.9 hard-codes (modeling_gpt_oss.py GptOssInferenceConfig
# __init__, NeuronGptOssMoE.__init__), with transformers' defaults where the key is absent.
GPT_OSS_FIXED = {"rms_norm_eps": 1e-5, "swiglu_limit": 7.0}


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    name = f"GptOssForCausalLM on {release}"
    found = []
    if settings.is_block_layout:
        found.append(
            f"{name} in the block KV layout ({settings.kv_layout_reason}): NxDI keeps its "
            f"own per-sequence KV cache whatever the layout (modeling_gpt_oss.py "
            f"NeuronGptOssModel.init_inference_optimization, GptOssKVCacheManager), so "
            f"block tables are never read, and a prefill over a cached prefix runs "
            f"token-generation attention (attention_base.py windowed_attention_forward: "
            f"is_token_gen = past_key_value is not None) and fails; serve without "
            f"--enable-prefix-caching and chunked prefill (contiguous layout)."
        )
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method != "mxfp4":
        found.append(
            f"{name}: the checkpoint's experts are not MXFP4 (quantization_config "
            f"quant_method {method!r}); NxDI reads them only as openai ships them, "
            f"`*_blocks` / `*_scales` (modeling_gpt_oss.py "
            f"convert_hf_format_state_dict_bf16_compute): serve openai's checkpoint, or "
            f"this one on the reference backend."
        )
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if rope.get("rope_type") != "yarn":
        found.append(
            f"{name}: rope type {rope.get('rope_type')!r}; NxDI computes gpt-oss's RoPE as "
            f"YaRN from rope_scaling (GptOssRotaryEmbedding): use openai's config."
        )
    initial = text.get("initial_context_length")
    if initial is None or initial != rope.get("original_max_position_embeddings"):
        found.append(
            f"{name}: initial_context_length={initial!r}, which NxDI's YaRN uses where "
            f"transformers uses rope_scaling.original_max_position_embeddings="
            f"{rope.get('original_max_position_embeddings')!r} (GptOssRotaryEmbedding); set "
            f"it to that value in config.json (openai's checkpoints have both equal)."
        )
    window = text.get("sliding_window")
    if window is not None and window % 128:
        found.append(
            f"{name}: sliding_window={window}; NxDI sizes the window's KV cache to the next "
            f"multiple of 128 and fails to load any other (gpt_oss_kv_cache_manager.py "
            f"_init_kv_shape, get_kernel_cache_size_bucket): use a window that is a "
            f"multiple of 128 (openai's is 128)."
        )
    for key, value in GPT_OSS_FIXED.items():
        if text.get(key, value) != value:
            found.append(
                f"{name}: {key}={text[key]!r}, which NxDI hard-codes as {value} "
                f"(modeling_gpt_oss.py); serve this checkpoint on the reference backend."
            )
    found += one_decode_length(settings, name, _WHOLE_CACHE)
    # its even layers take NxDI's windowed attention whatever max_model_len
    return found + short_bucket_problems(settings, window, name)


# measured on torch-xla's device and in the CPU mode: the decode's mask has the bucket's
# width (compute_for_token_gen), the cache read (gpt_oss_kv_cache_manager.py
# get_kv_by_layer_id: `seq_len = self.v_shapes[idx][2]`, ef2731e lines 168-169, cd3abf3
# 174-175) the largest bucket's
_WHOLE_CACHE = (
    "NxDI's gpt-oss reads each full-attention layer's KV cache over its whole length "
    "whatever the bucket (GptOssKVCacheManager.get_kv_by_layer_id)"
)


def windows(text: Text, max_model_len: int) -> tuple[int | None, ...]:
    window = text.get("sliding_window")
    return tuple(window if i % 2 == 0 else None for i in range(layers(text)))


_BLOCK = Support(
    REFUSED,
    "NxDI's gpt-oss keeps its own per-sequence KV cache in any layout "
    "(GptOssKVCacheManager) and fails on a prefix-cache hit; serve it in the contiguous "
    "layout",
)
FAMILY = NxDFamily(
    support=by_release(
        {
            **COMMON,
            "speculation": WINDOWED_SPECULATION,
            "block": _BLOCK,
            "prefix_hit": _BLOCK,
            "quantization": Support(
                EQUAL, "openai's MXFP4 experts (NxDI dequantizes them at load); others untested"
            ),
        }
    ),
    windows=windows,
    problems=problems,
)
