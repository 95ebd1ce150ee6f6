"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL on the reference backend against transformers: the
vision tower's graphs (one per vision bucket, an image padded into a larger bucket,
non-square grids, Qwen2.5-VL's windows, Qwen3-VL's interpolated position grid and its
DeepStack features), the decoder's M-RoPE (interleaved for Qwen3-VL) and the merge of
image embeddings at the placeholders (plus Qwen3-VL's DeepStack levels in its first
layers), and greedy decoding of a prompt with images equal to transformers' generate, on
synthetic pixel_values of the processor's shape [patches, 3 * 2 * patch * patch] and on
what the tiny model's processor makes of real images (run in the host's vLLM
environment: transformers 5 builds these processors only with torchvision)."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import numpy as np
import pytest
import torch

from neuron_plugin.backends.loader import cache_manifest, open_backend
from neuron_plugin.backends.reference.architectures import DecoderSpec, UnsupportedModelError
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.backends.reference.patch_layout import patch_inputs, position_taps
from neuron_plugin.backends.runner.client import RunnerBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.vision import ImageInputs, padding_image

ARCHS = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
         "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
         "qwen3_vl": "Qwen3VLForConditionalGeneration"}
EACH = pytest.mark.parametrize("arch", list(ARCHS), indirect=True)
LIMITS = EngineLimits(max_model_len=128, max_num_seqs=2, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=128, dtype="float32")
# 256 patches and 128 tokens: the processor's largest image (64 placeholders)
BUCKETS = {"context_encoding_buckets": [64, 128], "token_generation_buckets": [128]}
VISION_BUCKETS = (24, 64, 256)


def vlm_settings(vision_buckets=VISION_BUCKETS, buckets=BUCKETS, arch="qwen2_vl", **changes):
    settings = resolve_settings(LIMITS, buckets, backend="reference", architecture=ARCHS[arch])
    return dataclasses.replace(settings, vision_buckets=tuple(vision_buckets), **changes)


@pytest.fixture(scope="module")
def arch(request) -> str:
    """The architecture (EACH: each in turn; otherwise Qwen2-VL)."""
    return getattr(request, "param", "qwen2_vl")


@pytest.fixture(scope="module")
def vlm(tiny_model, arch):
    return tiny_model(arch)


@pytest.fixture(scope="module")
def hf_model(vlm):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()


def compiled(settings, model, folder):
    ReferenceBackend(settings, model).compile(folder)
    loaded = ReferenceBackend(settings, model)
    loaded.load(folder)
    return loaded


@pytest.fixture(scope="module")
def backend(vlm, arch, tmp_path_factory):
    return compiled(vlm_settings(arch=arch), vlm, tmp_path_factory.mktemp(f"{arch}-graphs"))


def image(grid, seed=0, patch=14) -> ImageInputs:
    patches = int(np.prod(grid))
    pixels = np.random.default_rng(seed).standard_normal((patches, 3 * 2 * patch * patch))
    return ImageInputs(pixels.astype(np.float32), np.array(grid, dtype=np.int64))


def model_image(backend, grid, seed=0) -> ImageInputs:
    """An image of the backend's model's patch size (Qwen3-VL's patches are 16 pixels)."""
    return image(grid, seed, patch=int((backend.images.tower.patch_dim // 6) ** 0.5))


def transformers_visual(hf_model, pixel_values, grid_thw) -> np.ndarray:
    """transformers' vision tower: its merged embeddings, and Qwen3-VL's DeepStack
    features concatenated after them (as vLLM's Qwen3-VL hands them on)."""
    with torch.no_grad():
        out = hf_model.model.visual(torch.as_tensor(pixel_values),
                                    grid_thw=torch.as_tensor(grid_thw))
    deepstack = getattr(out, "deepstack_features", None) or []
    return torch.cat([out.pooler_output, *deepstack], dim=-1).numpy()


@EACH
@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 6, 4), (1, 4, 4), (1, 6, 10), (2, 2, 4)],
                         ids=["wide", "tall", "padded-in-24", "padded-in-64", "two-frames"])
