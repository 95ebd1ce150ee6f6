"""Speculative decoding through vLLM's --speculative-config: greedy tokens with speculation
equal transformers' greedy tokens (so equal those without it), with prompt lookup
(n-gram) and with a draft model fused into the graphs, in both KV layouts, in-process and
through the backend runner; under continuous batching, an abort and a preemption; with
host-sampled and randomly sampled requests mixed in; and vLLM's spec-decode metrics and
the per-bucket counters show drafts accepted.

The target and draft are tiny Mistrals trained on the corpus (`speculation_models`), so
their continuations of corpus text are corpus text: drafts get accepted, as on real text
(random weights accept almost none). "Copy" prompts end with the start of a passage they
already contain, as an edit of a document does: prompt lookup finds the continuation.
"""

from __future__ import annotations

import pytest

from tests.e2e.support import GreedyOracle, corpus_token_ids, make_llm, shutdown_llm
from tests.e2e.test_continuous_batching import _greedy, _run_to_completion

pytestmark = pytest.mark.engine

MAX_NUM_SEQS = 3
DRAFTS = 3
# Token-generation grids are NxDI's defaults: with speculation they reach
# max_model_len + num_speculative_tokens (core.bucket_grids).
BUCKETS = {"context_encoding_buckets": [32, 64, 128, 256]}

CONFIGS = [
    pytest.param(("ngram", False, False), id="ngram-contiguous"),
    pytest.param(("ngram", True, False), id="ngram-prefix_caching"),
    pytest.param(("draft_model", False, True), id="draft_model-contiguous-sdk"),
    pytest.param(("draft_model", True, False), id="draft_model-prefix_caching"),
]


@pytest.fixture(scope="module")
def oracle(speculation_models) -> GreedyOracle:
    return GreedyOracle(speculation_models[0])


@pytest.fixture(scope="module", params=CONFIGS)
def engine(request, speculation_models):
    method, prefix, in_sdk = request.param
    target, draft = speculation_models
    spec = ({"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4} if method == "ngram"
            else {"method": "draft_model", "model": str(draft),
                  "num_speculative_tokens": DRAFTS})
    runner = {"backend_python": request.getfixturevalue("sdk_python")} if in_sdk else {}
    llm = make_llm(target, max_num_seqs=MAX_NUM_SEQS, speculative_config=spec,
                   enable_prefix_caching=prefix, disable_log_stats=False,
                   additional_config={"override_neuron_config": dict(BUCKETS), **runner})
    yield method, llm
    shutdown_llm(llm)


def _prompts(target) -> list[list[int]]:
    """Corpus passages of several lengths, and copy prompts: a passage followed by its
    own first tokens (the continuation is in the prompt)."""
    plain = [corpus_token_ids(target, n, offset=13 * n) for n in (5, 40, 70, 150)]
    copies = []
    for n, offset in ((60, 5), (90, 200)):
        passage = corpus_token_ids(target, n, offset=offset)
        copies.append(passage + passage[:12])
    return plain + copies


def _spec_counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}


