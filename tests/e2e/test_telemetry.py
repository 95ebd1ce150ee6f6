"""Per-bucket telemetry through a real engine: the Prometheus text exposes bucket
metrics whose counts match the requests sent, and the request trace is what
`neuron-buckets tune` reads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.support import corpus_token_ids, make_llm, shutdown_llm

pytestmark = pytest.mark.engine

CTE = [32, 64, 128, 256]
LENGTHS = [10, 32, 33, 50, 64, 65, 100, 200]
MAX_TOKENS = 6
LONE_TOKENS = 3


def _bucket(n: int) -> int:
    return next(b for b in CTE if b >= n)


def _metrics() -> dict[tuple[str, str, str], float]:
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name.startswith("neuron:"):
                key = (sample.name, sample.labels.get("phase", ""),
                       sample.labels.get("bucket", ""))
                if "le" not in sample.labels:
                    values[key] = sample.value
    return values


@pytest.fixture(scope="module")
def traced_run(model_dirs, tmp_path_factory):
    import os

    trace = tmp_path_factory.mktemp("trace") / "requests.jsonl"
    os.environ["VLLM_NEURON_TRACE"] = str(trace)
    try:
        llm = make_llm(model_dirs["llama"], additional_config={"override_neuron_config": {
            "context_encoding_buckets": CTE, "token_generation_buckets": [64, 128, 256]}})
    finally:
        del os.environ["VLLM_NEURON_TRACE"]
    from vllm import SamplingParams

    from neuron_plugin.serving.telemetry import register_collector

    register_collector(llm.llm_engine.vllm_config)
    prompts = [corpus_token_ids(model_dirs["llama"], n, offset=n) for n in LENGTHS]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    # A second, short request makes the engine run the step that tells the worker the
    # first batch finished (vLLM reports finished requests on the following step); it
    # decodes alone, in the one-row bucket of the default decode batch buckets.
    llm.generate({"prompt_token_ids": prompts[0]},
                 SamplingParams(temperature=0.0, max_tokens=LONE_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    yield trace, _wait_for_metrics()
    shutdown_llm(llm)


def _wait_for_metrics() -> dict:
    """The engine publishes its counters off the step path, every PUBLISH_INTERVAL_S:
    wait until every prompt and every decoded token has arrived (or 10 s), so that the
    tests below compare complete counts."""
    expected_calls = len(LENGTHS) + 1
    expected_decoded = len(LENGTHS) * (MAX_TOKENS - 1) + LONE_TOKENS - 1
    deadline = time.monotonic() + 10
    while True:
        values = _metrics()
        calls = sum(v for (name, phase, _), v in values.items()
                    if name == "neuron:bucket_calls_total" and phase == "context_encoding")
        decoded = sum(v for (name, phase, _), v in values.items()
                      if name == "neuron:real_tokens_total" and phase == "token_generation")
        done = calls >= expected_calls and decoded >= expected_decoded
        if done or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_context_encoding_metrics_match_the_prompts(traced_run):
    _, values = traced_run
    lengths = LENGTHS + [LENGTHS[0]]
    calls = Counter(_bucket(n) for n in lengths)
    for bucket in CTE:
        key = ("neuron:bucket_calls_total", "context_encoding", str(bucket))
        assert values.get(key, 0) == calls[bucket], (bucket, values.get(key))
        padded = sum(bucket - n for n in lengths if _bucket(n) == bucket)
        real = sum(n for n in lengths if _bucket(n) == bucket)
        assert values.get(("neuron:padded_tokens_total", "context_encoding", str(bucket)),
                          0) == padded
        assert values.get(("neuron:real_tokens_total", "context_encoding", str(bucket)),
                          0) == real
        assert values.get(("neuron:forward_seconds_count", "context_encoding", str(bucket)),
                          0) == calls[bucket]


def test_step_host_time_is_exported(traced_run):
    _, values = traced_run
    steps = values[("neuron:step_host_seconds_count", "", "")]
    calls = sum(v for (name, _, _), v in values.items() if name == "neuron:bucket_calls_total")
    # Every step with work calls the backend at least once; prefill steps call it once
    # per new prompt, so there are at least as many calls as steps.
    assert 0 < steps <= calls
    assert values[("neuron:step_host_seconds_sum", "", "")] > 0


def test_token_generation_metrics_are_consistent(traced_run):
    _, values = traced_run
    tkg = {k: v for k, v in values.items() if k[1] == "token_generation"}
    real = sum(v for (name, _, _), v in tkg.items() if name == "neuron:real_tokens_total")
    # the first token comes from prefill
    assert real == len(LENGTHS) * (MAX_TOKENS - 1) + LONE_TOKENS - 1
    for (name, phase, bucket), rows in tkg.items():
        if name != "neuron:bucket_rows_total":
            continue
        padded = tkg[("neuron:padded_tokens_total", phase, bucket)]
        real_here = tkg[("neuron:real_tokens_total", phase, bucket)]
        assert padded == rows - real_here  # one token per row in token generation
        batch = int(bucket.split("x")[0])
        assert rows == batch * tkg[("neuron:bucket_calls_total", phase, bucket)]


def test_decode_batch_buckets_by_default(traced_run):
    """max_num_seqs 4 and no token_generation_batches: decode batches of 1, 2 and 4 rows.
    The eight prompts decode four at a time, the last request alone, in one row."""
    _, values = traced_run
    rows = {bucket: v for (name, phase, bucket), v in values.items()
            if name == "neuron:bucket_rows_total" and phase == "token_generation"}
    assert {int(bucket.split("x")[0]) for bucket in rows} == {1, 4}
    alone = sum(v for bucket, v in rows.items() if bucket.startswith("1x"))
    assert alone == LONE_TOKENS - 1


def test_trace_records_each_request_and_feeds_the_tuner(traced_run, tmp_path):
    trace, _ = traced_run
    records = [json.loads(line) for line in Path(trace).read_text().splitlines()]
    first_batch = sorted(r["prompt_tokens"] for r in records[: len(LENGTHS)])
    assert first_batch == sorted(LENGTHS)
    assert all(r["output_tokens"] == MAX_TOKENS for r in records[: len(LENGTHS)])
    assert all(r["bucket"][0] == _bucket(r["prompt_tokens"]) for r in records)
    # each decoded four at a time (max_num_seqs 4): what --pair batch learns from
    assert [r["batch"] for r in records[: len(LENGTHS)]] == [4] * len(LENGTHS)
    tuned = subprocess.run(
        [str(Path(sys.executable).with_name("neuron-buckets")), "tune", str(trace),
         "--phase", "decode", "--pair", "batch", "--max-num-seqs", "4", "--max", "256",
         "--json"], capture_output=True, text=True, check=True)
    assert json.loads(tuned.stdout)["buckets"]["token_generation_batches"] == [4]

    out = tmp_path / "tuned.yaml"
    result = subprocess.run(
        [str(Path(sys.executable).with_name("neuron-buckets")), "tune", str(trace),
         "--max-buckets", "3", "--max", "256", "--json", "--output", str(out)],
        capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    assert report["workload"]["requests"] == len(records)
    grid = report["buckets"]["context_encoding_buckets"]
    assert len(grid) <= 3 and grid[-1] == 256
    assert "context_encoding_buckets" in out.read_text()
