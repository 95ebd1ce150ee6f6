"""The build a Neuron host serves from: the `vllm` wheel of the newest supported release,
installed from the package index as a host installs it (scripts/setup-host-env.sh, run
by scripts/run-tests.sh with pip's machine-local settings off), the backend in the
Neuron SDK's environment as a runner process: docs/serving/inf2.md step by step.

Each configuration is served twice at once, from the test build (vLLM's CPU build, this
interpreter's) and from the deployment build (NEURON_TEST_HOST_PYTHON), and the same
requests, one at a time, go to both through the official `openai` client: the two must
answer alike, and every answer with an outside oracle must be right (transformers'
greedy tokens, PEFT's for an adapter, the constraint a request sets). Covered: greedy,
streamed, chat, top-5 logprobs, stop, penalties, logit_bias, allowed_token_ids,
ignore_eos, structured outputs (choice, regex, JSON schema), seeded sampling, on-device
sampling, a too-long prompt's 400, prefix caching with a hit, a LoRA adapter loaded at
run time, n-gram speculation (with structured outputs and a logprobs row), and a server
that still answers right after all of them. Set NEURON_TEST_HOST_PYTHON to another
host environment (e.g. `VLLM_VERSION=0.32.0 scripts/setup-host-env.sh`, with
NEURON_TEST_HOST_RELEASE=0.32) to check it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.support import GreedyOracle, PeftOracle, Server, corpus_token_ids

pytestmark = [pytest.mark.server, pytest.mark.deployment]

TOKENS = 12
BUCKETS = [32, 64, 128, 256]
CHOICES = ["scheduler", "bucket", "graph"]
REGEX = "[a-e]{3}[0-9]"
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["prefill", "decode"]}},
          "required": ["kind"], "additionalProperties": False}
# logprobs keyed "token_id:N" (several token ids decode to the same text)
BY_ID = {"return_tokens_as_token_ids": True}
CONFIGS = {
    # prefix caching (the block layout) and adapters loaded at run time
    "serving": ["--enable-prefix-caching", "--enable-lora", "--max-loras", "1",
                "--max-lora-rank", "8"],
    # prompt-lookup drafts, verified in one decode call
    "ngram": ["--speculative-config", json.dumps({
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4})],
}


@pytest.fixture(scope="module")
def prompts(model_dirs) -> dict[str, list[int]]:
    """Corpus token ids: a prompt, a longer one and one sharing its first 128 tokens
    (four KV blocks), one that no bucket holds, and one that repeats itself."""
    model = model_dirs["llama"]
    long = corpus_token_ids(model, 160, offset=40)
    return {"prompt": corpus_token_ids(model, 24), "long": long,
            "hit": long[:128] + corpus_token_ids(model, 20, offset=900),
            "too_long": corpus_token_ids(model, 300),
            "repeated": corpus_token_ids(model, 16) * 3,
            "after": corpus_token_ids(model, 20, offset=500)}


@pytest.fixture(scope="module")
def oracle(model_dirs) -> GreedyOracle:
    return GreedyOracle(model_dirs["llama"])


@pytest.fixture(scope="module")
def peft(model_dirs, lora_adapters) -> PeftOracle:
    return PeftOracle(model_dirs["llama"], {"lora-a": lora_adapters["lora-a"]})


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, model_dirs, prompts, sdk_python, host_python, lora_adapters,
           tmp_path_factory):
    """{build: (server, its answers)} for one configuration, both builds served at once
    and asked the same requests in the same order."""
    name = request.param
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    extra = {"backend_python": sdk_python,
             "override_neuron_config": {"context_encoding_buckets": BUCKETS}}
    args = ["--max-model-len", "512", "--max-num-seqs", "4", "--seed", "0",
            "--additional-config", json.dumps(extra), *CONFIGS[name]]
    logs = tmp_path_factory.mktemp(f"deployment-{name}")
    servers = {build: Server(model_dirs["llama"], logs / f"{build}.log", args, env=env,
                             python=python, engine_start=None)
               for build, python in (("test", None), ("host", host_python))}
    try:
        for server in servers.values():
            server.wait_healthy(timeout=600)
        exercise = EXERCISES[name]
        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(servers, pool.map(
                lambda s: exercise(s, prompts, lora_adapters), servers.values()),
                strict=True))
        yield name, {build: (servers[build], answers[build]) for build in servers}
    finally:
        for server in servers.values():
            server.stop()


def test_the_host_environment_is_the_vllm_wheel_from_the_index(host_python):
    """What a host installs: the `vllm` distribution of the newest supported release,
    a CUDA build, without the CPU build's kernels (so nothing may depend on them)."""
    import subprocess

    code = ("import importlib.metadata as m, importlib.util as u; "
            "print(m.version('vllm'), m.version('torch'), "
            "u.find_spec('vllm._C') is not None)")
    vllm, torch, has_cpu_kernels = subprocess.run(
        [host_python, "-c", code], capture_output=True, text=True, check=True,
        timeout=120).stdout.split()
    from packaging.version import Version

    from neuron_plugin.core.vllm_builds import TESTED, WHEEL, installed_vllm

    build = installed_vllm({"vllm": vllm}.get)
    assert build is not None and build.build == WHEEL and build.supported(), vllm
    assert build.tested_by() is not None
    assert "+cpu" not in torch and has_cpu_kernels == "False"
    newest = max((release for release, kind in TESTED if kind == WHEEL), key=Version)
    assert build.release == os.environ.get("NEURON_TEST_HOST_RELEASE", newest)


