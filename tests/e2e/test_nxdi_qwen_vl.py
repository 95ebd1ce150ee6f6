"""Qwen3-VL, Qwen2-VL and Qwen2.5-VL on the nxd backend: NxDI's image-to-text applications
on real NxD Inference in its CPU mode (Qwen3-VL's as NxDI ships it; Qwen2-VL's with the
plugin's own vision encoder, Qwen2.5-VL on it with the plugin's own tower,
backends/nxd/families/qwen2_vl), driven by the plugin's NxDBackend and its host-side image
path (nxdi_image_to_text_probe.py: serving.images.Images, NxDBackend.encode_image,
forward), against transformers' model of the architecture (this environment's, float32)
on each tiny checkpoint of scripts/build_tiny_model.py (MODELS), with synthetic
pixel_values in the processor's layout [patches, 3 * 2 * patch * patch]. Each image's
embeddings from the vision encoder alone against transformers' image features, then
greedy tokens and every step's logits (nxdi_image_to_text.py's cases):
- a text-only prompt;
- one image (64 patches: the 64-patch vision bucket exactly);
- two images of different sizes (the second, 96 patches, padded into the 256 bucket);
- a prompt with an image that fills its 128-token context bucket exactly (patch
  vision-scatter-scratch-row: NxDI's padding would overwrite its last token);
- batch 2 decoding together, one row with an image (its M-RoPE positions shifted by the
  image's delta) and one without; and the same with NxDI's on-device sampler (`run`,
  greedy: tokens only).
The Qwen2-VL family's image cases need patch qwen2-vl-mrope (NxDI's text model rotates
image tokens by 1-D positions without it).
(What the backend refuses for them is checked without NxDI:
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
    TOLERANCE,
    assert_equal_to_transformers,
    build_cases,
    greedy,
    nxd_settings,
    run_probe,
)

pytestmark = [pytest.mark.nxdi]

# tiny checkpoint -> (architecture, pixel values per patch)
MODELS = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", 3 * 2 * 16 * 16),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", 3 * 2 * 14 * 14),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", 3 * 2 * 14 * 14),
}
VISION_BUCKETS = [64, 256]
GRIDS = {"small": (1, 8, 8), "wide": (1, 8, 12)}  # 64 and 96 patches: 16 and 24 tokens


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(tiny_model, model) -> Path:
    return tiny_model(model)


@pytest.fixture(scope="module")
def hf_model(model_dir, model):
    import transformers

    cls = getattr(transformers, MODELS[model][0])
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pixels(model, tmp_path_factory) -> dict[str, str]:
    """Each grid's synthetic pixel_values, saved: grid name -> .npy path."""
    folder = tmp_path_factory.mktemp(f"{model}-pixels")
    rng = np.random.default_rng(0)
    found = {}
    for name, grid in GRIDS.items():
        path = folder / f"{name}.npy"
        values = rng.standard_normal((int(np.prod(grid)), MODELS[model][1]))
        np.save(path, values.astype(np.float32))
        found[name] = str(path)
    return found


@pytest.fixture(scope="module")
def cases(model_dir, hf_model, pixels) -> dict[str, list[dict]]:
    """An image: <|vision_start|>, an <|image_pad|> per merged 2 x 2 patches,
    <|vision_end|>; its pixels and grid in the plan."""
    config = hf_model.config

    def placed(name: str, start: int) -> tuple[list[int], dict]:
        tokens = [config.image_token_id] * (int(np.prod(GRIDS[name])) // 4)
        run = [config.vision_start_token_id, *tokens, config.vision_end_token_id]
        return run, {"offset": start + 1, "grid": list(GRIDS[name]), "pixels": pixels[name]}

    return build_cases(model_dir, placed)


@pytest.fixture(scope="module")
def probed(nxdi_python, model, model_dir, cases, pixels, tmp_path_factory):
    settings = nxd_settings(MODELS[model][0], (16, 256, 4), VISION_BUCKETS)
    images = {name: {"grid": list(GRIDS[name]), "pixels": pixels[name]} for name in GRIDS}
    out = tmp_path_factory.mktemp(f"nxdi-{model}")
    return run_probe(nxdi_python, model_dir, settings, cases, out, images)


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


@pytest.mark.parametrize("image", sorted(GRIDS))
def test_the_vision_encoder_gives_transformers_image_embeddings(probed, hf_model, pixels, image):
    """Each image through NxDBackend.encode_image (its vision bucket: 64 patches exactly,
    96 padded into 256) against transformers' image features (get_image_features: the
    merger's output per image; Qwen3-VL's DeepStack levels are checked through the
    logits): the encoder alone, where the logits blur a defect (measured: Qwen2.5-VL's
    tower without its windows put the logits 1.2e-4 off, its embeddings 1.7e-3)."""
    _, out = probed
    got = np.load(out / f"embeddings-{image}.npy")
    hidden = hf_model.config.text_config.hidden_size
    grid = torch.tensor([GRIDS[image]])
    with torch.no_grad():
        features = hf_model.model.get_image_features(
            torch.from_numpy(np.load(pixels[image])), grid
        )
    expected = features.pooler_output[0]
    assert got.shape == (expected.shape[0], got.shape[1]) and got.shape[1] >= hidden
    gap = float((torch.from_numpy(got[:, :hidden]) - expected).abs().max())
    assert gap < TOLERANCE, f"{image}: embeddings off by {gap}"


def test_a_padding_call_runs_each_vision_bucket_and_answers_no_rows(probed, hf_model):
    """Warm-up runs every vision graph with a padding image (core.vision.padding_image):
    no rows, each as wide as an embedding and its DeepStack levels (Qwen3-VL)."""
    report, _ = probed
    levels = len(getattr(hf_model.config.vision_config, "deepstack_visual_indexes", ()))
    width = hf_model.config.text_config.hidden_size * (1 + levels)
    assert report["padding"] == {str(b): [0, width] for b in VISION_BUCKETS}


def test_the_patches_are_in_effect(probed, model):
    """The full-bucket case passes because of patch vision-scatter-scratch-row, which the
    probe finds in both releases' text models (and i2t-capture-hook on 0.8), the image
    cases of the Qwen2-VL family because of qwen2-vl-mrope."""
    report, _ = probed
    assert "vision-scatter-scratch-row" in report["patches"]
    if model != "qwen3_vl":
        assert "qwen2-vl-mrope" in report["patches"]
