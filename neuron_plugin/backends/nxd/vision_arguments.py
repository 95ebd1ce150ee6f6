"""The image inputs of an image-to-text text graph, from a call's `ForwardInputs`.

NxDI's image-to-text text wrappers take, after the causal LM's 21 positional inputs
(models/image_to_text_model_wrapper.py, the positional table; 0.8 cd3abf3 and 0.9
ef2731e), `rotary_position_ids` (21), `vision_embeddings` (22), `vision_mask` (23) and,
for Qwen3-VL, `deepstack_vision_embeds` (24). A compiled graph takes exactly the shapes
it was traced with, and `ModelWrapper.pad_inputs` silently replaces the image inputs by
dummies when `vision_mask` is not as wide as the bucket (0.9 model_wrapper.py lines
795-811), so every call passes them in the shapes of the wrapper's own example for its
bucket (`input_generator`; their widths differ between releases: Qwen3-VL's embeddings
are as wide as the bucket on 0.8, as seq_len on 0.9):

- context encoding: `vision_mask` int32 [1, L, 1] holds the positions of the image
  tokens in order, padded with L (the scratch row of patch `vision-scatter-scratch-row`:
  NxDI's own L - 1 would overwrite a full bucket's last token); `vision_embeddings`
  [1, E, hidden] the embeddings of those positions in the same order, zero rows after;
  Qwen3-VL's `deepstack_vision_embeds` [levels, 1, E, hidden] the DeepStack features the
  plugin carries after each embedding (core.vision: [tokens, hidden x (1 + levels)]);
  `rotary_position_ids` int32 [3, 1, L] the M-RoPE positions (the KV positions in all
  three rows for a prompt without images).
- token generation: the empty image inputs of the example, and `rotary_position_ids`
  [3, B, 1]: each row's KV position plus its request's delta (serving.images.decode).
Always passed, text-only calls included: the graphs are traced with them, and a missing
input shifts the later ones (ModelWrapper.forward drops non-tensor arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from neuron_plugin.core.inputs import CONTEXT_ENCODING, ForwardInputs

ROTARY, EMBEDDINGS, MASK, DEEPSTACK = 21, 22, 23, 24


@dataclass(frozen=True)
class VisionExample:
    """The image inputs one bucket of a text wrapper was traced with."""

    rotary: bool  # whether it takes rotary_position_ids (traced non-empty)
    embeddings: torch.Tensor  # its vision_embeddings example (shape and dtype)
    mask: torch.Tensor
    deepstack: torch.Tensor | None  # None: the wrapper takes no DeepStack input

    @classmethod
    def of(cls, example: Sequence[torch.Tensor]) -> VisionExample:
        deepstack = example[DEEPSTACK] if len(example) > DEEPSTACK else None
        return cls(
            rotary=example[ROTARY].numel() > 0,
            embeddings=example[EMBEDDINGS],
            mask=example[MASK],
            deepstack=deepstack,
        )


def examples_by_width(wrapper: object) -> dict[int, VisionExample]:
    """A text wrapper's image-input examples by the input_ids width of their bucket."""
    found = {}
    for example in wrapper.input_generator():  # type: ignore[attr-defined]
        found[int(example[0].shape[-1])] = VisionExample.of(example)
    return found


def vision_arguments(
    inputs: ForwardInputs,
    position_ids: np.ndarray,
    example: VisionExample,
    hidden_size: int,
) -> dict[str, torch.Tensor]:
    """NxDI's image inputs for a call (see the module docstring); `position_ids` are the
    KV positions the call passes NxDI ([rows, width])."""
    rotary = inputs.rope_positions
    if rotary is None:
        rotary = np.broadcast_to(position_ids, (3, *position_ids.shape))
    arguments: dict[str, torch.Tensor] = {}
    if example.rotary:
        arguments["rotary_position_ids"] = torch.from_numpy(
            np.ascontiguousarray(rotary[:, : position_ids.shape[0]], dtype=np.int32)
        )
    if inputs.phase != CONTEXT_ENCODING:
        arguments.update(vision_embeddings=example.embeddings, vision_mask=example.mask)
        if example.deepstack is not None:
            arguments["deepstack_vision_embeds"] = example.deepstack
        return arguments
    width = int(example.mask.shape[1])
    mask = inputs.vision_mask
    positions = np.flatnonzero(mask[0]) if mask is not None else np.zeros(0, dtype=np.int64)
    padded = np.full((1, width, 1), width, dtype=np.int32)
    padded[0, : positions.size, 0] = positions
    dtype = example.embeddings.dtype
    embeddings = torch.zeros(example.embeddings.shape, dtype=dtype)
    deepstack = None
    if example.deepstack is not None:
        deepstack = torch.zeros(example.deepstack.shape, dtype=example.deepstack.dtype)
        arguments["deepstack_vision_embeds"] = deepstack
    arguments.update(vision_embeddings=embeddings, vision_mask=torch.from_numpy(padded))
    if positions.size == 0:
        return arguments
    if inputs.vision_embeddings is None:
        raise ValueError(
            "a context encoding with a vision_mask and no vision_embeddings; this is a "
            "plugin bug, please report it."
        )
    rows = inputs.vision_embeddings[0, positions]
    embeddings[0, : positions.size] = torch.from_numpy(rows[:, :hidden_size]).to(dtype)
    if deepstack is not None and deepstack.dim() == 4:
        for level in range(deepstack.shape[0]):
            features = rows[:, hidden_size * (1 + level) : hidden_size * (2 + level)]
            deepstack[level, 0, : positions.size] = torch.from_numpy(features).to(dtype)
    return arguments
