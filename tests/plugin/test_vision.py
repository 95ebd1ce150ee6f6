"""core.vision: the vision inputs' pure arithmetic, against transformers where it has
an answer (the M-RoPE numbering of Qwen2-VL and of Qwen3-VL, which agree for images)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.vision import (
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    VisionLimits,
    chunk_embeddings,
    image_limits,
    mrope_positions,
    processor_limits,
    read_image_processor_config,
    resolve_vision_buckets,
    vision_bucket,
)
from tests.processor_formats import (
    COMMON,
    FORMATS,
    NEEDS_SDK,
    OVERRIDES,
    SMALL,
    processor_saved,
    write,
)

IMAGE, VIDEO, START, END = 90, 91, 92, 93


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def vl_model(request):
    """A tiny Qwen2-VL or Qwen3-VL base model: what get_rope_index needs."""
    if request.param == "qwen3_vl":
        from transformers import Qwen3VLConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

        return Qwen3VLModel(
            Qwen3VLConfig(
                text_config={
                    "hidden_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 32,
                    "intermediate_size": 64,
                    "vocab_size": 100,
                    "rope_parameters": {
                        "rope_type": "default",
                        "mrope_section": [6, 5, 5],
                        "mrope_interleaved": True,
                        "rope_theta": 10000.0,
                    },
                },
                vision_config={
                    "depth": 1,
                    "hidden_size": 32,
                    "intermediate_size": 32,
                    "num_heads": 2,
                    "out_hidden_size": 64,
                    "num_position_embeddings": 16,
                    "deepstack_visual_indexes": [],
                },
                image_token_id=IMAGE,
                video_token_id=VIDEO,
                vision_start_token_id=START,
                vision_end_token_id=END,
            )
        )
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = Qwen2VLConfig(
        text_config={
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "vocab_size": 100,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [4, 6, 6],
                "rope_theta": 10000.0,
            },
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
    )
    return Qwen2VLModel(config)


def _prompt(layout: list[object]) -> tuple[list[int], list[tuple[int, np.ndarray]]]:
    """Token ids and (offset, grid) of a layout of text runs (ints) and grids."""
    ids: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, int):
            ids += [5 + i % 50 for i in range(part)]
            continue
        grid = np.array(part, dtype=np.int64)
        ids.append(START)
        images.append((len(ids), grid))
        ids += [IMAGE] * (int(np.prod(grid)) // 4)
        ids.append(END)
    return ids, images


@pytest.mark.parametrize(
    "layout",
    [
        [3, (1, 4, 6), 4],
        [(1, 8, 4), 2],
        [2, (1, 4, 6), 3, (1, 8, 4), 1],
        [3, (1, 2, 2)],
    ],
    ids=["one-image", "image-first", "two-images", "ends-in-image"],
)
def test_mrope_positions_equal_transformers_get_rope_index(vl_model, layout):
    ids, images = _prompt(layout)
    positions, delta = mrope_positions(len(ids), images, spatial_merge_size=2)
    expected, expected_delta = vl_model.get_rope_index(
        torch.tensor([ids]),
        torch.tensor([[int(i == IMAGE) for i in ids]]),
        image_grid_thw=torch.tensor(np.stack([g for _, g in images])),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)


def test_text_only_prompt_has_plain_positions():
    positions, delta = mrope_positions(7, [], spatial_merge_size=2)
    assert positions.tolist() == [list(range(7))] * 3
    assert delta == 0


def test_chunk_takes_the_rows_of_the_images_it_covers():
    first = np.arange(6 * 2, dtype=np.float32).reshape(6, 2)
    second = 100 + np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
    placed = [(2, first), (10, second)]
    # tokens [4, 12): the last four rows of the first image, text, two of the second
    embeddings, mask = chunk_embeddings(4, 8, active=16, width=2, placed=placed)
    assert mask[0].tolist() == [True] * 4 + [False] * 2 + [True] * 2 + [False] * 8
    assert np.array_equal(embeddings[0, :4], first[2:])
    assert np.array_equal(embeddings[0, 6:8], second[:2])
    assert not embeddings[0, 8:].any()


def test_chunk_outside_every_image_has_none():
    embeddings, mask = chunk_embeddings(0, 2, 4, 2, [(2, np.ones((3, 2), np.float32))])
    assert not mask.any() and not embeddings.any()


def test_processor_limits_read_both_spellings_and_the_request_kwargs():
    given = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64, "patch_size": 14}
    assert processor_limits(given, {}) == VisionLimits(16, 256, 4)
    transformers5 = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}}
    assert processor_limits(transformers5, {}) == VisionLimits(16, 256, 4)
    assert processor_limits(given, {"max_pixels": 28 * 28 * 16}).max_patches == 64


def test_processor_limits_refuse_a_bad_pixel_count():
    with pytest.raises(NeuronConfigError, match=r"max_pixels\)='many'.*mm-processor-kwargs"):
        processor_limits({"min_pixels": 3136, "max_pixels": "many"}, {})


QWEN2_VL_VISION = {"model_type": "qwen2_vl", "patch_size": 14, "spatial_merge_size": 2}


def _write_layout(request, layout: str, folder) -> None:
    writer = FORMATS[layout]
    if layout in NEEDS_SDK:
        writer(folder, request.getfixturevalue("sdk_python"))
    else:
        writer(folder)


def _limits(folder, kwargs) -> VisionLimits:
    saved, source = read_image_processor_config(folder)
    return image_limits(saved, kwargs, QWEN2_VL_VISION, source)


@pytest.fixture(scope="module", params=list(FORMATS))
def layout(request, tmp_path_factory):
    """A folder holding one layout's processor files (tests/processor_formats.py)."""
    folder = tmp_path_factory.mktemp("layout") / request.param
    _write_layout(request, request.param, folder)
    return folder


