"""On-device sampling end to end: one batch mixing rows the device samples (greedy,
top-k/temperature) with rows that need their logits on the host (logprobs, a penalty,
a grammar, a seed), through `LLM(...)` with the backend in-process, in a runner process
in the SDK environment, and with on-device sampling off; and through `vllm serve`.

Every row is checked against an outside oracle: greedy rows and logprob rows against
transformers' greedy tokens, the penalty row against transformers with vLLM's
repetition penalty applied, the top-k row against transformers' top-k at each prefix,
the grammar row against its choices, the seeded row against a second run.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from tests.e2e.support import corpus_token_ids, make_llm, shutdown_llm

pytestmark = pytest.mark.engine  # the session's server (conftest.py; tests/xdist_schedule.py)

NEW_TOKENS = 10
PENALTY = 1.5
TOP_K = 3
CHOICES = ["scheduler", "bucket", "cache"]


@pytest.fixture(scope="module", params=["device", "device-sdk", "host"])
def llm(request, model_dirs):
    """Default settings (on-device sampling on), the same in the runner, and off."""
    config: dict = {"override_neuron_config": {
        "context_encoding_buckets": [16, 32, 64], "token_generation_buckets": [64, 128]}}
    if request.param == "device-sdk":
        config["backend_python"] = request.getfixturevalue("sdk_python")
    if request.param == "host":
        config["override_neuron_config"]["on_device_sampling_config"] = None
    engine = make_llm(model_dirs["llama"], max_model_len=128, max_num_seqs=8,
                      additional_config=config)
    yield engine
    shutdown_llm(engine)


def _prompts(model_dir, count: int) -> list[list[int]]:
    return [corpus_token_ids(model_dir, 12 + 5 * i, offset=31 * i) for i in range(count)]


def top_tokens(oracle, context: list[int], k: int) -> set[int]:
    """transformers' k most likely next tokens after `context`."""
    torch = oracle.torch
    with torch.no_grad():
        logits = oracle.model(torch.tensor([context])).logits[0, -1]
    return set(logits.topk(k).indices.tolist())


def penalized_greedy(oracle, prompt: list[int], count: int, penalty: float) -> list[int]:
    """Greedy decoding with vLLM's repetition penalty: logits of tokens already in the
    prompt or output are divided by it when positive, multiplied otherwise."""
    torch = oracle.torch
    context = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            logits = oracle.model(torch.tensor([context])).logits[0, -1].clone()
            seen = torch.tensor(sorted(set(context)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty,
                                       logits[seen] * penalty)
            context.append(int(logits.argmax()))
    return context[len(prompt):]


def test_mixed_batch_gives_each_row_its_treatment(llm, model_dirs, oracles):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    oracle = oracles("llama")
    prompts = _prompts(model_dirs["llama"], 7)
    fixed = dict(max_tokens=NEW_TOKENS, ignore_eos=True)
    params = [
        SamplingParams(temperature=0.0, **fixed),                          # device
        SamplingParams(temperature=2.0, top_k=TOP_K, top_p=0.95, **fixed),  # device
        SamplingParams(temperature=0.0, logprobs=2, **fixed),              # host: logprobs
        SamplingParams(temperature=0.0, repetition_penalty=PENALTY, **fixed),  # host
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,             # host: grammar
                       structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        SamplingParams(temperature=1.0, seed=11, **fixed),                 # host: seed
        SamplingParams(temperature=0.0, **fixed),                          # device
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]
    again = [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)]

    for index in (0, 2, 6):
        assert list(first[index].token_ids) == oracle.generate(prompts[index], NEW_TOKENS)
    context = list(prompts[1])
    for token in first[1].token_ids:
        assert token in top_tokens(oracle, context, TOP_K), (context, token)
        context.append(token)
    greedy_1 = oracle.generate(prompts[1], NEW_TOKENS)
    assert list(first[1].token_ids) != greedy_1  # all-argmax has p < 1e-4 at T=2
    logprobs = first[2].logprobs
    assert len(logprobs) == NEW_TOKENS
    assert all(step[token].rank == 1 for step, token in zip(logprobs, first[2].token_ids))
    assert list(first[3].token_ids) == penalized_greedy(oracle, prompts[3], NEW_TOKENS,
                                                        PENALTY)
    assert first[4].text in CHOICES
    assert list(first[5].token_ids) == list(again[5].token_ids)


@pytest.mark.server
def test_server_serves_a_concurrent_mixed_batch(client, model_dirs, oracles):
    """The shared `vllm serve` (default settings: on-device sampling on) answers
    concurrent requests of both kinds, each correctly."""
    model = str(model_dirs["llama"])
    oracle = oracles("llama")
    prompts = _prompts(model_dirs["llama"], 4)
    kinds = [{}, {"temperature": 2.0, "extra_body": {"top_k": TOP_K}}, {"logprobs": 2},
             {"extra_body": {"structured_outputs": {"choice": CHOICES}}}]

    def complete(index: int):
        options = {"temperature": 0.0, **kinds[index]}
        extra = {"return_token_ids": True, **options.pop("extra_body", {})}
        return client.completions.create(model=model, prompt=prompts[index],
                                         max_tokens=NEW_TOKENS, extra_body=extra,
                                         **options).choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(kinds)) as pool:
        greedy, sampled, with_logprobs, chosen = pool.map(complete, range(len(kinds)))
    for choice, prompt in ((greedy, prompts[0]), (with_logprobs, prompts[2])):
        assert choice.model_extra["token_ids"] == oracle.generate(prompt, NEW_TOKENS)
    assert len(with_logprobs.logprobs.tokens) == NEW_TOKENS
    context = list(prompts[1])
    for token in sampled.model_extra["token_ids"]:
        assert token in top_tokens(oracle, context, TOP_K), (context, token)
        context.append(token)
    assert chosen.text in CHOICES
