"""Images through a vision encoder: what one encoder call takes, the bucket it runs in,
and where its embeddings go in the prompt.

A vision-language model (Qwen2-VL family first) has two kinds of graphs: the decoder's
(context encoding, token generation) and the vision encoder's, one per vision bucket.
A vision bucket is a number of patches: an image of `grid_thw` (temporal, height, width
patches, the model's processor's split) runs in the first bucket of at least
t*h*w patches, padded, as NxDI pads an image to its vision bucket
(`image_to_text_model_wrapper.py` pads pixel_values). One image per call: the images of a
prompt run one after another, each once (vLLM's encoder cache keeps their embeddings for
chunked prefill and prefix-cache misses). The encoder answers one embedding per
spatial_merge_size**2 patches, and those replace the prompt's image placeholder tokens
in order (`ForwardInputs.vision_embeddings` / `vision_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from neuron_plugin.core.settings import NeuronConfigError

VISION_ENCODING = "vision_encoding"


@dataclass(frozen=True)
class ImageInputs:
    """One image as the model's processor prepared it (Qwen2-VL: its flattened patches,
    channels x temporal x patch x patch values each, in the processor's order)."""

    pixel_values: np.ndarray  # [patches, patch_dim] float32
    grid_thw: np.ndarray  # [3] int64: temporal, height, width patches

    @property
    def patches(self) -> int:
        return int(np.prod(self.grid_thw))

    def embedding_tokens(self, spatial_merge_size: int) -> int:
        """Placeholder tokens (and encoder outputs) of this image."""
        return self.patches // (spatial_merge_size * spatial_merge_size)

    @property
    def is_padding(self) -> bool:
        """A call holding only padding (`padding_image`)."""
        return self.patches == 0


def padding_image(bucket: int) -> ImageInputs:
    """An encoder call of exactly vision bucket `bucket` holding only padding (warm-up,
    timing), as `core.inputs.padding_inputs` is for the decoder's graphs: no patches
    (grid_thw zero), pixel_values [bucket, 0]; its answer has no rows."""
    return ImageInputs(np.zeros((bucket, 0), dtype=np.float32), np.zeros(3, dtype=np.int64))


@dataclass(frozen=True)
class VisionGeometry:
    """The sizes of a vision-language model's image arrays, from its config.json
    (Qwen2-VL family keys): what crosses a process boundary per image and per call."""

    patch_dim: int  # values per patch: channels x temporal_patch_size x patch_size**2
    spatial_merge_size: int
    hidden_size: int  # the text decoder's: one embedding per merged patch group

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> VisionGeometry | None:
        """None for a text model (no vision_config)."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return None
        text = config.get("text_config")
        hidden = (text if isinstance(text, dict) else config)["hidden_size"]
        # the Hub's Qwen2-VL configs say in_chans, transformers in_channels
        channels = int(vision.get("in_channels") or vision.get("in_chans") or 3)
        patch = int(vision.get("patch_size", 14))
        return cls(
            patch_dim=channels * int(vision.get("temporal_patch_size", 2)) * patch * patch,
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            hidden_size=int(hidden),
        )


def vision_bucket(buckets: tuple[int, ...], patches: int) -> int:
    """The first vision bucket that holds `patches` (buckets ascending)."""
    for bucket in buckets:
        if patches <= bucket:
            return bucket
    largest = buckets[-1] if buckets else 0
    raise NeuronConfigError(
        f"an image of {patches} patches exceeds the largest vision bucket ({largest} "
        f"patches): lower the processor's max_pixels (mm_processor_kwargs) or add a larger "
        f"bucket to override_neuron_config.vision_buckets."
    )