@pytest.mark.parametrize("kwargs, patches", OVERRIDES, ids=lambda v: json.dumps(v))
def test_image_limits_are_the_processors_in_every_layout(layout, kwargs, patches):
    """Every layout (the Hub's, transformers 5's image processor and processor saves,
    transformers 4.57's slow save and its fast one's nulls), under each kind of
    --mm-processor-kwargs: the patch range the processor vLLM runs gives
    (tests/e2e/test_vision_processor_formats.py checks it against that processor)."""
    assert _limits(layout, kwargs) == VisionLimits(*patches, 4)


def test_null_or_absent_keys_are_the_processor_class_defaults(tmp_path):
    """Qwen2VLImageProcessor's size {3136, 1003520}, patch 14, merge 2 where a key is
    absent or null."""
    write(tmp_path, PREPROCESSOR_FILE, dict.fromkeys(["size", "min_pixels", "patch_size"]))
    assert _limits(tmp_path, {}) == VisionLimits(16, 5120, 4)
    write(tmp_path, PREPROCESSOR_FILE, {})
    assert _limits(tmp_path, {"max_pixels": 28 * 28 * 64}) == VisionLimits(16, 256, 4)
    assert _limits(tmp_path / "none", {}) == VisionLimits(16, 5120, 4)  # no files at all


def test_processor_config_image_processor_comes_before_preprocessor_config(tmp_path):
    processor_saved(tmp_path)
    write(tmp_path, PREPROCESSOR_FILE, {**COMMON, "size": {**SMALL, "longest_edge": 28 * 28 * 4}})
    assert _limits(tmp_path, {}).max_patches == 256
    assert read_image_processor_config(tmp_path)[1] == "processor_config.json (image_processor)"
    # a processor_config.json without the image processor's settings (the Hub's older
    # layout, its processor's own keys only): preprocessor_config.json has them
    write(tmp_path, PROCESSOR_FILE, {"processor_class": "Qwen2VLProcessor"})
    assert _limits(tmp_path, {}).max_patches == 16
    assert read_image_processor_config(tmp_path)[1] == PREPROCESSOR_FILE


def test_qwen3_vl_patches_are_its_processors_16_pixels(tmp_path):
    """The Hub's Qwen3-VL layout: size only, 16-pixel patches (the class default is 14)."""
    size = {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64}
    write(tmp_path, PREPROCESSOR_FILE, {**COMMON, "patch_size": 16, "size": size})
    vision = {**QWEN2_VL_VISION, "model_type": "qwen3_vl", "patch_size": 16}
    saved, source = read_image_processor_config(tmp_path)
    assert image_limits(saved, {}, vision, source) == VisionLimits(16, 256, 4)


