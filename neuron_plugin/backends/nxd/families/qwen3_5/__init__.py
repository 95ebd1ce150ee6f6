"""Qwen3.5 (text, dense and MoE) on the nxd backend: a class of the plugin's own on NxDI's
base classes (`modeling.NeuronQwen35ForCausalLM`; NxDI has no Qwen3.5 in any release) for
Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and the language model of their multimodal
checkpoints. This module imports no NxDI (compat reads it in vLLM's environment):
what the class serves per release and feature, what it refuses before anything compiles,
and the config attribute the backend sets for it (`adjustments`: max_model_len, the
position of the decode pad rows that must leave the state as it is).

The class keeps each sequence's DeltaNet state (convolution inputs and recurrent state)
in its sequence slot beside the KV cache line, so it serves the contiguous KV layout
only: vLLM's state blocks of the block layout (prefix caching, chunked prefill) would
need a slot per state layer as a graph input NxDI's forward does not take."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd.families import NxDFamily, Text
from neuron_plugin.backends.nxd.own_classes import refusals
from neuron_plugin.backends.nxd.support import EQUAL, REFUSED, Support, by_release
from neuron_plugin.core.recurrent_state import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    layer_types,
    state_geometry,
)
from neuron_plugin.core.settings import NeuronSettings

CLASS = "neuron_plugin.backends.nxd.families.qwen3_5.modeling:NeuronQwen35ForCausalLM"
MAX_MODEL_LEN = "qwen3_5_max_model_len"  # the InferenceConfig attribute `adjustments` sets

_OWN_ATTENTION = "its attention is its own (output gate, partial RoPE, q/k norms)"
# NeuronConfig keys (override_neuron_config) that switch NxDI onto kernels, parallelism
# or KV cache layouts the class does not implement (modeling.py: plain torch over NxD's
# parallel layers, NxDI's GQA projections read unfused).
UNSUPPORTED_KEYS: Mapping[str, str] = {
    "fused_qkv": "its attention reads the q, k and v projections apart",
    "qkv_kernel_enabled": "the QKV kernel needs fused_qkv and transposes its weights",
    "qkv_nki_kernel_enabled": "the QKV kernel needs fused_qkv and transposes its weights",
    "qkv_cte_nki_kernel_fuse_rope": "the fused QKV kernel applies NxDI's RoPE",
    "qkv_kernel_fuse_residual_add": "the fused QKV kernel adds NxDI's residual",
    "attn_kernel_enabled": _OWN_ATTENTION,
    "attn_tkg_nki_kernel_enabled": _OWN_ATTENTION,
    "attn_tkg_builtin_kernel_enabled": _OWN_ATTENTION,
    "attn_block_tkg_nki_kernel_enabled": _OWN_ATTENTION,
    "attn_block_tkg_nki_kernel_cache_update": _OWN_ATTENTION,
    "attn_block_cte_nki_kernel_enabled": _OWN_ATTENTION,
    "out_proj_kernel_enabled": "the output-projection kernel expects NxDI's attention layout",
    "mlp_kernel_enabled": "its MLP is NxD's parallel linears",
    "quantized_mlp_kernel_enabled": "its MLP is NxD's parallel linears",
    "mlp_kernel_fuse_residual_add": "its MLP is NxD's parallel linears",
    "k_cache_transposed": "its attention reads the KV cache untransposed",
    "flash_decoding_enabled": "its decode attends the whole cache on each rank",
    "sequence_parallel_enabled": "its layers take whole sequences",
    "windowed_context_encoding_size": "its DeltaNet layers encode the whole prompt at once",
    "vocab_parallel": "its embeddings are sharded across the embedding dimension",
    "kv_cache_quant": "its KV cache is in the model's dtype",
    "layer_boundary_markers": "its decoder layers are its own",
}
UNSUPPORTED_DEGREES: Mapping[str, str] = {
    "cp_degree": "context parallelism",
    "attention_dp_degree": "attention data parallelism",
    "ep_degree": "expert parallelism",
    "pp_degree": "pipeline parallelism",
}

# the head counts each core takes an equal share of (the DeltaNet's value heads are a
# multiple of its key heads)
_SPLIT_HEADS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads")


def config_problems(text: Text) -> list[str]:
    """What of config.json the class does not compute."""
    found = []
    if state_geometry(text) is None:
        found.append("config.json has no linear_attention layers; it is not a Qwen3.5 text model")
    unknown = sorted(set(layer_types(text)) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        found.append(f"layer_types {unknown} are not Qwen3.5's")
    if text.get("attention_bias"):
        found.append("attention_bias=true; the class's attention projections have no bias")
    return found


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    name = f"{settings.architecture} on {release} (the plugin's own Qwen3.5 class)"
    reference = "serve it on the reference backend (VLLM_NEURON_BACKEND=reference)"
    found = [f"{name}: {problem}; {reference}." for problem in config_problems(text)]
    if settings.is_block_layout:
        found.append(
            f"{name} in the block KV layout ({settings.kv_layout_reason}): the class keeps "
            f"each sequence's DeltaNet state in its sequence slot of the contiguous layout "
            f"and takes no state blocks; serve it without --enable-prefix-caching and "
            f"--enable-chunked-prefill, or {reference}."
        )
    tp = settings.tp_degree
    undivided = {key: text.get(key) for key in _SPLIT_HEADS if int(text.get(key) or 1) % tp}
    if undivided:
        found.append(
            f"{name} with --tensor-parallel-size {tp}: {tp} does not divide "
            f"{', '.join(f'{k}={v}' for k, v in undivided.items())} (each core holds an "
            f"equal share of the attention and DeltaNet heads); serve it with a "
            f"--tensor-parallel-size that divides them, or {reference}."
        )
    return found + refusals.problems(name, settings, UNSUPPORTED_KEYS, UNSUPPORTED_DEGREES)


def adjustments(settings: NeuronSettings, text: Text) -> dict[str, Any]:
    """max_model_len: a decode row at position max_model_len - 1 is a pad row (no
    request decodes there: arguments._decode_arguments), whose state the class keeps."""
    return {MAX_MODEL_LEN: settings.max_model_len}


_OWN = "the plugin's own class (families/qwen3_5/modeling.py)"
_BLOCK = "its DeltaNet state lives in the sequence slot; it takes no vLLM state blocks"
TABLE = {
    "contiguous": Support(EQUAL, _OWN),
    "block": Support(REFUSED, _BLOCK),
    "prefix_hit": Support(REFUSED, _BLOCK),
    "on_device_sampling": Support(EQUAL, "NxDI's sampler"),
    "speculation": Support(
        REFUSED, "a speculative step would write the state past rejected drafts"
    ),
    "lora": Support(REFUSED, "the class's projections are not NxDI's LoRA modules"),
    "quantization": Support(REFUSED, "NxDI's quantization does not convert the class's layers"),
}
FAMILY = NxDFamily(support=by_release(TABLE, TABLE), problems=problems, adjustments=adjustments)