def test_vision_graph_equals_transformers_visual(backend, hf_model, arch, grid):
    img = model_image(backend, grid)
    expected = transformers_visual(hf_model, img.pixel_values, [grid])
    got = backend.encode_image(img)
    # Qwen3-VL: the embedding and two DeepStack levels of 128 each
    width = 3 * 128 if arch == "qwen3_vl" else 128
    assert got.shape == (img.embedding_tokens(2), width) == expected.shape
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


def test_qwen3_position_taps_are_transformers_interpolation():
    """Qwen3-VL's learned position grid resampled to an image's grid: the rows and
    weights transformers blends, patches in merge-block order, zero for padding."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grid = np.array([2, 6, 10])
    taps, weights = position_taps(grid, 2, 8, 128)
    expected_taps, expected_weights = get_vision_interpolation_indices_and_weights(
        torch.from_numpy(grid[None]), num_grid_per_side=8, mode="bilinear",
        align_corners=True, spatial_merge_size=2)
    np.testing.assert_array_equal(taps[:120], expected_taps.numpy())
    np.testing.assert_array_equal(weights[:120], expected_weights.numpy())
    assert not weights[120:].any() and not taps[120:].any()


def test_qwen2_5_windows_are_transformers_windows():
    """Qwen2.5-VL's window of each patch, from get_vision_window_index's reordering:
    the windows transformers attends within, as groups of patch indices."""
    from transformers.vision_utils import get_vision_window_index

    grid = np.array([2, 6, 10])  # 3x5 merge groups a frame, windows of 2x2 groups
    _, groups = patch_inputs(grid, 2, 128, window=2)
    index, bounds = get_vision_window_index(torch.from_numpy(grid[None]), 2, 56, 14)
    order = (index[:, None] * 4 + torch.arange(4)).reshape(-1).numpy()  # patches
    bounds = bounds.unique().tolist()  # empty windows repeat a bound
    expected = sorted(sorted(order[a:b].tolist()) for a, b in zip(bounds, bounds[1:]))
    got = sorted(np.flatnonzero(groups[1] == g).tolist() for g in set(groups[1, :120]))
    assert got == expected and len(got) == 2 * 2 * 3  # two frames of 2 x 3 windows
    assert (groups[:, 120:] == -1).all()


def test_patch_inputs_are_transformers_vision_positions():
    from transformers.vision_utils import get_vision_position_ids

    grid = np.array([2, 4, 6])
    rotary_ids, groups = patch_inputs(grid, 2, 64)
    expected = get_vision_position_ids(torch.from_numpy(grid[None]), 2).numpy()
    np.testing.assert_array_equal(rotary_ids[:48], expected)
    np.testing.assert_array_equal(groups[0], [0] * 24 + [1] * 24 + [-1] * 16)
    np.testing.assert_array_equal(groups[1], groups[0])


def test_an_image_above_the_largest_vision_bucket_is_refused(backend):
    with pytest.raises(NeuronConfigError, match="288 patches exceeds the largest vision "
                                                "bucket \\(256 patches\\)"):
        backend.encode_image(image((1, 16, 18)))
    with pytest.raises(ValueError, match="pixel_values has shape \\[16, 10\\]"):
        backend.encode_image(ImageInputs(np.zeros((16, 10), np.float32), np.array([1, 4, 4])))
    with pytest.raises(ValueError, match="multiples of the spatial merge size 2"):
        backend.encode_image(image((1, 3, 4)))


def test_a_padding_image_runs_its_bucket(backend):
    """Warm-up and timing (run_graph_once) run each vision graph on a padding image."""
    for bucket in VISION_BUCKETS:
        assert backend.encode_image(padding_image(bucket)).shape == (0, 128)
    with pytest.raises(ValueError, match="a padding image of 32 patches: no vision bucket"):
        backend.encode_image(padding_image(32))


def prompt(hf_model, grids) -> list[int]:
    """Text, then each image's placeholder run between vision_start and vision_end."""
    c = hf_model.config
    ids = [5, 17, 33]
    for grid in grids:
        ids += [c.vision_start_token_id] + [c.image_token_id] * (int(np.prod(grid)) // 4)
        ids += [c.vision_end_token_id, 41, 9]
    return ids


STEPS = 6


def transformers_greedy(hf_model, ids, pixel_values, grid_thw):
    """transformers' greedy tokens, last prompt logits, M-RoPE positions [3, len(ids)]
    and the positions' shift after the prompt (get_rope_index's delta)."""
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == hf_model.config.image_token_id).int()  # as the processor's
    images_in = {"pixel_values": torch.as_tensor(pixel_values),
                 "image_grid_thw": torch.as_tensor(grid_thw), "mm_token_type_ids": mm_types}
    with torch.no_grad():
        tokens = hf_model.generate(input_ids=input_ids, **images_in, max_new_tokens=STEPS,
                                   do_sample=False)[0, len(ids):].tolist()
        rope, deltas = hf_model.model.get_rope_index(input_ids, mm_types,
                                                     images_in["image_grid_thw"])
        logits = hf_model(input_ids=input_ids, **images_in).logits[0, -1]
    return tokens, logits, rope[:, 0].numpy(), int(deltas[0, 0])