def test_a_partial_size_in_the_call_is_completed_for_qwen3_vl_only():
    """vLLM calls Qwen2-VL's processor with --mm-processor-kwargs' size as given, which
    replaces the processor's whole (a partial one then fails on every image); its
    Qwen3-VL processor completes it from the processor's own size first."""
    saved = {**COMMON, "min_pixels": SMALL["shortest_edge"], "max_pixels": SMALL["longest_edge"]}
    kwargs = {"size": {"longest_edge": 28 * 28 * 16}}
    qwen3 = {**QWEN2_VL_VISION, "model_type": "qwen3_vl_vision"}
    assert image_limits(saved, kwargs, qwen3) == VisionLimits(16, 64, 4)
    with pytest.raises(NeuronConfigError, match="has no shortest_edge"):
        image_limits(saved, kwargs, QWEN2_VL_VISION)


@pytest.mark.parametrize(
    ("saved", "kwargs", "says"),
    [
        # a partial size replaces the default whole (transformers' __init__); vLLM's
        # processor then fails on every image
        (
            {},
            {"size": {"longest_edge": 12544}},
            r"size=\{'longest_edge': 12544\} \(from --mm-processor-kwargs\) has no "
            r"shortest_edge.*'\{\"min_pixels\": ...\}'",
        ),
        (
            {"size": {"shortest_edge": 3136}},
            {},
            r"\(from preprocessor_config.json\) has no longest_edge.*max_pixels",
        ),
        (
            {"size": SMALL},
            {"max_pixels": "many"},
            r"size.longest_edge \(max_pixels\)='many' \(from --mm-processor-kwargs\)",
        ),
        ({"size": SMALL, "patch_size": 0}, {}, r"patch_size=0 \(from preprocessor_config.json\)"),
        ({"size": 3136}, {}, r"size=3136 \(from preprocessor_config.json\) must be a mapping"),
        # vLLM passes it to the processor's call, which refuses None
        (
            {"size": SMALL},
            {"images_kwargs": {"max_pixels": None}},
            r"--mm-processor-kwargs max_pixels=None.*remove it",
        ),
    ],
    ids=[
        "partial-size-kwargs",
        "partial-size-saved",
        "not-a-number",
        "zero-patch",
        "not-a-size",
        "null-kwarg",
    ],
)
def test_unusable_settings_are_refused_naming_the_setting_and_the_fix(saved, kwargs, says):
    with pytest.raises(NeuronConfigError, match=says):
        image_limits(saved, kwargs, QWEN2_VL_VISION)


def test_default_vision_buckets_grow_by_powers_of_two_to_the_largest_image():
    assert resolve_vision_buckets({}, VisionLimits(16, 256, 4)) == (16, 32, 64, 128, 256)
    assert resolve_vision_buckets({}, VisionLimits(12, 200, 4)) == (16, 32, 64, 128, 200)
    assert resolve_vision_buckets({}, None) == ()


def test_vision_buckets_given_are_checked():
    limits = VisionLimits(16, 256, 4)
    assert resolve_vision_buckets({"vision_buckets": [64, 256]}, limits) == (64, 256)
    with pytest.raises(NeuronConfigError, match=r"vision_buckets has \[66\].*multiples of 4"):
        resolve_vision_buckets({"vision_buckets": [66, 256]}, limits)
    with pytest.raises(NeuronConfigError, match="vision_buckets"):
        resolve_vision_buckets({"vision_buckets": [256, 64]}, limits)
    with pytest.raises(NeuronConfigError, match="takes no images; remove it"):
        resolve_vision_buckets({"vision_buckets": [64]}, None)


def test_vision_bucket_is_first_fit_and_names_the_fix_beyond_the_largest():
    assert vision_bucket((16, 64, 256), 16) == 16
    assert vision_bucket((16, 64, 256), 20) == 64
    with pytest.raises(NeuronConfigError, match="300 patches exceeds the largest vision bucket"):
        vision_bucket((16, 64, 256), 300)
