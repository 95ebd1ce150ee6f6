"""Disaggregated prefill and decode on loopback: a prefill server and a decode server
(`vllm serve --device neuron` each, the plugin's NeuronKVConnector, KV payloads in a
shared folder) behind vLLM's router in its prefill/decode mode (`vllm-router
--vllm-pd-disaggregation`), as scripts/serve-pd-demo.sh starts them. The decode server
runs its backend in a runner process (the KV arena), the prefill server in-process.

- greedy tokens through the router equal transformers' and a single server's, the
  decode server computing no prompt (only token generation), the payloads deleted;
- a payload that is not the decode server's (model, dtype, block size, shape, prompt),
  missing, not safetensors (a pickle) or named by a path is refused with its reason in
  the log, and the request is recomputed (kv_load_failure_policy recompute): right
  tokens;
- the prefill server killed mid-load: every request completes with the right tokens or
  gets an error, none hangs, and the decode server serves on.
The pair is started once for the module (each server takes about a minute here)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from neuron_plugin.core.kv_transfer import connector_config
from tests.e2e.scrape import neuron_samples, total
from tests.e2e.support import LoopbackProcess, Server, corpus_token_ids, free_port

pytestmark = pytest.mark.server

BLOCK = 32
ARGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--enable-prefix-caching",
        "--block-size", str(BLOCK)]
BUCKETS = {"context_encoding_buckets": [32, 64, 128, 256, 512]}
NEW_TOKENS = 8
REQUEST_TIMEOUT_S = 60


class PDRouter(LoopbackProcess):
    """`vllm-router` in its prefill/decode mode in front of one P and one D."""

    name = "vllm-router"

    def __init__(self, prefill: str, decode: str, log_path: Path):
        port = free_port()
        super().__init__(
            [str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1",
             "--port", str(port), "--vllm-pd-disaggregation", "--prefill", prefill,
             "--decode", decode, "--policy", "round_robin",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
             "--request-timeout-secs", str(REQUEST_TIMEOUT_S)], port, log_path)


def _server_args(kv_folder: Path, backend_python: str | None = None) -> list[str]:
    extra = {"override_neuron_config": BUCKETS,
             **({"backend_python": backend_python} if backend_python else {})}
    return [*ARGS, "--additional-config", json.dumps(extra),
            "--kv-transfer-config", connector_config(str(kv_folder))]


@pytest.fixture(scope="module")
def pd(model_dirs, sdk_python, tmp_path_factory):
    """(router, prefill server, decode server, payload folder)."""
    root = tmp_path_factory.mktemp("pd")
    kv = root / "kv"
    model = model_dirs["llama"]
    prefill = Server(model, root / "prefill.log", _server_args(kv))
    decode = Server(model, root / "decode.log", _server_args(kv, sdk_python))
    router = None
    try:
        prefill.wait_healthy(timeout=480)
        decode.wait_healthy(timeout=480)
        router = PDRouter(prefill.url, decode.url, root / "router.log")
        router.wait_healthy()
        yield router, prefill, decode, kv
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode):
            server.stop()


def _complete(url: str, model: Path, prompt: list[int], **extra) -> tuple[int, dict]:
    import requests

    reply = requests.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S + 15, json={
        "model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **extra})
    return reply.status_code, reply.json() if reply.ok else {"error": reply.text}


def _tokens(reply: dict) -> list[int]:
    return reply["choices"][0]["token_ids"]


def _prefills(server: Server) -> float:
    return total(neuron_samples(server.url), "neuron:bucket_calls_total",
                 phase="context_encoding")


def test_greedy_tokens_through_the_router_equal_transformers_and_one_server(
        pd, model_dirs, oracles):
    router, prefill, decode, kv = pd
    model = model_dirs["llama"]
    # one token, under a block, exactly one and two blocks, across blocks, long
    prompts = [corpus_token_ids(model, n, offset=11 * n) for n in (1, 7, 32, 64, 100, 300)]
    decode_prefills = _prefills(decode)
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda p: _complete(router.url, model, p), prompts))
    for prompt, (status, reply) in zip(prompts, replies):
        assert status == 200, reply
        assert _tokens(reply) == oracles("llama").generate(prompt, NEW_TOKENS), len(prompt)
    time.sleep(1.5)  # engines publish every 0.5 s
    # The decode server took every prompt's KV: it ran token generation only (it computes
    # a prompt's last token itself, which for a one-token prompt is the whole prompt; one
    # token is a token-generation call in NxDI's prefix-caching layout too).
    assert _prefills(decode) - decode_prefills == 0
    assert sorted(os.listdir(kv)) == []  # every payload deleted once imported
    assert "KV transfer for request" not in decode.log()  # no load failed
    # every prefill answer named a payload (the router warns when one does not)
    assert "No kv_transfer_params" not in router.log()
    # The prefill server alone (its prefix cache holds its own KV, not the transfer's).
    for prompt, (_, reply) in zip(prompts, replies):
        status, single = _complete(prefill.url, model, prompt)
        assert status == 200 and _tokens(single) == _tokens(reply)


def _geometry(model_dirs):
    from neuron_plugin.backends.kv_blocks import KVGeometry
    from neuron_plugin.core.checkpoint import read_hf_config

    config = read_hf_config(model_dirs["llama"])
    return KVGeometry(config["num_hidden_layers"], BLOCK, config["num_key_value_heads"],
                      config["head_dim"], "float32")


def _forged(kv: Path, prompt: list[int], model: str, geometry, token_ids=None) -> str:
    """A payload as a prefill server writes it, with what the test chooses."""
    import torch

    from neuron_plugin.kv_transfer.params import new_key
    from neuron_plugin.kv_transfer.payload import write_payload

    key = new_key()
    blocks = math.ceil(len(prompt) / geometry.block_size)
    data = torch.randn(geometry.shape(blocks)).to(geometry.torch_dtype)
    write_payload(kv, key, data, token_ids or prompt, model, geometry)
    return key


def _params(key: str, num_tokens: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "neuron_kv": {"format": 1, "key": key, "num_tokens": num_tokens}}


def test_a_payload_not_this_servers_is_refused_and_the_prompt_recomputed(
        pd, model_dirs, oracles):
    import dataclasses
    import pickle

    from neuron_plugin.kv_transfer.payload import model_identity

    _, _, decode, kv = pd
    model = model_dirs["llama"]
    ours = model_identity(model)
    geometry = _geometry(model_dirs)
    prompt = corpus_token_ids(model, 70, offset=900)
    expected = oracles("llama").generate(prompt, NEW_TOKENS)
    cases = {
        "model": (_forged(kv, prompt, "f" * 64, geometry), f"its model is {'f' * 16}"),
        "dtype": (_forged(kv, prompt, ours, dataclasses.replace(geometry, dtype="bfloat16")),
                  "its KV dtype is bfloat16, this server's is float32"),
        "block size": (_forged(kv, prompt, ours, dataclasses.replace(geometry, block_size=16)),
                       f"its block size is 16, this server's is {BLOCK}"),
        "shape": (_forged(kv, prompt, ours, dataclasses.replace(geometry, kv_heads=4)),
                  "its kv shape"),
        "prompt": (_forged(kv, prompt, ours, geometry, token_ids=[t + 1 for t in prompt]),
                   "the KV of another prompt"),
        "missing": ("0123456789abcdef0123456789abcdef", "no KV payload"),
        "path": ("../../../etc/passwd", "is not 32 lowercase hex digits"),
    }
    pickled = "fedcba9876543210fedcba9876543210"
    # what torch.save would write: a pickle, which must never be unpickled
    (kv / f"{pickled}.safetensors").write_bytes(pickle.dumps({"kv": list(range(10))}))
    cases["pickle"] = (pickled, "is not a safetensors file")
    before = _prefills(decode)
    for name, (key, reason) in cases.items():
        status, reply = _complete(decode.url, model, prompt,
                                  kv_transfer_params=_params(key, len(prompt)))
        assert status == 200, (name, reply)
        assert _tokens(reply) == expected, name
        log = decode.log()
        assert f"{reason}" in log, (name, log[-3000:])
        assert "computes the prompt itself (kv_load_failure_policy recompute)" in log
    time.sleep(1.5)
    # every refused request was computed from its prompt on the decode server (the
    # first one in full, the others from its prefix cache: one call each)
    assert _prefills(decode) - before == len(cases)
    assert sorted(os.listdir(kv)) == []  # refused payloads are deleted too


def test_prefill_server_killed_mid_load_errors_or_right_tokens_never_a_hang(
        pd, model_dirs, oracles):
    """Run last: it kills the prefill server."""
    router, prefill, decode, _ = pd
    model = model_dirs["llama"]
    prompts = [corpus_token_ids(model, 40 + 9 * i, offset=2000 + 17 * i) for i in range(12)]

    def one(prompt: list[int]) -> tuple[list[int], str, list[int] | None]:
        import requests

        try:
            status, reply = _complete(router.url, model, prompt)
        except requests.Timeout:
            return prompt, "timeout", None
        except requests.ConnectionError as exc:
            return prompt, f"error: {exc}", None
        if status != 200:
            return prompt, f"error: HTTP {status} {str(reply)[:200]}", None
        return prompt, "ok", _tokens(reply)

    outcomes = []
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(one, p) for p in prompts]:
            outcomes.append(future.result())
            if len(outcomes) == 3:
                prefill.proc.kill()  # SIGKILL: the prefill server vanishes mid-load
    assert prefill.proc.poll() is not None
    assert time.monotonic() - started < 2 * REQUEST_TIMEOUT_S
    counts = {s: sum(1 for _, status, _ in outcomes if status.startswith(s))
              for s in ("ok", "error", "timeout")}
    assert counts["timeout"] == 0, outcomes
    assert counts["ok"] >= 3 and counts["error"] >= 1, outcomes
    for prompt, status, tokens in outcomes:
        if status == "ok":
            assert tokens == oracles("llama").generate(prompt, NEW_TOKENS)
    # The decode server is unharmed and serves on its own.
    prompt = corpus_token_ids(model, 50, offset=4000)
    status, reply = _complete(decode.url, model, prompt)
    assert status == 200
    assert _tokens(reply) == oracles("llama").generate(prompt, NEW_TOKENS)
