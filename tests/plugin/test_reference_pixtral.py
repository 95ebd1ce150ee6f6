"""Pixtral (transformers' Llava format, as mistral-community/pixtral-12b ships it) on the
reference backend against transformers: the vision graphs (Pixtral's tower with its 2-D
RoPE and the projector, an image padded into its vision bucket, wide and tall images),
the image embeddings placed at the [IMG] tokens only ([IMG_BREAK] and [IMG_END] keep
their own, vLLM's is_embed), in whole prompts and in chunks that cut an image, and greedy
decoding of a prompt with two images equal to transformers' generate, on what the tiny
model's real PixtralProcessor makes of two images (run in the host's vLLM environment:
transformers 5 builds PixtralProcessor only with torchvision)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from neuron_plugin.backends.reference.architectures import UnsupportedModelError
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.backends.reference.vision import vision_tower
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.vision import (
    VisionGeometry,
    VisionLimits,
    chunk_embeddings,
    pixtral_limits,
    pixtral_patches,
    spread_embeddings,
)

ARCH = "LlavaForConditionalGeneration"
LIMITS = EngineLimits(max_model_len=128, max_num_seqs=2, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=128, dtype="float32")
BUCKETS = {"context_encoding_buckets": [64, 128], "token_generation_buckets": [128]}
VISION_BUCKETS = (16, 64)  # the processor's largest image: 8 x 8 patches
STEPS = 6


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("pixtral")


@pytest.fixture(scope="module")
def hf_model(model):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def backend(model, tmp_path_factory):
    settings = dataclasses.replace(
        resolve_settings(LIMITS, BUCKETS, backend="reference", architecture=ARCH),
        vision_buckets=VISION_BUCKETS,
    )
    folder = tmp_path_factory.mktemp("pixtral-graphs")
    ReferenceBackend(settings, model).compile(folder)
    loaded = ReferenceBackend(settings, model)
    loaded.load(folder)
    return loaded


def pixels(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """An image as Pixtral's processor hands it: [3, rows * 16, columns * 16]."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((3, rows * 16, columns * 16)).astype(np.float32)


def transformers_features(hf_model, images: list[np.ndarray]) -> list[np.ndarray]:
    """transformers' image features (tower, then projector) of each image, fed as its
    processor batches them: padded to the largest, with image_sizes."""
    height = max(i.shape[1] for i in images)
    width = max(i.shape[2] for i in images)
    batch = np.zeros((len(images), 3, height, width), dtype=np.float32)
    for n, image in enumerate(images):
        batch[n, :, : image.shape[1], : image.shape[2]] = image
    sizes = torch.tensor([list(i.shape[1:]) for i in images])
    with torch.no_grad():
        features = hf_model.model.get_image_features(
            pixel_values=torch.from_numpy(batch), image_sizes=sizes).pooler_output
    return [f.reshape(-1, f.shape[-1]).numpy() for f in features]


@pytest.mark.parametrize("grid", [(3, 5), (8, 6), (4, 4), (1, 1)],
                         ids=["wide-padded-in-16", "tall-padded-in-64", "exact-16", "one-patch"])
def test_vision_graph_equals_transformers_tower_and_projector(backend, hf_model, grid):
    image = pixels(*grid)
    got = backend.encode_image(pixtral_patches(image, 16))
    (expected,) = transformers_features(hf_model, [image])
    assert got.shape == (grid[0] * grid[1], 128) == expected.shape
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


def test_two_images_attend_to_themselves_only(backend, hf_model):
    """transformers runs a batch's images in one sequence under a block-diagonal mask;
    the plugin one per call: the same features."""
    images = [pixels(3, 5, seed=1), pixels(8, 6, seed=2)]
    expected = transformers_features(hf_model, images)
    for image, features in zip(images, expected, strict=True):
        got = backend.encode_image(pixtral_patches(image, 16))
        np.testing.assert_allclose(got, features, atol=2e-5, rtol=1e-4)


def test_pixtral_patches_are_patch_conv_windows():
    image = pixels(2, 3)
    patches = pixtral_patches(image, 16)
    assert patches.grid_thw.tolist() == [1, 2, 3] and patches.pixel_values.shape == (6, 768)
    # patch 4 is row 1, column 1: pixels [16:32, 16:32] of each channel
    np.testing.assert_array_equal(patches.pixel_values[4], image[:, 16:32, 16:32].reshape(-1))
    with pytest.raises(ValueError, match="not whole 16-pixel patches"):
        pixtral_patches(image[:, :20], 16)


