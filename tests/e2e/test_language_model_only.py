"""Multimodal checkpoints served text-only on the reference backend: `vllm serve --device
neuron --language-model-only` from the Neuron host's vLLM environment (vLLM's Llama 4 and
Gemma 4 model modules import torchvision, which the CPU test environment lacks), the
backend in a runner in the SDK-pinned environment (transformers 4.57 reads Llama 4's
config; it has no Gemma 4, whose config.json the backend reads as JSON), the block layout
with prefix caching. The tiny checkpoints (scripts/build_tiny_model.py): Llama 4
(Llama4ForConditionalGeneration: chunked attention over 16 tokens, NoPE layers with
temperature tuning, MoE layers) and Gemma 4 (Gemma4ForConditionalGeneration with the
`gemma4` text model: per-layer head dims, shared KV, per-layer embeddings): six
concurrent prompts of 20-90 tokens, twice (the second round from the prefix cache), give
transformers' greedy tokens. A vision tower is not run under that flag: an image gets a
400 (Llama 4 served with images: tests/e2e/test_vision_llama4.py)."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.support import GreedyOracle, Server, corpus_token_ids

PROMPT_LENGTHS = [20, 33, 47, 60, 70, 90]
NEW_TOKENS = 12
BLOCK_SIZE = 32
ARGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--enable-prefix-caching",
        "--block-size", str(BLOCK_SIZE), "--enable-prompt-tokens-details"]
BUCKETS = {"context_encoding_buckets": [32, 64, 128], "token_generation_buckets": [128]}
# a 1x1 PNG
PIXEL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
         "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


@pytest.fixture(scope="module", params=["llama4", "gemma4_mm"])
def model(request, tiny_model) -> Path:
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    return [corpus_token_ids(model, n, offset=7 * n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def server(model, host_python, sdk_python, tmp_path_factory):
    config = {"override_neuron_config": BUCKETS, "backend_python": sdk_python}
    served = Server(model, tmp_path_factory.mktemp(model.name) / "server.log",
                    [*ARGS, "--language-model-only", "--additional-config", json.dumps(config)],
                    env={**os.environ, "VLLM_NEURON_BACKEND": "reference"}, python=host_python)
    try:
        served.wait_healthy(timeout=420)
        yield served
    finally:
        served.stop()


@pytest.mark.server
def test_text_prompts_equal_transformers_cold_and_from_the_prefix_cache(server, model,
                                                                        prompts):
    import requests

    def complete(prompt: list[int]) -> tuple[list[int], int]:
        reply = requests.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        assert reply.ok, reply.text
        body = reply.json()
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return body["choices"][0]["token_ids"], cached

    oracle = GreedyOracle(model)
    expected = [oracle.generate(p, NEW_TOKENS) for p in prompts]
    for round_ in ("cold", "warm"):
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        assert [tokens for tokens, _ in answers] == expected, round_
    # the warm round read every full block of its prompt from the prefix cache
    hits = [cached for _, cached in answers]
    assert all(h >= BLOCK_SIZE * ((n - 1) // BLOCK_SIZE)
               for h, n in zip(hits, PROMPT_LENGTHS, strict=True)), hits
    log = server.log()
    assert "KV layout block" in log and "transformers 4.57" in log


@pytest.mark.server
def test_an_image_gets_a_400_and_text_chat_answers(server, model):
    import requests

    image = {"type": "image_url", "image_url": {"url": PIXEL}}
    reply = requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": str(model), "max_tokens": 3,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]})
    assert reply.status_code == 400 and "At most 0 image" in reply.text, reply.text
    reply = requests.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": str(model), "max_tokens": 3,
        "messages": [{"role": "user", "content": "hello there"}]})
    assert reply.ok, reply.text
