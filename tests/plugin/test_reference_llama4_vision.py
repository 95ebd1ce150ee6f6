"""Llama 4's vision tower and projector on the reference backend against transformers
(Llama4ForConditionalGeneration.get_image_features, then multi_modal_projector), on the
tiny Llama 4 of scripts/build_tiny_model.py: the graph of each vision bucket, exported,
written and loaded as the backend compiles it, for one tile and for the tiles (local
and global) the model's real Llama4Processor cuts images into; padding tiles never
change a real tile's rows; the embeddings land on the <|patch|> placeholders only, in
vLLM's order; the processor's limits give the vision buckets in whole tiles, and an image
past the largest is refused naming max_patches."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.backends.reference.graph_file import load_graph, save_graph
from neuron_plugin.backends.reference.families.llama4 import (
    Llama4VisionSpec,
    pixel_shuffle,
    rotary_angles,
)
from neuron_plugin.backends.reference.vision import load_weights, vision_tower
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.settings import EngineLimits, resolve_settings
from neuron_plugin.core.vision import (
    ImageInputs,
    VisionGeometry,
    VisionLimits,
    llama4_limits,
    llama4_merge,
    resolve_vision_buckets,
    spread_embeddings,
    tile_patches,
    vision_bucket,
)

ROOT = Path(__file__).resolve().parents[2]
TILE = 56  # the tiny model's tile: 4 x 4 patches of 14 pixels
PATCH = 14
TILE_PATCHES = 16
PREPROCESSOR = {"max_patches": 4, "size": {"height": TILE, "width": TILE}}
BUCKETS = resolve_vision_buckets({}, llama4_limits(PREPROCESSOR, {}, TILE, PATCH))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama4")


@pytest.fixture(scope="module")
def hf_model(model):
    from transformers import Llama4ForConditionalGeneration

    return Llama4ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def spec(model) -> Llama4VisionSpec:
    tower = vision_tower(read_hf_config(model))
    assert isinstance(tower, Llama4VisionSpec)
    return tower


@pytest.fixture(scope="module")
def graphs(model, spec, tmp_path_factory):
    """bucket -> the vision graph as the backend compiles and loads it (torch.export,
    graph_file), and the checkpoint's weights."""
    folder = tmp_path_factory.mktemp("llama4-vision-graphs")
    weights = load_weights(model, spec, torch.float32)
    module = spec.graph()
    loaded = {}
    for bucket in BUCKETS:
        exported = torch.export.export(module, (weights, torch.zeros(bucket, spec.patch_dim)))
        save_graph(exported, folder, f"vision_{bucket}")
        loaded[bucket] = load_graph(folder, f"vision_{bucket}")
    return loaded, weights


def encode(graphs, image: ImageInputs, padding: np.ndarray | None = None) -> np.ndarray:
    """The image's embeddings from its bucket's graph, as ReferenceBackend.encode_image
    pads and trims them (`padding`: what fills the rest of the bucket; zeros there)."""
    loaded, weights = graphs
    bucket = vision_bucket(BUCKETS, image.patches)
    padded = np.zeros((bucket, image.pixel_values.shape[1]), dtype=np.float32)
    if padding is not None:
        padded[:] = padding[:bucket]
    padded[: image.patches] = image.pixel_values
    with torch.inference_mode():
        out = loaded[bucket](weights, torch.from_numpy(padded))
    return out[: image.embedding_tokens(2)].numpy()


def transformers_features(hf_model, tiles: np.ndarray) -> np.ndarray:
    """transformers' image features of an image's tiles ([tiles, 3, 56, 56]): the tower
    (with its pixel-shuffle MLP), then the projector, flattened tile after tile."""
    import transformers

    kwargs = {} if int(transformers.__version__.split(".")[0]) >= 5 else {
        "vision_feature_select_strategy": "default"}
    with torch.no_grad():
        features = hf_model.get_image_features(pixel_values=torch.from_numpy(tiles), **kwargs)
        features = getattr(features, "last_hidden_state", features)
        projected = hf_model.multi_modal_projector(features.reshape(-1, features.shape[-1]))
    return projected.numpy()


def random_tiles(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 3, TILE, TILE)).astype(np.float32)


@pytest.mark.parametrize("tiles", [1, 2, 3, 5],
                         ids=["one-tile-exact", "two-padded-in-32", "three-padded-in-64",
                              "five-the-largest"])
