"""Prompt logprobs through the plugin's server equal plain vLLM's on the same checkpoint,
and lm-evaluation-harness scores the same per sample through both.

One `vllm serve --device neuron` (prompt-logprob graphs on, prefix caching on, chunked
prefill at 64 tokens a step, so a long prompt is scored in chunks) and one plain
`vllm serve` on vLLM's own CPU platform, both shared by every test here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

pytestmark = [pytest.mark.server]

TASKS = Path(__file__).parent / "lm_eval_tasks"
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default, left as it is on both servers
COMMON = ["--max-model-len", "256", "--max-num-seqs", "4", "--seed", "0"]


@pytest.fixture(scope="module")
def servers(model_dirs, tmp_path_factory):
    """(plugin server, plain vLLM server) on tiny-llama, started together."""
    from tests.e2e.support import PlainVllmServer, Server

    logs = tmp_path_factory.mktemp("prompt-logprobs")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_NEURON_BACKEND"}
    config = {
        "prompt_logprobs": True,
        "override_neuron_config": {"context_encoding_buckets": [32, 64]},
    }
    plugin = Server(model_dirs["llama"], logs / "plugin.log",
                    [*COMMON, "--enable-prefix-caching", "--enable-chunked-prefill",
                     "--max-num-batched-tokens", "64",
                     "--additional-config", json.dumps(config)], env=env)
    plain = PlainVllmServer(model_dirs["llama"], logs / "plain.log",
                            [*COMMON, "--kv-cache-memory-bytes", str(64 << 20)])
    try:
        plugin.wait_healthy()
        plain.wait_healthy()
        yield plugin, plain
    finally:
        plugin.stop()
        plain.stop()


def _complete(server, model: Path, **body) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions",
                         json={"model": str(model), **body}, timeout=120)


def _prompt_logprobs(server, model: Path, prompt: list[int], k: int) -> list[dict | None]:
    response = _complete(server, model, prompt=prompt, max_tokens=1, temperature=0.0,
                         prompt_logprobs=k)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["prompt_logprobs"]


def test_prompt_logprobs_equal_plain_vllm_and_transformers(servers, model_dirs, oracles):
    """Every position's top-k ids, ranks and logprobs as plain vLLM gives them, and the
    prompt tokens' logprobs as transformers' log-softmax: short prompts, and one of 150
    tokens that the plugin scores in three chunks, asked after the same prompt was
    served without prompt logprobs (its blocks in the prefix cache, which vLLM does not
    read for a request that scores its prompt)."""
    import torch

    from tests.e2e.support import corpus_token_ids

    plugin, plain = servers
    model = model_dirs["llama"]
    prompts = [corpus_token_ids(model, n, offset) for n, offset in ((2, 0), (17, 5), (150, 40))]
    warm = _complete(plugin, model, prompt=prompts[2], max_tokens=1, temperature=0.0)
    assert warm.status_code == 200, warm.text
    oracle = oracles("llama")
    for prompt in prompts:
        ours = _prompt_logprobs(plugin, model, prompt, 5)
        theirs = _prompt_logprobs(plain, model, prompt, 5)
        assert len(ours) == len(theirs) == len(prompt)
        assert ours[0] is None and theirs[0] is None
        with torch.no_grad():
            reference = oracle.model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        for position, (mine, vllm) in enumerate(zip(ours[1:], theirs[1:], strict=True)):
            assert mine.keys() == vllm.keys(), position
            for token, entry in mine.items():
                assert entry["rank"] == vllm[token]["rank"], (position, token)
                assert math.isclose(entry["logprob"], vllm[token]["logprob"], abs_tol=1e-4)
            target = str(prompt[position + 1])
            expected = float(reference[position, prompt[position + 1]])
            assert math.isclose(mine[target]["logprob"], expected, abs_tol=1e-4), position


def test_prompt_logprobs_above_max_logprobs_get_vllms_400(servers, model_dirs):
    """vLLM's own refusal, word for word, and the server keeps serving."""
    plugin, plain = servers
    model = model_dirs["llama"]
    answers = [
        _complete(s, model, prompt="hello", max_tokens=1, prompt_logprobs=MAX_LOGPROBS + 1)
        for s in (plugin, plain)
    ]
    assert [a.status_code for a in answers] == [400, 400]
    messages = [a.json()["error"]["message"] for a in answers]
    assert messages[0] == messages[1]
    assert f"greater than max allowed: {MAX_LOGPROBS}" in messages[0]
    assert len(_prompt_logprobs(plugin, model, [5, 6, 7], MAX_LOGPROBS)) == 3


def _lm_eval(server, model: Path, out: Path) -> dict[str, list[dict]]:
    """lm_eval's local-completions on the three local tasks: its logged samples per task,
    in document order."""
    args = ",".join([f"model={model}", f"base_url={server.url}/v1/completions",
                     f"tokenizer={model}", "tokenizer_backend=huggingface",
                     "max_length=128", "max_retries=1", "num_concurrent=1"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
         "--tasks", "tiny_choice,tiny_rolling,tiny_generate", "--include_path", str(TASKS),
         "--log_samples", "--output_path", str(out), "--batch_size", "1"],
        cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples: dict[str, list[dict]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda row: row["doc_id"])
    return samples


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _close(a, b) -> bool:
    """lm-eval's logged responses (generated text, loglikelihoods and is-greedy flags,
    which it logs as strings, nested in lists) equal, numbers within float tolerance."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    x, y = _number(a), _number(b)
    if x is not None and y is not None and not isinstance(a, bool):
        return math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-4)
    return a == b


def test_lm_eval_scores_each_sample_as_through_plain_vllm(servers, model_dirs, tmp_path):
    """A multiple-choice task and a rolling-perplexity one (both echo + logprobs) and a
    generate_until one, as lm-eval users run them: the same per-sample answers."""
    plugin, plain = servers
    model = model_dirs["llama"]
    ours = _lm_eval(plugin, model, tmp_path / "plugin")
    theirs = _lm_eval(plain, model, tmp_path / "plain")
    assert sorted(ours) == sorted(theirs) == ["tiny_choice", "tiny_generate", "tiny_rolling"]
    for task, rows in ours.items():
        assert len(rows) == len(theirs[task]) > 0, task
        for mine, vllm in zip(rows, theirs[task], strict=True):
            assert mine["doc_id"] == vllm["doc_id"]
            assert _close(mine["resps"], vllm["resps"]), (task, mine["resps"], vllm["resps"])
            assert _close(mine["filtered_resps"], vllm["filtered_resps"]), task
