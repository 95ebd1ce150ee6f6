"""Qwen3-VL on NxDI: NxDI's image-to-text application (`backends/nxd/image_to_text.py`),
equal to transformers with images, measured through the plugin's backend on NxDI 0.8 and
0.9 (tests/e2e/test_nxdi_qwen_vl.py), in the contiguous layout only: NxDI's
Qwen3VLInferenceConfig raises for the block layout and prefix caching, and its
application passes no adapter ids (LoRA) and builds no speculation submodel."""

from __future__ import annotations

from neuron_plugin.backends.nxd import image_to_text

FAMILY = image_to_text.family(
    "Qwen3-VL", "Qwen3VLInferenceConfig raises", "one or more per prompt, any grid"
)
