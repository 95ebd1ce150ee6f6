"""Qwen3-MoE on NxDI: every layer a MoE layer (a checkpoint with dense layers is
refused); NxD's layer-boundary marker is the identity on the CPU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_plugin.backends.nxd.families import NxDFamily, Text, layers
from neuron_plugin.backends.nxd.support import COMMON, EQUAL, Support, by_release
from neuron_plugin.core.settings import NeuronSettings


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    """transformers' Qwen3-MoE has a dense MLP in `mlp_only_layers` and off the
    `decoder_sparse_step` (Qwen3MoeDecoderLayer); NxDI's makes every layer a MoE layer."""
    step = text.get("decoder_sparse_step") or 1
    only = set(text.get("mlp_only_layers") or [])
    dense = [i for i in range(layers(text)) if i in only or (i + 1) % step]
    if not dense:
        return []
    return [
        f"Qwen3MoeForCausalLM on {release}: layers {dense} have a dense MLP in transformers "
        f"(mlp_only_layers={sorted(only)}, decoder_sparse_step={step}), but NxDI's model "
        f"makes every layer a MoE layer and reads a router for each (modeling_qwen3_moe.py "
        f"convert_qwen3_moe_hf_to_neuron_state_dict): serve this checkpoint on the "
        f"reference backend (VLLM_NEURON_BACKEND=reference)."
    ]


FAMILY = NxDFamily(
    support=by_release(
        {
            **COMMON,
            "contiguous": Support(
                EQUAL,
                "every layer MoE (a dense layer, mlp_only_layers, is refused); NxD's "
                "layer-boundary marker is the identity on the CPU",
            ),
        }
    ),
    problems=problems,
)
