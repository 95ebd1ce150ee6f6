"""A fleet on loopback: two `vllm serve --device neuron` processes ("hosts") sharing an S3
compile cache (a real S3 API server, moto's, on 127.0.0.1) behind vLLM's router
(`vllm-router`, round-robin), as the Kubernetes recipe in configs/kubernetes/ deploys
them. The host with the fleet's signing key compiles and publishes; the other, which only
trusts that key, loads. The router spreads a bounded load over both; killing one host
mid-load leaves the other serving, and every request either completes with the right
tokens or gets an error, counted: none hangs. Both hosts' telemetry is scraped."""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.scrape import neuron_samples, total, wait_for, wait_for_hosts
from tests.e2e.support import LoopbackProcess, Server, corpus_token_ids, free_port

pytestmark = pytest.mark.server

ARGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--additional-config",
        '{"override_neuron_config": {"context_encoding_buckets": [32, 64, 128, 256]}}']
REQUEST_TIMEOUT_S = 60
POLICY = "round_robin"  # see docs/operations/fleets.md for the choice


class Router(LoopbackProcess):
    """`vllm-router` (the vLLM project's router) on loopback in front of `workers`."""

    name = "vllm-router"

    def __init__(self, workers: list[str], log_path: Path):
        port = free_port()
        super().__init__(
            [str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1",
             "--port", str(port), "--worker-urls", *workers, "--policy", POLICY,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
             "--request-timeout-secs", str(REQUEST_TIMEOUT_S)], port, log_path)


