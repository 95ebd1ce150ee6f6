"""Qwen3-VL on NxDI: NxDI's image-to-text application (`backends/nxd/image_to_text.py`),
equal to transformers with images, measured through the plugin's backend on NxDI 0.8 and
0.9 (tests/e2e/test_nxdi_qwen_vl.py), in the contiguous layout only: NxDI's
Qwen3VLInferenceConfig raises for the block layout and prefix caching, and its
application passes no adapter ids (LoRA) and builds no speculation submodel."""

from __future__ import annotations

from neuron_plugin.backends.nxd.families import NxDFamily, missing_patches
from neuron_plugin.backends.nxd.support import EQUAL, QUANTIZED, REFUSED, Support, by_release
from neuron_plugin.patches import i2t_capture_hook, vision_scatter

_NO_BLOCKS = Support(
    REFUSED,
    "NxDI's Qwen3-VL takes the contiguous KV layout only (Qwen3VLInferenceConfig raises)",
)
TABLE = {
    "contiguous": Support(EQUAL, "text and images (one or more per prompt, any grid)"),
    "block": _NO_BLOCKS,
    "prefix_hit": _NO_BLOCKS,
    "on_device_sampling": Support(EQUAL),
    "speculation": Support(REFUSED, "NxDI's image-to-text application has no speculation"),
    "lora": Support(REFUSED, "NxDI's image-to-text forward passes no adapter ids"),
    "quantization": QUANTIZED,
}
PATCHES = (vision_scatter.NAME, i2t_capture_hook.NAME)

FAMILY = NxDFamily(
    support=by_release(TABLE, TABLE),
    problems=missing_patches(
        PATCHES,
        "NxDI's image merge would overwrite a full context bucket's last token, and NxDI "
        "0.8's image-to-text forward raises NameError",
    ),
)
