"""Async scheduling on and off.

With on-device sampling (the default) vLLM's async scheduling stays on, in-process and
with the backend in a runner process, so every engine of the e2e suite runs with it:
greedy parity (test_greedy_parity.py: both layouts, prefix caching, chunked prefill, the
runner), continuous batching, aborts, preemption, sampling options and structured
outputs (test_continuous_batching.py), mixed device/host batches
(test_device_sampling.py). This file checks that premise, and runs the synchronous path
(--no-async-scheduling, and what on-device sampling off gives) through continuous
batching, an abort and a preemption against transformers' greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.e2e.support import corpus_token_ids, make_llm, shutdown_llm
from tests.e2e.test_continuous_batching import _greedy, _run_to_completion

pytestmark = pytest.mark.engine

MAX_NUM_SEQS = 3
BUCKETS = {
    "context_encoding_buckets": [16, 32, 64, 128, 256],
    "token_generation_buckets": [64, 128, 256],
    "token_generation_batches": [1, 2, 3],
}


@pytest.mark.parametrize("where", ["in-process", "sdk"])
def test_async_scheduling_is_on_with_device_sampling(where, model_dirs, request):
    from vllm.engine.arg_utils import EngineArgs

    runner = {"backend_python": request.getfixturevalue("sdk_python")} if where == "sdk" else {}

    def config(**extra):
        return EngineArgs(
            model=str(model_dirs["llama"]),
            dtype="float32",
            max_model_len=256,
            max_num_seqs=MAX_NUM_SEQS,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            additional_config={"override_neuron_config": dict(BUCKETS), **runner},
            **extra,
        ).create_engine_config()

    on = config()
    assert on.scheduler_config.async_scheduling is True
    assert on.max_concurrent_batches == 2  # the engine core's batch queue
    assert config(async_scheduling=False).scheduler_config.async_scheduling is False


@pytest.fixture(scope="module")
def sync_llm(model_dirs):
    engine = make_llm(
        model_dirs["llama"],
        max_num_seqs=MAX_NUM_SEQS,
        async_scheduling=False,
        additional_config={"override_neuron_config": dict(BUCKETS)},
    )
    assert engine.llm_engine.vllm_config.scheduler_config.async_scheduling is False
    yield engine
    shutdown_llm(engine)


def test_synchronous_steps_batch_abort_and_preempt(sync_llm, model_dirs, oracles):
    oracle = oracles("llama")
    lengths, max_tokens = [5, 70, 16, 120, 33], [3, 16, 1, 5, 9]
    prompts = [
        corpus_token_ids(model_dirs["llama"], n, offset=11 * i) for i, n in enumerate(lengths)
    ]
    outputs = sync_llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [_greedy(m) for m in max_tokens],
        use_tqdm=False,
    )
    for prompt, wanted, out in zip(prompts, max_tokens, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == oracle.generate(prompt, wanted)

    engine = sync_llm.llm_engine
    for i in range(MAX_NUM_SEQS):
        prompt = corpus_token_ids(model_dirs["llama"], 40, offset=i)
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, _greedy(200))
    for _ in range(4):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(MAX_NUM_SEQS)])
    prompts_by_id = {
        f"resume-{i}": corpus_token_ids(model_dirs["llama"], 30 + 7 * i, offset=90 + i)
        for i in range(MAX_NUM_SEQS)
    }
    for req_id, prompt in prompts_by_id.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, _greedy(12))
    for _ in range(5):
        engine.step()
    assert engine.reset_prefix_cache(reset_running_requests=True)  # preempts them all
    finished = _run_to_completion(engine)
    assert finished == {r: oracle.generate(p, 12) for r, p in prompts_by_id.items()}