def test_greedy_tokens_equal_transformers_and_drafts_are_accepted(engine, speculation_models,
                                                                  oracle):
    method, llm = engine
    prompts = _prompts(speculation_models[0])
    max_tokens = [24, 17, 3, 24, 20, 24]
    before = _spec_counters(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [_greedy(m) for m in max_tokens], use_tqdm=False)
    for prompt, wanted, out in zip(prompts, max_tokens, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == oracle.generate(prompt, wanted)
    after = _spec_counters(llm)
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get(
        "vllm:spec_decode_num_draft_tokens", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    assert drafted > 0 and accepted > 0, (method, drafted, accepted)


def test_abort_and_preemption_keep_tokens_exact(engine, speculation_models, oracle):
    _, llm = engine
    target = speculation_models[0]
    core = llm.llm_engine
    for i in range(MAX_NUM_SEQS):
        core.add_request(f"abort-{i}", {"prompt_token_ids": corpus_token_ids(target, 40, offset=i)},
                         _greedy(200))
    for _ in range(4):
        core.step()
    core.abort_request([f"abort-{i}" for i in range(MAX_NUM_SEQS)])
    prompts = {f"resume-{i}": corpus_token_ids(target, 30 + 7 * i, offset=90 + i)
               for i in range(MAX_NUM_SEQS)}
    for req_id, prompt in prompts.items():
        core.add_request(req_id, {"prompt_token_ids": prompt}, _greedy(20))
    for _ in range(3):
        core.step()
    assert core.reset_prefix_cache(reset_running_requests=True)  # preempts them all
    finished = _run_to_completion(core)
    assert finished == {r: oracle.generate(p, 20) for r, p in prompts.items()}


def test_host_sampled_and_sampled_requests_mix_with_speculation(engine, speculation_models,
                                                                oracle):
    """A logprobs request (host-sampled: no drafts, its logits for one position) and
    sampled requests run beside greedy ones; the greedy ones stay exact."""
    from vllm import SamplingParams

    _, llm = engine
    target = speculation_models[0]
    greedy_prompt = corpus_token_ids(target, 50, offset=300)
    requests = [
        ({"prompt_token_ids": greedy_prompt}, _greedy(16)),
        ({"prompt_token_ids": corpus_token_ids(target, 30, offset=7)},
         SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)),
        ({"prompt_token_ids": corpus_token_ids(target, 35, offset=400)},
         SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, n=3,
                        seed=5)),
    ]
    outputs = llm.generate([r[0] for r in requests], [r[1] for r in requests],
                           use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == oracle.generate(greedy_prompt, 16)
    logprobs = outputs[1].outputs[0]
    assert len(logprobs.token_ids) == 16 and len(logprobs.logprobs) == 16
    assert all(len(step) >= 2 for step in logprobs.logprobs)
    sampled = outputs[2].outputs
    assert all(len(o.token_ids) == 16 for o in sampled)


@pytest.mark.server
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_vllm_serve_with_speculation_matches_transformers(method, speculation_models, oracle,
                                                          tmp_path):
    """`vllm serve --device neuron --speculative-config ...`: concurrent completions give
    transformers' greedy tokens, and /metrics shows vLLM's spec-decode counters and the
    per-bucket ones counting accepted drafts."""
    import concurrent.futures
    import json

    import requests

    from tests.e2e.scrape import neuron_samples, total, wait_for
    from tests.e2e.support import Server

    target, draft = speculation_models
    spec = ({"method": "ngram", "num_speculative_tokens": DRAFTS, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4} if method == "ngram"
            else {"model": str(draft), "num_speculative_tokens": DRAFTS})
    server = Server(target, tmp_path / "serve.log",
                    ["--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS),
                     "--speculative-config", json.dumps(spec), "--additional-config",
                     json.dumps({"override_neuron_config": BUCKETS})])
    try:
        server.wait_healthy()
        assert "speculative decoding: " + method in server.log()
        prompts = _prompts(target)

        def complete(prompt: list[int]) -> list[int]:
            reply = requests.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": str(target), "prompt": prompt, "max_tokens": 20,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            reply.raise_for_status()
            return reply.json()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        assert got == [oracle.generate(p, 20) for p in prompts]
        vllm = neuron_samples(server.url, prefix="vllm:spec_decode_num_accepted_tokens")
        assert total(vllm, "vllm:spec_decode_num_accepted_tokens_total") > 0
        neuron = wait_for(server.url, lambda s: total(s, "neuron:spec_accepted_tokens_total") > 0)
        assert total(neuron, "neuron:spec_accepted_tokens_total") > 0
        assert total(neuron, "neuron:spec_draft_tokens_total") >= total(
            neuron, "neuron:spec_accepted_tokens_total")
    finally:
        server.stop()
