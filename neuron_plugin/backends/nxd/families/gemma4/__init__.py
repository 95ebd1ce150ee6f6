"""Gemma 4 (text) on the nxd backend: a class of the plugin's own on NxDI's base classes
(`modeling.NeuronGemma4ForCausalLM`; NxDI has no Gemma 4 in any release), for
Gemma4ForCausalLM and the language model of Gemma4ForConditionalGeneration. This module
imports no NxDI (compat reads it in vLLM's environment): what the class serves per
release and feature, each layer's window as it applies it (config.json's layer types,
read by `core.gemma4`), and what it refuses before anything compiles: config.json settings it
does not compute as transformers does, and NeuronConfig keys that would put NxDI's
kernels, parallelism or cache layouts on paths the class does not take."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd.families import NxDFamily, Text
from neuron_plugin.backends.nxd.own_classes import refusals
from neuron_plugin.backends.nxd.support import EQUAL, REFUSED, Support, by_release
from neuron_plugin.core.gemma4 import (
    SLIDING,
    config_problems,
    layer_types,
)
from neuron_plugin.core.settings import NeuronSettings

CLASS = "neuron_plugin.backends.nxd.families.gemma4.modeling:NeuronGemma4ForCausalLM"

# NeuronConfig keys (override_neuron_config) that switch NxDI onto kernels, parallelism
# or KV cache layouts the class does not implement: its attention, KV packing, MLP and
# MoE are plain torch over NxD's parallel layers (modeling.py), and it reads NxDI's GQA
# projections unfused (gqa.py GroupQueryAttention_QKV q_proj/k_proj/v_proj).
UNSUPPORTED_KEYS: Mapping[str, str] = {
    "fused_qkv": "its attention reads the q, k and v projections apart (keys as values)",
    "qkv_kernel_enabled": "the QKV kernel needs fused_qkv and transposes its weights",
    "qkv_nki_kernel_enabled": "the QKV kernel needs fused_qkv and transposes its weights",
    "qkv_cte_nki_kernel_fuse_rope": "the fused QKV kernel applies NxDI's RoPE",
    "qkv_kernel_fuse_residual_add": "the fused QKV kernel adds NxDI's residual",
    "attn_kernel_enabled": "its attention is its own (scaling 1, windows per layer type)",
    "attn_tkg_nki_kernel_enabled": "its attention is its own",
    "attn_tkg_builtin_kernel_enabled": "its attention is its own",
    "attn_block_tkg_nki_kernel_enabled": "its attention is its own (and the kernel pads "
    "block tables with -1)",
    "attn_block_tkg_nki_kernel_cache_update": "its attention is its own",
    "attn_block_cte_nki_kernel_enabled": "its attention is its own",
    "out_proj_kernel_enabled": "the output-projection kernel expects NxDI's attention layout",
    "mlp_kernel_enabled": "its MLP is NxD's parallel linears",
    "quantized_mlp_kernel_enabled": "its MLP is NxD's parallel linears",
    "mlp_kernel_fuse_residual_add": "its MLP is NxD's parallel linears",
    "k_cache_transposed": "its KV cache rows are packed (heads, dim), not transposed",
    "flash_decoding_enabled": "its decode attends the whole cache on each rank",
    "sequence_parallel_enabled": "its layers take whole sequences",
    "windowed_context_encoding_size": "its prefill encodes the whole bucket at once",
    "vocab_parallel": "its embeddings are sharded across the embedding dimension",
    "kv_cache_quant": "its KV cache is in the model's dtype",
    "layer_boundary_markers": "its decoder layers are its own",
}
# degrees above 1 the class does not implement
UNSUPPORTED_DEGREES: Mapping[str, str] = {
    "cp_degree": "context parallelism",
    "attention_dp_degree": "attention data parallelism",
    "ep_degree": "expert parallelism (its MoE block holds every expert on each rank)",
    "pp_degree": "pipeline parallelism",
}


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    name = f"{settings.architecture} on {release} (the plugin's own Gemma 4 class)"
    reference = "serve it on the reference backend (VLLM_NEURON_BACKEND=reference)"
    found = [f"{name}: {problem}; {reference}." for problem in config_problems(text)]
    return found + refusals.problems(name, settings, UNSUPPORTED_KEYS, UNSUPPORTED_DEGREES)


def windows(text: Text, max_model_len: int) -> tuple[int | None, ...]:
    """Each layer's window as the class applies it: config.json's sliding layers see
    `sliding_window` keys (q - k < window), the full layers all."""
    layers = int(text.get("num_hidden_layers") or 0)
    window = int(text.get("sliding_window") or 512)
    return tuple(window if kind == SLIDING else None for kind in layer_types(text, layers))


_OWN = "the plugin's own class (families/gemma4/modeling.py)"
TABLE = {
    "contiguous": Support(EQUAL, _OWN),
    "block": Support(EQUAL, _OWN),
    "prefix_hit": Support(EQUAL, _OWN + ": its own masked attention over the cached prefix"),
    "on_device_sampling": Support(EQUAL, "NxDI's sampler over the soft-capped logits"),
    "speculation": Support(REFUSED, "the class implements no draft or verification model"),
    "lora": Support(REFUSED, "the class's projections are not NxDI's LoRA modules"),
    "quantization": Support(REFUSED, "NxDI's quantization does not convert the class's layers"),
}
FAMILY = NxDFamily(support=by_release(TABLE, TABLE), windows=windows, problems=problems)
