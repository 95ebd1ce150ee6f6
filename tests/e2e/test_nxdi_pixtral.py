"""Pixtral (Llava format) on the nxd backend: NxDI's image-to-text application on real NxD
Inference in its CPU mode, driven by the plugin's NxDBackend and its host-side image path
(nxdi_image_to_text_probe.py: serving.images.Images, NxDBackend.encode_image through
nxd.pixtral_vision, forward), against transformers' LlavaForConditionalGeneration (this
environment's, float32) on the tiny checkpoint of scripts/build_tiny_model.py, with
synthetic images in the processor's layout [3, H, W] (whole 16-pixel patches). Only the
[IMG] placeholders take embeddings ([IMG_BREAK] ends each patch row, [IMG_END] the
image). Greedy tokens and every step's logits (nxdi_image_to_text.py's cases):
- a text-only prompt;
- one image (4 x 4 patches: the 16-patch vision bucket exactly);
- two images of different sizes (the second, 4 x 6 patches, padded into the 64 bucket);
- a prompt with an image that fills its 128-token context bucket exactly (patch
  vision-scatter-scratch-row: NxDI's padding would overwrite its last token);
- batch 2 decoding together, one row with an image and one without; and the same with
  NxDI's on-device sampler (`run`, greedy: tokens only).
Each case runs once per NxDI release listed (NEURON_TEST_NXDI_PYTHONS, see
tests/e2e/conftest.py). NxD Inference is not on the package index: without an
interpreter these tests skip."""

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

ARCH = "LlavaForConditionalGeneration"
VISION_BUCKETS = [16, 64]
PATCH = 16
SHAPES = {"small": (4, 4), "wide": (4, 6)}  # patch rows x columns: 16 and 24 patches


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("pixtral")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """An image: each patch row's [IMG]s, then [IMG_BREAK] ([IMG_END] after the last),
    only the [IMG]s taking an embedding (is_embed); its pixels [3, H, W] in the plan."""
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    folder = tmp_path_factory.mktemp("pixtral-pixels")
    rng = np.random.default_rng(0)
    pixels = {}
    for name, (rows, columns) in SHAPES.items():
        path = folder / f"{name}.npy"
        image = rng.standard_normal((3, rows * PATCH, columns * PATCH)).astype(np.float32)
        np.save(path, image)
        pixels[name] = str(path)

    def placed(name: str, start: int) -> tuple[list[int], dict]:
        rows, columns = SHAPES[name]
        run: list[int] = []
        for row in range(rows):
            run += [ids["[IMG]"]] * columns
            run.append(ids["[IMG_END]"] if row == rows - 1 else ids["[IMG_BREAK]"])
        embed = [t == ids["[IMG]"] for t in run]
        return run, {"offset": start, "is_embed": embed, "pixels": pixels[name]}

    return build_cases(model_dir, placed)


@pytest.fixture(scope="module")
def probed(nxdi_python, model_dir, cases, tmp_path_factory):
    settings = nxd_settings(ARCH, (1, 64, 1), VISION_BUCKETS)
    return run_probe(
        nxdi_python, model_dir, settings, cases, tmp_path_factory.mktemp("nxdi-pixtral")
    )


def _expected(hf_model, row: dict) -> tuple[list[int], torch.Tensor]:
    """Llava takes the images zero-padded to one size with each one's own size
    (image_sizes)."""
    images = {}
    if row["images"]:
        loaded = [torch.from_numpy(np.load(i["pixels"])) for i in row["images"]]
        height = max(i.shape[1] for i in loaded)
        width = max(i.shape[2] for i in loaded)
        padded = torch.zeros(len(loaded), 3, height, width)
        for index, image in enumerate(loaded):
            padded[index, :, : image.shape[1], : image.shape[2]] = image
        images = {
            "pixel_values": padded,
            "image_sizes": torch.tensor([list(i.shape[1:]) for i in loaded]),
        }
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


def test_the_scatter_patch_is_in_effect(probed):
    """The full-bucket case passes because of patch vision-scatter-scratch-row, which the
    probe finds in both releases' Pixtral text model (and i2t-capture-hook on 0.8)."""
    report, _ = probed
    assert "vision-scatter-scratch-row" in report["patches"]
