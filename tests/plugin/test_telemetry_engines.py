"""Telemetry of several engines behind one API server: each engine process publishes a
snapshot, the collector labels every series with model_name and engine, and a finished
engine's snapshot leaves /metrics; and an engine forked after prometheus_client was
imported still writes its multiprocess files; configurations started one after another
in a process share its one collector. (Several API servers, where the engines write
those files, run end to end in tests/e2e/test_data_parallel.py.)"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from neuron_plugin.core.inputs import CONTEXT_ENCODING, ForwardInputs

# The engine scripts' start: one call of 10 tokens in the 32 bucket.
CALL = """
import numpy as np
from neuron_plugin.core.inputs import CONTEXT_ENCODING, ForwardInputs
from neuron_plugin.serving.telemetry import StepTelemetry

def call(telemetry):
    telemetry.on_backend_call(ForwardInputs(
        phase=CONTEXT_ENCODING, bucket=(32,), input_ids=np.zeros((1, 32), dtype=np.int64),
        position_ids=np.zeros((1, 32), dtype=np.int64), seq_ids=np.zeros(1, dtype=np.int64),
        slot_mapping=None, block_table=None, full_context_lens=np.array([10]),
        computed_context_lens=np.array([0]), num_real=1), forward_s=0.003, host_s=0.0002)
"""
# Engine 1 in its own process (an engine's snapshot is named by its pid): two calls,
# then it runs until its stdin closes.
ENGINE_1 = CALL + """
import sys

telemetry = StepTelemetry(sys.argv[1], model_name="tiny", engine=1)
for _ in range(2):
    call(telemetry)
telemetry.publish()
print("ready", flush=True)
sys.stdin.read()
telemetry.close()
"""


# `vllm serve` under data parallelism with VLLM_WORKER_MULTIPROC_METHOD=fork: the API
# server imported prometheus_client before vLLM set PROMETHEUS_MULTIPROC_DIR, then forks
# an engine, whose calls must reach the directory every API server's /metrics reads.
FORKED_ENGINE = CALL + """
import os, sys
import prometheus_client

os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
pid = os.fork()
if pid == 0:
    telemetry = StepTelemetry(model_name="tiny", engine=1)
    call(telemetry)
    telemetry.close()
    os._exit(0)
os.waitpid(pid, 0)
"""


def _samples(collect) -> dict[tuple[str, str], float]:
    """(sample name, engine) -> value for the context-encoding bucket-32 series."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    collect(registry)
    values = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.labels.get("le") is None and sample.name.startswith("neuron:"):
                assert sample.labels["model_name"] == "tiny"
                assert sample.labels.get("bucket", "32") == "32"
                values[(sample.name, sample.labels["engine"])] = sample.value
    return values


def test_snapshots_of_two_engine_processes_are_labelled_per_engine(tmp_path):
    from neuron_plugin.serving.telemetry import NeuronMetricsCollector, StepTelemetry

    engine_1 = subprocess.Popen([sys.executable, "-c", ENGINE_1, str(tmp_path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    engine_0 = StepTelemetry(tmp_path, model_name="tiny", engine=0)
    try:
        engine_0.on_backend_call(ForwardInputs(
            phase=CONTEXT_ENCODING, bucket=(32,), input_ids=np.zeros((1, 32), dtype=np.int64),
            position_ids=np.zeros((1, 32), dtype=np.int64), seq_ids=np.zeros(1, dtype=np.int64),
            slot_mapping=None, block_table=None, full_context_lens=np.array([20]),
            computed_context_lens=np.array([0]), num_real=1), forward_s=0.002, host_s=0.0001)
        engine_0.on_step(0.001)
        engine_0.publish()
        assert engine_1.stdout.readline().strip() == "ready"
        values = _samples(lambda r: r.register(NeuronMetricsCollector(tmp_path)))
        assert values[("neuron:bucket_calls_total", "0")] == 1
        assert values[("neuron:real_tokens_total", "0")] == 20
        assert values[("neuron:bucket_calls_total", "1")] == 2
        assert values[("neuron:real_tokens_total", "1")] == 20
        assert values[("neuron:padded_tokens_total", "1")] == 44
        assert values[("neuron:forward_seconds_count", "1")] == 2
        assert values[("neuron:step_host_seconds_count", "0")] == 1
        assert values[("neuron:step_host_seconds_count", "1")] == 0
        engine_1.communicate("", timeout=120)  # engine 1 shuts down
        values = _samples(lambda r: r.register(NeuronMetricsCollector(tmp_path)))
        assert values[("neuron:bucket_calls_total", "0")] == 1
        assert ("neuron:bucket_calls_total", "1") not in values
    finally:
        engine_0.close()
        if engine_1.poll() is None:
            engine_1.kill()
            engine_1.wait()


def test_an_engine_forked_after_prometheus_was_imported_writes_the_shared_files(tmp_path):
    from prometheus_client import multiprocess

    done = subprocess.run([sys.executable, "-c", FORKED_ENGINE, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    values = _samples(lambda registry: multiprocess.MultiProcessCollector(
        registry, path=str(tmp_path)))
    assert values[("neuron:bucket_calls_total", "1")] == 1
    assert values[("neuron:real_tokens_total", "1")] == 10


def test_configurations_started_one_after_another_share_the_process_collector(tmp_path):
    """An offline user who starts a second `LLM` in the process registers its
    configuration too: both engines' series reach the default registry (a collector per
    configuration would expose the same names twice, which prometheus_client refuses),
    and each leaves it with its engine."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from neuron_plugin.serving.telemetry import StepTelemetry, register_collector
    from neuron_plugin.serving.vllm_settings import SETTINGS_KEY, TELEMETRY_DIR_KEY

    def calls() -> dict[str, float]:
        text = generate_latest(REGISTRY).decode()
        return {
            s.labels["engine"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "neuron:bucket_calls_total" and s.labels["model_name"] == "two-llms"
        }

    engines = []
    for engine in range(2):
        directory = tmp_path / f"llm-{engine}"
        config = SimpleNamespace(
            additional_config={SETTINGS_KEY: {}, TELEMETRY_DIR_KEY: str(directory)}
        )
        assert register_collector(config) == directory
        assert register_collector(config) == directory  # again: nothing more registered
        telemetry = StepTelemetry(directory, model_name="two-llms", engine=engine)
        for _ in range(engine + 1):
            telemetry.on_backend_call(ForwardInputs(
                phase=CONTEXT_ENCODING, bucket=(32,), input_ids=np.zeros((1, 32), dtype=np.int64),
                position_ids=np.zeros((1, 32), dtype=np.int64),
                seq_ids=np.zeros(1, dtype=np.int64), slot_mapping=None, block_table=None,
                full_context_lens=np.array([10]), computed_context_lens=np.array([0]),
                num_real=1), forward_s=0.001, host_s=0.0001)
        telemetry.publish()
        engines.append(telemetry)
    try:
        assert calls() == {"0": 1, "1": 2}
        engines.pop(0).close()  # the first LLM shut down
        assert calls() == {"1": 2}
    finally:
        for telemetry in engines:
            telemetry.close()
    assert calls() == {}
