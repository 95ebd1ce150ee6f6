"""Qwen3-VL's vision encoder on the nxd backend: one image through NxDI's vision graph of
its plugin vision bucket, with the host-side arrays NxDI's own vision wrapper computes
(models/qwen3_vl/modeling_qwen3_vl_vision.py NeuronQwen3VLVisionModelWrapper), padded to
that bucket. The two releases split the work differently:

- 0.9 (ef2731e, wrapper.forward lines 605-640): the graph takes pixel_values [P,
  C*T*p*p], rotary_pos_emb [P, head_dim/2] float32 (`rot_pos_emb`), pos_emb [P, D]
  (`fast_pos_embed_interpolate`) and vision_position_ids [P] int32 (the image index per
  patch, -1 for padding: `create_vision_position_ids`), and answers hidden [1, S, H] and
  DeepStack [levels, 1, S, H], padded to the text seq_len S;
- 0.8 (cd3abf3, forward lines 450-490): the host embeds the patches itself
  (`patch_embed` + `fast_pos_embed_interpolate`), and the graph takes those [P, D],
  rotary_pos_emb and a block-diagonal int32 mask [P, P] (`create_vision_attention_mask`,
  zero for padding), and answers hidden [P/4, H] and a list of DeepStack [P/4, H].

The answer is the plugin's embedding layout (core.vision): per merged patch group the
embedding and its DeepStack features concatenated, [patches / merge**2, H x (1 + levels)].
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.vision import ImageInputs

PAD_IMAGE = -1  # vision_position_ids of padding patches (0.9's VISION_POSITION_ID_PAD_VALUE)


def _padded(values: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    out = torch.full((rows, *values.shape[1:]), fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


def graph_inputs(wrapper: Any, image: ImageInputs, bucket: int) -> tuple[torch.Tensor, ...]:
    """The vision graph's inputs for `image` in `bucket`, computed by the release's own
    wrapper helpers (see the module docstring); a padding image is all padding."""
    dtype = wrapper.config.vision_config.neuron_config.torch_dtype
    grid = torch.from_numpy(np.asarray(image.grid_thw, dtype=np.int64)[None]).to(torch.int32)
    patches = image.patches
    pixels = torch.from_numpy(np.asarray(image.pixel_values, dtype=np.float32)).to(dtype)
    vision = wrapper.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if patches == 0:  # core.vision.padding_image
        pixels = torch.zeros((0, width), dtype=dtype)
        grid = torch.zeros((0, 3), dtype=torch.int32)
    head = vision.hidden_size // vision.num_heads
    rotary = (
        wrapper.rot_pos_emb(grid).to(torch.float32)
        if patches
        else torch.zeros((0, head // 2), dtype=torch.float32)
    )
    positions = (
        wrapper.fast_pos_embed_interpolate(grid).to(dtype)
        if patches
        else torch.zeros((0, vision.hidden_size), dtype=dtype)
    )
    if hasattr(wrapper, "create_vision_position_ids"):  # 0.9: embedded in the graph
        ids = (
            wrapper.create_vision_position_ids(grid)
            if patches
            else torch.zeros(0, dtype=torch.int32)
        )
        return (
            _padded(pixels, bucket),
            _padded(rotary, bucket),
            _padded(positions, bucket),
            _padded(ids.to(torch.int32), bucket, PAD_IMAGE),
        )
    if hasattr(wrapper, "create_vision_attention_mask") and hasattr(wrapper, "patch_embed"):
        hidden = (wrapper.patch_embed(pixels) + positions) if patches else positions
        mask = torch.zeros((bucket, bucket), dtype=torch.int32)
        if patches:
            mask[:patches, :patches] = wrapper.create_vision_attention_mask(grid)
        return _padded(hidden.to(dtype), bucket), _padded(rotary, bucket), mask
    raise NeuronConfigError(
        f"the installed NxDI's Qwen3-VL vision wrapper ({type(wrapper).__qualname__}) has "
        f"neither create_vision_position_ids (NxDI 0.9) nor create_vision_attention_mask "
        f"and patch_embed (0.8): the nxd backend does not know how to drive it; serve "
        f"Qwen3-VL with NxDI 0.8 or 0.9, or with VLLM_NEURON_BACKEND=reference."
    )


def encode(wrapper: Any, image: ImageInputs, bucket: int) -> np.ndarray:
    """`image`'s embeddings [tokens, H x (1 + levels)] float32 from the vision graph of
    `bucket` (no rows for a padding image)."""
    merge = int(wrapper.config.vision_config.spatial_merge_size)
    tokens = image.patches // (merge * merge)
    with torch.inference_mode():
        hidden, deepstack = wrapper._forward(*graph_inputs(wrapper, image, bucket))
    levels = [hidden.reshape(-1, hidden.shape[-1])[:tokens]]
    levels += [level.reshape(-1, level.shape[-1])[:tokens] for level in deepstack]
    return torch.cat(levels, dim=-1).float().numpy()
