"""`vllm serve` (vLLM 0.32, torch 2.13) with its backend in a runner process in the
second environment (torch 2.9.1, transformers 4.57, no vLLM), as on inf2: greedy tokens
equal transformers, the 400 for an over-long prompt, and the faults: a runner killed
mid-request, the server killed, an interpreter without the backend."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
from tests.e2e.support import Server, alive, corpus_token_ids

pytestmark = pytest.mark.server

BUCKETS = '{"context_encoding_buckets": [32, 64, 128, 256]}'


def _args(python: str) -> list[str]:
    return ["--max-model-len", "512", "--max-num-seqs", "4", "--additional-config",
            json.dumps({"override_neuron_config": json.loads(BUCKETS),
                        "backend_python": python})]


def _runner_pid(server: Server) -> int:
    found = re.search(r"backend runner pid (\d+)", server.log())
    assert found, server.log()[-3000:]
    return int(found.group(1))


@pytest.fixture(scope="module")
def runner_server(model_dirs, sdk_python, tmp_path_factory):
    server = Server(model_dirs["llama"], tmp_path_factory.mktemp("runner") / "serve.log",
                    _args(sdk_python), engine_start=None)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_runner_reports_the_sdk_pins(runner_server, sdk_python):
    """The handshake, logged once by the worker, shows the runner ran torch 2.9.1 under
    the second interpreter while vLLM runs torch 2.13 here."""
    import torch

    line = next(l for l in runner_server.log().splitlines() if "backend runner pid" in l)
    assert f"reference backend in {sdk_python}" in line
    assert "torch 2.9.1" in line and "transformers 4.57." in line
    assert torch.__version__.startswith("2.13")


def test_completions_through_the_runner_equal_transformers(runner_server, model_dirs, oracles):
    import requests

    prompt = corpus_token_ids(model_dirs["llama"], 45)
    reply = requests.post(f"{runner_server.url}/v1/completions", json={
        "model": str(model_dirs["llama"]), "prompt": prompt, "max_tokens": 10,
        "temperature": 0.0}, timeout=60).json()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    assert reply["choices"][0]["text"] == tokenizer.decode(
        oracles("llama").generate(prompt, 10))


def test_over_long_prompt_is_a_400_and_serving_goes_on(runner_server, model_dirs):
    import requests

    url = f"{runner_server.url}/v1/completions"
    too_long = requests.post(url, json={"model": str(model_dirs["llama"]),
                                        "prompt": [5] * 257, "max_tokens": 2}, timeout=60)
    assert too_long.status_code == 400
    assert "largest context-encoding bucket holds 256" in too_long.text
    fine = requests.post(url, json={"model": str(model_dirs["llama"]), "prompt": [5] * 20,
                                    "max_tokens": 2}, timeout=60)
    assert fine.status_code == 200


def test_killed_runner_fails_in_flight_requests_and_stops_the_server(model_dirs, sdk_python,
                                                                     tmp_path):
    """No hang, nothing silently dropped: every in-flight request gets an error within
    seconds, and the server shuts down (vLLM stops once its engine is dead) with the
    runner's fate and the fix in its log."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import requests

    server = Server(model_dirs["llama"], tmp_path / "serve.log", _args(sdk_python),
                    engine_start=None)
    try:
        server.wait_healthy()
        runner = _runner_pid(server)
        decoding = [threading.Event() for _ in range(3)]

        def long_stream(i: int) -> str:
            """How a streamed request ended: "finished" only with its 400th token."""
            try:
                with requests.post(f"{server.url}/v1/completions", stream=True, json={
                        "model": str(model_dirs["llama"]), "prompt": [5 + i] * 30,
                        "max_tokens": 400, "ignore_eos": True, "temperature": 0.0,
                        "stream": True}, timeout=60) as reply:
                    if reply.status_code != 200:
                        return f"HTTP {reply.status_code}"
                    for line in reply.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        chunk = json.loads(line[len(b"data: "):])
                        if "error" in chunk:
                            return f"error: {chunk['error']}"
                        decoding[i].set()
                        reason = chunk["choices"][0].get("finish_reason")
                        if reason:
                            return "finished" if reason == "length" else f"ended: {reason}"
                    return "stream cut"
            except requests.RequestException as exc:
                return f"connection error: {exc}"

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(long_stream, i) for i in range(3)]
            for started in decoding:  # every request has its first tokens
                assert started.wait(60), [f.result() for f in futures if f.done()]
            os.kill(runner, signal.SIGKILL)
            killed = time.monotonic()
            outcomes = [f.result() for f in futures]
        assert time.monotonic() - killed < 30
        assert not [o for o in outcomes if o == "finished"], outcomes
        server.proc.wait(60)  # raises TimeoutExpired if the server hangs on
        log = server.log()
        # `run` with on-device sampling, `forward` when the host samples
        assert re.search(r"was killed by SIGKILL during (run|forward)\b", log)
        assert "the requests in flight fail and the server stops" in log
    finally:
        server.stop()


def test_interpreter_without_the_backend_stops_start_up(model_dirs, tmp_path):
    """A Python without the plugin's backend side: start-up fails (non-zero, no hang)
    with the interpreter, the missing package and the fix in the log."""
    bare = tmp_path / "bare"
    subprocess.run([os.sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    python = str(bare / "bin" / "python")
    server = Server(model_dirs["llama"], tmp_path / "serve.log", _args(python),
                    env={**os.environ, "PWD": str(tmp_path)})
    try:
        assert server.proc.wait(240) != 0
        log = server.log()
        assert python in log
        assert "No module named" in log
        assert "pip install 'vllm-neuron-plugin[backend]'" in log
    finally:
        server.stop()


def test_killing_the_server_leaves_no_runner(runner_server):
    """Last in the file: it ends the module's server (a server of its own would cost
    another start-up)."""
    runner = _runner_pid(runner_server)
    assert alive(runner)
    runner_server.proc.kill()  # SIGKILL: no shutdown handler runs in the API server
    runner_server.proc.wait()
    deadline = time.monotonic() + 30
    while alive(runner) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(runner), "the runner outlived the server"
