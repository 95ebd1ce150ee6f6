"""Continuous batching on the contiguous layout: more requests than sequence slots, mixed
lengths and max_tokens, aborts freeing slots, and sampling options through vLLM's
sampler."""

from __future__ import annotations

import pytest
from tests.e2e.support import corpus_token_ids, make_llm, shutdown_llm

pytestmark = pytest.mark.engine

MAX_NUM_SEQS = 3


@pytest.fixture(scope="module", params=["in-process", "sdk"])
def llm(request, model_dirs):
    """The engine with its backend in-process, and in a runner process in the
    SDK-pinned environment (torch 2.9, transformers 4.57)."""
    runner = ({"backend_python": request.getfixturevalue("sdk_python")}
              if request.param == "sdk" else {})
    engine = make_llm(model_dirs["llama"], max_num_seqs=MAX_NUM_SEQS,
                      additional_config={"override_neuron_config": {
                          "context_encoding_buckets": [16, 32, 64, 128, 256],
                          "token_generation_buckets": [64, 128, 256],
                          "token_generation_batches": [1, 2, 3]}, **runner})
    yield engine
    shutdown_llm(engine)


def _greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_more_requests_than_slots_all_complete_correctly(llm, model_dirs, oracles):
    lengths = [5, 70, 16, 17, 120, 33, 9, 64, 2]
    max_tokens = [3, 16, 1, 12, 5, 9, 16, 2, 7]
    prompts = [corpus_token_ids(model_dirs["llama"], n, offset=11 * i)
               for i, n in enumerate(lengths)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [_greedy(m) for m in max_tokens], use_tqdm=False)
    oracle = oracles("llama")
    for prompt, wanted, out in zip(prompts, max_tokens, outputs):
        assert list(out.outputs[0].token_ids) == oracle.generate(prompt, wanted)


def test_aborted_request_frees_its_slot(llm, model_dirs, oracles):
    engine = llm.llm_engine
    long_prompts = {f"abort-{i}": corpus_token_ids(model_dirs["llama"], 40, offset=i)
                    for i in range(MAX_NUM_SEQS)}
    for req_id, prompt in long_prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, _greedy(200))
    for _ in range(4):
        engine.step()
    engine.abort_request(list(long_prompts))

    # Every slot was taken by an aborted request; new ones must get them back and
    # must not see the aborted requests' KV entries.
    fresh = {f"fresh-{i}": corpus_token_ids(model_dirs["llama"], 20 + i, offset=50 + i)
             for i in range(MAX_NUM_SEQS)}
    for req_id, prompt in fresh.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, _greedy(10))
    finished = _run_to_completion(engine)
    assert set(finished) == set(fresh)
    oracle = oracles("llama")
    for req_id, prompt in fresh.items():
        assert finished[req_id] == oracle.generate(prompt, 10)


def _run_to_completion(engine) -> dict[str, list[int]]:
    finished = {}
    for _ in range(300):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            return finished
    raise AssertionError(f"requests still unfinished after 300 steps: {finished.keys()}")


def _decode_batches(llm) -> dict[tuple[int, ...], int]:
    """Token-generation bucket -> calls so far, from the engine's own telemetry."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    return {bucket: stats.calls for (phase, bucket), stats in worker.telemetry.buckets.items()
            if phase == "token_generation"}


def test_a_lone_request_decodes_one_row_after_a_busy_period(llm, model_dirs, oracles):
    """A decode batch's bucket follows its largest seq_id, and vLLM hands a new request the
    block freed last (its free queue reuses uncached blocks first): the last of three
    requests to finish held the third slot. The lone request after them takes the lowest
    free sequence slot and decodes in the one-row bucket."""
    engine = llm.llm_engine
    for i, tokens in enumerate((2, 4, 12)):  # the third, in the third slot, finishes last
        engine.add_request(f"busy-{i}", {"prompt_token_ids": corpus_token_ids(
            model_dirs["llama"], 20, offset=130 + i)}, _greedy(tokens))
    _run_to_completion(engine)
    before = _decode_batches(llm)
    prompt = corpus_token_ids(model_dirs["llama"], 25, offset=140)
    engine.add_request("alone", {"prompt_token_ids": prompt}, _greedy(6))
    finished = _run_to_completion(engine)
    assert finished == {"alone": oracles("llama").generate(prompt, 6)}
    used = {bucket[0] for bucket, calls in _decode_batches(llm).items()
            if calls > before.get(bucket, 0)}
    assert used == {1}


def test_preempted_requests_resume_with_a_fresh_prefill(llm, model_dirs, oracles):
    """vLLM preempts every running request (reset_prefix_cache with
    reset_running_requests); they come back as resumed requests whose prompt and
    generated tokens are encoded again, and finish with the tokens of an undisturbed run."""
    engine = llm.llm_engine
    prompts = {f"resume-{i}": corpus_token_ids(model_dirs["llama"], 30 + 7 * i, offset=90 + i)
               for i in range(MAX_NUM_SEQS)}
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": prompt}, _greedy(12))
    for _ in range(5):
        engine.step()
    assert engine.reset_prefix_cache(reset_running_requests=True)
    finished = _run_to_completion(engine)
    oracle = oracles("llama")
    assert finished == {req_id: oracle.generate(prompt, 12) for req_id, prompt in prompts.items()}


def test_sampling_options_go_through_vllms_sampler(llm, model_dirs):
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": corpus_token_ids(model_dirs["llama"], 24)}
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=1234,
                            max_tokens=12, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.2)
    first = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0]
    again = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0]
    assert list(first.token_ids) == list(again.token_ids)  # seed makes it reproducible
    assert len(first.logprobs) == 12
    assert all(len(step) >= 3 for step in first.logprobs)

    several = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7,
                                                  max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    assert len(several.outputs) == 3
    assert len({tuple(o.token_ids) for o in several.outputs}) > 1

    greedy = list(llm.generate(prompt, _greedy(12), use_tqdm=False)[0].outputs[0].token_ids)
    stop_at = greedy[5]
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                  stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert list(stopped.token_ids) == greedy[: greedy.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


def test_structured_output_constrains_tokens(llm, model_dirs):
    """Grammar bitmasks from vLLM's structured-output manager apply to the host logits."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    choices = ["scheduler", "bucket", "cache"]
    prompt = {"prompt_token_ids": corpus_token_ids(model_dirs["llama"], 16)}
    out = llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert out[0].outputs[0].text in choices

