"""Images through a vision encoder: what one encoder call takes, the bucket it runs in,
and where its embeddings go in the prompt.

A vision-language model (the Qwen2-VL family and Qwen3-VL) has two kinds of graphs: the decoder's
(context encoding, token generation) and the vision encoder's, one per vision bucket.
A vision bucket is a number of patches: an image of `grid_thw` (temporal, height, width
patches, the model's processor's split) runs in the first bucket of at least
t*h*w patches, padded, as NxDI pads an image to its vision bucket
(`image_to_text_model_wrapper.py` pads pixel_values). One image per call: the images of a
prompt run one after another, each once (vLLM's encoder cache keeps their embeddings for
chunked prefill and prefix-cache misses). The encoder answers one embedding per
spatial_merge_size**2 patches, and those replace the prompt's image placeholder tokens
in order (`ForwardInputs.vision_embeddings` / `vision_mask`). Llama 4's processor cuts an
image into tiles of a fixed size: its grid_thw is (tiles, patches a side, patches a
side), a vision bucket holds whole tiles, and its pixel shuffle merges 2 x 2 patches to
one embedding (spatial_merge_size 2). Qwen3-VL's embedding of a
merged group also carries its DeepStack features, concatenated after it as vLLM's
Qwen3-VL hands them on ([tokens, hidden x (1 + deepstack levels)]): the decoder adds
level i to its hidden states after layer i at the image's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bucketing.errors import BucketError
from bucketing.grids import validate_grid
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.models.table import vision_architectures

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
    (Qwen2-VL family and Qwen3-VL keys): what crosses a process boundary per image and
    per call."""

    patch_dim: int  # values per patch: channels x temporal_patch_size x patch_size**2
    spatial_merge_size: int
    hidden_size: int  # the text decoder's: one embedding per merged patch group
    deepstack: int = 0  # Qwen3-VL's DeepStack levels (deepstack_visual_indexes)

    @property
    def embedding_width(self) -> int:
        """Values per merged patch group the encoder answers: the embedding and its
        DeepStack features, concatenated."""
        return self.hidden_size * (1 + self.deepstack)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> VisionGeometry | None:
        """None for a text model (no vision_config)."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return None
        text = config.get("text_config")
        hidden = int((text if isinstance(text, dict) else config)["hidden_size"])
        patch = int(vision.get("patch_size", 14))
        if vision.get("model_type") == "pixtral":  # one embedding per 2-D patch
            channels = int(vision.get("num_channels", 3))
            return cls(patch_dim=channels * patch * patch, spatial_merge_size=1, hidden_size=hidden)
        if vision.get("model_type") == LLAMA4_VISION:  # pixel_shuffle merges patches
            channels = int(vision.get("num_channels", 3))
            return cls(
                patch_dim=channels * patch * patch,
                spatial_merge_size=llama4_merge(vision),
                hidden_size=hidden,
            )
        # the Hub's Qwen2-VL configs say in_chans, transformers in_channels
        channels = int(vision.get("in_channels") or vision.get("in_chans") or 3)
        return cls(
            patch_dim=channels * int(vision.get("temporal_patch_size", 2)) * patch * patch,
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            hidden_size=hidden,
            deepstack=len(vision.get("deepstack_visual_indexes") or ()),
        )


LLAMA4_VISION = "llama4_vision_model"  # Llama 4's vision_config model_type
LLAMA4_MERGE = 2  # 1 / pixel_shuffle_ratio


def llama4_merge(vision: Mapping[str, Any]) -> int:
    """Llama 4's patches a side per embedding: 1 / pixel_shuffle_ratio. Every Llama 4
    checkpoint has 0.5 (transformers' default), and vLLM's API server counts an image's
    patches from its placeholders with it (serving.images.image_patches): another ratio
    is refused."""
    ratio = vision.get("pixel_shuffle_ratio", 0.5)
    if ratio != 1 / LLAMA4_MERGE:
        raise NeuronConfigError(
            f"Llama 4's vision_config.pixel_shuffle_ratio={ratio!r}: the plugin runs Llama 4's "
            f"vision tower at 0.5 only (every Llama 4 checkpoint's); serve one of those."
        )
    return LLAMA4_MERGE


def vision_bucket(buckets: tuple[int, ...], patches: int) -> int:
    """The first vision bucket that holds `patches` (buckets ascending)."""
    for bucket in buckets:
        if patches <= bucket:
            return bucket
    largest = buckets[-1] if buckets else 0
    raise NeuronConfigError(
        f"an image of {patches} patches exceeds the largest vision bucket ({largest} "
        f"patches): lower the image processor's size limit in mm_processor_kwargs "
        f"(max_pixels; Llama 4: max_patches, its tiles per image) or add a larger bucket "
        f"to override_neuron_config.vision_buckets."
    )


# The vision-language architectures whose vision towers the plugin runs (the table's
# vision rows the reference backend serves: the Qwen2-VL family and Qwen3-VL, patches
# merged spatial_merge_size**2 to one embedding, M-RoPE positions; Llava: Pixtral's
# tower, one embedding per patch, 1-D positions; Llama 4: tiles of patches,
# pixel-shuffled 2 x 2 to one embedding).
VISION_ARCHITECTURES = vision_architectures()
VISION_BUCKETS_KEY = "vision_buckets"
# Where a checkpoint keeps its image processor's settings: transformers 5's
# ProcessorMixin.save_pretrained (and 4.57's with legacy_serialization=False) nests them
# under "image_processor" in processor_config.json; the Hub's checkpoints, an image
# processor's own save_pretrained and 4.57's processor save a flat preprocessor_config.json.
PROCESSOR_FILE = "processor_config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"
NESTED_IMAGE_PROCESSOR = "image_processor"
# transformers' Qwen2VLImageProcessor, the image processor of Qwen2-VL, Qwen2.5-VL and
# Qwen3-VL (AutoImageProcessor's mapping; their processors add no image defaults): its
# class defaults, used where the saved settings lack a key or hold null.
QWEN2_VL_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
QWEN2_VL_PATCH = 14
QWEN2_VL_MERGE = 2
# size edges and the older keys that override them (min_pixels / max_pixels)
_PIXEL_EDGES = (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"))
_KWARGS_FLAG = "--mm-processor-kwargs"
_IMAGES_KWARGS = "images_kwargs"


def image_processor_config(
    processor: Mapping[str, Any] | None, preprocessor: Mapping[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """The image processor's saved settings, and where they were found, as transformers
    5 (the release vLLM 0.32 and 0.33 run) finds them
    (`ImageProcessingMixin.get_image_processor_dict`): processor_config.json's nested
    `image_processor` where it has one, else preprocessor_config.json. `processor` and
    `preprocessor` are those two files' contents (None where absent). transformers 4.57
    looks the other way round (preprocessor_config.json first), which differs only for a
    checkpoint holding both, and vLLM does not run it."""
    nested = (processor or {}).get(NESTED_IMAGE_PROCESSOR)
    if isinstance(nested, Mapping):
        return dict(nested), f"{PROCESSOR_FILE} ({NESTED_IMAGE_PROCESSOR})"
    if preprocessor is not None:
        return dict(preprocessor), PREPROCESSOR_FILE
    return {}, f"no {PREPROCESSOR_FILE} or {PROCESSOR_FILE}: transformers' defaults"


def read_image_processor_config(folder: Path) -> tuple[dict[str, Any], str]:
    """`image_processor_config` of a local checkpoint folder."""
    found = [
        json.loads(path.read_text()) if path.is_file() else None
        for path in (folder / PROCESSOR_FILE, folder / PREPROCESSOR_FILE)
    ]
    return image_processor_config(*found)


@dataclass(frozen=True)
class VisionLimits:
    """What the model's processor makes of an image: between `min_patches` and
    `max_patches` patches, a multiple of `step` (spatial_merge_size**2; Llama 4: a
    tile's patches) each. `global_tile` (Llama 4): an image of more than one tile gets
    one more, so it never has exactly two."""

    min_patches: int
    max_patches: int
    step: int
    global_tile: bool = False


def _given(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that hold a value: transformers' image processors take a null as the
    key's absence (the class's default)."""
    return {k: v for k, v in settings.items() if v is not None}


def _image_kwargs(mm_processor_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """--mm-processor-kwargs as vLLM hands them on: the flat keys (which vLLM passes to
    the processor's from_pretrained, replacing the saved keys) and the images' call
    kwargs (the flat keys with `images_kwargs` over them, a `size` merged key by key:
    vLLM's `_resolve_mm_processor_kwargs`)."""
    flat = {k: v for k, v in mm_processor_kwargs.items() if k != _IMAGES_KWARGS}
    scoped = dict(flat)
    nested = mm_processor_kwargs.get(_IMAGES_KWARGS) or {}
    for key, value in nested.items():
        if isinstance(value, Mapping) and isinstance(scoped.get(key), Mapping):
            scoped[key] = {**scoped[key], **value}
        else:
            scoped[key] = value
    return flat, scoped


def processor_limits(
    preprocessor: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any],
    source: str = PREPROCESSOR_FILE,
    *,
    fills_partial_size: bool = False,
) -> VisionLimits:
    """A Qwen2-VL image processor's patch range. It resizes an image to a multiple of
    patch_size * merge_size per side with min_pixels <= height x width <= max_pixels
    (`smart_resize`), so an image has at most max_pixels / patch_size**2 patches.
    `preprocessor` holds the checkpoint's saved settings (`image_processor_config`,
    read from `source`). The bounds are resolved as the processor vLLM runs resolves
    them:

    1. vLLM builds the processor from the saved settings with --mm-processor-kwargs'
       flat keys replacing theirs (transformers' `from_dict`), except those the
       processor's call takes, `size` among them (vLLM's
       `cached_get_processor_without_dynamic_kwargs`); its `size` ({shortest_edge,
       longest_edge}) is the saved one, a null or absent one being the class's
       default, then `min_pixels` / `max_pixels` override its edges (transformers'
       Qwen2VLImageProcessor.__init__);
    2. vLLM calls it with the image kwargs (`images_kwargs` over the flat keys): a
       `size` there replaces the built one whole, or with `fills_partial_size`
       (Qwen3-VL: vLLM's Qwen3VLMultiModalProcessor completes it from the built one)
       edge by edge, then `min_pixels` / `max_pixels` override its edges.

    Settings on which vLLM's processor fails every image are refused: a size without
    both edges, a null in the call's kwargs (transformers takes whole numbers only)."""
    flat, scoped = _image_kwargs(mm_processor_kwargs)
    nulls = sorted(k for k in (*_QWEN2_VL_CALL_KEYS, "size") if k in scoped and scoped[k] is None)
    if nulls:
        raise NeuronConfigError(
            f"--mm-processor-kwargs {nulls[0]}=None: vLLM passes it to the image "
            f"processor's call, which takes a whole number there (transformers refuses "
            f"None on every image); remove it or give a value."
        )
    built = {**preprocessor, **{k: v for k, v in flat.items() if k != "size"}}
    origin = {k: (_KWARGS_FLAG if k in flat else source) for k in built}
    given = _given(built)
    size = _size_mapping(given.get("size", QWEN2_VL_SIZE), origin.get("size", source))
    size_origin = origin["size"] if "size" in given else "Qwen2VLImageProcessor's default"
    edge_origin = dict.fromkeys(size, size_origin)
    for edge, pixels in _PIXEL_EDGES:
        if pixels in given:
            size[edge], edge_origin[edge] = given[pixels], origin[pixels]
    if "size" in scoped:
        asked = _size_mapping(scoped["size"], _KWARGS_FLAG)
        if not fills_partial_size:
            size, edge_origin, size_origin = {}, {}, _KWARGS_FLAG
        for edge, value in asked.items():
            size[edge], edge_origin[edge] = value, _KWARGS_FLAG
    for edge, pixels in _PIXEL_EDGES:
        if pixels in scoped:
            size[edge], edge_origin[edge] = scoped[pixels], _KWARGS_FLAG
    for edge, pixels in _PIXEL_EDGES:
        if size.get(edge) is None:
            raise NeuronConfigError(
                f"the image processor's size={size} (from {size_origin}) has no {edge}: "
                f"transformers' Qwen2VLImageProcessor needs both shortest_edge and "
                f"longest_edge on every image (a size given replaces the one it had "
                f"whole); give both in size, or set --mm-processor-kwargs "
                f"'{{\"{pixels}\": ...}}'."
            )
    low, high = (
        _whole(f"size.{edge} ({pixels})", size[edge], edge_origin[edge], pixels)
        for edge, pixels in _PIXEL_EDGES
    )
    patch = _call_value("patch_size", QWEN2_VL_PATCH, given, scoped, origin)
    merge = _call_value("merge_size", QWEN2_VL_MERGE, given, scoped, origin)
    step = merge * merge
    area = patch * patch
    return VisionLimits(
        min_patches=max(step, -(-low // area) // step * step),
        max_patches=max(step, high // area // step * step),
        step=step,
    )


# the Qwen2-VL image processor's call kwargs the limits depend on, besides size
_QWEN2_VL_CALL_KEYS = ("min_pixels", "max_pixels", "patch_size", "merge_size")


def _size_mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise NeuronConfigError(
            f"the image processor's size={value!r} (from {where}) must be a mapping of "
            f"shortest_edge and longest_edge pixels; set --mm-processor-kwargs "
            f'\'{{"min_pixels": ..., "max_pixels": ...}}\'.'
        )
    return dict(value)


def _call_value(
    name: str,
    default: int,
    given: Mapping[str, Any],
    scoped: Mapping[str, Any],
    origin: Mapping[str, str],
) -> int:
    """A whole-number setting of the processor (patch_size, merge_size): the call's
    image kwargs, else the built processor's, else the class's default."""
    if scoped.get(name) is not None:
        return _whole(name, scoped[name], _KWARGS_FLAG)
    if name in given:
        return _whole(name, given[name], origin[name])
    return default


def pixtral_limits(
    preprocessor: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any],
    image_size: int,
    source: str = PREPROCESSOR_FILE,
) -> VisionLimits:
    """A Pixtral image processor's patch range: it scales an image down so its longest
    side is at most size.longest_edge pixels and rounds each side up to whole patches
    (transformers' PixtralImageProcessor resize / get_resize_output_image_size), so an
    image has 1 to ceil(longest_edge / patch)**2 patches, one embedding each. vLLM counts
    an image's [IMG] placeholders as if longest_edge were the vision config's
    `image_size` (PixtralHFEncoderInfo.get_patch_grid_size), so another edge would give
    an image more or fewer embeddings than placeholders: refused. A null or absent key
    is the class's default (size.longest_edge 1024, 16-pixel patches)."""
    given = _given(preprocessor)
    size = {**given.get("size", PIXTRAL_SIZE), **_given(mm_processor_kwargs.get("size") or {})}
    where = f"{_KWARGS_FLAG} or {source}"
    edge = _whole("size.longest_edge", size.get("longest_edge"), where)
    if edge != image_size:
        raise NeuronConfigError(
            f"Pixtral's image processor size.longest_edge={edge} ({where}) "
            f"differs from vision_config.image_size={image_size}: "
            f"vLLM places an image's [IMG] tokens for image_size (PixtralHFEncoderInfo), "
            f"the processor scales it to longest_edge, and the two would not match; set "
            f"size.longest_edge to {image_size} or remove it from --mm-processor-kwargs."
        )
    patch_size = {**given.get("patch_size", PIXTRAL_PATCH)}
    side = -(-edge // int(patch_size.get("height", 16)))
    return VisionLimits(min_patches=1, max_patches=side * side, step=1)


# transformers' PixtralImageProcessor class defaults
PIXTRAL_SIZE = {"longest_edge": 1024}
PIXTRAL_PATCH = {"height": 16, "width": 16}


def pixtral_patches(pixel_values: np.ndarray, patch: int) -> ImageInputs:
    """One image of Pixtral's processor ([channels, height, width], sides whole patches)
    as its patches row by row, each channels x patch x patch values in patch_conv's
    kernel order; grid_thw (1, rows, columns)."""
    channels, height, width = pixel_values.shape
    rows, columns = height // patch, width // patch
    if rows * patch != height or columns * patch != width:
        raise ValueError(
            f"an image of {height}x{width} pixels is not whole {patch}-pixel patches (the "
            f"model's processor makes it so)"
        )
    blocks = pixel_values.reshape(channels, rows, patch, columns, patch)
    flat = blocks.transpose(1, 3, 0, 2, 4).reshape(rows * columns, channels * patch * patch)
    return ImageInputs(
        np.ascontiguousarray(flat, dtype=np.float32), np.array([1, rows, columns], np.int64)
    )


def llama4_limits(
    preprocessor: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any],
    image_size: int,
    patch_size: int,
    source: str = PREPROCESSOR_FILE,
) -> VisionLimits:
    """A Llama 4 image processor's patch range, in whole tiles of image_size pixels a
    side ((image_size / patch)**2 patches each): it fits an image to a grid of at most
    max_patches tiles and adds the global tile when there is more than one
    (transformers' Llama4ImageProcessor, find_supported_resolutions; vLLM's
    Mllama4MultiModalProcessor counts 1 + rows x columns tiles alike), so an image has 1
    or 3 to max_patches + 1 tiles. vLLM places an image's tokens for tiles of
    vision_config.image_size pixels, so a processor tile of another size is refused. A
    null or absent key is the class's default (max_patches 16)."""
    given = _given(preprocessor)
    size = {**given.get("size", {}), **_given(mm_processor_kwargs.get("size") or {})}
    where = f"{_KWARGS_FLAG} or {source}"
    tile = (size.get("height", image_size), size.get("width", image_size))
    if tile != (image_size, image_size):
        raise NeuronConfigError(
            f"Llama 4's image processor size={dict(size)} ({where}) "
            f"differs from vision_config.image_size={image_size}: "
            f"vLLM lays out an image's tokens for tiles of image_size pixels; set size to "
            f"{{'height': {image_size}, 'width': {image_size}}} or remove it."
        )
    chunks = mm_processor_kwargs.get("max_patches", given.get("max_patches", 16))
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise NeuronConfigError(
            f"Llama 4's image processor max_patches={chunks!r} ({where}) "
            f"must be a whole number of tiles >= 1; set "
            f"--mm-processor-kwargs '{{\"max_patches\": 4}}'."
        )
    per_tile = (image_size // patch_size) ** 2
    tiles = chunks + 1 if chunks > 1 else 1
    return VisionLimits(
        min_patches=per_tile, max_patches=tiles * per_tile, step=per_tile, global_tile=True
    )


def image_limits(
    preprocessor: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any],
    vision: Mapping[str, Any],
    source: str = PREPROCESSOR_FILE,
) -> VisionLimits:
    """A vision-language model's image sizes, by its image processor (the saved
    settings' image_processor_type, else the vision_config's model_type): Pixtral's,
    Llama 4's or the Qwen2-VL family's; `preprocessor` holds the saved settings
    (`image_processor_config`, read from `source`), `vision` is the checkpoint's
    vision_config."""
    kind = str(preprocessor.get("image_processor_type") or "")
    tower = vision.get("model_type")
    if kind.startswith("Pixtral") or (not kind and tower == "pixtral"):
        return pixtral_limits(preprocessor, mm_processor_kwargs, int(vision["image_size"]), source)
    if kind.startswith("Llama4") or (not kind and tower == LLAMA4_VISION):
        llama4_merge(vision)
        return llama4_limits(
            preprocessor,
            mm_processor_kwargs,
            int(vision["image_size"]),
            int(vision["patch_size"]),
            source,
        )
    return processor_limits(
        preprocessor,
        mm_processor_kwargs,
        source,
        fills_partial_size=str(tower).startswith("qwen3_vl"),
    )


def tile_patches(pixel_values: np.ndarray, patch: int) -> ImageInputs:
    """One image of Llama 4's processor ([tiles, channels, side, side] pixels) as its
    tiles' patches, tile after tile, each tile's row by row (`pixtral_patches`, the
    order of the tower's Unfold); grid_thw (tiles, patches a side, patches a side)."""
    cut = [pixtral_patches(tile, patch) for tile in pixel_values]
    _, rows, columns = (int(n) for n in cut[0].grid_thw)
    return ImageInputs(
        np.concatenate([c.pixel_values for c in cut]),
        np.array([len(cut), rows, columns], np.int64),
    )


def _whole(name: str, value: object, where: str, key: str | None = None) -> int:
    """A setting that must be a whole number >= 1 (pixels, a patch's side); `key`: the
    --mm-processor-kwargs key that sets it (default: `name`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        outer, _, inner = (key or name).partition(".")
        fix = f'{{"{outer}": {{"{inner}": ...}}}}' if inner else f'{{"{outer}": ...}}'
        raise NeuronConfigError(
            f"the image processor's {name}={value!r} (from {where}) must be a whole "
            f"number >= 1; set --mm-processor-kwargs '{fix}'."
        )
    return value


def resolve_vision_buckets(
    override: Mapping[str, Any], limits: VisionLimits | None
) -> tuple[int, ...]:
    """The vision encoder's buckets: the user's `vision_buckets`, or powers of two
    times `step` from the smallest image's patches up to the largest's (appended), as
    NxDI's default text grids grow; none for a text model. With a global tile (Llama 4)
    the powers of two count local tiles, each bucket one more for the global tile: an
    image of 2**k local tiles fills one exactly, and no graph is built for two tiles,
    which no image has."""
    if limits is None:
        if VISION_BUCKETS_KEY in override:
            raise NeuronConfigError(
                f"override_neuron_config.{VISION_BUCKETS_KEY} sizes a vision encoder's "
                f"graphs, but this model takes no images; remove it."
            )
        return ()
    name = f"override_neuron_config.{VISION_BUCKETS_KEY}"
    if VISION_BUCKETS_KEY in override:
        try:
            buckets = validate_grid(override[VISION_BUCKETS_KEY], name=name)
        except BucketError as exc:
            raise NeuronConfigError(str(exc)) from None
        odd = [b for b in buckets if b % limits.step]
        if odd:
            raise NeuronConfigError(
                f"{name} has {odd}: an image's patches come in multiples of "
                f"{limits.step} (spatial_merge_size squared; Llama 4: a tile's patches); "
                f"round them up."
            )
        return buckets
    if limits.global_tile:
        return _tile_grid(limits.max_patches // limits.step, limits.step)
    grown: list[int] = []
    steps = -(-limits.min_patches // limits.step)
    size = limits.step << max(0, (steps - 1).bit_length())
    while size < limits.max_patches:
        grown.append(size)
        size *= 2
    return (*grown, limits.max_patches)


def _tile_grid(most: int, per_tile: int) -> tuple[int, ...]:
    """Buckets of 1 tile, 2**k local tiles and the global one below `most` tiles, and
    `most`, in patches."""
    tiles, local = [1], 2
    while local + 1 < most:
        tiles.append(local + 1)
        local *= 2
    if most > 1:
        tiles.append(most)
    return tuple(n * per_tile for n in tiles)


def mrope_positions(
    length: int, images: list[tuple[int, np.ndarray]], spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """M-RoPE rotary positions [3, length] of a prompt whose images (placeholder offset,
    grid_thw) sit in it, and the shift its later tokens keep (`delta`: the token at KV
    position p rotates at p + delta), as the Qwen2-VL family numbers them
    (transformers' `get_rope_index`): text counts on in all three rows from the last
    position used; an image's tokens take (frame, row, column) of the merged grid,
    offset by the position the image starts at. Qwen3-VL's get_rope_index numbers an
    image alike (its text resumes max(height, width) merged rows on, the same for an
    image's single frame)."""
    rows, start, cursor = [], 0, 0
    for offset, grid in sorted(images, key=lambda image: image[0]):
        text = offset - start
        rows.append(np.broadcast_to(cursor + np.arange(text), (3, text)))
        cursor += text
        t, h, w = (
            int(grid[0]),
            int(grid[1]) // spatial_merge_size,
            int(grid[2]) // spatial_merge_size,
        )
        frame, row, column = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        placed = cursor + np.stack([frame.ravel(), row.ravel(), column.ravel()])
        rows.append(placed)
        cursor = int(placed.max()) + 1
        start = offset + t * h * w
    rows.append(np.broadcast_to(cursor + np.arange(length - start), (3, length - start)))
    positions = np.concatenate(rows, axis=1).astype(np.int64)
    return positions, cursor + (length - start) - length


def chunk_embeddings(
    start: int,
    count: int,
    active: int,
    width: int,
    placed: list[tuple[int, np.ndarray]],
    embeds: list[np.ndarray | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The vision inputs of a context-encoding call of prompt tokens [start, start +
    count) padded to `active`: embeddings [1, active, width] and mask [1, active], from
    each image's (placeholder offset, embeddings [tokens, width]; width:
    `VisionGeometry.embedding_width`). A chunk may cut an
    image anywhere (chunked prefill, a prefix-cache hit inside an image): it takes the
    rows of the image's embeddings its tokens cover, as vLLM's GPU runner gathers them
    (`_gather_mm_embeddings`). `embeds` (per image; None: every token) marks the
    placeholder tokens an embedding replaces, the others keep their own (Pixtral's
    [IMG_BREAK] and [IMG_END], vLLM's PlaceholderRange.is_embed); such an image's rows
    are one per placeholder token (`spread_embeddings`)."""
    embeddings = np.zeros((1, active, width), dtype=np.float32)
    mask = np.zeros((1, active), dtype=bool)
    end = start + count
    for (offset, rows), embed in zip(placed, embeds or [None] * len(placed), strict=True):
        first, last = max(start, offset), min(end, offset + rows.shape[0])
        if first >= last:
            continue
        embeddings[0, first - start : last - start] = rows[first - offset : last - offset]
        mask[0, first - start : last - start] = (
            True if embed is None else embed[first - offset : last - offset]
        )
    return embeddings, mask


def spread_embeddings(rows: np.ndarray, embed: np.ndarray) -> np.ndarray:
    """An image's embeddings [embedded tokens, hidden] laid over its placeholder run
    [len(embed), hidden]: in order at the tokens `embed` marks, zero elsewhere."""
    if int(embed.sum()) != rows.shape[0]:
        raise ValueError(
            f"an image of {rows.shape[0]} embeddings for {int(embed.sum())} placeholder "
            f"tokens; the processor and the model disagree"
        )
    spread = np.zeros((embed.size, rows.shape[1]), dtype=rows.dtype)
    spread[embed] = rows
    return spread