def prefill_with_images(backend, image_token, ids, images, rope):
    """The context encoding of `ids` with each image's embeddings at its placeholders
    and the M-RoPE positions `rope` [3, len(ids)], as the model runner builds it."""
    inputs = context_encoding_inputs(backend.settings, np.array(ids), 0, 0, None)
    active = inputs.input_ids.shape[1]
    mask = np.zeros((1, active), dtype=bool)
    mask[0, : len(ids)] = np.array(ids) == image_token
    embeddings = np.zeros((1, active, backend.images.tower.embedding_width), dtype=np.float32)
    embeddings[0, mask[0]] = np.concatenate([backend.encode_image(i) for i in images])
    rope_positions = np.zeros((3, 1, active), dtype=np.int64)
    rope_positions[:, 0, : len(ids)] = rope
    return dataclasses.replace(inputs, vision_embeddings=embeddings, vision_mask=mask,
                               rope_positions=rope_positions)


def backend_greedy(backend, first_logits, prompt_len, delta) -> list[int]:
    """Greedy decoding after the prefill: every M-RoPE axis at the position + delta."""
    tokens = [int(first_logits.argmax())]
    for position in range(prompt_len, prompt_len + STEPS - 1):
        step = token_generation_inputs(backend.settings, np.array([[tokens[-1]]]),
                                       np.array([[position]]), np.array([0]), None)
        rows, width = step.position_ids.shape
        step = dataclasses.replace(step, rope_positions=np.broadcast_to(
            step.position_ids + delta, (3, rows, width)).copy())
        tokens.append(int(backend.forward(step)[0].argmax()))
    return tokens


@EACH
def test_greedy_with_images_equals_transformers_generate(backend, hf_model, arch):
    grids = [(1, 4, 6), (1, 6, 10)]  # the second one padded into the 64-patch bucket
    images = [model_image(backend, g, seed=i) for i, g in enumerate(grids)]
    ids = prompt(hf_model, grids)
    expected, expected_logits, rope, delta = transformers_greedy(
        hf_model, ids, np.concatenate([i.pixel_values for i in images]), np.array(grids))
    inputs = prefill_with_images(backend, hf_model.config.image_token_id, ids, images, rope)
    logits = backend.forward(inputs)[0]
    np.testing.assert_allclose(logits.numpy(), expected_logits.numpy(), atol=1e-4, rtol=1e-4)
    # each matters: without the images' embeddings, without M-RoPE, or (Qwen3-VL)
    # without the DeepStack levels, the logits differ by ten times the tolerance or more
    no_image = np.zeros_like(inputs.vision_mask)
    missings: list[dict] = [{"vision_mask": no_image}, {"rope_positions": None}]
    if arch == "qwen3_vl":
        flat = inputs.vision_embeddings.copy()
        flat[..., 128:] = 0
        missings.append({"vision_embeddings": flat})
    for missing in missings:
        other = backend.forward(dataclasses.replace(inputs, **missing))[0]
        assert (other - logits).abs().max() > 1e-3, missing
    assert backend_greedy(backend, logits, len(ids), delta) == expected


