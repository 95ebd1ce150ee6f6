"""The nxd backend on real NxD Inference, in NxDI's own CPU mode, through the runner:
`VLLM_NEURON_BACKEND=nxd vllm serve --device neuron` with `"on_cpu": true` gives
transformers' greedy tokens in both KV layouts, a prefix-cache hit in a (128, 128)
context-encoding graph included (NxDI's unmasked prefix prefill, patched), with a
logprobs request (sampled on the host) decoding beside device-sampled ones, and
transformers' prompt logprobs (the server compiles the prompt-logprob graphs). The backend
driven directly (nxdi_logits_probe.py): a decode step whose rows are all sampled on the
device gets no logits from NxDI's graphs, a step with a host-sampled row gets them from
the logits graph and hands that row's alone across the seam, and both graphs sample the
same tokens.

NxD Inference is not on the package index: these tests need an interpreter where it
imports (NEURON_TEST_NXDI_PYTHON, e.g. a Neuron SDK venv, or one built by hand as
../shared/nxdi-cpu/README.md describes, with this plugin importable there) and skip
otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.e2e.support import Server, corpus_token_ids

pytestmark = [pytest.mark.server, pytest.mark.nxdi]

NEW_TOKENS = 12
OVERRIDE = ('"on_cpu": true, "context_encoding_buckets": [32, 64, 128, 256], '
            '"token_generation_buckets": [64, 128, 256]')


@pytest.fixture(scope="module", params=["contiguous", "block"])
def server(request, nxdi_python, model_dirs, tmp_path_factory):
    block = request.param == "block"
    env = {**os.environ, "VLLM_NEURON_BACKEND": "nxd",
           "VLLM_NEURON_BACKEND_PYTHON": nxdi_python}
    args = ["--max-model-len", "256", "--max-num-seqs", "4", "--additional-config",
            f'{{"prompt_logprobs": true, "override_neuron_config": {{{OVERRIDE}}}}}',
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


def test_real_nxdi_logprobs_request_beside_device_sampled_ones(server, model_dirs, oracles):
    """Three greedy requests on the device and one with logprobs (sampled on the host from
    the logits graph's row) decode together: every one gives transformers' tokens."""
    import requests

    _, model, process = server
    prompts = [corpus_token_ids(model_dirs["llama"], n, offset=7 * n) for n in (6, 11, 23, 30)]

    def complete(index: int) -> list[int]:
        extra = {"logprobs": 1} if index == 3 else {}
        reply = requests.post(f"{process.url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompts[index], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **extra}).json()
        choice = reply["choices"][0]
        assert (choice["logprobs"] is not None) == (index == 3)
        return choice["token_ids"]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(complete, range(4)))
    assert got == [oracles("llama").generate(p, NEW_TOKENS) for p in prompts]


def test_real_nxdi_prompt_logprobs_through_vllm(server, model_dirs, oracles):
    """prompt_logprobs through `vllm serve` on real NxDI (the prompt-logprob submodel,
    backends/nxd/prompt_graphs.py): each position's top 5 and the prompt token's
    logprob as transformers' log-softmax gives them; one above --max-logprobs (vLLM's
    default 20) gets vLLM's own 400 and the server keeps serving."""
    import math

    import requests
    import torch

    _, model, process = server
    prompt = corpus_token_ids(model_dirs["llama"], 70, offset=13)

    def ask(k: int) -> requests.Response:
        return requests.post(f"{process.url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": k})

    too_many = ask(21)
    assert too_many.status_code == 400
    assert "greater than max allowed: 20" in too_many.json()["error"]["message"]
    reply = ask(5)
    assert reply.status_code == 200, reply.text
    scored = reply.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    with torch.no_grad():
        want = oracles("llama").model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for position, entries in enumerate(scored[1:]):
        top = want[position].topk(5)
        ranked = {e["rank"]: int(t) for t, e in entries.items() if e["rank"] <= 5}
        assert [ranked[r] for r in range(1, 6)] == top.indices.tolist(), position
        target = prompt[position + 1]
        assert math.isclose(entries[str(target)]["logprob"], float(want[position, target]),
                            abs_tol=1e-4), position


# -- the backend on real NxDI, the logits each call returns ---------------------------------
PROBE = Path(__file__).with_name("nxdi_logits_probe.py")
STEPS = 6


def _probe(python: str, settings, model: Path, host_row: bool) -> dict:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [python, str(PROBE), json.dumps(settings.to_dict()), str(model),
         "1" if host_row else "0", str(STEPS)],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["contiguous", "block", "batch-bucketing"])
