"""vLLM's async scheduling contract through the real model runner, in vLLM's call order:
execute_model(N), sample_tokens(N) -> a promise, execute_model(N+1) (which completes N),
then the promise's get_output(). With the backend in a runner process the step's last
call is submitted and collected later (the forward runs while the host goes on); with
it in-process `submit` computes. Either way every token equals the synchronous run's,
device rows and a host (logprobs) row alike, and get_output answers once, from any
thread."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

PROMPT = 16
BATCH = 4
STEPS = 5


class CallCounter:
    """The backend, counting which entry points a runner used."""

    def __init__(self, backend):
        self.backend = backend
        self.name, self.settings = backend.name, backend.settings
        self.calls = {"run": 0, "submit": 0, "collect": 0}
        self.module = None

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def run(self, inputs, sampling):
        self.calls["run"] += 1
        return self.backend.run(inputs, sampling)

    def submit(self, inputs, sampling):
        self.calls["submit"] += 1
        return self.backend.submit(inputs, sampling)

    def collect(self):
        self.calls["collect"] += 1
        return self.backend.collect()


@pytest.fixture(scope="module", params=["in-process", "runner"])
def engine(request, model_dirs, tmp_path_factory):
    from bench_sampling import engine_config
    from vllm.config import set_current_vllm_config

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    python = request.getfixturevalue("sdk_python") if request.param == "runner" else None
    config = engine_config(model_dirs["llama"], BATCH, True, python)
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
        backend = open_backend(
            settings, model_dirs["llama"], str(tmp_path_factory.mktemp("async-cache"))
        )
        try:
            yield config, settings, backend
        finally:
            close = getattr(backend, "close", None)
            if close is not None:
                close()


def drive(config, settings, backend, async_scheduling: bool):
    """Prefill BATCH requests (r1 asks for logprobs: a host row), decode STEPS steps in
    vLLM's async order; each request's tokens and r1's logprobs ids."""
    from bench_host_overhead import scheduler_output
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from neuron_plugin.serving.model_runner import NeuronModelRunner

    counter = CallCounter(backend)
    runner = NeuronModelRunner(config, settings, counter, [], async_scheduling)
    ids = [f"r{i}" for i in range(BATCH)]
    requests = [
        NewRequestData(
            req_id=r,
            prompt_token_ids=np.random.default_rng(i).integers(5, 200, PROMPT).tolist(),
            mm_features=[],
            sampling_params=SamplingParams(
                temperature=0.0, max_tokens=64, logprobs=2 if r == "r1" else None
            ),
            pooling_params=None,
            block_ids=([i + 1],),
            num_computed_tokens=0,
            lora_request=None,
        )
        for i, r in enumerate(ids)
    ]
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    logprob_ids: list[list[int]] = []

    def take(out) -> None:
        for req_id, index in out.req_id_to_index.items():
            tokens[req_id] += out.sampled_token_ids[index]
        row = out.logprobs.slice_request(out.req_id_to_index["r1"], 1)
        logprob_ids.append(row.logprob_token_ids[0].tolist())

    schedule = [scheduler_output(new=requests, scheduled=dict.fromkeys(ids, PROMPT))]
    for step in range(STEPS):
        # What the async scheduler sends: it counts the in-flight token already.
        cached = CachedRequestData(
            req_ids=ids,
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * BATCH,
            num_computed_tokens=[PROMPT + step] * BATCH,
            num_output_tokens=[1 + step] * BATCH,
        )
        schedule.append(scheduler_output(cached=cached, scheduled=dict.fromkeys(ids, 1)))
    previous = None
    for so in schedule:
        assert runner.execute_model(so) is None
        out = runner.sample_tokens(None)
        if previous is not None:  # vLLM reads step N's output after starting N+1
            take(previous.get_output())
        previous = out if isinstance(out, AsyncModelRunnerOutput) else None
        if previous is None:
            take(out)
    if previous is not None:
        # From another thread, as vLLM's multiprocess executor does: one completion.
        results = []
        reader = threading.Thread(target=lambda: results.append(previous.get_output()))
        reader.start()
        reader.join()
        assert previous.get_output() is results[0]
        take(results[0])
    return tokens, logprob_ids, counter.calls


def test_async_steps_equal_synchronous_ones(engine):
    config, settings, backend = engine
    sync_tokens, sync_logprobs, sync_calls = drive(config, settings, backend, False)
    tokens, logprobs, calls = drive(config, settings, backend, True)
    assert all(len(t) == 1 + STEPS for t in tokens.values())
    assert tokens == sync_tokens
    assert logprobs == sync_logprobs
    assert sync_calls["submit"] == 0
    # Each step's one call (a decode batch, or the last prefill) is left in flight.
    assert calls["submit"] == calls["collect"] == 1 + STEPS
    assert calls["run"] == BATCH - 1  # the other prefills of the first step
