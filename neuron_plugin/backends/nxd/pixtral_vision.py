"""Pixtral's vision encoder on the nxd backend (Llava-format checkpoints): one image
through NxDI's vision graph of its plugin vision bucket, never through the vision
wrapper's own `forward`, which cannot run in the CPU mode (it assigns its arguments only
off the CPU: models/pixtral/modeling_pixtral_vision.py PixtralVisionModelWrapper.forward,
the same in 0.8 cd3abf3 and 0.9 ef2731e).

The graph (`NeuronPixtralVisionModel.forward`) takes the wrapper's `patchify` arrays,
padded as its `pad_inputs` pads them: patch_embeds [1, P, C*p*p] (each patch's values in
patch_conv's kernel order, patches row by row: core.vision.pixtral_patches, the same
order as the wrapper's unfold), a block-diagonal int32 attention mask [1, 1, P, P] (one
image: ones over its patches, zero for padding) and position_ids [P] int32, row x
(image_size / patch) + column (`position_ids_in_meshgrid`; 0 for padding). It answers
[1, P, text hidden] after the projector: one embedding per patch (no merge).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from neuron_plugin.core.vision import ImageInputs


def graph_inputs(wrapper: Any, image: ImageInputs, bucket: int) -> tuple[torch.Tensor, ...]:
    """The vision graph's inputs for `image` in `bucket` (see the module docstring); a
    padding image is all padding."""
    vision = wrapper.config.vision_config
    dtype = vision.neuron_config.torch_dtype
    width = vision.num_channels * vision.patch_size**2
    patches = image.patches
    embeds = torch.zeros((1, bucket, width), dtype=dtype)
    mask = torch.zeros((1, 1, bucket, bucket), dtype=torch.int32)
    positions = torch.zeros(bucket, dtype=torch.int32)
    if patches:
        _, rows, columns = (int(n) for n in image.grid_thw)
        side = vision.image_size // vision.patch_size
        grid = np.arange(rows)[:, None] * side + np.arange(columns)[None, :]
        embeds[0, :patches] = torch.from_numpy(image.pixel_values).to(dtype)
        mask[0, 0, :patches, :patches] = 1
        positions[:patches] = torch.from_numpy(grid.reshape(-1).astype(np.int32))
    return embeds, mask, positions


def encode(wrapper: Any, image: ImageInputs, bucket: int) -> np.ndarray:
    """`image`'s embeddings [patches, text hidden] float32 from the vision graph of
    `bucket` (no rows for a padding image)."""
    with torch.inference_mode():
        out = wrapper._forward(*graph_inputs(wrapper, image, bucket))
    return out.reshape(-1, out.shape[-1])[: image.patches].float().numpy()