def test_vision_graph_equals_transformers_tower_and_projector(graphs, hf_model, tiles):
    pixels = random_tiles(tiles, seed=tiles)
    got = encode(graphs, tile_patches(pixels, PATCH))
    expected = transformers_features(hf_model, pixels)
    assert got.shape == (tiles * 4, 128) == expected.shape
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-4)


def test_padding_tiles_never_change_real_rows(graphs):
    """A tile attends within itself only: whatever fills the bucket's padding tiles,
    the real tiles' embeddings are the same (exactly: the padding is other batch rows)."""
    image = tile_patches(random_tiles(3, seed=7), PATCH)
    zeros = encode(graphs, image)
    garbage = np.random.default_rng(8).standard_normal((64, image.pixel_values.shape[1])) * 50
    np.testing.assert_array_equal(encode(graphs, image, garbage.astype(np.float32)), zeros)
    # while a real tile's pixels do change its own rows, and only its own
    changed = image.pixel_values.copy()
    changed[TILE_PATCHES:2 * TILE_PATCHES] += 1
    moved = encode(graphs, ImageInputs(changed, image.grid_thw))
    np.testing.assert_array_equal(moved[:4], zeros[:4])
    assert np.abs(moved[4:8] - zeros[4:8]).max() > 1e-3


def test_tile_patches_are_unfold_windows():
    pixels = random_tiles(2, seed=3)
    image = tile_patches(pixels, PATCH)
    assert image.grid_thw.tolist() == [2, 4, 4] and image.pixel_values.shape == (32, 588)
    # patch 16 + 5 is tile 1's row 1, column 1; Unfold's order is channel, row, column
    unfold = torch.nn.functional.unfold(torch.from_numpy(pixels), PATCH, stride=PATCH)
    np.testing.assert_array_equal(image.pixel_values[21], unfold[1, :, 5].numpy())
    np.testing.assert_array_equal(image.pixel_values[21], pixels[1, :, 14:28, 14:28].reshape(-1))


def test_rotary_and_pixel_shuffle_follow_transformers(spec):
    from transformers.models.llama4 import modeling_llama4

    config = modeling_llama4.Llama4VisionConfig(
        hidden_size=spec.embed_dim, num_attention_heads=spec.num_heads, image_size=TILE,
        patch_size=PATCH, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_theta=10000.0)
    rotary = modeling_llama4.Llama4VisionRotaryEmbedding(config)
    freqs = rotary.freqs_ci.squeeze(1)  # [17, head_dim / 2] complex
    angles = rotary_angles(spec)
    torch.testing.assert_close(torch.polar(torch.ones_like(angles), angles), freqs,
                               rtol=0, atol=1e-6)
    x = torch.randn(3, TILE_PATCHES, 8)
    torch.testing.assert_close(pixel_shuffle(x, 4, 2), modeling_llama4.pixel_shuffle(x, 0.5),
                               rtol=0, atol=0)


def test_geometry_limits_and_buckets_are_whole_tiles(model):
    config = read_hf_config(model)
    assert VisionGeometry.from_hf_config(config) == VisionGeometry(588, 2, 128)
    preprocessor = {"image_processor_type": "Llama4ImageProcessorFast", **PREPROCESSOR}
    # 1 tile, or 1 + rows x columns <= 4: at most 5 tiles of 16 patches
    assert llama4_limits(preprocessor, {}, TILE, PATCH) == VisionLimits(16, 80, 16, True)
    # one tile, then 2**k local tiles and the global one: no graph for two tiles, which
    # no image has
    assert BUCKETS == (16, 48, 80)
    bigger = llama4_limits(preprocessor, {"max_patches": 9}, TILE, PATCH)
    assert resolve_vision_buckets({}, bigger) == (16, 48, 80, 144, 160)
    assert llama4_limits(preprocessor, {"max_patches": 1}, TILE, PATCH).max_patches == 16
    assert llama4_limits(preprocessor, {"max_patches": 9}, TILE, PATCH).max_patches == 160
    with pytest.raises(NeuronConfigError, match=r"max_patches='4' .* whole number of tiles"):
        llama4_limits(preprocessor, {"max_patches": "4"}, TILE, PATCH)
    with pytest.raises(NeuronConfigError, match=r"differs from vision_config\.image_size=56"):
        llama4_limits(preprocessor, {"size": {"height": 112, "width": 112}}, TILE, PATCH)
    with pytest.raises(NeuronConfigError, match=r"multiples of 16 .*Llama 4: a tile's"):
        resolve_vision_buckets({"vision_buckets": [16, 40]}, VisionLimits(16, 80, 16, True))
    with pytest.raises(NeuronConfigError, match=r"pixel_shuffle_ratio=0\.25: .* 0\.5 only"):
        llama4_merge({"pixel_shuffle_ratio": 0.25})