def _host_env(home: Path, s3_endpoint: str, cache_url: str, key: Path,
              signs: bool) -> dict[str, str]:
    """A host's environment: the shared S3 cache with throwaway credentials, its own
    read cache and user key (XDG folders), and the fleet's trust settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "VLLM_NEURON_CACHE_"))}
    env.update(AWS_ENDPOINT_URL_S3=s3_endpoint, AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE=str(home / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(home / "no-aws-credentials"),
               NO_PROXY="127.0.0.1,localhost", XDG_CACHE_HOME=str(home / "cache"),
               XDG_CONFIG_HOME=str(home / "config"), VLLM_NEURON_CACHE_URL=cache_url,
               VLLM_NEURON_CACHE_TRUSTED_KEYS=f"{key}.pub")
    if signs:
        env["VLLM_NEURON_CACHE_SIGNING_KEY"] = str(key)
    return env


def _wait_for_line(server: Server, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, server.log())):
        assert server.proc.poll() is None, server.log()[-4000:]
        assert time.monotonic() < deadline, server.log()[-4000:]
        time.sleep(1)
    return found


@pytest.fixture(scope="module")
def fleet(model_dirs, s3_endpoint, fleet_key, tmp_path_factory):
    """(router, compile host, serving host, S3 bucket, cache key)."""
    import boto3

    bucket = f"fleet-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                 aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    root = tmp_path_factory.mktemp("fleet")
    hosts: list[Server] = []
    router = None
    try:
        for name, signs in (("host-a", True), ("host-b", False)):
            env = _host_env(root / name, s3_endpoint, f"s3://{bucket}/neuron", fleet_key, signs)
            hosts.append(Server(model_dirs["llama"], root / f"{name}.log", ARGS, env=env))
            if signs:  # the second host starts once the first has published
                key = _wait_for_line(hosts[0], r"compiled and published \d+ graphs under "
                                               r"key (\w+)", timeout=480).group(1)
        for host in hosts:
            host.wait_healthy(timeout=480)
        router = Router([h.url for h in hosts], root / "router.log")
        router.wait_healthy()
        yield router, hosts[0], hosts[1], bucket, key
    finally:
        if router is not None:
            router.stop()
        for host in hosts:
            host.stop()


def _s3_keys(s3_endpoint: str, bucket: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _prompts(model_dirs, count: int, offset: int) -> list[list[int]]:
    return [corpus_token_ids(model_dirs["llama"], 8 + (7 * i) % 90, offset=offset + 13 * i)
            for i in range(count)]


def _send(router: Router, model: Path, prompts: list[list[int]], max_tokens: int,
          during=None) -> list[tuple[list[int], str, list[int] | None]]:
    """Send every prompt through the router, 4 at a time; `during(done)` runs after each
    completed request. Each outcome is (prompt, "ok" | "error: ..." | "timeout", tokens):
    a request that neither completes nor fails within REQUEST_TIMEOUT_S is a timeout."""
    import requests

    def one(prompt: list[int]) -> tuple[list[int], str, list[int] | None]:
        try:
            reply = requests.post(f"{router.url}/v1/completions", json={
                "model": str(model), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                timeout=REQUEST_TIMEOUT_S + 15)
        except requests.Timeout:
            return prompt, "timeout", None
        except requests.ConnectionError as exc:
            return prompt, f"error: {exc}", None
        if reply.status_code != 200:
            return prompt, f"error: HTTP {reply.status_code} {reply.text[:200]}", None
        return prompt, "ok", reply.json()["choices"][0]["token_ids"]

    outcomes = []
    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(one, p) for p in prompts]:
            outcomes.append(future.result())
            if during is not None:
                during(len(outcomes))
    return outcomes


def test_the_first_host_compiles_and_the_second_loads_from_s3(fleet, s3_endpoint):
    _, compile_host, serving_host, bucket, key = fleet
    assert "compile cache: published" in compile_host.log()
    serving = serving_host.log()
    assert f"compile cache hit: key {key}" in serving, serving[-4000:]
    assert "compiling" not in serving
    assert f"entries/{key}.json" in [k.removeprefix("neuron/")
                                     for k in _s3_keys(s3_endpoint, bucket)]


def test_the_router_spreads_the_load_and_both_hosts_report_it(fleet, model_dirs, oracles):
    router, *hosts, _, _ = fleet
    before = [total(neuron_samples(h.url), "neuron:bucket_calls_total",
                    phase="context_encoding") for h in hosts]
    prompts = _prompts(model_dirs, 8, offset=0)
    outcomes = _send(router, model_dirs["llama"], prompts, max_tokens=4)
    assert [status for _, status, _ in outcomes] == ["ok"] * len(prompts), outcomes
    for prompt, _, tokens in outcomes:
        assert tokens == oracles("llama").generate(prompt, 4)

    def served_since(scrapes: list) -> list[float]:
        return [total(s, "neuron:bucket_calls_total", phase="context_encoding") - b
                for s, b in zip(scrapes, before)]

    served = served_since(wait_for_hosts([h.url for h in hosts],
                                         lambda s: sum(served_since(s)) >= len(prompts)))
    assert all(n >= 1 for n in served), served
    assert sum(served) == len(prompts)


def test_killing_a_host_mid_load_leaves_the_other_serving(fleet, model_dirs, oracles):
    router, survivor, victim, _, _ = fleet
    before = total(neuron_samples(survivor.url), "neuron:bucket_calls_total",
                   phase="context_encoding")

    def kill_after_three(done: int) -> None:
        if done == 3:
            victim.proc.kill()  # SIGKILL: the host vanishes mid-load

    prompts = _prompts(model_dirs, 16, offset=500)
    outcomes = _send(router, model_dirs["llama"], prompts, max_tokens=24,
                     during=kill_after_three)
    assert victim.proc.poll() is not None
    counts = {s: sum(1 for _, status, _ in outcomes if status.startswith(s))
              for s in ("ok", "error", "timeout")}
    assert counts["timeout"] == 0, outcomes
    assert counts["ok"] + counts["error"] == len(prompts), outcomes
    assert counts["ok"] >= 3, outcomes
    for prompt, status, tokens in outcomes:
        if status == "ok":
            assert tokens == oracles("llama").generate(prompt, 24)

    after = _send(router, model_dirs["llama"], _prompts(model_dirs, 6, offset=900),
                  max_tokens=4)
    assert [status for _, status, _ in after] == ["ok"] * 6, after
    served = total(wait_for(survivor.url, lambda s: total(
        s, "neuron:bucket_calls_total", phase="context_encoding") - before >= 6),
        "neuron:bucket_calls_total", phase="context_encoding") - before
    assert served >= 6, served  # at least everything sent after the kill