def test_geometry_and_limits_are_pixtrals(model):
    config = read_hf_config(model)
    assert VisionGeometry.from_hf_config(config) == VisionGeometry(768, 1, 128)
    preprocessor = {"size": {"longest_edge": 128}, "patch_size": {"height": 16, "width": 16}}
    assert pixtral_limits(preprocessor, {}, 128) == VisionLimits(1, 64, 1)
    big = {"size": {"longest_edge": 200}}
    assert pixtral_limits({**preprocessor, **big}, {}, 200).max_patches == 13 * 13
    # vLLM's placeholders follow vision_config.image_size, the pixels longest_edge
    for kwargs in (big, {"size": {"longest_edge": 96}}):
        with pytest.raises(NeuronConfigError, match=r"differs from vision_config\.image_size=128"):
            pixtral_limits(preprocessor, kwargs, 128)


def test_a_llava_without_pixtrals_tower_is_refused(model):
    config = read_hf_config(model)
    clip = {**config,
            "vision_config": {**config["vision_config"], "model_type": "clip_vision_model"}}
    with pytest.raises(UnsupportedModelError, match="runs Llava with Pixtral's"):
        vision_tower(clip)
    layer = {**config, "vision_feature_layer": -2}
    with pytest.raises(UnsupportedModelError, match="vision_feature_layer=-2"):
        vision_tower(layer)


# What the tiny model's PixtralProcessor makes of a chat with two images.
PROCESSOR_SCRIPT = """
import sys

import numpy as np
from PIL import Image
from transformers import AutoProcessor

processor = AutoProcessor.from_pretrained(sys.argv[1])
messages = [{"role": "user", "content": [
    {"type": "text", "text": "Compare"}, {"type": "image"},
    {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
text = processor.apply_chat_template(messages, add_generation_prompt=True)
rng = np.random.default_rng(0)
images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
          for shape in ((40, 70, 3), (300, 200, 3))]
out = processor(text=[text], images=images, return_tensors="np")
np.savez(sys.argv[2], text=np.array(text), input_ids=out["input_ids"][0],
         pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
         processor=np.array(type(processor).__name__))
"""


@pytest.fixture(scope="module")
def processed(model, host_python, tmp_path_factory):
    out = tmp_path_factory.mktemp("pixtral-processed") / "processed.npz"
    subprocess.run([host_python, "-c", PROCESSOR_SCRIPT, str(model), str(out)], check=True,
                   capture_output=True, text=True)
    return dict(np.load(out))


def placeholder_runs(ids: list[int], tokens: dict[str, int]) -> list[tuple[int, np.ndarray]]:
    """Each image's placeholder run (offset, is_embed) as vLLM's PixtralHF processor
    marks it: [IMG] rows closed by [IMG_BREAK], the last by [IMG_END]; only [IMG] embeds."""
    runs, start = [], None
    for n, token in enumerate(ids):
        if start is None and token == tokens["[IMG]"]:
            start = n
        if start is not None and token == tokens["[IMG_END]"]:
            runs.append((start, np.array(ids[start : n + 1]) == tokens["[IMG]"]))
            start = None
    return runs


