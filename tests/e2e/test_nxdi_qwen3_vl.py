"""Qwen3-VL on the nxd backend: NxDI's image-to-text application on real NxD Inference in
its CPU mode, driven by the plugin's NxDBackend and its host-side image path
(nxdi_image_to_text_probe.py: serving.images.Images, NxDBackend.encode_image, forward),
against transformers' Qwen3VLForConditionalGeneration (this environment's, float32) on
the tiny checkpoint of scripts/build_tiny_model.py, with synthetic pixel_values in the
processor's layout [patches, 3 * 2 * 16 * 16]. Greedy tokens and every step's logits
(nxdi_image_to_text.py's cases):
- a text-only prompt;
- one image (64 patches: the 64-patch vision bucket exactly);
- two images of different sizes (the second, 96 patches, padded into the 256 bucket);
- a prompt with an image that fills its 128-token context bucket exactly (patch
  vision-scatter-scratch-row: NxDI's padding would overwrite its last token);
- batch 2 decoding together, one row with an image (its M-RoPE positions shifted by the
  image's delta) and one without; and the same with NxDI's on-device sampler (`run`,
  greedy: tokens only).
(What the backend refuses for it is checked without NxDI:
tests/plugin/test_nxd_image_to_text.py.) Each case runs once per NxDI release listed
(NEURON_TEST_NXDI_PYTHONS, see tests/e2e/conftest.py). NxD Inference is not on the
package index: without an interpreter these tests skip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.nxdi_image_to_text import (
    CASES,
    assert_equal_to_transformers,
    build_cases,
    greedy,
    nxd_settings,
    run_probe,
)

pytestmark = [pytest.mark.nxdi]

ARCH = "Qwen3VLForConditionalGeneration"
VISION_BUCKETS = [64, 256]
GRIDS = {"small": (1, 8, 8), "wide": (1, 8, 12)}  # 64 and 96 patches: 16 and 24 tokens
PATCH_DIM = 3 * 2 * 16 * 16


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("qwen3_vl")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(model_dir, hf_model, tmp_path_factory) -> dict[str, list[dict]]:
    """An image: <|vision_start|>, an <|image_pad|> per merged 2 x 2 patches,
    <|vision_end|>; its pixels and grid in the plan."""
    folder = tmp_path_factory.mktemp("qwen3-vl-pixels")
    rng = np.random.default_rng(0)
    config = hf_model.config
    pixels = {}
    for name, grid in GRIDS.items():
        path = folder / f"{name}.npy"
        np.save(path, rng.standard_normal((int(np.prod(grid)), PATCH_DIM)).astype(np.float32))
        pixels[name] = str(path)

    def placed(name: str, start: int) -> tuple[list[int], dict]:
        tokens = [config.image_token_id] * (int(np.prod(GRIDS[name])) // 4)
        run = [config.vision_start_token_id, *tokens, config.vision_end_token_id]
        return run, {"offset": start + 1, "grid": list(GRIDS[name]), "pixels": pixels[name]}

    return build_cases(model_dir, placed)


@pytest.fixture(scope="module")
def probed(nxdi_python, model_dir, cases, tmp_path_factory):
    settings = nxd_settings(ARCH, (16, 256, 4), VISION_BUCKETS)
    return run_probe(
        nxdi_python, model_dir, settings, cases, tmp_path_factory.mktemp("nxdi-qwen3-vl")
    )


def _expected(hf_model, row: dict) -> tuple[list[int], torch.Tensor]:
    images = {}
    if row["images"]:
        ids = torch.tensor([row["prompt"]])
        images = {
            "pixel_values": torch.cat(
                [torch.from_numpy(np.load(i["pixels"])) for i in row["images"]]
            ),
            "image_grid_thw": torch.tensor([i["grid"] for i in row["images"]]),
            "mm_token_type_ids": (ids == hf_model.config.image_token_id).int(),
        }
    return greedy(hf_model, row["prompt"], **images)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logits_equal_transformers(probed, hf_model, cases, case):
    assert_equal_to_transformers(probed, cases[case], case, lambda row: _expected(hf_model, row))


def test_a_padding_call_runs_each_vision_bucket_and_answers_no_rows(probed, hf_model):
    """Warm-up runs every vision graph with a padding image (core.vision.padding_image):
    no rows, each as wide as an embedding and its DeepStack levels."""
    report, _ = probed
    levels = len(hf_model.config.vision_config.deepstack_visual_indexes)
    width = hf_model.config.text_config.hidden_size * (1 + levels)
    assert report["padding"] == {str(b): [0, width] for b in VISION_BUCKETS}


def test_the_scatter_patch_is_in_effect(probed):
    """The full-bucket case passes because of patch vision-scatter-scratch-row, which the
    probe finds in both releases' Qwen3-VL text model (and i2t-capture-hook on 0.8)."""
    report, _ = probed
    assert "vision-scatter-scratch-row" in report["patches"]
