"""Pixtral served end to end: `vllm serve TINY_PIXTRAL --device neuron` (transformers'
Llava format with a real PixtralProcessor, the reference backend) answers OpenAI chat
requests with one and two images with transformers' greedy tokens, and refuses an image
larger than its largest vision bucket with a 400. One small server
(one context-encoding and one vision bucket), in the host's vLLM environment beside
its oracle, as tests/e2e/test_vision.py serves Qwen2-VL; that module covers the
multimodal path's other behaviours once for every architecture."""

from __future__ import annotations

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
)

pytestmark = [pytest.mark.server, pytest.mark.deployment]

# 224x112 pixels scale to 128x64: 8 x 4 patches (32 [IMG], 8 row ends); 56x100: 4 x 7
REQUESTS = {
    "one": chat("what is in the picture", image_url(1, 224, 112)),
    "two": chat("compare the two pictures", image_url(3, 56, 100), image_url(1, 224, 112)),
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("pixtral")


@pytest.fixture(scope="module")
def expected(model, host_python) -> dict[str, list[int]]:
    return transformers_answers(model, host_python, REQUESTS)


@pytest.fixture(scope="module")
def server(model, host_python, tmp_path_factory):
    # below the processor's largest image (8 x 8 patches)
    yield from serve(model, host_python, tmp_path_factory, [256], [32],
                     ("--max-num-seqs", "2"))


@pytest.fixture(scope="module")
def eos(model) -> int:
    return int(text_config(read_hf_config(model))["eos_token_id"])


@pytest.mark.parametrize("name", list(REQUESTS))
def test_greedy_tokens_equal_transformers(server, expected, eos, name):
    assert answer(server, REQUESTS[name], eos) == _until_eos(expected[name], eos)


def test_an_image_beyond_the_largest_bucket_gets_a_400(server, expected, eos):
    """224x224 pixels scale to 128x128: 64 patches (one per [IMG]), beyond the largest
    bucket; the platform counts a Pixtral image's patches from its placeholders'
    is_embed."""
    response = ask(server, chat("look", image_url(4, 224, 224)))
    assert response.status_code == 400, response.text
    assert "64 patches exceeds the largest vision bucket (32 patches)" in response.text
    assert answer(server, REQUESTS["one"], eos) == _until_eos(expected["one"], eos)
