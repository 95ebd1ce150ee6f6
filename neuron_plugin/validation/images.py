"""Images for the validation kit's `images` case: made from a seed (so a failing case's
inputs reproduce), placed in token-id prompts the way vLLM expands them, and carried to
the oracle as the model's processor prepared them. No vLLM here: the oracle (another
environment) decodes what `encode_arrays` wrote."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from neuron_plugin.core.errors import NeuronConfigError


def image_pixels(seed: int, height: int, width: int) -> np.ndarray:
    """Random RGB pixels [height, width, 3] uint8: the `images` case's images."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


# The text token Llama 4's processor expands into an image's tiles (transformers'
# Llama4Processor image_token, the target of vLLM's Mllama4MultiModalProcessor); its
# config's image_token_index is <|patch|>, the token each embedding takes.
LLAMA4_IMAGE_TOKEN = "<|image|>"
LLAMA4_VISION = "llama4_vision_model"


def placeholder_ids(
    hf_config: Mapping[str, Any], added_vocab: Mapping[str, int]
) -> tuple[int, ...]:
    """The token ids that stand for one image in a token-id prompt, before vLLM's
    processor expands its image token into one per embedding: the Qwen2-VL family's
    <|vision_start|><|image_pad|><|vision_end|>, Llama 4's <|image|> (looked up in the
    tokenizer's added tokens), a LLaVA-style model's image token."""
    if "vision_start_token_id" in hf_config:
        return (
            int(hf_config["vision_start_token_id"]),
            int(hf_config["image_token_id"]),
            int(hf_config["vision_end_token_id"]),
        )
    if (hf_config.get("vision_config") or {}).get("model_type") == LLAMA4_VISION:
        if LLAMA4_IMAGE_TOKEN in added_vocab:
            return (added_vocab[LLAMA4_IMAGE_TOKEN],)
    elif "image_token_index" in hf_config:
        return (int(hf_config["image_token_index"]),)
    raise NeuronConfigError(
        f"the validation kit does not know how {hf_config.get('architectures')} mark an "
        f"image in a prompt (no vision_start_token_id or image_token_index in config.json, "
        f"or for Llama 4 no {LLAMA4_IMAGE_TOKEN} in the tokenizer); run validate with "
        f"--cases naming the other cases."
    )


def image_sizes(
    buckets: tuple[int, ...],
    unit: int,
    unit_patches: int,
    limits: tuple[int, int],
    global_tile: bool = False,
) -> list[tuple[int, int]]:
    """(height, width) of an image that fills each vision bucket exactly: images grow in
    squares of `unit` pixels a side, `unit_patches` patches each (Qwen2-VL: 28 pixels,
    2x2 patches of 14; Llama 4: a tile); the sides as near square as the bucket allows.
    With a global tile (Llama 4), an image of more than one square gets one more, so a
    bucket of n > 2 squares is filled by n - 1 of them and one of 2 by none. Buckets
    outside the processor's (min, max) patches are left out: the processor would resize
    such an image."""
    sizes = []
    for bucket in buckets:
        if not limits[0] <= bucket <= limits[1] or bucket % unit_patches:
            continue
        units = bucket // unit_patches
        if global_tile and units > 1:
            units -= 1
            if units == 1:
                continue
        side = max(d for d in range(1, int(units**0.5) + 1) if units % d == 0)
        sizes.append((side * unit, units // side * unit))
    return sizes


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Arrays as JSON: dtype, shape and the little-endian bytes in base64."""
    encoded = {}
    for name, array in arrays.items():
        data = np.ascontiguousarray(array)
        little = data.astype(data.dtype.newbyteorder("<"), copy=False)
        encoded[name] = {
            "dtype": little.dtype.str,
            "shape": list(data.shape),
            "data": base64.b64encode(little.tobytes()).decode(),
        }
    return encoded


def decode_arrays(encoded: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """`encode_arrays` undone."""
    return {
        name: np.frombuffer(base64.b64decode(item["data"]), dtype=np.dtype(item["dtype"]))
        .reshape(item["shape"])
        .copy()
        for name, item in encoded.items()
    }
