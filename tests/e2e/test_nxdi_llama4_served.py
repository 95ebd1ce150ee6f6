"""Llama 4 served by the nxd backend: NxDI's image-to-text application on real NxD
Inference in its CPU mode with the plugin's patch llama4-rope-temperature, driven by the
plugin's NxDBackend and its host-side image path (nxdi_image_to_text_probe.py:
serving.images.Images, NxDBackend.encode_image through nxd.llama4_vision, forward),
against transformers' Llama4ForConditionalGeneration (this environment's, float32, the
checkpoint as it is: llama3 RoPE scaling, temperature tuning from position 7) on the tiny
checkpoint of scripts/build_tiny_model.py (NoPE and chunked RoPE layers, dense and MoE
layers), with synthetic tiles [tiles, 3, 56, 56] (4 embeddings per tile, at the image's
<|patch|> tokens). Greedy tokens and every step's logits (nxdi_image_to_text.py's cases):
- a text-only prompt past the first attention chunk;
- one image of one tile (the 16-patch vision bucket exactly);
- two images, of one and of three tiles (the second padded into the 80-patch bucket);
- a prompt with an image that fills its 128-token context bucket exactly (patch
  vision-scatter-scratch-row);
- batch 2 decoding together, one row with an image and one without; and the same with
  NxDI's on-device sampler (`run`, greedy: tokens only).
What NxDI does without the patches: tests/e2e/test_nxdi_llama4.py. Each case runs once
per NxDI release listed (NEURON_TEST_NXDI_PYTHONS, see tests/e2e/conftest.py); without
an interpreter these tests skip."""

from __future__ import annotations

import json
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

ARCH = "Llama4ForConditionalGeneration"
TILE = 56
TILE_PATCHES = 16  # (56 / 14)**2
TILE_TOKENS = 4  # pixel shuffle ratio 0.5: 16 patches to 4 embeddings
VISION_BUCKETS = [TILE_PATCHES, 5 * TILE_PATCHES]
TILES = {"small": 1, "wide": 3}


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama4")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Llama4ForConditionalGeneration

    return Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """An image: <|image_start|>, a <|patch|> per embedding, <|image_end|>; its tiles
    [tiles, 3, 56, 56] in the plan."""
    config = json.loads((model_dir / "config.json").read_text())
    folder = tmp_path_factory.mktemp("llama4-pixels")
    rng = np.random.default_rng(0)
    pixels = {}
    for name, count in TILES.items():
        path = folder / f"{name}.npy"
        np.save(path, rng.standard_normal((count, 3, TILE, TILE)).astype(np.float32))
        pixels[name] = str(path)

    def placed(name: str, start: int) -> tuple[list[int], dict]:
        tokens = TILES[name] * TILE_TOKENS
        run = [
            config["boi_token_index"],
            *[config["image_token_index"]] * tokens,
            config["eoi_token_index"],
        ]
        entry = {"offset": start + 1, "is_embed": [True] * tokens, "pixels": pixels[name]}
        return run, entry

    return build_cases(model_dir, placed)


@pytest.fixture(scope="module")
def probed(nxdi_python, model_dir, cases, tmp_path_factory):
    settings = nxd_settings(ARCH, (TILE_PATCHES, 5 * TILE_PATCHES, TILE_PATCHES), VISION_BUCKETS)
    return run_probe(
        nxdi_python, model_dir, settings, cases, tmp_path_factory.mktemp("nxdi-llama4-served")
    )


def _expected(hf_model, row: dict) -> tuple[list[int], torch.Tensor]:
    """Every image's tiles in one pixel_values [tiles, 3, 56, 56]."""
    images = {}
    if row["images"]:
        tiles = [torch.from_numpy(np.load(i["pixels"])) for i in row["images"]]
        images = {"pixel_values": torch.cat(tiles)}
    return greedy(hf_model, row["prompt"], **images)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logits_equal_transformers(probed, hf_model, cases, case):
    assert_equal_to_transformers(probed, cases[case], case, lambda row: _expected(hf_model, row))


def test_a_padding_call_runs_each_vision_bucket_and_answers_no_rows(probed, hf_model):
    """Warm-up runs every vision graph with a padding image (core.vision.padding_image):
    no rows, each as wide as the text model's embeddings."""
    report, _ = probed
    width = hf_model.config.text_config.hidden_size
    assert report["padding"] == {str(b): [0, width] for b in VISION_BUCKETS}


def test_the_patches_are_in_effect(probed):
    """The cases pass because of patch llama4-rope-temperature (RoPE scaling and
    temperature tuning) and vision-scatter-scratch-row (the full bucket), which the probe
    finds in both releases' Llama 4 text model (and i2t-capture-hook on 0.8)."""
    report, _ = probed
    assert {"llama4-rope-temperature", "vision-scatter-scratch-row"} <= set(report["patches"])
