"""Qwen3-VL on NxDI: NxDI's image-to-text application (`backends/nxd/image_to_text.py`),
equal to transformers with images, measured through the plugin's backend on NxDI 0.8 and
0.9 (tests/e2e/test_nxdi_qwen3_vl.py), in the contiguous layout only: NxDI's
Qwen3VLInferenceConfig raises for the block layout and prefix caching, and its
application passes no adapter ids (LoRA) and builds no speculation submodel."""

from __future__ import annotations

from collections.abc import Mapping

from neuron_plugin.backends.nxd.families import NxDFamily, Text
from neuron_plugin.backends.nxd.support import EQUAL, QUANTIZED, REFUSED, Support, by_release
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.patches import i2t_capture_hook, vision_scatter

_NO_BLOCKS = Support(
    REFUSED,
    "NxDI's Qwen3-VL takes the contiguous KV layout only (Qwen3VLInferenceConfig raises)",
)
_TABLE = {
    "contiguous": Support(EQUAL, "text and images (one or more per prompt, any grid)"),
    "block": _NO_BLOCKS,
    "prefix_hit": _NO_BLOCKS,
    "on_device_sampling": Support(EQUAL),
    "speculation": Support(REFUSED, "NxDI's image-to-text application has no speculation"),
    "lora": Support(REFUSED, "NxDI's image-to-text forward passes no adapter ids"),
    "quantization": QUANTIZED,
}
PATCHES = (vision_scatter.NAME, i2t_capture_hook.NAME)


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, object],
    text: Text,
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    """Without its patches NxDI's Qwen3-VL cannot be driven: the plugin pads image
    positions with the scratch row of vision-scatter-scratch-row, and NxDI 0.8's forward
    raises NameError without i2t-capture-hook."""
    disabled = [p for p in PATCHES if patch_status.get(p) == "disabled"]
    if not disabled:
        return []
    return [
        f"{settings.architecture} on {release} without the plugin's patches "
        f"{', '.join(disabled)} (VLLM_NEURON_DISABLE_PATCHES): NxDI's image merge "
        f"would overwrite a full context bucket's last token, and NxDI 0.8's "
        f"image-to-text forward raises NameError; remove them from "
        f"VLLM_NEURON_DISABLE_PATCHES."
    ]


FAMILY = NxDFamily(support=by_release(_TABLE, _TABLE), problems=problems)
