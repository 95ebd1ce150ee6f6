"""Qwen3.5 (gated DeltaNet layers beside gated attention, dense and MoE) served with
`vllm serve --device neuron` on the reference backend, greedy tokens equal to
transformers' on the tiny checkpoints (scripts/build_tiny_model.py `qwen3_5`,
`qwen3_5_moe`: four state layers in two of vLLM's state groups, two full-attention
layers). From the Neuron host's vLLM environment: vLLM's Qwen3.5 module imports its
Qwen3-VL module, which needs torchvision, which the CPU test environment lacks.

- MoE, contiguous layout: six concurrent prompts of 5-100 tokens for four sequence slots
  (decode batches with padding rows, slots reused), across the 32-token bucket and the
  chunked form's 64-token chunks; each sequence's state lives beside its KV cache line.
- Dense, as the Hub ships Qwen3.5 (Qwen3_5ForConditionalGeneration, `qwen3_5_mm`: the
  text config nested, the tensors under model.language_model.) served text-only
  (--language-model-only), prefix caching and chunked prefill (chunks of at most 32
  tokens, blocks of 16), the backend in a runner in the SDK-pinned environment
  (transformers 4.57 has no Qwen3.5: config.json is read as JSON): the state in vLLM's
  hybrid KV cache ('align' mode, a state block per 16 positions); the same prompts
  twice, the second round
  reading its prefixes' KV and state blocks from the cache; then longer generations with
  every running request preempted mid-decode (vLLM's /reset_prefix_cache with
  reset_running_requests): each comes back encoded again from its first token, its
  state from zeros, and finishes with the tokens of an undisturbed run.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.support import GreedyOracle, Server, corpus_token_ids

PROMPT_LENGTHS = [5, 31, 33, 64, 65, 100]
NEW_TOKENS = 12
LONG = 40  # new tokens of the preempted generations
MAX_MODEL_LEN = 160
BLOCK_SIZE = 16
BUCKETS = {"context_encoding_buckets": [32, 128], "token_generation_buckets": [160]}
ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
CACHED = ["--enable-prefix-caching", "--enable-chunked-prefill", "--max-num-batched-tokens",
          "32", "--block-size", str(BLOCK_SIZE), "--enable-prompt-tokens-details",
          "--language-model-only"]
LAYOUTS = {"qwen3_5_moe": "contiguous", "qwen3_5_mm": "prefix-caching"}

pytestmark = pytest.mark.server


def prompts(model: Path) -> list[list[int]]:
    return [corpus_token_ids(model, n, offset=5 * n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, tiny_model, host_python, tmp_path_factory):
    model = tiny_model(request.param)
    config: dict = {"override_neuron_config": BUCKETS}
    args = list(ARGS)
    if LAYOUTS[request.param] == "prefix-caching":
        config["backend_python"] = request.getfixturevalue("sdk_python")
        args += CACHED
    server = Server(model, tmp_path_factory.mktemp(request.param) / "serve.log",
                    [*args, "--additional-config", json.dumps(config)],
                    env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, python=host_python)
    try:
        server.wait_healthy(timeout=420)
        yield model, server, GreedyOracle(model)
    finally:
        server.stop()


def complete(server: Server, model: Path, prompt: list[int], max_tokens: int = NEW_TOKENS,
             started: threading.Event | None = None) -> tuple[list[int], int]:
    """(greedy token ids, cached prompt tokens); `started` is set at the first token."""
    import requests

    body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    if started is None:
        reply = requests.post(f"{server.url}/v1/completions", timeout=180, json=body)
        assert reply.ok, reply.text
        answer = reply.json()
        cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        return answer["choices"][0]["token_ids"], cached or 0
    tokens: list[int] = []
    with requests.post(f"{server.url}/v1/completions", timeout=300, stream=True,
                       json={**body, "stream": True}) as reply:
        assert reply.ok, reply.text
        for line in reply.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if tokens:
                started.set()
    return tokens, 0


def test_served_greedy_tokens_equal_transformers(served):
    model, server, oracle = served
    expected = [oracle.generate(p, NEW_TOKENS) for p in prompts(model)]
    cached = LAYOUTS[model.name.removeprefix("tiny-")] == "prefix-caching"
    for round_ in ("cold", "warm") if cached else ("cold",):
        with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
            answers = list(pool.map(lambda p: complete(server, model, p), prompts(model)))
        assert [tokens for tokens, _ in answers] == expected, round_
    log = server.log()
    if not cached:
        assert "KV layout contiguous" in log
        return
    assert "a state block per 16 positions (mamba_cache_mode align)" in log
    assert "(runner:" in log
    # the warm round read its prompts' full blocks, states included, from the cache
    hits = [hit for _, hit in answers]
    assert all(h >= BLOCK_SIZE * ((n - 1) // BLOCK_SIZE)
               for h, n in zip(hits, PROMPT_LENGTHS, strict=True)), hits


def test_preempted_requests_resume_from_a_fresh_state(served):
    import requests

    model, server, oracle = served
    if LAYOUTS[model.name.removeprefix("tiny-")] != "prefix-caching":
        pytest.skip("preempted on the prefix-caching server")
    chosen = prompts(model)[1:5]  # four requests, four sequence slots: all running
    started = [threading.Event() for _ in chosen]
    with ThreadPoolExecutor(len(chosen)) as pool:
        futures = [pool.submit(complete, server, model, p, LONG, e)
                   for p, e in zip(chosen, started, strict=True)]
        for event in started:
            assert event.wait(timeout=180)
        reset = requests.post(f"{server.url}/reset_prefix_cache",
                              params={"reset_running_requests": "true"}, timeout=60)
        assert reset.ok and reset.json()["success"], reset.text
        got = [future.result()[0] for future in futures]
    assert got == [oracle.generate(p, LONG) for p in chosen]
    assert preemptions(server) >= len(chosen)


def preemptions(server: Server) -> float:
    """vLLM's count of preempted requests (its /metrics counter)."""
    import requests

    metrics = requests.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_preemptions_total"))
