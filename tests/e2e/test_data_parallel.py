"""`vllm serve --device neuron --data-parallel-size 2` on one host, as on an inf2 with
NeuronCores to spare: vLLM's own data parallelism (two engines, and by default two API
servers, which switches Prometheus to multiprocess mode), each engine on its own slice
of the cores the user made visible, with its backend in a runner process in the second
environment (which inherits the slice), one compile shared through the compile cache's
lock, greedy tokens equal to transformers from both ranks, and per-engine metrics that
add up, the same from every API server."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.scrape import neuron_samples, total, wait_for
from tests.e2e.support import Server, corpus_token_ids

pytestmark = pytest.mark.server

# A range and a list, as the runtime reads them (vLLM itself reads only lists); one core
# left over.
VISIBLE = "5-6,9"
CTE = [32, 64, 128, 256]
# Prompt lengths pinned to each rank (vLLM's X-data-parallel-rank header).
PROMPTS = {0: [10, 40], 1: [20, 100, 120]}
MAX_TOKENS = 6


def _bucket(n: int) -> str:
    return str(next(b for b in CTE if b >= n))


@pytest.fixture(scope="module")
def dp_server(model_dirs, sdk_python, tmp_path_factory):
    import os

    env = dict(os.environ, NEURON_RT_VISIBLE_CORES=VISIBLE)
    server = Server(model_dirs["llama"], tmp_path_factory.mktemp("dp") / "serve.log",
                    ["--data-parallel-size", "2", "--max-model-len", "256",
                     "--max-num-seqs", "4", "--additional-config",
                     json.dumps({"override_neuron_config": {"context_encoding_buckets": CTE},
                                 "backend_python": sdk_python})], env=env)
    try:
        server.wait_healthy(timeout=480)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def replies(dp_server, model_dirs):
    """(rank, prompt, token ids) of every request, sent concurrently, each to its rank."""
    import requests

    def complete(rank: int, prompt: list[int]) -> tuple[int, list[int], list[int]]:
        reply = requests.post(f"{dp_server.url}/v1/completions", headers={
            "X-data-parallel-rank": str(rank)}, json={
            "model": str(model_dirs["llama"]), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}, timeout=120)
        assert reply.status_code == 200, reply.text
        return rank, prompt, reply.json()["choices"][0]["token_ids"]

    work = [(rank, corpus_token_ids(model_dirs["llama"], n, offset=7 * n))
            for rank, lengths in PROMPTS.items() for n in lengths]
    with ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(lambda item: complete(*item), work))


def test_each_engine_gets_its_own_slice_of_the_visible_cores(dp_server):
    """Engine r takes visible core r (TP 1); its backend runner, the process that would
    open the Neuron runtime, inherited exactly that slice."""
    log = dp_server.log()
    assigned = {int(pid): (int(engine), cores) for pid, engine, cores in re.findall(
        r"pid=(\d+)\) .*engine (\d+) \(data-parallel rank \d on this host\): "
        r"NEURON_RT_VISIBLE_CORES=(\S+)", log)}
    assert sorted(assigned.values()) == [(0, "5"), (1, "6")], log[-4000:]
    runners = {int(pid): int(runner) for pid, runner in re.findall(
        r"pid=(\d+)\) .*backend runner pid (\d+)", log)}
    for worker, (engine, cores) in assigned.items():
        environ = open(f"/proc/{runners[worker]}/environ", "rb").read().split(b"\0")
        assert f"NEURON_RT_VISIBLE_CORES={cores}".encode() in environ, engine


def test_the_ranks_share_one_compile(dp_server):
    log = dp_server.log()
    assert len(re.findall(r"compiled and published \d+ graphs", log)) == 1, log[-4000:]
    assert len(re.findall(r"compile cache hit: key", log)) == 1


def test_both_ranks_answer_with_transformers_greedy_tokens(replies, oracles):
    assert sorted({rank for rank, _, _ in replies}) == [0, 1]
    for rank, prompt, tokens in replies:
        assert tokens == oracles("llama").generate(prompt, MAX_TOKENS), (rank, len(prompt))


def test_metrics_are_per_engine_and_add_up_on_every_api_server(dp_server, replies,
                                                              model_dirs):
    sent = sum(len(lengths) for lengths in PROMPTS.values())
    samples = wait_for(dp_server.url, lambda s: total(
        s, "neuron:real_tokens_total", phase="token_generation") >= sent * (MAX_TOKENS - 1))
    for rank, lengths in PROMPTS.items():
        engine = {"engine": str(rank), "phase": "context_encoding"}
        for bucket in {_bucket(n) for n in lengths}:
            mine = [n for n in lengths if _bucket(n) == bucket]
            assert total(samples, "neuron:bucket_calls_total", bucket=bucket,
                         **engine) == len(mine), (rank, bucket)
            assert total(samples, "neuron:real_tokens_total", bucket=bucket,
                         **engine) == sum(mine)
            assert total(samples, "neuron:padded_tokens_total", bucket=bucket,
                         **engine) == sum(int(bucket) - n for n in mine)
        assert total(samples, "neuron:real_tokens_total", engine=str(rank),
                     phase="token_generation") == len(lengths) * (MAX_TOKENS - 1)
        assert total(samples, "neuron:step_host_seconds_count", engine=str(rank)) > 0
    assert total(samples, "neuron:bucket_calls_total", phase="context_encoding") == sent
    assert {dict(labels)["model_name"] for _, labels in samples} == {str(model_dirs["llama"])}
    # Two API servers share the port: a scrape lands on either, and both show every
    # engine's counters once (prometheus_client's multiprocess files, not one process's
    # registry).
    for _ in range(6):
        assert neuron_samples(dp_server.url) == samples
