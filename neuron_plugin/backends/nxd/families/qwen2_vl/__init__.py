"""Qwen2-VL and Qwen2.5-VL on NxDI: NxDI's Qwen2-VL image-to-text application with a
vision encoder of the plugin's own that takes any image grid (`modeling`; Qwen2.5-VL's
tower, which NxDI lacks, built there too), driven by the plugin
(`backends/nxd/image_to_text.py`), equal to transformers with images, measured through
the plugin's backend on NxDI 0.8 and 0.9 (tests/e2e/test_nxdi_qwen_vl.py), in the
contiguous layout only: NxDI's Qwen2VLInferenceConfig switches the block layout and
prefix caching off (the backend refuses them by name), and its application passes no
adapter ids (LoRA) and builds no speculation submodel."""

from __future__ import annotations

from neuron_plugin.backends.nxd import image_to_text
from neuron_plugin.patches import qwen2_vl_mrope

FAMILY = image_to_text.family(
    "Qwen2-VL",
    "Qwen2VLInferenceConfig turns the block layout off",
    "one or more per prompt, any grid",
    patches=(qwen2_vl_mrope.NAME,),
    without="NxDI's Qwen2-VL text model would rotate image tokens without M-RoPE",
)
