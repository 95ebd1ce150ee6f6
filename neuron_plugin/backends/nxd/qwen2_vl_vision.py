"""The Qwen2-VL and Qwen2.5-VL vision encoders on the nxd backend: one image through the
graph of its plugin vision bucket of the plugin's own encoder (families/qwen2_vl/
modeling.py), with the grid-dependent inputs the host computes as the reference
backend's vision graph takes them (backends/reference/patch_layout.py patch_inputs): the
patches padded with zero rows, each patch's (row, column) for the 2-D rotary, its frame
and its window (Qwen2.5-VL: `window_size` pixels a side, in merge groups as transformers'
vit_merger_window_size; Qwen2-VL: its frame again), -1 for padding. The answer is the
plugin's embedding layout (core.vision): [patches / merge**2, text hidden] float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.reference.patch_layout import patch_inputs
from neuron_plugin.core.vision import ImageInputs


def graph_inputs(wrapper: Any, image: ImageInputs, bucket: int) -> tuple[torch.Tensor, ...]:
    """The vision graph's inputs for `image` in `bucket` (a padding image: all padding)."""
    vision = wrapper.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.zeros((bucket, width), dtype=vision.neuron_config.torch_dtype)
    patches = image.patches
    if patches:
        pixels[:patches] = torch.from_numpy(np.asarray(image.pixel_values, dtype=np.float32))
    merge = int(vision.spatial_merge_size)
    window = int(getattr(vision, "window_size", 0)) // merge // int(vision.patch_size)
    rotary_ids, groups = patch_inputs(np.asarray(image.grid_thw), merge, bucket, window)
    return (
        pixels,
        torch.from_numpy(rotary_ids.astype(np.int32)),
        torch.from_numpy(groups.astype(np.int32)),
    )


def encode(wrapper: Any, image: ImageInputs, bucket: int) -> np.ndarray:
    """`image`'s embeddings [tokens, text hidden] float32 from the vision graph of
    `bucket` (no rows for a padding image)."""
    merge = int(wrapper.config.vision_config.spatial_merge_size)
    with torch.inference_mode():
        hidden = wrapper._forward(*graph_inputs(wrapper, image, bucket))
    return hidden[: image.patches // (merge * merge)].float().numpy()
