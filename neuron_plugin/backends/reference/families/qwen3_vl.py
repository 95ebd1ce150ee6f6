"""Qwen3-VL: Qwen3's layers with interleaved M-RoPE, and the Qwen2-VL family's vision
tower in its Qwen3 form (learned position grid, DeepStack mergers; `qwen2_vl`)."""

from typing import Any

from neuron_plugin.backends.reference.architecture import Architecture
from neuron_plugin.backends.reference.families.qwen2_vl import VisionSpec, mrope_section

ARCHITECTURES = {
    "Qwen3VLForConditionalGeneration": Architecture(
        "qwen3_vl",
        qk_norm=True,
        default_rope_theta=500_000.0,
        vision=True,
        mrope_interleaved=True,
        spec_fields=mrope_section,
    )
}


def tower(config: dict[str, Any]) -> VisionSpec:
    return VisionSpec.from_hf_config(config)
