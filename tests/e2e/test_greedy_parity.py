"""Greedy tokens through vLLM + this plugin equal transformers' greedy tokens.

One engine per (architecture, bucketing, prefix caching) configuration; prompt lengths
sit on and around a bucket boundary (63, 64, 65 for the 64 bucket) and exceed
max_num_seqs in number, so continuous batching and slot reuse are exercised too. The
`-sdk` configurations run the backend in a runner process in the second environment
(torch 2.9, transformers 4.57, no vLLM), the way inf2 hosts serve.
"""

from __future__ import annotations

import pytest
from tests.e2e.support import corpus_token_ids, make_llm, shutdown_llm

pytestmark = pytest.mark.engine

BUCKETS = {"context_encoding_buckets": [32, 64, 128, 256],
           "token_generation_buckets": [64, 128, 256]}
PROMPT_LENGTHS = [31, 32, 33, 63, 64, 65, 100]
NEW_TOKENS = 16

CONFIGS = [
    pytest.param((arch, bucketing, prefix, False),
                 id=f"{arch}-bucketing_{bucketing}-prefix_{prefix}")
    for arch in ("llama", "qwen3")
    for bucketing in ("on", "off")
    for prefix in ("off", "on")
] + [
    # Chunked prefill: 48-token steps split the longer prompts into chunks [start, end)
    # that run as (chunk, prefix) context encodings next to decodes of other requests.
    pytest.param(("llama", "on", "chunked", False), id="llama-bucketing_on-chunked_prefill"),
] + [
    # Both layouts, both architectures, through the runner in the SDK-pinned environment.
    pytest.param((arch, "on", prefix, True), id=f"{arch}-bucketing_on-prefix_{prefix}-sdk")
    for arch in ("llama", "qwen3")
    for prefix in ("off", "on")
]


@pytest.fixture(scope="module", params=CONFIGS)
def engine(request, model_dirs):
    arch, bucketing, prefix, in_sdk = request.param
    override = dict(BUCKETS) if bucketing == "on" else {"enable_bucketing": False}
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 48} \
        if prefix == "chunked" else {}
    runner = {"backend_python": request.getfixturevalue("sdk_python")} if in_sdk else {}
    llm = make_llm(model_dirs[arch], enable_prefix_caching=prefix == "on",
                   additional_config={"override_neuron_config": override, **runner},
                   **chunked)
    yield arch, prefix == "on", llm
    shutdown_llm(llm)


def _generate(llm, prompts):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           use_tqdm=False)
    return outputs


def test_greedy_tokens_match_transformers(engine, model_dirs, oracles):
    arch, prefix_caching, llm = engine
    prompts = [corpus_token_ids(model_dirs[arch], n, offset=7 * n) for n in PROMPT_LENGTHS]
    expected = [oracles(arch).generate(p, NEW_TOKENS) for p in prompts]

    cold = _generate(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in cold] == expected

    if prefix_caching:
        # The same prompts again: every full block is a prefix-cache hit now.
        warm = _generate(llm, prompts)
        assert [list(o.outputs[0].token_ids) for o in warm] == expected
        hits = [o.num_cached_tokens for o in warm]
        assert all(h >= 32 * ((n - 1) // 32) for h, n in zip(hits, PROMPT_LENGTHS)), hits
        assert sum(hits) > 0