def test_an_image_past_the_largest_bucket_is_refused_naming_max_patches():
    with pytest.raises(NeuronConfigError, match=r"96 patches exceeds the largest vision "
                       r"bucket \(80 patches\).*max_patches.*vision_buckets"):
        vision_bucket(BUCKETS, 96)


def test_the_api_server_counts_an_images_patches_from_its_placeholders():
    """platform.validate_request's count (serving.images.image_patches): Llama 4's items
    carry no grid; its <|patch|> placeholders are a quarter of its patches."""
    from vllm.multimodal.inputs import PlaceholderRange

    from neuron_plugin.serving.images import image_patches

    embed = torch.tensor([False] + [True] * 4 + [False] + [True] * 16 + [False])
    ranges = [PlaceholderRange(offset=3, length=embed.numel(), is_embed=embed)]
    llama4 = {"mm_kwargs": {"image": [{"aspect_ratios": 1}]}, "mm_placeholders": {"image": ranges}}
    assert image_patches(llama4) == [80]
    pixtral = {"mm_kwargs": {"image": [{"pixel_values": 1}]}, "mm_placeholders": {"image": ranges}}
    assert image_patches(pixtral) == [20]


@pytest.fixture(scope="module")
def backend(model, tmp_path_factory):
    """The reference backend serving the tiny Llama 4: its decoder's graphs and one
    vision graph per bucket, compiled into a folder and loaded from it."""
    limits = EngineLimits(max_model_len=64, max_num_seqs=1, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=64, dtype="float32")
    buckets = {"context_encoding_buckets": [64], "token_generation_buckets": [64]}
    settings = dataclasses.replace(
        resolve_settings(limits, buckets, backend="reference",
                         architecture="Llama4ForConditionalGeneration"),
        vision_buckets=BUCKETS)
    folder = tmp_path_factory.mktemp("llama4-backend")
    ReferenceBackend(settings, model).compile(folder)
    loaded = ReferenceBackend(settings, model)
    loaded.load(folder)
    return loaded


def test_the_backend_encodes_tiles_as_transformers_and_refuses_what_no_bucket_holds(
        backend, hf_model):
    """ReferenceBackend.encode_image pads an image's tiles to its bucket and trims the
    answer; an image of more tiles than the largest bucket holds, or of tiles of another
    size, is refused before the graph runs."""
    pixels = random_tiles(3, seed=11)
    got = backend.encode_image(tile_patches(pixels, PATCH))
    np.testing.assert_allclose(got, transformers_features(hf_model, pixels), atol=2e-5,
                               rtol=1e-4)
    with pytest.raises(NeuronConfigError, match="96 patches exceeds the largest vision bucket"):
        backend.encode_image(tile_patches(random_tiles(6, seed=12), PATCH))
    wrong = ImageInputs(np.zeros((32, 588), np.float32), np.array([2, 2, 8]))
    with pytest.raises(ValueError, match="takes tiles of 4x4 patches"):
        backend.encode_image(wrong)


# What the tiny model's Llama4Processor makes of a chat with two images (a wide one cut
# into 1 x 3 tiles and the global tile, a small one in one tile), in the host's vLLM
# environment: transformers builds Llama4ImageProcessorFast only with torchvision.
PROCESSOR_SCRIPT = """
import sys

import numpy as np
from PIL import Image
from transformers import AutoProcessor

processor = AutoProcessor.from_pretrained(sys.argv[1])
messages = [{"role": "user", "content": [
    {"type": "text", "text": "Compare"}, {"type": "image"},
    {"type": "text", "text": "with"}, {"type": "image"}]}]
text = processor.apply_chat_template(messages, add_generation_prompt=True)
rng = np.random.default_rng(0)
images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
          for shape in ((50, 160, 3), (30, 40, 3))]
out = processor(text=[text], images=images, return_tensors="pt")  # pixels in bfloat16
tokenizer = processor.tokenizer
ids = {t: tokenizer.convert_tokens_to_ids(t) for t in
       ("<|image_start|>", "<|image_end|>", "<|patch|>", "<|image|>", "<|tile_x_separator|>")}
np.savez(sys.argv[2], input_ids=out["input_ids"][0].numpy(),
         pixel_values=out["pixel_values"].float().numpy(),
         processor=np.array(type(processor).__name__), tokens=np.array(list(ids.values())))
"""


