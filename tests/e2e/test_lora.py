"""Multi-LoRA through `vllm serve --device neuron`, adapters loaded at run time.

One real server (the backend in the SDK environment's runner process, so adapters cross
the process boundary through shared memory) with 2 adapter slots of rank 8 and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1. Adapters are PEFT's own files
(scripts/build_tiny_lora.py); the oracle is transformers + PEFT, per row. Checked:
- two adapters loaded through /v1/load_lora_adapter and the base model, requested
  together, each give PEFT's greedy tokens;
- loading a third adapter and unloading one while requests using them are in flight
  loses nothing: every request completes with PEFT's tokens, and the third adapter takes
  a slot when one frees up (vLLM's scheduler runs at most --max-loras adapters a step);
- malformed, oversized and mismatched adapters are refused naming the adapter, the value
  and the limit, and the server keeps serving.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.support import PeftOracle, Server, corpus_token_ids

pytestmark = pytest.mark.server

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def oracle(model_dirs, lora_adapters) -> PeftOracle:
    return PeftOracle(model_dirs["llama"], lora_adapters)


@pytest.fixture(scope="module")
def lora_server(model_dirs, sdk_python, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    extra = {"backend_python": sdk_python,
             "override_neuron_config": {"context_encoding_buckets": [32, 64, 128, 256]}}
    server = Server(model_dirs["llama"], tmp_path_factory.mktemp("lora") / "serve.log",
                    ["--max-model-len", "256", "--max-num-seqs", "4", "--enable-lora",
                     "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                     "--additional-config", json.dumps(extra)], env=env)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(lora_server, lora_adapters) -> Server:
    """The server with adapters "a" and "b" loaded at run time (once)."""
    _load(lora_server, "a", lora_adapters["lora-a"])
    _load(lora_server, "b", lora_adapters["lora-b"])
    return lora_server


def _post(server: Server, route: str, body: dict):
    import requests

    return requests.post(f"{server.url}{route}", json=body, timeout=120)


def _load(server: Server, name: str, path: Path) -> None:
    reply = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert reply.status_code == 200, reply.text


def _complete(server: Server, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    """(HTTP status, generated token ids or the error text)."""
    reply = _post(server, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    if reply.status_code != 200:
        return reply.status_code, reply.text
    return 200, reply.json()["choices"][0]["token_ids"]


def _stream(server: Server, model: str, prompt: list[int], max_tokens: int,
            started: threading.Event):
    """A streamed completion: `started` is set at its first token; (status, token ids)."""
    import requests

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    tokens: list[int] = []
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True,
                       timeout=300) as reply:
        if reply.status_code != 200:
            started.set()
            return reply.status_code, reply.text
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                tokens += choice.get("token_ids") or []
            if tokens:
                started.set()
    return 200, tokens


def _base(model_dirs) -> str:
    return str(model_dirs["llama"])


def test_adapters_loaded_at_run_time_and_the_base_model_match_peft_per_row(
        served, model_dirs, oracle):
    import requests

    lora_server = served
    listed = {m["id"] for m in requests.get(f"{lora_server.url}/v1/models", timeout=30)
              .json()["data"]}
    assert {"a", "b", _base(model_dirs)} <= listed
    rows = [("a", "lora-a", 0), (_base(model_dirs), None, 40), ("b", "lora-b", 80),
            ("a", "lora-a", 120)]
    prompts = [corpus_token_ids(model_dirs["llama"], 20 + 5 * i, offset=o)
               for i, (_, _, o) in enumerate(rows)]
    with ThreadPoolExecutor(len(rows)) as pool:
        results = list(pool.map(lambda r: _complete(lora_server, r[0][0], r[1]),
                                zip(rows, prompts, strict=True)))
    for (model, adapter, _), prompt, (status, tokens) in zip(rows, prompts, results,
                                                             strict=True):
        assert status == 200, tokens
        assert tokens == oracle.generate(prompt, MAX_TOKENS, adapter), model
    # the adapters change the model: each row differs from the base model's tokens
    assert results[0][1] != oracle.generate(prompts[0], MAX_TOKENS, None)
    assert results[2][1] != oracle.generate(prompts[2], MAX_TOKENS, None)


def test_load_and_unload_under_load_lose_nothing(served, model_dirs, lora_adapters, oracle):
    lora_server = served
    long = 64
    running = [("a", "lora-a"), ("b", "lora-b"), (_base(model_dirs), None), ("a", "lora-a")]
    prompts = [corpus_token_ids(model_dirs["llama"], 30, offset=200 + 17 * i)
               for i in range(len(running))]
    started = [threading.Event() for _ in running]
    with ThreadPoolExecutor(8) as pool:
        in_flight = [pool.submit(_stream, lora_server, model, prompt, long, event)
                     for (model, _), prompt, event in zip(running, prompts, started,
                                                          strict=True)]
        assert all(event.wait(120) for event in started)
        # While they decode: a third adapter comes in (both slots are busy, so its
        # request waits for one), and "a" is unloaded under its own requests.
        _load(lora_server, "c", lora_adapters["lora-c"])
        c_prompt = corpus_token_ids(model_dirs["llama"], 25, offset=333)
        c_request = pool.submit(_complete, lora_server, "c", c_prompt, long)
        unloaded = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "a"})
        assert unloaded.status_code == 200, unloaded.text
        assert not any(f.done() for f in in_flight), "the requests ended before the loads"
        results = [f.result() for f in in_flight]
        c_result = c_request.result()
    for (model, adapter), prompt, (status, tokens) in zip(running, prompts, results,
                                                          strict=True):
        assert status == 200, tokens
        assert tokens == oracle.generate(prompt, long, adapter), model
    assert c_result == (200, oracle.generate(c_prompt, long, "lora-c"))
    # "a" is gone for new requests, and loads again (a new id) with the same tokens
    status, text = _complete(lora_server, "a", prompts[0])
    assert status == 404, text
    _load(lora_server, "a", lora_adapters["lora-a"])
    assert _complete(lora_server, "a", prompts[0]) == (
        200, oracle.generate(prompts[0], MAX_TOKENS, "lora-a"))


def test_bad_adapters_are_refused_by_name_and_the_server_keeps_serving(
        lora_server, model_dirs, tmp_path):
    from build_tiny_lora import build_lora

    llama, qwen3 = model_dirs["llama"], model_dirs["qwen3"]
    rank16 = build_lora(llama, tmp_path / "rank16", seed=4, r=16, lora_alpha=16,
                        target_modules=["q_proj"])
    pickled = build_lora(llama, tmp_path / "pickled", seed=5, safe_serialization=False, r=8,
                         lora_alpha=8, target_modules=["q_proj"])
    other = build_lora(qwen3, tmp_path / "other-base", seed=6, r=8, lora_alpha=8,
                       target_modules=["q_proj", "v_proj"])
    refusals = {
        "rank16": (rank16, ["'rank16'", "rank 16", "--max-lora-rank 8"]),
        "pickled": (pickled, ["'pickled'", "adapter_model.bin", "safetensors"]),
        "other-base": (other, ["'other-base'", "layer 2", "2 layers"]),
    }
    for name, (path, words) in refusals.items():
        reply = _post(lora_server, "/v1/load_lora_adapter",
                      {"lora_name": name, "lora_path": str(path)})
        assert reply.status_code >= 400, (name, reply.text)
        for word in words:
            assert word in reply.text, (name, word, reply.text)
    missing = _post(lora_server, "/v1/load_lora_adapter",
                    {"lora_name": "missing", "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 404, missing.text
    status, tokens = _complete(lora_server, _base(model_dirs),
                               corpus_token_ids(model_dirs["llama"], 12))
    assert status == 200 and len(tokens) == MAX_TOKENS
