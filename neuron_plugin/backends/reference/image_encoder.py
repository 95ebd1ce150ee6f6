"""A vision-language model's images on the reference backend (core.vision): the vision
tower's graph per vision bucket, whose weights are inputs too; an image's patches padded
to its bucket, only its real embeddings returned; and the decoder's extra inputs (M-RoPE
positions, the embeddings at the placeholder positions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_plugin.backends.reference.decoder import DecoderSpec
from neuron_plugin.backends.reference.graph_file import LoadedGraph
from neuron_plugin.backends.reference.vision import Tower, vision_tower
from neuron_plugin.backends.reference.vision import load_weights as load_vision_weights
from neuron_plugin.backends.reference.vision import weight_shapes as vision_weight_shapes
from neuron_plugin.core.checkpoint import safetensors_shapes
from neuron_plugin.core.inputs import CONTEXT_ENCODING
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.vision import ImageInputs, vision_bucket


class ImageEncoder:
    """See the module docstring."""

    def __init__(self, settings: NeuronSettings, tower: Tower, model_dir: Path, dtype: torch.dtype):
        self.settings = settings
        self.tower = tower
        self.model_dir = model_dir
        self.dtype = dtype
        self.module = tower.graph()
        self.weights: list[torch.Tensor] = []

    def export(self, patches: int) -> torch.export.ExportedProgram:
        """The vision bucket of `patches` patches as a fixed-shape graph."""
        shapes = vision_weight_shapes(self.tower, safetensors_shapes(self.model_dir))
        arrays = self.tower.image_inputs(np.zeros(3, dtype=np.int64), patches)
        example = (
            [torch.zeros(shape, dtype=self.dtype) for shape in shapes],
            torch.zeros(patches, self.tower.patch_dim),
            *(torch.from_numpy(a) for a in arrays),
        )
        return torch.export.export(self.module, example)

    def load(self) -> None:
        self.weights = load_vision_weights(self.model_dir, self.tower, self.dtype)

    def bucket(self, image: ImageInputs) -> int:
        """The vision bucket `image` runs in, its arrays checked."""
        buckets = self.settings.vision_buckets
        if image.is_padding:
            bucket = image.pixel_values.shape[0]
            if bucket not in buckets:
                raise ValueError(f"a padding image of {bucket} patches: no vision bucket {buckets}")
            return bucket
        t, h, w = (int(n) for n in image.grid_thw)
        merge = self.tower.spatial_merge_size
        if h % merge or w % merge or t < 1:
            raise ValueError(
                f"image grid_thw={[t, h, w]}: height and width must be multiples of the "
                f"spatial merge size {merge} (the model's processor makes them so)"
            )
        _check_shape("pixel_values", image.pixel_values, (image.patches, self.tower.patch_dim))
        return vision_bucket(buckets, image.patches)

    def encode(self, image: ImageInputs, bucket: int, graph: LoadedGraph) -> np.ndarray:
        """The image's embeddings [embedding_tokens, embedding_width] float32 from its
        bucket's graph: its patches padded to the bucket, the padding's rows dropped
        (none for a padding image, core.vision.padding_image)."""
        padded = np.zeros((bucket, self.tower.patch_dim), dtype=np.float32)
        if not image.is_padding:
            padded[: image.patches] = image.pixel_values
        arrays = self.tower.image_inputs(image.grid_thw, bucket)
        with torch.inference_mode():
            merged = graph(
                self.weights, torch.from_numpy(padded), *(torch.from_numpy(a) for a in arrays)
            )
        return merged[: image.embedding_tokens(self.tower.spatial_merge_size)].float().numpy()

    def decoder_inputs(
        self,
        phase: str,
        position_ids: np.ndarray,
        rope_positions: np.ndarray | None,
        embeddings: np.ndarray | None,
        mask: np.ndarray | None,
    ) -> dict[str, torch.Tensor]:
        """The decoder's extra inputs: M-RoPE positions in both phases (every axis the
        KV position when the call has none), and in context encoding the image
        embeddings and their mask (zeros and False in a call without images)."""
        batch, active = position_ids.shape
        if rope_positions is None:
            rope_positions = np.broadcast_to(position_ids, (3, batch, active))
        _check_shape("rope_positions", rope_positions, (3, batch, active))
        out = {"rope_positions": torch.from_numpy(np.ascontiguousarray(rope_positions, np.int64))}
        if phase != CONTEXT_ENCODING:
            return out
        width = self.tower.embedding_width
        if embeddings is None or mask is None:
            embeddings = np.zeros((batch, active, width), dtype=np.float32)
            mask = np.zeros((batch, active), dtype=bool)
        _check_shape("vision_embeddings", embeddings, (batch, active, width))
        _check_shape("vision_mask", mask, (batch, active))
        out["vision_embeddings"] = torch.from_numpy(np.ascontiguousarray(embeddings, np.float32))
        out["vision_mask"] = torch.from_numpy(np.ascontiguousarray(mask, bool))
        return out


def image_encoder(
    settings: NeuronSettings,
    spec: DecoderSpec,
    hf_config: dict[str, Any],
    model_dir: Path,
    dtype: torch.dtype,
) -> ImageEncoder | None:
    """A vision-language model's image encoder (None for a text model), its buckets
    checked against its tower."""
    if not spec.vision:
        if settings.vision_buckets:
            raise NeuronConfigError(
                f"vision_buckets={list(settings.vision_buckets)}: {spec.architecture} has no "
                f"vision encoder; remove vision_buckets from override_neuron_config."
            )
        return None
    if settings.draft_model or settings.speculation_length:
        raise NeuronConfigError(
            f"{spec.architecture}: speculative decoding of a vision-language model is not "
            f"supported by the reference backend; remove --speculative-config."
        )
    tower = vision_tower(hf_config)
    odd = [n for n in settings.vision_buckets if n % tower.merge_patches]
    if odd:
        raise NeuronConfigError(
            f"vision_buckets={list(settings.vision_buckets)}: {odd} are not multiples of "
            f"{tower.merge_patches} patches (spatial_merge_size**2, the patches of one "
            f"image embedding; Llama 4: a tile's); round them up to multiples of "
            f"{tower.merge_patches}."
        )
    return ImageEncoder(settings, tower, model_dir, dtype)


def _check_shape(name: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
    if array.shape != shape:
        raise ValueError(f"{name} has shape {list(array.shape)}; this call needs {list(shape)}")
