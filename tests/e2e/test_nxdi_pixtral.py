"""Pixtral (Llava format) on the nxd backend: NxDI's image-to-text application on real NxD
Inference in its CPU mode, driven by the plugin's NxDBackend and its host-side image path
(nxdi_image_to_text_probe.py: serving.images.Images, NxDBackend.encode_image through
nxd.pixtral_vision, forward), against transformers' LlavaForConditionalGeneration (this
environment's, float32) on the tiny checkpoint of scripts/build_tiny_model.py, with
synthetic images in the processor's layout [3, H, W] (whole 16-pixel patches). Only the
[IMG] placeholders take embeddings ([IMG_BREAK] ends each patch row, [IMG_END] the
image). Greedy tokens and every step's logits:
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
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.support import corpus_token_ids

pytestmark = [pytest.mark.nxdi]

ARCH = "LlavaForConditionalGeneration"
STEPS = 6  # decode steps after the prefill's token
MAX_MODEL_LEN = 256
BUCKETS = {
    "context_encoding_buckets": [128, 256],
    "token_generation_buckets": [256],
    "max_batch_buckets": 1,
}
VISION_BUCKETS = [16, 64]
PATCH = 16
SHAPES = {"small": (4, 4), "wide": (4, 6)}  # patch rows x columns: 16 and 24 patches
# Logits of NxDI's float32 CPU mode against transformers' (measured up to ~1e-5).
TOLERANCE = 1e-4
PROBE = Path(__file__).with_name("nxdi_image_to_text_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def _settings() -> dict:
    from neuron_plugin.core.settings import EngineLimits, resolve_settings
    from neuron_plugin.core.vision import VisionLimits

    limits = EngineLimits(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        block_size=None,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=MAX_MODEL_LEN,
        dtype="float32",
        tp_degree=1,
        vision=VisionLimits(1, 64, 1),
    )
    override = {"on_cpu": True, **BUCKETS, "vision_buckets": VISION_BUCKETS}
    return resolve_settings(limits, override, backend="nxd", architecture=ARCH).to_dict()


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("pixtral")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def _placeholders(model_dir: Path, shape: tuple[int, int]) -> tuple[list[int], list[bool]]:
    """An image's placeholder tokens (each patch row's [IMG]s, then [IMG_BREAK]; the last
    row ends with [IMG_END]) and which of them take an embedding."""
    tokens = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tokens}
    rows, columns = shape
    run: list[int] = []
    for row in range(rows):
        run += [ids["[IMG]"]] * columns
        run.append(ids["[IMG_END]"] if row == rows - 1 else ids["[IMG_BREAK]"])
    return run, [t == ids["[IMG]"] for t in run]


@pytest.fixture(scope="module")
def cases(model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's rows: the prompt and its images (placeholder offset, is_embed,
    pixels)."""
    folder = tmp_path_factory.mktemp("pixtral-pixels")
    rng = np.random.default_rng(0)
    pixels = {}
    for name, (rows, columns) in SHAPES.items():
        path = folder / f"{name}.npy"
        image = rng.standard_normal((3, rows * PATCH, columns * PATCH)).astype(np.float32)
        np.save(path, image)
        pixels[name] = str(path)

    def row(parts: list) -> dict:
        prompt: list[int] = []
        images = []
        for part in parts:
            if isinstance(part, str):
                run, embed = _placeholders(model_dir, SHAPES[part])
                images.append({"offset": len(prompt), "is_embed": embed, "pixels": pixels[part]})
                prompt += run
            else:
                prompt += part
        return {"prompt": prompt, "images": images}

    text = corpus_token_ids(model_dir, 20, offset=11)
    before = corpus_token_ids(model_dir, 30, offset=40)
    after = corpus_token_ids(model_dir, 12, offset=200)
    small = len(_placeholders(model_dir, SHAPES["small"])[0])
    full_tail = 128 - len(before) - small
    return {
        "text_only": [row([text])],
        "one_image": [row([before, "small", after])],
        "two_images": [row([before, "small", after, "wide", text[:5]])],
        "full_bucket": [row([before, "small", corpus_token_ids(model_dir, full_tail, offset=300)])],
        "batch2": [row([before, "small", after]), row([text])],
        "batch2_device_sampling": [row([before, "small", after]), row([text])],
    }


@pytest.fixture(scope="module")
def probed(nxdi_python, model_dir, cases, tmp_path_factory):
    out = tmp_path_factory.mktemp("nxdi-pixtral")
    plan = {"model": str(model_dir), "steps": STEPS, "settings": _settings(), "cases": cases}
    (out / "plan.json").write_text(json.dumps(plan))
    env = {
        **os.environ,
        "NXD_CPU_MODE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [nxdi_python, str(PROBE), str(out / "plan.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), out


def _expected(hf_model, row: dict) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's logits [STEPS + 1, vocab]: Llava takes
    the images zero-padded to one size with each one's own size (image_sizes)."""
    ids = torch.tensor([row["prompt"]])
    kwargs = {}
    if row["images"]:
        images = [torch.from_numpy(np.load(i["pixels"])) for i in row["images"]]
        height = max(i.shape[1] for i in images)
        width = max(i.shape[2] for i in images)
        padded = torch.zeros(len(images), 3, height, width)
        for index, image in enumerate(images):
            padded[index, :, : image.shape[1], : image.shape[2]] = image
        kwargs = {
            "pixel_values": padded,
            "image_sizes": torch.tensor([list(i.shape[1:]) for i in images]),
        }
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            **kwargs,
            max_new_tokens=STEPS + 1,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    return tokens, torch.stack([step[0] for step in out.logits])


@pytest.mark.parametrize(
    "case",
    ["text_only", "one_image", "two_images", "full_bucket", "batch2", "batch2_device_sampling"],
)
def test_greedy_tokens_and_logits_equal_transformers(probed, hf_model, cases, case):
    report, out = probed
    assert "refused" not in report, report.get("refused")
    logits = np.load(out / f"{case}.npy", allow_pickle=False)
    for index, row in enumerate(cases[case]):
        tokens, expected = _expected(hf_model, row)
        assert report[case][index] == tokens, f"{case} row {index}"
        if case.endswith("device_sampling"):  # tokens only
            continue
        gap = float((torch.from_numpy(logits[index]) - expected).abs().max())
        assert gap < TOLERANCE, f"{case} row {index}: logits off by {gap}"


def test_full_bucket_case_fills_its_bucket(cases):
    assert len(cases["full_bucket"][0]["prompt"]) == BUCKETS["context_encoding_buckets"][0]


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
