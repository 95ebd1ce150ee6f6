"""Pixtral served end to end: `vllm serve TINY_PIXTRAL --device neuron` (transformers'
Llava format with a real PixtralProcessor, the reference backend) answers OpenAI chat
requests with one and two images with transformers' greedy tokens. One small server
(one context-encoding and one vision bucket), in the host's vLLM environment beside
its oracle, as tests/e2e/test_vision.py serves Qwen2-VL; that module covers the
multimodal path's other behaviours once for every architecture."""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.support import Server
from tests.e2e.test_vision import (
    Endpoint,
    _until_eos,
    answer,
    chat,
    image_url,
    transformers_answers,
)

pytestmark = [pytest.mark.server, pytest.mark.deployment]

# 224x224 scales to 128x128 (8 x 8 patches: 64 [IMG], 8 row ends), 56x140 to 48x128
REQUESTS = {
    "one": chat("what is in the picture", image_url(1, 224, 224)),
    "two": chat("compare the two pictures", image_url(3, 56, 140), image_url(1, 224, 224)),
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("pixtral")


@pytest.fixture(scope="module")
def expected(model, host_python) -> dict[str, list[int]]:
    return transformers_answers(model, host_python, REQUESTS)


@pytest.fixture(scope="module")
def server(model, host_python, tmp_path_factory):
    served = Server(
        model,
        tmp_path_factory.mktemp("pixtral") / "server.log",
        [
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "2",
            "--limit-mm-per-prompt",
            json.dumps({"image": 2}),
            "--additional-config",
            json.dumps(
                {
                    "override_neuron_config": {
                        "context_encoding_buckets": [256],
                        "vision_buckets": [64],
                    }
                }
            ),
        ],
        env={**os.environ, "VLLM_NEURON_BACKEND": "reference"},
        python=host_python,
    )
    served.wait_healthy(timeout=420)
    yield Endpoint(served.url, str(model))
    served.stop()


@pytest.mark.parametrize("name", list(REQUESTS))
def test_greedy_tokens_equal_transformers(server, expected, model, name):
    from neuron_plugin.core.checkpoint import read_hf_config, text_config

    eos = int(text_config(read_hf_config(model))["eos_token_id"])
    assert answer(server, REQUESTS[name], eos) == _until_eos(expected[name], eos)
