"""Pixtral in transformers' Llava format on NxDI: NxDI's image-to-text application
(`backends/nxd/image_to_text.py`, its vision tower run by `backends/nxd/pixtral_vision.py`),
equal to transformers with images, measured through the plugin's backend on NxDI 0.8 and
0.9 (tests/e2e/test_nxdi_pixtral.py), in the contiguous layout only: NxDI's
PixtralInferenceConfig raises for the block layout and prefix caching."""

from __future__ import annotations

from neuron_plugin.backends.nxd import image_to_text

FAMILY = image_to_text.family(
    "Pixtral", "PixtralInferenceConfig raises", "one or more per prompt, up to image_size a side"
)
