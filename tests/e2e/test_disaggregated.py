"""Disaggregated prefill and decode on loopback: a prefill server and a decode server
(`vllm serve --device neuron` each, the plugin's NeuronKVConnector, KV payloads in a
shared folder) behind vLLM's router in its prefill/decode mode (`vllm-router
--vllm-pd-disaggregation`), as scripts/serve-pd-demo.sh starts them. The decode server
runs its backend in a runner process (the KV arena), the prefill server in-process.

- greedy tokens through the router equal transformers' and a single server's, the
  decode server computing no prompt (only token generation), the payloads deleted;
- a payload that is not the decode server's (model, dtype, block size, shape, prompt),
  missing, not safetensors (a pickle), a directory or a FIFO at its path, unsigned or
  forged, or holding NaN is refused with its reason in the log, and the request is
  recomputed (kv_load_failure_policy recompute): right tokens, the server alive, and
  later requests sharing its prefix right too;
- payloads do not outlive their use: params the connector cannot serve (a wrong prompt
  length, "true" as a string, a prefill with n=2 or streaming) are HTTP 400 and the
  payload they name is deleted; an expired payload is swept while the servers idle;
- with kv_load_failure_policy fail (the prefill server's) a missing payload is HTTP 400
  with the reason, not a bare 500;
- the prefill server killed mid-load: every request completes with the right tokens or
  gets an error, none hangs, and the decode server serves on.
The pair is started once for the module (each server takes about a minute here); both
share a payload key (VLLM_NEURON_KV_KEY), which the tests use to write payloads a real
prefill server could have written."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from neuron_plugin.core.kv_transfer import KEY_ENV, connector_config
from tests.e2e.scrape import neuron_samples, total
from tests.e2e.support import LoopbackProcess, Server, corpus_token_ids, free_port

pytestmark = pytest.mark.server

BLOCK = 32
ARGS = ["--max-model-len", "512", "--max-num-seqs", "4", "--enable-prefix-caching",
        "--block-size", str(BLOCK)]
BUCKETS = {"context_encoding_buckets": [32, 64, 128, 256, 512]}
NEW_TOKENS = 8
REQUEST_TIMEOUT_S = 60
KEY = "p" * 32  # the pair's payload key
TTL_S = 30  # swept every 7.5 s


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


def _server_args(kv_folder: Path, backend_python: str | None = None,
                 policy: str = "recompute") -> list[str]:
    extra = {"override_neuron_config": BUCKETS,
             **({"backend_python": backend_python} if backend_python else {})}
    kv = json.loads(connector_config(str(kv_folder), policy=policy))
    kv["kv_connector_extra_config"]["ttl_s"] = TTL_S
    return [*ARGS, "--additional-config", json.dumps(extra),
            "--kv-transfer-config", json.dumps(kv)]


@pytest.fixture(scope="module")
def pd(model_dirs, sdk_python, tmp_path_factory):
    """(router, prefill server, decode server, payload folder)."""
    root = tmp_path_factory.mktemp("pd")
    kv = root / "kv"
    model = model_dirs["llama"]
    env = {**os.environ, KEY_ENV: KEY}
    # the prefill server fails requests whose load fails (it loads only in the test of
    # that policy); the decode server recomputes them
    prefill = Server(model, root / "prefill.log", _server_args(kv, policy="fail"), env=env)
    decode = Server(model, root / "decode.log", _server_args(kv, sdk_python), env=env)
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
    # the KV moved is counted where it moved: saved by the prefill, loaded by the decode
    saved = total(neuron_samples(prefill.url), "neuron:kv_transfer_bytes_total",
                  direction="saved")
    loaded = total(neuron_samples(decode.url), "neuron:kv_transfer_bytes_total",
                   direction="loaded")
    assert saved > 0 and loaded > 0
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
    from neuron_plugin.backends.reference.decoder import COMPUTATION

    return KVGeometry(config["num_hidden_layers"], BLOCK, config["num_key_value_heads"],
                      config["head_dim"], "float32", f"reference computation {COMPUTATION}")


def _forged(kv: Path, prompt: list[int], model: str, geometry, token_ids=None, data=None,
            secret: str = KEY) -> str:
    """A payload as a prefill server writes it (signed with `secret`), with what the
    test chooses."""
    import torch

    from neuron_plugin.kv_transfer.params import new_key
    from neuron_plugin.kv_transfer.payload import RequestScope, write_payload

    key = new_key()
    blocks = math.ceil(len(prompt) / geometry.block_size)
    if data is None:
        data = torch.randn(geometry.shape(blocks)).to(geometry.torch_dtype)
    write_payload(kv, key, data, token_ids or prompt, model, geometry, secret.encode(),
                  scope=RequestScope())
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
    cases = {  # each payload written just before its request (the sweep keeps to ttl_s)
        "model": (lambda: _forged(kv, prompt, "f" * 64, geometry), f"its model is {'f' * 16}"),
        "dtype": (lambda: _forged(kv, prompt, ours, dataclasses.replace(geometry,
                                                                        dtype="bfloat16")),
                  "its KV dtype is bfloat16, this server's is float32"),
        "block size": (lambda: _forged(kv, prompt, ours, dataclasses.replace(geometry,
                                                                             block_size=16)),
                       f"its block size is 16, this server's is {BLOCK}"),
        "shape": (lambda: _forged(kv, prompt, ours, dataclasses.replace(geometry, kv_heads=4)),
                  "its kv shape"),
        "prompt": (lambda: _forged(kv, prompt, ours, geometry,
                                   token_ids=[t + 1 for t in prompt]),
                   "the KV of another prompt"),
        "missing": (lambda: "0123456789abcdef0123456789abcdef", "no KV payload"),
    }
    pickled = "fedcba9876543210fedcba9876543210"

    def pickle_payload() -> str:
        # what torch.save would write: a pickle, which must never be unpickled
        (kv / f"{pickled}.safetensors").write_bytes(pickle.dumps({"kv": list(range(10))}))
        return pickled

    cases["pickle"] = (pickle_payload, "is not a safetensors file")
    before = _prefills(decode)
    for name, (write, reason) in cases.items():
        status, reply = _complete(decode.url, model, prompt,
                                  kv_transfer_params=_params(write(), len(prompt)))
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


def _alive_and_right(server: Server, model_dirs, oracles, offset: int) -> None:
    """The server serves on: a greedy request equals transformers."""
    model = model_dirs["llama"]
    prompt = corpus_token_ids(model, 40, offset=offset)
    status, reply = _complete(server.url, model, prompt)
    assert status == 200, reply
    assert _tokens(reply) == oracles("llama").generate(prompt, NEW_TOKENS)


def test_a_directory_or_fifo_at_a_payload_path_neither_kills_nor_hangs_the_decode_server(
        pd, model_dirs, oracles):
    """Cases 2 and 3: the load refuses each (no blocking open of the FIFO), the request is
    recomputed, the directory (which no unlink removes) is left in place with a warning,
    and the server serves on."""
    _, _, decode, kv = pd
    model = model_dirs["llama"]
    prompt = corpus_token_ids(model, 50, offset=1300)
    expected = oracles("llama").generate(prompt, NEW_TOKENS)
    folder, fifo = "d1" * 16, "f1" * 16
    (kv / f"{folder}.safetensors").mkdir()
    os.mkfifo(kv / f"{fifo}.safetensors")
    try:
        for key, reason in ((folder, "is a directory, not a regular file"),
                            (fifo, "is a FIFO, device or socket, not a regular file")):
            status, reply = _complete(decode.url, model, prompt,
                                      kv_transfer_params=_params(key, len(prompt)))
            assert status == 200, (key, reply)
            assert _tokens(reply) == expected
            assert reason in decode.log()
        assert (kv / f"{folder}.safetensors").is_dir()  # cannot be unlinked: left, logged
    finally:
        (kv / f"{folder}.safetensors").rmdir()
        (kv / f"{fifo}.safetensors").unlink(missing_ok=True)  # unlinked like a payload
    _alive_and_right(decode, model_dirs, oracles, 1400)


def test_nan_or_unauthenticated_kv_never_reaches_the_cache(pd, model_dirs, oracles):
    """Cases 4 and 5: a well-formed payload holding NaN (signed with the pair's key), one
    scaled x1000 and signed with another key, and one changed after it was signed are
    refused with the reason and recomputed; plain requests sharing their first 64 tokens
    (decode-server prefix-cache hits) then get transformers' tokens, 3 of 3."""
    import torch

    from neuron_plugin.kv_transfer.payload import RequestScope, model_identity, read_payload

    _, _, decode, kv = pd
    model = model_dirs["llama"]
    ours = model_identity(model)
    geometry = _geometry(model_dirs)
    shared = corpus_token_ids(model, 64, offset=1500)
    prompt = shared + corpus_token_ids(model, 6, offset=1600)
    blocks = math.ceil(len(prompt) / BLOCK)
    nan = torch.randn(geometry.shape(blocks))
    nan[0, 1, 0, 3] = float("nan")

    def changed_after_signing() -> str:
        from safetensors import safe_open
        from safetensors.torch import save_file

        key = _forged(kv, prompt, ours, geometry)
        path = str(kv / f"{key}.safetensors")
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        tensors["kv"] = tensors["kv"] * 1000  # its tag kept
        save_file(tensors, path, metadata=metadata)
        return key

    big = 1000 * torch.randn(geometry.shape(blocks))
    cases = {
        "nan": (lambda: _forged(kv, prompt, ours, geometry, data=nan), "holds NaN or Inf"),
        "forged": (lambda: _forged(kv, prompt, ours, geometry, data=big, secret="x" * 32),
                   "is not the one this deployment's key makes"),
        "changed": (changed_after_signing, "is not the one this deployment's key makes"),
    }
    expected = oracles("llama").generate(prompt, NEW_TOKENS)
    for name, (write, reason) in cases.items():
        key = write()
        if name == "nan":  # well formed and signed: only its values are refused
            with pytest.raises(ValueError, match="holds NaN"):
                read_payload(kv, key, ours, geometry, prompt, 16, KEY.encode(),
                             scope=RequestScope())
        status, reply = _complete(decode.url, model, prompt,
                                  kv_transfer_params=_params(key, len(prompt)))
        assert status == 200 and _tokens(reply) == expected, (name, reply)
        assert reason in decode.log(), name
    for i in range(3):
        plain = shared + corpus_token_ids(model, 5 + i, offset=1700 + 31 * i)
        status, reply = _complete(decode.url, model, plain)
        assert status == 200
        assert _tokens(reply) == oracles("llama").generate(plain, NEW_TOKENS), i
    assert sorted(os.listdir(kv)) == []


def test_payloads_do_not_outlive_their_requests(pd, model_dirs, oracles):
    """Case 6: params the connector cannot serve are HTTP 400 with the reason and the
    payload they name is deleted (a wrong prompt length, "true" as a string); a prefill
    with n=2 or streaming is refused (400) and writes nothing; an expired payload (e.g.
    named by a request vLLM's API server refused before the engine saw it) is swept while
    the servers idle."""
    import requests

    from neuron_plugin.kv_transfer.payload import model_identity

    _, prefill, decode, kv = pd
    model = model_dirs["llama"]
    geometry = _geometry(model_dirs)
    prompt = corpus_token_ids(model, 45, offset=1800)
    wrong_length = _forged(kv, prompt, model_identity(model), geometry)
    string_flag = _forged(kv, prompt, model_identity(model), geometry)
    refused = {
        wrong_length: (_params(wrong_length, len(prompt) + 1),
                       f"num_tokens={len(prompt) + 1} is not this request's prompt length"),
        string_flag: ({**_params(string_flag, len(prompt)), "do_remote_prefill": "true"},
                      "do_remote_prefill='true' must be true or false"),
    }
    for key, (params, reason) in refused.items():
        status, reply = _complete(decode.url, model, prompt, kv_transfer_params=params)
        assert status == 400 and reason in reply["error"], reply
        assert not (kv / f"{key}.safetensors").exists()
    status, reply = _complete(prefill.url, model, prompt, n=2, temperature=1.0,
                              kv_transfer_params={"do_remote_decode": True})
    assert status == 400 and "asks for n=2 sequences" in reply["error"], reply
    # a stream has begun (HTTP 200) when vLLM checks the request: the refusal is its event
    streamed = requests.post(f"{prefill.url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": str(model), "prompt": prompt, "max_tokens": NEW_TOKENS, "stream": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert '"code": 400' in streamed.text and "cannot stream" in streamed.text, streamed.text
    assert '"choices"' not in streamed.text
    assert sorted(os.listdir(kv)) == []
    # a key that is no key: 400 too
    status, reply = _complete(decode.url, model, prompt,
                              kv_transfer_params=_params("../../../etc/passwd", len(prompt)))
    assert status == 400 and "is not 32 lowercase hex digits" in reply["error"]
    # expired, and no traffic: the sweep's timer removes it within ttl_s / 4
    expired = _forged(kv, prompt, model_identity(model), geometry)
    os.utime(kv / f"{expired}.safetensors", (1000, 1000))
    deadline = time.monotonic() + TTL_S / 4 + 5
    while (kv / f"{expired}.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (kv / f"{expired}.safetensors").exists()
    _alive_and_right(decode, model_dirs, oracles, 1900)


def test_with_kv_load_failure_policy_fail_a_missing_payload_is_a_400_with_the_reason(
        pd, model_dirs, oracles):
    """Case 7: the prefill server (policy fail) asked to load a payload that is not there
    answers HTTP 400 saying so, not vLLM's bare 500; it serves on."""
    _, prefill, _, _ = pd
    model = model_dirs["llama"]
    prompt = corpus_token_ids(model, 33, offset=2100)
    status, reply = _complete(prefill.url, model, prompt,
                              kv_transfer_params=_params("ab" * 16, len(prompt)))
    assert status == 400, reply
    assert "no KV payload" in reply["error"] and "kv_load_failure_policy fail" in reply["error"]
    _alive_and_right(prefill, model_dirs, oracles, 2200)


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
