"""Qwen2-VL and Qwen2.5-VL on NxDI: NxDI's Qwen2-VL image-to-text application with a
vision encoder of the plugin's own that takes any image grid (`modeling`; Qwen2.5-VL's
tower, which NxDI lacks, built there too), driven by the plugin
(`backends/nxd/image_to_text.py`), equal to transformers with images, measured through
the plugin's backend on NxDI 0.8 and 0.9 (tests/e2e/test_nxdi_qwen_vl.py), in the
contiguous layout only: NxDI's Qwen2VLInferenceConfig switches the block layout and
prefix caching off (the backend refuses them by name), and its application passes no
adapter ids (LoRA) and builds no speculation submodel."""

from __future__ import annotations

from neuron_plugin.backends.nxd.families import NxDFamily, missing_patches, qwen3_vl
from neuron_plugin.backends.nxd.support import REFUSED, Support, by_release
from neuron_plugin.patches import i2t_capture_hook, qwen2_vl_mrope, vision_scatter

_NO_BLOCKS = Support(
    REFUSED,
    "NxDI's Qwen2-VL takes the contiguous KV layout only (Qwen2VLInferenceConfig turns "
    "the block layout off)",
)
# Qwen3-VL's (the same image-to-text application), with Qwen2-VL's reason for the layout
_TABLE = {**qwen3_vl.TABLE, "block": _NO_BLOCKS, "prefix_hit": _NO_BLOCKS}
PATCHES = (qwen2_vl_mrope.NAME, vision_scatter.NAME, i2t_capture_hook.NAME)

FAMILY = NxDFamily(
    support=by_release(_TABLE, _TABLE),
    problems=missing_patches(
        PATCHES,
        "NxDI's Qwen2-VL text model would rotate image tokens without M-RoPE and its "
        "image merge overwrite a full context bucket's last token, and NxDI 0.8's "
        "image-to-text forward raises NameError",
    ),
)
