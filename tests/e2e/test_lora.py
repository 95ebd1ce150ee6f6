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
- malformed, oversized, mismatched and hostile adapters (NaN weights, a transposed
  lora_A, a symlink loop, target_modules the model lacks, a target_modules pattern that
  backtracks catastrophically or does not compile) are refused with HTTP 400
  naming the adapter, the value and the limit, and the server keeps serving;
- an adapter changed, swapped or deleted on disk after it left the host cache serves
  the weights verified when it was loaded (its private copy), never the engine's death;
- load_inplace switches requests in flight to the new weights at the next step.
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


# -- hostile adapters (issue 32): none kills the server or reaches a slot unverified -------
def _variant(source: Path, folder: Path, edit=None, config=None) -> Path:
    """A copy of adapter `source` with its tensors (`edit`) or config changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    if edit is not None:
        weights = folder / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        edit(tensors)
        save_file(tensors, str(weights))
    if config is not None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _alive_and_right(server: Server, model_dirs, oracle, offset: int) -> None:
    """The server serves on: a base-model greedy request equals transformers."""
    prompt = corpus_token_ids(model_dirs["llama"], 24, offset=offset)
    assert _complete(server, _base(model_dirs), prompt) == (
        200, oracle.generate(prompt, MAX_TOKENS, None))


def test_an_adapter_changed_or_deleted_after_it_left_the_host_cache_serves_as_verified(
        lora_server, model_dirs, lora_adapters, oracle, tmp_path):
    """Case 1: "ev" is loaded, then three more push it out of the host cache
    (--max-cpu-loras 3) and out of both slots; its file is truncated, then swapped for
    another adapter's, then its folder deleted. Each time a request naming "ev" gets the
    tokens of the weights checked when "ev" was loaded (its verified copy), and the
    server serves on."""
    import shutil

    ev = _variant(lora_adapters["lora-a"], tmp_path / "ev")
    prompt = corpus_token_ids(model_dirs["llama"], 22, offset=610)
    want = oracle.generate(prompt, MAX_TOKENS, "lora-a")
    _load(lora_server, "ev", ev)
    assert _complete(lora_server, "ev", prompt) == (200, want)
    for name, source in (("ev-b", "lora-b"), ("ev-c", "lora-c"), ("ev-b2", "lora-b")):
        _load(lora_server, name, _variant(lora_adapters[source], tmp_path / name))
        assert _complete(lora_server, name, prompt) == (
            200, oracle.generate(prompt, MAX_TOKENS, source))
    weights = ev / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert _complete(lora_server, "ev", prompt) == (200, want)
    shutil.copy(lora_adapters["lora-b"] / "adapter_model.safetensors", weights)
    for name in ("ev-c", "ev-b2"):  # "ev" out of both slots again
        assert _complete(lora_server, name, prompt)[0] == 200
    assert _complete(lora_server, "ev", prompt) == (200, want)  # not lora-b's weights
    shutil.rmtree(ev)
    for name in ("ev-c", "ev-b2"):
        assert _complete(lora_server, name, prompt)[0] == 200
    assert _complete(lora_server, "ev", prompt) == (200, want)
    _alive_and_right(lora_server, model_dirs, oracle, 640)


def test_hostile_adapters_are_client_errors_with_their_reason(
        lora_server, model_dirs, lora_adapters, oracle, tmp_path):
    """Cases 4 and 7: NaN weights, a transposed lora_A, a symlink loop, target_modules the
    base model does not have, and the earlier refusals (rank, pickle, another base
    model) are HTTP 400 with the reason; the server serves on after each."""
    import torch
    from build_tiny_lora import build_lora

    source = lora_adapters["lora-c"]  # rank 8 on q_proj, v_proj

    def nan(tensors):
        name = next(k for k in tensors if "q_proj.lora_B" in k)
        tensors[name] = torch.full_like(tensors[name], float("nan"))

    def transposed(tensors):
        name = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[name] = tensors[name].t().contiguous()

    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    (loop / "adapter_model.safetensors").symlink_to(loop / "adapter_model.safetensors")
    llama, qwen3 = model_dirs["llama"], model_dirs["qwen3"]
    cases = {
        "nan": (_variant(source, tmp_path / "nan", edit=nan),
                ["'nan'", "NaN or Inf", "q_proj.lora_B"]),
        "transposed": (_variant(source, tmp_path / "transposed", edit=transposed),
                       ["'transposed'", "this lora_A is transposed", "[r, in_features]"]),
        "loop": (loop, ["'loop'", "adapter_model.safetensors is a symbolic link loop"]),
        "targets": (_variant(source, tmp_path / "targets",
                             config={"target_modules": ["query_key_value", "dense"]}),
                    ["'targets'", "none of which is a module of the base model"]),
        # issue 39: a pattern that backtracks catastrophically under Python's re (one
        # load used to stall every request) and one that does not compile
        "backtracking": (_variant(source, tmp_path / "backtracking",
                                  config={"target_modules": r"(\w|\.|\w\.?)*X"}),
                         ["'backtracking'", "none of which is a module of the base model"]),
        "bad-regex": (_variant(source, tmp_path / "bad-regex",
                               config={"target_modules": "(q_proj"}),
                      ["'bad-regex'", "target_modules cannot be used",
                       "is not a valid regular expression"]),
        "rank16": (build_lora(llama, tmp_path / "rank16", seed=4, r=16, lora_alpha=16,
                              target_modules=["q_proj"]),
                   ["'rank16'", "rank 16", "--max-lora-rank 8"]),
        "pickled": (build_lora(llama, tmp_path / "pickled", seed=5, safe_serialization=False,
                               r=8, lora_alpha=8, target_modules=["q_proj"]),
                    ["'pickled'", "adapter_model.bin", "safetensors"]),
        "other-base": (build_lora(qwen3, tmp_path / "other-base", seed=6, r=8, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj"]),
                       ["'other-base'", "layer 2", "2 layers"]),
    }
    for n, (name, (path, words)) in enumerate(cases.items()):
        reply = _post(lora_server, "/v1/load_lora_adapter",
                      {"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == 400, (name, reply.text)
        for word in words:
            assert word in reply.text, (name, word, reply.text)
        assert "Internal" not in reply.text
        _alive_and_right(lora_server, model_dirs, oracle, 700 + 10 * n)
    missing = _post(lora_server, "/v1/load_lora_adapter",
                    {"lora_name": "missing", "lora_path": str(tmp_path / "nowhere")})
    assert missing.status_code == 404, missing.text


def test_reload_in_place_switches_requests_in_flight_to_the_new_weights(
        lora_server, model_dirs, lora_adapters, oracle, tmp_path):
    """load_inplace (docs/configuration/lora.md: requests in flight switch at the next step): a request
    streaming with "sw" keeps running and completes; its first token is lora-a's, and
    its tokens are not lora-a's alone (the KV of its earlier positions stays lora-a's, so
    no oracle gives the mixed sequence); a request after the reload gets lora-c's."""
    _load(lora_server, "sw", _variant(lora_adapters["lora-a"], tmp_path / "sw"))
    prompt = corpus_token_ids(model_dirs["llama"], 30, offset=820)
    long = 96
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, lora_server, "sw", prompt, long, started)
        assert started.wait(120)
        reply = _post(lora_server, "/v1/load_lora_adapter", {
            "lora_name": "sw", "lora_path": str(lora_adapters["lora-c"]), "load_inplace": True})
        assert reply.status_code == 200, reply.text
        status, tokens = running.result()
    assert status == 200 and len(tokens) == long
    pure_a = oracle.generate(prompt, long, "lora-a")
    assert tokens[0] == pure_a[0]  # the first token ran on lora-a
    assert tokens != pure_a  # the rest switched to lora-c's weights part way
    assert _complete(lora_server, "sw", prompt) == (
        200, oracle.generate(prompt, MAX_TOKENS, "lora-c"))