def test_offline_llm_on_a_host_without_neuron_devices_says_where_it_runs(
        host_python, model_dirs, prompts, oracle, tmp_path):
    """vLLM alone finds no platform here (a CUDA build, no GPU) and fails with "Device
    string must not be empty"; the plugin takes over with the reference backend and
    says so, with nothing set (vllm-neuron's offline example shape)."""
    import subprocess

    from tests.e2e.test_offline_script import SCRIPT

    script = tmp_path / "offline.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_NEURON_") and k != "VLLM_WORKER_MULTIPROC_METHOD"}
    prompt = prompts["after"]
    done = subprocess.run([host_python, str(script), str(model_dirs["llama"]),
                           ",".join(map(str, prompt))], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "none of vLLM's own platforms activates" in output
    tokens = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS"))
    assert [int(t) for t in tokens.split()[1].split(",")] == oracle.generate(prompt, 8)


def test_both_builds_answer_alike(served):
    name, by_build = served
    test, host = by_build["test"][1], by_build["host"][1]
    assert test.keys() == host.keys()
    for case in test:
        assert _same(test[case], host[case]), (name, case, test[case], host[case])


def test_the_deployment_builds_answers_are_right(served, prompts, oracle, peft):
    name, by_build = served
    server, answers = by_build["host"]
    CHECKS[name](answers, prompts, oracle, peft)
    # still serving, and right, after everything it was sent
    assert requests.get(f"{server.url}/health", timeout=10).ok
    after = prompts["after"]
    assert _completion(server, after)["token_ids"] == oracle.generate(after, TOKENS)


# -- the requests ---------------------------------------------------------------------
def _client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _completion(server: Server, prompt: list[int] | str, model: str | None = None,
                **options: Any) -> dict[str, Any]:
    """One completion's choice as a dict (token ids included)."""
    extra = {"return_token_ids": True, **options.pop("extra_body", {})}
    reply = _client(server).completions.create(
        model=model or _model(server), prompt=prompt, max_tokens=options.pop("max_tokens",
                                                                              TOKENS),
        temperature=options.pop("temperature", 0.0), extra_body=extra, **options)
    choice = reply.choices[0]
    logprobs = None
    if choice.logprobs is not None:  # per token: its own, then the top ones by text
        logprobs = [(own, sorted(top.items())) for own, top in
                    zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs,
                        strict=True)]
    return {"text": choice.text, "token_ids": choice.model_extra["token_ids"],
            "finish_reason": choice.finish_reason, "logprobs": logprobs}


def _model(server: Server) -> str:
    return requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]


def _prefix_hits(server: Server) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def _serving_requests(server: Server, prompts: dict[str, list[int]],
                      adapters: dict[str, Path]) -> dict:
    """Every request kind, in a fixed order (device-sampled draws depend on the steps
    run before them)."""
    from openai import BadRequestError

    prompt = prompts["prompt"]
    out: dict[str, Any] = {"greedy": _completion(server, prompt)}
    stream = _client(server).completions.create(
        model=_model(server), prompt=prompt, max_tokens=TOKENS, temperature=0.0, stream=True)
    out["stream"] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    chat = _client(server).chat.completions.create(
        model=_model(server), max_tokens=TOKENS, temperature=0.0,
        messages=[{"role": "user", "content": "What does the scheduler do?"}])
    out["chat"] = chat.choices[0].message.content
    out["logprobs"] = _completion(server, prompt, logprobs=5, extra_body=BY_ID)
    # Before "stop": the device rows' draws are one engine-wide stream, and a stop string
    # ends its request in the front end, which aborts it in the engine a number of
    # steps later that depends on timing, each step drawing.
    out["device_sampled"] = _completion(server, prompt, temperature=0.7,
                                        extra_body={"top_k": 20})
    greedy_text = out["greedy"]["text"]
    out["stop_word"] = greedy_text[len(greedy_text) // 2:][:3]
    out["stop"] = _completion(server, prompt, stop=[out["stop_word"]])
    out["penalties"] = _completion(server, prompt, presence_penalty=0.6, frequency_penalty=0.4,
                                   extra_body={"repetition_penalty": 1.3})
    out["bias_token"] = out["greedy"]["token_ids"][0] + 1
    out["logit_bias"] = _completion(server, prompt, logit_bias={str(out["bias_token"]): 100})
    out["allowed"] = sorted(set(prompt[:5]))
    out["allowed_token_ids"] = _completion(
        server, prompt, extra_body={"allowed_token_ids": out["allowed"]})
    out["ignore_eos"] = _completion(server, prompt, max_tokens=40,
                                    extra_body={"ignore_eos": True})
    out["choice"] = _completion(server, prompt, extra_body={"structured_outputs":
                                                            {"choice": CHOICES}})
    out["regex"] = _completion(server, prompt, extra_body={"structured_outputs":
                                                           {"regex": REGEX}})
    out["json"] = _completion(server, prompt, max_tokens=24, extra_body={
        "structured_outputs": {"json": SCHEMA}})
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 42}
    out["seeded"] = _completion(server, prompt, **seeded)
    out["seeded_again"] = _completion(server, prompt, **seeded)
    try:
        _completion(server, prompts["too_long"])
        out["too_long"] = None
    except BadRequestError as error:
        out["too_long"] = (error.status_code, error.message)
    out["prefix_first"] = _completion(server, prompts["long"])
    hits = _prefix_hits(server)
    out["prefix_hit"] = _completion(server, prompts["hit"])
    out["prefix_hit_tokens"] = _prefix_hits(server) - hits
    loaded = requests.post(f"{server.url}/v1/load_lora_adapter", timeout=120, json={
        "lora_name": "a", "lora_path": str(adapters["lora-a"])})
    out["lora_load"] = loaded.status_code
    out["lora"] = _completion(server, prompt, model="a", extra_body={"ignore_eos": True})
    return out


