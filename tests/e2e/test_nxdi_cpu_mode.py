"""The nxd backend on real NxD Inference, in NxDI's own CPU mode, through the runner:
`VLLM_NEURON_BACKEND=nxd vllm serve --device neuron` with `"on_cpu": true` gives
transformers' greedy tokens in both KV layouts, a prefix-cache hit in a (128, 128)
context-encoding graph included (NxDI's unmasked prefix prefill, patched).

NxD Inference is not on the package index: these tests need an interpreter where it
imports (NEURON_TEST_NXDI_PYTHON, e.g. a Neuron SDK venv, or one built by hand as
../shared/nxdi-cpu/README.md describes, with this plugin importable there) and skip
otherwise."""

from __future__ import annotations

import os
import subprocess

import pytest
from tests.e2e.support import Server, corpus_token_ids

pytestmark = [pytest.mark.server, pytest.mark.nxdi]

NXDI_PYTHON_ENV = "NEURON_TEST_NXDI_PYTHON"
NEW_TOKENS = 12
OVERRIDE = ('"on_cpu": true, "context_encoding_buckets": [32, 64, 128, 256], '
            '"token_generation_buckets": [64, 128, 256]')


@pytest.fixture(scope="module")
def nxdi_python() -> str:
    python = os.environ.get(NXDI_PYTHON_ENV)
    if not python:
        pytest.skip(f"{NXDI_PYTHON_ENV} is not set: no interpreter with NxD Inference")
    probe = subprocess.run(
        [python, "-c", "import neuronx_distributed_inference.models.model_base, "
                       "neuron_plugin.backends.nxd.backend"],
        capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"NxD Inference or the plugin does not import under {python}: {last}")
    return python


@pytest.fixture(scope="module", params=["contiguous", "block"])
def server(request, nxdi_python, model_dirs, tmp_path_factory):
    block = request.param == "block"
    env = {**os.environ, "VLLM_NEURON_BACKEND": "nxd",
           "VLLM_NEURON_BACKEND_PYTHON": nxdi_python}
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--additional-config",
            f'{{"override_neuron_config": {{{OVERRIDE}}}}}',
            *(["--enable-prefix-caching", "--block-size", "32"] if block else [])]
    model = model_dirs["llama"]
    process = Server(model,
                     tmp_path_factory.mktemp("nxdi-cpu") / "serve.log", args, env=env)
    try:
        process.wait_healthy(timeout=600)
        yield block, str(model), process
    finally:
        process.stop()


def _complete(server: Server, model: str, prompt: list[int]) -> list[int]:
    import requests

    reply = requests.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}).json()
    return reply["choices"][0]["token_ids"]


def test_real_nxdi_greedy_tokens_equal_transformers(server, model_dirs, oracles):
    block, model, process = server
    prompts = [corpus_token_ids(model_dirs["llama"], n, offset=5 * n) for n in (1, 9, 40, 100)]
    for prompt in prompts:
        assert _complete(process, model, prompt) == oracles("llama").generate(prompt, NEW_TOKENS)
    if block:
        # 96 cached tokens and 100 new ones run NxDI's (128, 128) graph, whose active part
        # re-encodes 68 cached positions: right only with the prefix-prefill-mask patch.
        prompt = corpus_token_ids(model_dirs["llama"], 196, offset=3)
        _complete(process, model, prompt[:96] + prompt[96:97])
        assert _complete(process, model, prompt) == oracles("llama").generate(prompt, NEW_TOKENS)
        assert "NxDI patch prefix-prefill-mask: applied" in process.log()