# What the tiny model's processor makes of a chat with two images (run in the host's
# vLLM environment: transformers 5 builds Qwen2VLProcessor only with torchvision).
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
          for shape in ((60, 90, 3), (1000, 800, 3))]
out = processor(text=[text], images=images, return_tensors="np")
np.savez(sys.argv[2], text=np.array(text), input_ids=out["input_ids"][0],
         pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
         processor=np.array(type(processor).__name__))
"""


@EACH
def test_the_processors_images_equal_transformers(vlm, hf_model, host_python, tmp_path,
                                                  backend):
    """The builder's processor files (written from their documented keys) load with
    AutoProcessor; its chat template puts a placeholder run per image part, its pixel
    limits keep a large image within 256 patches, and what it makes of two images
    (non-square, one downscaled) serves as transformers' generate answers (Qwen3-VL's
    16-pixel patches make the same grids: its tiny processor's limits are 4x4 to 16x16
    of its patches' merge groups too)."""
    out = tmp_path / "processed.npz"
    subprocess.run([host_python, "-c", PROCESSOR_SCRIPT, str(vlm), str(out)], check=True,
                   capture_output=True, text=True)
    processed = np.load(out)
    c = hf_model.config
    assert str(processed["processor"]) == type(hf_model).__name__.replace(
        "ForConditionalGeneration", "Processor")
    assert str(processed["text"]).count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    grids = processed["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 6], [1, 16, 14]]  # 60x90 pixels; 1000x800 scaled down
    ids = processed["input_ids"].tolist()
    assert ids.count(c.image_token_id) == int(grids.prod(axis=1).sum()) // 4
    splits = np.cumsum(grids.prod(axis=1))[:-1]
    images = [ImageInputs(p.astype(np.float32), g)
              for p, g in zip(np.split(processed["pixel_values"], splits), grids, strict=True)]
    expected, expected_logits, rope, delta = transformers_greedy(
        hf_model, ids, processed["pixel_values"], grids)
    inputs = prefill_with_images(backend, c.image_token_id, ids, images, rope)
    logits = backend.forward(inputs)[0]
    np.testing.assert_allclose(logits.numpy(), expected_logits.numpy(), atol=1e-4, rtol=1e-4)
    assert backend_greedy(backend, logits, len(ids), delta) == expected


def test_a_call_without_images_is_transformers_text_only(backend, hf_model):
    ids = [5, 17, 33, 41, 9, 12, 100]
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
    logits = backend.forward(context_encoding_inputs(backend.settings, np.array(ids), 0, 1,
                                                     None))[0]
    np.testing.assert_allclose(logits.numpy(), expected.numpy(), atol=1e-4, rtol=1e-4)


def test_flat_and_nested_configs_read_alike(vlm):
    """The Hub's Qwen2-VL config.json (transformers 4.x) is flat, with rope_scaling
    type mrope; transformers 5 nests the decoder's keys in text_config."""
    nested = json.loads((vlm / "config.json").read_text())
    text = nested["text_config"]
    flat = {**{k: v for k, v in nested.items() if k != "text_config"},
            **{k: v for k, v in text.items() if k != "rope_parameters"}}
    assert "rope_parameters" not in flat and flat["rope_scaling"]["type"] == "mrope"
    assert DecoderSpec.from_hf_config(flat) == DecoderSpec.from_hf_config(nested)
    spec = DecoderSpec.from_hf_config(nested)
    assert (spec.mrope_section, spec.hidden_size, spec.num_layers) == ((4, 6, 6), 128, 2)
    bad = {**nested, "text_config": {**text, "rope_parameters": {
        **text["rope_parameters"], "mrope_section": [4, 6, 4]}}}
    with pytest.raises(UnsupportedModelError, match="summing to head_dim / 2 = 16"):
        DecoderSpec.from_hf_config(bad)


def test_vision_buckets_are_in_the_cache_key(vlm, model_dirs):
    """A vision bucket is a graph: other buckets are another key. A text model's key
    has no vision entry, so keys compiled before vision buckets existed still hit."""
    keys = [cache_manifest(s, ReferenceBackend(s, vlm))
            for s in (vlm_settings((24, 64)), vlm_settings((24, 128)))]
    assert keys[0]["neuron"]["vision_buckets"] == [24, 64]
    assert keys[0] != keys[1]
    text = resolve_settings(LIMITS, BUCKETS, backend="reference",
                            architecture="LlamaForCausalLM")
    manifest = cache_manifest(text, ReferenceBackend(text, model_dirs["llama"]))
    assert "vision_buckets" not in manifest["neuron"]


def test_vision_buckets_are_checked(vlm, model_dirs):
    with pytest.raises(NeuronConfigError, match="\\[30\\] are not multiples of 4 patches"):
        ReferenceBackend(vlm_settings((16, 30)), vlm)
    text = resolve_settings(LIMITS, BUCKETS, backend="reference",
                            architecture="LlamaForCausalLM")
    with pytest.raises(NeuronConfigError, match="LlamaForCausalLM has no vision encoder"):
        ReferenceBackend(dataclasses.replace(text, vision_buckets=(16,)), model_dirs["llama"])


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"], indirect=True)
def test_images_cross_the_runner_boundary(backend, hf_model, vlm, arch, sdk_python, tmp_path):
    """A real runner process in the SDK's environment (torch 2.9, transformers 4.57)
    compiles, warms up every graph (the vision ones with a padding image) and answers
    encode_image and a context encoding with images as the in-process backend does
    (Qwen3-VL: embeddings three times the hidden size wide, its DeepStack levels)."""
    settings = vlm_settings(arch=arch, backend_python=sdk_python)
    remote = open_backend(settings, vlm, str(tmp_path))
    try:
        assert isinstance(remote, RunnerBackend)
        images = [model_image(backend, (1, 4, 6), seed=3), model_image(backend, (1, 6, 8), 4)]
        for img in images:
            np.testing.assert_allclose(remote.encode_image(img), backend.encode_image(img),
                                       atol=1e-5, rtol=1e-5)
        ids = prompt(hf_model, [(1, 4, 6)])
        inputs = context_encoding_inputs(backend.settings, np.array(ids), 0, 0, None)
        active = inputs.input_ids.shape[1]
        mask = np.zeros((1, active), dtype=bool)
        mask[0, : len(ids)] = np.array(ids) == hf_model.config.image_token_id
        embeddings = np.zeros((1, active, backend.images.tower.embedding_width), dtype=np.float32)
        embeddings[0, mask[0]] = backend.encode_image(images[0])
        rope = np.random.default_rng(0).integers(0, 40, (3, 1, active))
        inputs = dataclasses.replace(inputs, vision_embeddings=embeddings, vision_mask=mask,
                                     rope_positions=rope)
        np.testing.assert_allclose(remote.forward(inputs).numpy(),
                                   backend.forward(inputs).numpy(), atol=1e-5, rtol=1e-5)
        with pytest.raises(NeuronConfigError, match="exceeds the largest vision bucket"):
            remote.encode_image(model_image(backend, (1, 16, 18)))
    finally:
        remote.close()
    assert remote.runner.process.returncode == 0