def _ngram_requests(server: Server, prompts: dict[str, list[int]],
                    adapters: dict[str, Path]) -> dict:
    """Greedy on a prompt that repeats itself (drafts get proposed), and host rows (a
    grammar, logprobs) that take no drafts beside it."""
    repeated = prompts["repeated"]
    return {
        "greedy": _completion(server, repeated, max_tokens=24),
        "choice": _completion(server, repeated, extra_body={"structured_outputs":
                                                            {"choice": CHOICES}}),
        "json": _completion(server, repeated, max_tokens=24, extra_body={
            "structured_outputs": {"json": SCHEMA}}),
        "logprobs": _completion(server, repeated, logprobs=5, extra_body=BY_ID),
    }


EXERCISES: dict[str, Callable[[Server, dict[str, list[int]], dict[str, Path]], dict]] = {
    "serving": _serving_requests, "ngram": _ngram_requests}


# -- what makes an answer right --------------------------------------------------------
def _check_serving(answers: dict, prompts: dict[str, list[int]], oracle: GreedyOracle,
                   peft: PeftOracle) -> None:
    prompt = prompts["prompt"]
    expected = oracle.generate(prompt, TOKENS)
    assert answers["greedy"]["token_ids"] == expected
    assert answers["stream"] == answers["greedy"]["text"]
    assert answers["chat"]
    assert answers["logprobs"]["token_ids"] == expected
    for token, (own, top) in zip(expected, answers["logprobs"]["logprobs"], strict=True):
        assert len(top) == 5 and max(top, key=lambda item: item[1]) == (f"token_id:{token}",
                                                                         own)
    stop = answers["stop"]
    assert stop["finish_reason"] == "stop"
    assert stop["text"] == answers["greedy"]["text"].split(answers["stop_word"])[0]
    assert answers["penalties"]["token_ids"] != expected  # the penalties took effect
    assert set(answers["logit_bias"]["token_ids"]) == {answers["bias_token"]}
    assert set(answers["allowed_token_ids"]["token_ids"]) <= set(answers["allowed"])
    assert len(answers["ignore_eos"]["token_ids"]) == 40
    assert answers["ignore_eos"]["finish_reason"] == "length"
    assert answers["choice"]["text"] in CHOICES
    assert re.fullmatch(REGEX, answers["regex"]["text"]), answers["regex"]
    assert json.loads(answers["json"]["text"])["kind"] in ("prefill", "decode")
    assert answers["seeded"]["token_ids"] == answers["seeded_again"]["token_ids"]
    assert answers["seeded"]["token_ids"] != expected
    assert len(answers["device_sampled"]["token_ids"]) == TOKENS
    status, message = answers["too_long"]
    assert status == 400 and "largest context-encoding bucket holds 256" in message
    assert answers["prefix_first"]["token_ids"] == oracle.generate(prompts["long"], TOKENS)
    assert answers["prefix_hit"]["token_ids"] == oracle.generate(prompts["hit"], TOKENS)
    assert answers["prefix_hit_tokens"] >= 128
    assert answers["lora_load"] == 200
    assert answers["lora"]["token_ids"] == peft.generate(prompt, TOKENS, "lora-a")


def _check_ngram(answers: dict, prompts: dict[str, list[int]], oracle: GreedyOracle,
                 peft: PeftOracle) -> None:
    expected = oracle.generate(prompts["repeated"], 24)
    assert answers["greedy"]["token_ids"] == expected
    assert answers["choice"]["text"] in CHOICES
    assert json.loads(answers["json"]["text"])["kind"] in ("prefill", "decode")
    assert answers["logprobs"]["token_ids"] == expected[:TOKENS]


CHECKS = {"serving": _check_serving, "ngram": _check_ngram}


def _same(a: Any, b: Any) -> bool:
    """Equal, log-probabilities within 1e-4 (two torch releases' float kernels)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