def test_the_processors_prompt_with_two_images_equals_transformers_generate(
        backend, hf_model, processed, model):
    """The builder's processor files load as a real PixtralProcessor; its two images
    (one downscaled to the 128-pixel edge) placed at their [IMG] tokens, in one prefill
    and in chunks that cut each image, give transformers' logits and greedy tokens."""
    from transformers import AutoTokenizer

    assert str(processed["processor"]) == "PixtralProcessor"
    assert processed["image_sizes"].tolist() == [[48, 80], [128, 96]]
    ids = processed["input_ids"].tolist()
    tokens = {t: AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(t)
              for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")}
    runs = placeholder_runs(ids, tokens)
    assert [int(embed.sum()) for _, embed in runs] == [15, 48]
    assert [embed.size for _, embed in runs] == [15 + 3, 48 + 8]  # a break per row
    images = [p[:, :h, :w] for p, (h, w) in
              zip(processed["pixel_values"], processed["image_sizes"], strict=True)]
    placed = [(offset, spread_embeddings(backend.encode_image(pixtral_patches(i, 16)), embed))
              for (offset, embed), i in zip(runs, images, strict=True)]
    embeds = [embed for _, embed in runs]

    with torch.no_grad():
        batch = {"input_ids": torch.tensor([ids]),
                 "pixel_values": torch.from_numpy(processed["pixel_values"]),
                 "image_sizes": torch.from_numpy(processed["image_sizes"])}
        expected_logits = hf_model(**batch).logits[0, -1]
        expected = hf_model.generate(**batch, max_new_tokens=STEPS,
                                     do_sample=False)[0, len(ids):].tolist()

    inputs = context_encoding_inputs(backend.settings, np.array(ids), 0, 0, None)
    embeddings, mask = chunk_embeddings(0, len(ids), inputs.input_ids.shape[1], 128, placed,
                                        embeds)
    assert mask.sum() == 15 + 48
    # the images matter: without their embeddings the logits differ far beyond the
    # tolerance below (run first: the prefill with images writes the KV cache decoded on)
    other = backend.forward(dataclasses.replace(inputs, vision_mask=np.zeros_like(mask)))[0]
    logits = backend.forward(dataclasses.replace(
        inputs, vision_embeddings=embeddings, vision_mask=mask))[0]
    np.testing.assert_allclose(logits.numpy(), expected_logits.numpy(), atol=1e-4, rtol=1e-4)
    assert (other - logits).abs().max() > 1e-3

    tokens_out = [int(logits.argmax())]
    for position in range(len(ids), len(ids) + STEPS - 1):
        step = token_generation_inputs(backend.settings, np.array([[tokens_out[-1]]]),
                                       np.array([[position]]), np.array([0]), None)
        tokens_out.append(int(backend.forward(step)[0].argmax()))
    assert tokens_out == expected


def test_a_chunk_that_cuts_an_image_takes_its_rows(processed):
    """chunk_embeddings with is_embed: a chunk starting inside an image's run takes the
    rows and the [IMG] marks its tokens cover, as vLLM's _gather_mm_embeddings."""
    embed = np.array([1, 1, 0, 1, 1, 0], dtype=bool)  # two rows of two, break, end
    rows = np.arange(4 * 2, dtype=np.float32).reshape(4, 2) + 1
    spread = spread_embeddings(rows, embed)
    embeddings, mask = chunk_embeddings(7, 4, 8, 2, [(5, spread)], [embed])
    # the chunk holds prompt tokens 7..10: run positions 2..5 (break, img, img, end)
    assert mask[0].tolist() == [False, True, True, False, False, False, False, False]
    np.testing.assert_array_equal(embeddings[0, 1:3], rows[2:4])
    with pytest.raises(ValueError, match="3 embeddings for 4 placeholder tokens"):
        spread_embeddings(rows[:3], embed)


MLLAMA_FACT = """
from vllm.model_executor.models.registry import ModelRegistry

assert "MllamaForConditionalGeneration" not in ModelRegistry.get_supported_archs()
try:
    ModelRegistry._raise_for_unsupported(["MllamaForConditionalGeneration"])
except ValueError as exc:
    print(exc)
"""


def test_vllm_no_longer_serves_mllama():
    """The fact the refusal above quotes, from the vLLM this runs on: in a process of its
    own, as importing vLLM's registry here would fix this process's platform before the
    tests that choose the Neuron one."""
    done = subprocess.run([sys.executable, "-c", MLLAMA_FACT], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "supported in vLLM until v0.10.2" in done.stdout, done.stdout


def test_pixtral_crosses_the_runner_boundary(backend, model, sdk_python, tmp_path):
    """A real runner process in the SDK's environment (torch 2.9, transformers 4.57)
    compiles Pixtral's graphs and answers encode_image as the in-process backend does."""
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.backends.runner.client import RunnerBackend

    settings = dataclasses.replace(backend.settings, backend_python=sdk_python)
    remote = open_backend(settings, model, str(tmp_path))
    try:
        assert isinstance(remote, RunnerBackend)
        for image in (pixels(3, 5, seed=5), pixels(8, 6, seed=6)):
            patches = pixtral_patches(image, 16)
            np.testing.assert_allclose(remote.encode_image(patches),
                                       backend.encode_image(patches), atol=1e-5, rtol=1e-5)
    finally:
        remote.close()
    assert remote.runner.process.returncode == 0
