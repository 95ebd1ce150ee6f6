"""Llama 4 served end to end: `vllm serve TINY_LLAMA4 --device neuron` (a tiny
Llama4ForConditionalGeneration with a real Llama4Processor, the reference backend)
answers OpenAI chat requests with one image (three tiles with the global one), two
images and none with transformers' greedy tokens, all at once too, and refuses an image
of more tiles than its largest vision bucket holds with a 400. One small server, in the
host's vLLM environment beside its oracle, as tests/e2e/test_vision.py serves Qwen2-VL;
that module covers the multimodal path's other behaviours once for every architecture."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from neuron_plugin.core.checkpoint import read_hf_config, text_config
from tests.e2e.test_vision import (
    _until_eos,
    answer,
    ask,
    chat,
    image_url,
    serve,
    transformers_answers,
    validate_images,
)

pytestmark = [pytest.mark.server, pytest.mark.deployment]

# 56-pixel tiles, at most 4 an image: 56x112 pixels are 1 x 2 tiles and the global one
# (3 x 4 <|patch|> placeholders), 40x40 one tile (4); 224x224, 2 x 2 and the global one
REQUESTS = {
    "one": chat("what is in the picture", image_url(1, 56, 112)),
    "other": chat("what is in the picture", image_url(5, 56, 112)),
    "two": chat("compare the two pictures", image_url(2, 40, 40), image_url(1, 56, 112)),
    "text": [{"role": "user", "content": "the scheduler decides"}],
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama4")


@pytest.fixture(scope="module")
def expected(model, host_python) -> dict[str, list[int]]:
    return transformers_answers(model, host_python, REQUESTS)


@pytest.fixture(scope="module")
def server(model, host_python, tmp_path_factory):
    # 1 and 4 tiles of 16 patches: below the processor's largest image (2 x 2 tiles and
    # the global one)
    yield from serve(model, host_python, tmp_path_factory, [256], [16, 64],
                     ("--max-num-seqs", "4"))


@pytest.fixture(scope="module")
def eos(model) -> int:
    return int(text_config(read_hf_config(model))["eos_token_id"])


@pytest.mark.parametrize("name", list(REQUESTS))
def test_greedy_tokens_equal_transformers(server, expected, eos, name):
    assert answer(server, REQUESTS[name], eos) == _until_eos(expected[name], eos)


def test_the_image_decides_the_answer(expected):
    """The same text with another image of the same shape: transformers answers
    otherwise, so the equalities above check the images' embeddings."""
    assert expected["one"] != expected["other"]


def test_concurrent_image_and_text_requests_equal_transformers(server, expected, eos):
    """The requests at once: one step batches images and text."""
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        got = dict(zip(REQUESTS, pool.map(lambda m: answer(server, m, eos), REQUESTS.values()),
                       strict=True))
    assert got == {name: _until_eos(ids, eos) for name, ids in expected.items()}


def test_an_image_of_more_tiles_than_the_largest_bucket_gets_a_400(server, expected, eos):
    """224x224 pixels are 2 x 2 tiles and the global one: 80 patches, beyond the largest
    bucket; the platform counts a Llama 4 image's patches from its <|patch|> tokens."""
    response = ask(server, chat("look", image_url(4, 224, 224)))
    assert response.status_code == 400, response.text
    assert "80 patches exceeds the largest vision bucket (64 patches)" in response.text
    assert "max_patches" in response.text
    assert answer(server, REQUESTS["one"], eos) == _until_eos(expected["one"], eos)


def test_explain_config_plans_whole_tiles(model, host_python):
    """From the checkpoint's preprocessor_config.json (max_patches 4): 1 to 5 tiles of 16
    patches, one tile and 2**k local tiles with the global one."""
    done = subprocess.run(
        [str(Path(host_python).with_name("neuron-plugin")), "explain-config", str(model),
         "--max-model-len", "256", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["buckets"]["vision"] == [16, 48, 80]
    assert report["graphs"]["vision_encoding"] == 3


def test_validate_judges_llama4_images_in_whole_tiles(model, host_python, tmp_path):
    """`neuron-plugin validate`'s images case on Llama 4: its prompts mark an image with
    <|image|> (what vLLM's processor expands into tiles; config.json's image token is
    <|patch|>), its images fill buckets of whole tiles (one tile; 2 x 2 local tiles and
    the global one), and every answer equals transformers' on the same processor's
    pixels."""
    images = validate_images(model, host_python, tmp_path / "validate", [64, 128, 256],
                             [16, 80])
    assert images["status"] == "pass", images
    assert images["evidence"]["image_sizes"] == [[56, 56], [112, 112], [56, 56], [112, 112]]
