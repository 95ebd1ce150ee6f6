"""Llama 4's vision encoder on the nxd backend: one image through NxDI's vision graph of
its vision bucket (models/llama4/modeling_llama4_vision.py `Llama4VisionModelWrapper`,
the same in 0.8 cd3abf3 and 0.9 ef2731e). NxDI buckets that graph by tiles (chunks) per
call and takes the tiles' pixels [tiles, C, S, S], zero tiles after the image's
(encoder_utils.pad_image_tensor); it answers [tiles, tokens per tile, text hidden]
after the projector. The plugin counts a vision bucket in patches, a whole number of
tiles of (S / patch)**2 patches each (core.vision.resolve_vision_buckets), and hands an
image as its tiles' patches (core.vision.tile_patches), which this turns back into
pixels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from neuron_plugin.core.vision import ImageInputs


def patches_per_tile(image_size: int, patch_size: int) -> int:
    """A tile's patches: (image_size / patch_size)**2."""
    return (image_size // patch_size) ** 2


def graph_inputs(wrapper: Any, image: ImageInputs, bucket: int) -> torch.Tensor:
    """The vision graph's pixels [bucket tiles, C, S, S] for `image` (tile_patches'
    layout: per tile, its patches row by row, each C x p x p values), zero tiles after."""
    vision = wrapper.config.vision_config
    patch, side = int(vision.patch_size), int(vision.image_size)
    channels = int(vision.num_channels)
    dtype = wrapper.config.neuron_config.torch_dtype
    count = bucket // patches_per_tile(side, patch)
    pixels = torch.zeros((count, channels, side, side), dtype=dtype)
    if image.patches:
        used, rows = int(image.grid_thw[0]), side // patch
        cut = np.asarray(image.pixel_values, dtype=np.float32).reshape(
            used, rows, rows, channels, patch, patch
        )
        whole = cut.transpose(0, 3, 1, 4, 2, 5).reshape(used, channels, side, side)
        pixels[:used] = torch.from_numpy(np.ascontiguousarray(whole)).to(dtype)
    return pixels


def encode(wrapper: Any, image: ImageInputs, bucket: int) -> np.ndarray:
    """`image`'s embeddings [tiles x tokens per tile, text hidden] float32 from the
    vision graph of `bucket` (no rows for a padding image)."""
    with torch.inference_mode():
        out = wrapper._forward(graph_inputs(wrapper, image, bucket))
    count = int(image.grid_thw[0]) if image.patches else 0
    return out[:count].reshape(-1, out.shape[-1]).float().numpy()