@pytest.fixture(scope="module")
def processed(model, host_python, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama4-processed") / "processed.npz"
    subprocess.run([host_python, "-c", PROCESSOR_SCRIPT, str(model), str(out)], check=True,
                   capture_output=True, text=True)
    return dict(np.load(out))


def test_the_processors_tiles_give_transformers_features_at_the_patch_tokens(
        graphs, hf_model, processed):
    """The builder's files load as a real Llama4Processor; each image's tiles (the wide
    one's three local tiles and its global tile) run in their bucket and give
    transformers' features, and laid over the image's placeholder run at its <|patch|>
    tokens only (vLLM's select_token_ids) they are what transformers puts at the prompt's
    image tokens, in order."""
    assert str(processed["processor"]) == "Llama4Processor"
    start, end, patch, image_token, separator = processed["tokens"].tolist()
    ids = processed["input_ids"]
    pixels = processed["pixel_values"]
    assert pixels.shape == (4 + 1, 3, TILE, TILE)
    tiles = [4, 1]  # vLLM's patches_per_image: 1 + 1 x 3, and 1
    starts = np.flatnonzero(ids == start).tolist()
    ends = np.flatnonzero(ids == end).tolist()
    assert len(starts) == len(ends) == 2
    assert (ids[starts[0]:ends[0]] == separator).sum() == 2  # three tiles in a row
    spread, offset = [], 0
    for count, first, last in zip(tiles, starts, ends, strict=True):
        image = tile_patches(pixels[offset:offset + count], PATCH)
        offset += count
        embeddings = encode(graphs, image)
        run = ids[first:last + 1]
        embed = run == patch
        assert int(embed.sum()) == count * 4 and (run == image_token).sum() == 1
        spread.append((first, spread_embeddings(embeddings, embed), embed))
    expected = transformers_features(hf_model, pixels)
    # transformers' merge: features in order at input_ids == image_token_index (<|patch|>)
    at_patches = np.concatenate([rows[embed] for _, rows, embed in spread])
    np.testing.assert_allclose(at_patches, expected, atol=2e-5, rtol=1e-4)
    placed = np.zeros((ids.size, 128), dtype=np.float32)
    for first, rows, _ in spread:
        placed[first:first + rows.shape[0]] += rows
    assert (np.abs(placed).sum(-1) > 0).tolist() == (ids == patch).tolist()


# The same graph in the backend runner's environment (torch 2.9, transformers 4.57, whose
# get_image_features takes vision_feature_select_strategy), against that transformers.
SDK_SCRIPT = """
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import Llama4ForConditionalGeneration

from neuron_plugin.backends.reference.graph_file import load_graph, save_graph
from neuron_plugin.backends.reference.vision import load_weights, vision_tower
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.vision import tile_patches

model = sys.argv[1]
spec = vision_tower(read_hf_config(model))
weights = load_weights(model, spec, torch.float32)
folder = Path(tempfile.mkdtemp())
exported = torch.export.export(spec.graph(), (weights, torch.zeros(64, spec.patch_dim)))
save_graph(exported, folder, "vision_64")
graph = load_graph(folder, "vision_64")
tiles = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 3, 56, 56), np.float32))
padded = np.zeros((64, spec.patch_dim), np.float32)
padded[:48] = tile_patches(tiles.numpy(), 14).pixel_values
hf = Llama4ForConditionalGeneration.from_pretrained(model, torch_dtype=torch.float32).eval()
with torch.no_grad():
    features = hf.get_image_features(pixel_values=tiles, vision_feature_select_strategy="default")
    expected = hf.multi_modal_projector(features.reshape(-1, features.shape[-1]))
    got = graph(weights, torch.from_numpy(padded))[:12]
print(torch.__version__, transformers.__version__, (got - expected).abs().max().item())
"""


def test_the_graph_equals_transformers_4_57_in_the_runners_environment(model, sdk_python):
    done = subprocess.run([sdk_python, "-c", SDK_SCRIPT, str(model)], capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    torch_version, transformers_version, difference = done.stdout.split()[-3:]
    assert torch_version.startswith("2.9") and transformers_version.startswith("4.57")
    assert float(difference) < 2e-5
