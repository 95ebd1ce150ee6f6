"""core.vision: the vision inputs' pure arithmetic, against transformers where it has
an answer (the M-RoPE numbering of Qwen2-VL and of Qwen3-VL, which agree for images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.vision import (
    VisionLimits,
    chunk_embeddings,
    mrope_positions,
    processor_limits,
    resolve_vision_buckets,
    vision_bucket,
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
    with pytest.raises(NeuronConfigError, match=r"max_pixels='many'.*mm-processor-kwargs"):
        processor_limits({"min_pixels": 3136, "max_pixels": "many"}, {})


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