def test_real_nxdi_graphs_return_logits_only_for_steps_with_host_rows(
        nxdi_python, model_dirs, oracles, layout):
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    block = layout == "block"
    limits = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=32 if block else None,
                          enable_prefix_caching=block, enable_chunked_prefill=False,
                          max_num_batched_tokens=256, dtype="float32", tp_degree=1)
    override = {"on_cpu": True, "context_encoding_buckets": [32, 64, 128, 256],
                "token_generation_buckets": [64, 128, 256],
                # a fixed draw, so that two runs sample the same tokens
                "on_device_sampling_config": {"deterministic": True}}
    if layout == "batch-bucketing":
        override["token_generation_batches"] = [1, 2, 4]
    settings = resolve_settings(limits, override, backend="nxd",
                                architecture="LlamaForCausalLM")
    model = model_dirs["llama"]
    device = _probe(nxdi_python, settings, model, host_row=False)
    mixed = _probe(nxdi_python, settings, model, host_row=True)
    row = 4 * device["vocab_size"]  # float32
    for run in (device, mixed):
        for call in run["prefill"]:  # a prefill's graph returns its one row
            assert call == {"tag": "context_encoding_model", "tokens_bytes": 4,
                            "logits_bytes": row, "seam_logits_bytes": 0}
    assert device["decode"] == [{"tag": "token_generation_model", "tokens_bytes": 4 * 4,
                                 "logits_bytes": 0, "seam_logits_bytes": 0}] * STEPS
    assert mixed["decode"] == [{"tag": "token_generation_logits_model", "tokens_bytes": 4 * 4,
                                "logits_bytes": 4 * row, "seam_logits_bytes": row}] * STEPS
    # the tokens-only and the logits graphs sample alike; the greedy rows are transformers'
    assert mixed["tokens"] == device["tokens"]
    for seq in (0, 3):
        prompt = device["prompts"][seq]
        assert device["tokens"][seq] == oracles("llama").generate(prompt, STEPS + 1)


# -- KV blocks out of and into real NxDI (prefill/decode disaggregation) ---------------------
KV_PROBE = Path(__file__).with_name("nxdi_kv_probe.py")


def test_real_nxdi_kv_blocks_move_to_another_backend_and_decode_there(nxdi_python, model_dirs,
                                                                       oracles):
    """NxDI's own block KV cache (its CPU mode, the prefix-caching layout): a prompt's
    blocks read from one backend and written into other blocks of a second decode there
    to transformers' tokens, as on the backend that computed them."""
    from neuron_plugin.core.settings import EngineLimits, resolve_settings

    limits = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=32,
                          enable_prefix_caching=True, enable_chunked_prefill=False,
                          max_num_batched_tokens=256, dtype="float32", tp_degree=1)
    settings = resolve_settings(limits, {"on_cpu": True,
                                         "context_encoding_buckets": [32, 64, 128, 256],
                                         "token_generation_buckets": [64, 128, 256]},
                                backend="nxd", architecture="LlamaForCausalLM")
    model = model_dirs["llama"]
    prompt = corpus_token_ids(model, 45, offset=321)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "NXD_CPU_MODE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [nxdi_python, str(KV_PROBE), json.dumps(settings.to_dict()), str(model),
         json.dumps(prompt), str(NEW_TOKENS - 1)],
        capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # NxDI's prefix-caching cache: pa_num_blocks + 1 blocks, the block dimension tiled
    # (8 blocks a sequence < 128), 2 KV heads of 64 (block_kv_cache_manager.py)
    assert report["state_shape"] == [settings.num_blocks + 1, 16, 2, 2, 64]
    geometry = report["geometry"]
    # how the values were computed, bound into every payload: the NxDI patches that
    # change the math (the prefix-cache hit's masked prefill among them)
    computation = geometry.pop("computation")
    assert computation.startswith("nxd, patches: ") and "prefix-prefill-mask" in computation
    assert geometry == {"layers": 2, "block_size": 32, "kv_heads": 2, "head_dim": 64,
                        "dtype": "float32"}
    assert report["kv_shape"] == [2, 2, 2, 32, 2, 64]
    assert report["round_trip_equal"] and report["nonzero"]
    expected = oracles("llama").generate(prompt, NEW_TOKENS)
    assert report["prefill_tokens"] == expected
    assert report["moved_tokens"] == expected
