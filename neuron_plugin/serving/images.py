"""Images on the worker: vLLM's multimodal features -> the vision inputs of each backend
call (core.vision), beside the text path.

vLLM's scheduler decides when an image is encoded (`scheduled_encoder_inputs`, within
its encoder-cache budget) and when its embeddings may go (`free_encoder_mm_hashes`);
this keeps the embeddings in between, keyed by the feature's identifier as vLLM's GPU
runner keys its encoder cache, so the same image in two requests is encoded once while
both hold it. A context-encoding call of prompt tokens [start, end) takes the rows of
each image its tokens cover (`core.vision.chunk_embeddings`), whatever the chunk or
prefix-cache hit cut. A model with M-RoPE (the Qwen2-VL family) also gets each call's
rotary positions: the prompt's from `core.vision.mrope_positions`, computed once per
request, and a decode's from its KV position and the request's shift. Pixtral's
processor hands whole images (core.vision.pixtral_patches cuts them), and only its
[IMG] placeholders take embeddings (vLLM's is_embed; [IMG_BREAK] and [IMG_END] keep
their own); Llama 4's hands an image's tiles (core.vision.tile_patches), and only its
<|patch|> placeholders take embeddings (the tile separators, <|image|> and the image's
start and end keep their own).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from neuron_plugin.core.checkpoint import text_config
from neuron_plugin.core.inputs import ForwardInputs
from neuron_plugin.core.vision import (
    LLAMA4_MERGE,
    LLAMA4_VISION,
    ImageInputs,
    VisionGeometry,
    chunk_embeddings,
    mrope_positions,
    pixtral_patches,
    spread_embeddings,
    tile_patches,
    vision_bucket,
)
from neuron_plugin.serving.observers import StepObserver

if TYPE_CHECKING:  # the platform imports this module; backends load in the worker
    from neuron_plugin.backends.base import LoadedBackend


@dataclass
class _Request:
    """One request's images (placeholder offset and length, encoder-cache key) and,
    with M-RoPE, its prompt's rotary positions [3, prompt] and the shift of what
    follows."""

    images: list[tuple[int, int, str]]
    rope: np.ndarray | None
    delta: int
    # per image: which placeholder tokens take an embedding (None: all)
    embeds: list[np.ndarray | None] = dataclasses.field(default_factory=list)


def image_inputs(feature: Any) -> ImageInputs:
    """The encoder input of one vLLM image feature (its processor's output)."""
    return ImageInputs(pixel_values=pixel_values(feature), grid_thw=image_grid(feature))


def pixel_values(feature: Any) -> np.ndarray:
    return feature.data["pixel_values"].data.float().numpy()


def is_embed(feature: Any) -> np.ndarray | None:
    """Which of an image feature's placeholder tokens take its embeddings (vLLM's
    PlaceholderRange.is_embed; None: all of them)."""
    embed = feature.mm_position.is_embed
    return None if embed is None else embed.numpy().astype(bool)


def image_grid(feature: Any) -> np.ndarray:
    """An image feature's grid_thw. vLLM strips an image that a prefix-cache hit covers
    down to the fields an M-RoPE model keeps on the host (`image_grid_thw`): its pixels
    are not needed, its grid is."""
    return feature.data["image_grid_thw"].data.numpy().astype(np.int64)


class Images:
    """See the module docstring."""

    def __init__(
        self,
        backend: LoadedBackend,
        hf_config: dict[str, Any],
        observers: Sequence[StepObserver] = (),
    ):
        self.backend = backend
        self.observers = tuple(observers)
        geometry = VisionGeometry.from_hf_config(hf_config)
        if geometry is None:  # the settings give vision buckets to vision models only
            raise RuntimeError("vision buckets for a model without a vision_config")
        self.merge, self.width = geometry.spatial_merge_size, geometry.embedding_width
        vision = hf_config["vision_config"]
        # Pixtral's processor hands whole images, Llama 4's tiles; the Qwen2-VL
        # family's, their patches
        self.kind = vision.get("model_type")
        self.patch = int(vision.get("patch_size", 14))
        text = text_config(hf_config)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        self.mrope = bool(rope.get("mrope_section"))
        self.requests: dict[str, _Request] = {}
        self.features: dict[str, list[Any]] = {}
        self.cache: dict[str, np.ndarray] = {}

    def add(self, req_id: str, prompt_len: int, features: Sequence[Any]) -> None:
        images = [f for f in features if f.modality == "image"]
        self.features[req_id] = list(features)
        rope, delta = None, 0
        if self.mrope and images:
            rope, delta = mrope_positions(
                prompt_len,
                [(f.mm_position.offset, image_grid(f)) for f in images],
                self.merge,
            )
        placed = [(f.mm_position.offset, f.mm_position.length, f.identifier) for f in images]
        self.requests[req_id] = _Request(placed, rope, delta, [is_embed(f) for f in images])

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.features.pop(req_id, None)

    def encode(self, freed: Iterable[str], scheduled: dict[str, list[int]]) -> None:
        """Drop the embeddings vLLM freed, then encode the images it scheduled (each
        once: an image already held is not run again), in that order as vLLM's GPU
        runner does (a freed image can be scheduled again in the same step)."""
        for identifier in freed:
            self.cache.pop(identifier, None)
        for req_id, indexes in scheduled.items():
            features = self.features[req_id]
            for index in indexes:
                feature = features[index]
                if feature.identifier not in self.cache:
                    self.cache[feature.identifier] = self._encoded(feature)

    def _encoded(self, feature: Any) -> np.ndarray:
        """A feature's embeddings, one row per placeholder token (zero rows at those
        that keep their own embedding)."""
        if self.kind == "pixtral":
            image = pixtral_patches(pixel_values(feature), self.patch)
        elif self.kind == LLAMA4_VISION:
            image = tile_patches(pixel_values(feature), self.patch)
        else:
            image = image_inputs(feature)
        embeddings = self._encode(image)
        embed = is_embed(feature)
        return embeddings if embed is None else spread_embeddings(embeddings, embed)

    def _encode(self, image: ImageInputs) -> np.ndarray:
        started = time.perf_counter()
        embeddings = self.backend.encode_image(image)
        forward_s = time.perf_counter() - started
        bucket = vision_bucket(self.backend.settings.vision_buckets, image.patches)
        for observer in self.observers:
            observer.on_vision_call(bucket, image.patches, forward_s)
        return embeddings

    def in_images(self, req_ids: Sequence[str], positions: np.ndarray) -> np.ndarray:
        """[rows] whether the token at each row's position is an image placeholder."""
        return np.fromiter(
            (
                any(o <= p < o + n for o, n, _ in self.requests[r].images)
                if r in self.requests
                else False
                for r, p in zip(req_ids, positions.tolist(), strict=False)
            ),
            dtype=bool,
            count=positions.size,
        )

    def context(self, req_id: str, inputs: ForwardInputs) -> ForwardInputs:
        """A context-encoding call with its images' rows and rotary positions."""
        request = self.requests.get(req_id)
        if request is None or not request.images:
            return inputs
        start = int(inputs.computed_context_lens[0])
        count = int(inputs.full_context_lens[0]) - start
        active = inputs.input_ids.shape[1]
        covered = [  # only the images this chunk covers: vLLM may have freed the others
            (offset, identifier, embed)
            for (offset, length, identifier), embed in zip(
                request.images, request.embeds, strict=True
            )
            if offset < start + count and offset + length > start
        ]
        placed = [(offset, self._embeddings(identifier)) for offset, identifier, _ in covered]
        embeds = [embed for _, _, embed in covered]
        embeddings, mask = chunk_embeddings(start, count, active, self.width, placed, embeds)
        rope = None
        if request.rope is not None:
            rope = np.broadcast_to(inputs.position_ids, (3, *inputs.position_ids.shape)).copy()
            rope[:, 0, :count] = _rotary(
                request.rope, request.delta, np.arange(start, start + count)
            )
        return dataclasses.replace(
            inputs, vision_embeddings=embeddings, vision_mask=mask, rope_positions=rope
        )

    def _embeddings(self, identifier: str) -> np.ndarray:
        embeddings = self.cache.get(identifier)
        if embeddings is None:  # vLLM schedules an image's encoding before its tokens
            raise RuntimeError(
                f"image {identifier} is needed before vLLM scheduled its encoding; report "
                f"this with the engine log"
            )
        return embeddings

    def decode(self, req_ids: Sequence[str], inputs: ForwardInputs) -> ForwardInputs:
        """A token-generation call's rotary positions: each row's KV positions shifted by
        its request's delta (None when no row is shifted)."""
        if not self.mrope:
            return inputs
        deltas = np.zeros(inputs.position_ids.shape[0], dtype=np.int64)
        deltas[: len(req_ids)] = [
            self.requests[r].delta if r in self.requests else 0 for r in req_ids
        ]
        if not deltas.any():
            return inputs
        shifted = inputs.position_ids + deltas[:, None]
        return dataclasses.replace(
            inputs, rope_positions=np.broadcast_to(shifted, (3, *shifted.shape)).copy()
        )


def _rotary(prompt: np.ndarray, delta: int, positions: np.ndarray) -> np.ndarray:
    """Rotary positions [3, n] of KV positions `positions`: the prompt's own ([3,
    prompt length]) where it has them, the shifted KV position past it (tokens generated
    before a preemption and prefilled again)."""
    inside = positions < prompt.shape[1]
    rotary = np.broadcast_to(positions + delta, (3, positions.size)).copy()
    rotary[:, inside] = prompt[:, positions[inside]]
    return rotary


def image_patches(processed: Mapping[str, Any]) -> list[int]:
    """Patches of each image of a processed request (vLLM's `mm_kwargs`; an item the
    processor cache left out was checked when first seen). A model without grids has
    as many patches as embedded placeholders (Pixtral: one embedding per patch), or
    LLAMA4_MERGE**2 times as many (Llama 4, whose items say their tiles'
    aspect_ratios: core.vision.llama4_merge refuses another pixel shuffle)."""
    items = (processed.get("mm_kwargs") or {}).get("image") or ()
    if any(item and "image_grid_thw" not in item for item in items):
        ranges = (processed.get("mm_placeholders") or {}).get("image") or ()
        merged = any(item and "aspect_ratios" in item for item in items)
        per_embed = LLAMA4_MERGE**2 if merged else 1
        return [int(r.get_num_embeds()) * per_embed for r in ranges]
    return [int(np.prod(item["image_grid_thw"].data.numpy())) for item in items if item]
