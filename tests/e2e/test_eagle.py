"""EAGLE and EAGLE-3 speculation through vLLM's --speculative-config on the reference
backend: greedy tokens equal transformers' greedy tokens (so equal those without
speculation) at batch 1 and beside sampled and host-sampled rows, in both KV layouts,
in-process and through the backend runner (the SDK's environment), with the heads'
drafts accepted (vLLM's spec-decode counters); `neuron-plugin validate` judges such a
configuration's speculation case and reports the head's acceptance.

The target is the corpus-trained tiny Mistral of tests/e2e/test_speculative_decoding.py;
the heads are trained on its hidden states (scripts/build_eagle_heads.py), so their
drafts get accepted as a real head's are.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.support import GreedyOracle, corpus_token_ids, make_llm, shutdown_llm
from tests.e2e.test_continuous_batching import _greedy

pytestmark = pytest.mark.engine

DRAFTS = 3
BUCKETS = {"context_encoding_buckets": [32, 64, 128, 256]}

CONFIGS = [
    pytest.param(("eagle", False, True), id="eagle-contiguous-sdk"),
    pytest.param(("eagle3", True, False), id="eagle3-prefix_caching"),
]


@pytest.fixture(scope="module")
def oracle(eagle_heads) -> GreedyOracle:
    return GreedyOracle(eagle_heads[0])


@pytest.fixture(scope="module", params=CONFIGS)
def engine(request, eagle_heads):
    method, prefix, in_sdk = request.param
    target, eagle, eagle3 = eagle_heads
    spec = {"method": method, "model": str(eagle if method == "eagle" else eagle3),
            "num_speculative_tokens": DRAFTS}
    runner = {"backend_python": request.getfixturevalue("sdk_python")} if in_sdk else {}
    llm = make_llm(target, max_num_seqs=3, speculative_config=spec,
                   enable_prefix_caching=prefix, disable_log_stats=False,
                   additional_config={"override_neuron_config": dict(BUCKETS), **runner})
    yield method, llm
    shutdown_llm(llm)


def _spec_counters(llm) -> dict[str, float]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}


def _accepted(llm, before: dict[str, float]) -> tuple[float, float]:
    after = _spec_counters(llm)
    name = "vllm:spec_decode_num_{}_tokens"
    return tuple(after[name.format(k)] - before.get(name.format(k), 0)  # type: ignore[return-value]
                 for k in ("draft", "accepted"))


def test_greedy_tokens_equal_transformers_and_drafts_are_accepted(engine, eagle_heads, oracle):
    """Batch 1, then a batch of prompts of several lengths (prefix caching: the second
    pass hits the cache)."""
    method, llm = engine
    target = eagle_heads[0]
    prompts = [corpus_token_ids(target, n, offset=13 * n) for n in (5, 40, 70, 150)]
    wanted = [24, 17, 3, 24]
    before = _spec_counters(llm)
    single = llm.generate([{"prompt_token_ids": prompts[1]}], [_greedy(30)], use_tqdm=False)
    assert list(single[0].outputs[0].token_ids) == oracle.generate(prompts[1], 30)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [_greedy(m) for m in wanted], use_tqdm=False)
        for prompt, count, out in zip(prompts, wanted, outputs, strict=True):
            assert list(out.outputs[0].token_ids) == oracle.generate(prompt, count), method
    drafted, accepted = _accepted(llm, before)
    # trained heads are accepted nearly always (95-98% here); a head computed wrongly is not
    assert drafted > 0 and accepted / drafted > 0.5, (method, drafted, accepted)


def test_sampled_and_host_sampled_rows_beside_greedy_ones(engine, eagle_heads, oracle):
    """A logprobs request (host-sampled: no drafts) and sampled requests (vLLM's
    rejection sampling of the head's drafts) run beside a greedy one, which stays exact."""
    from vllm import SamplingParams

    _, llm = engine
    target = eagle_heads[0]
    greedy_prompt = corpus_token_ids(target, 50, offset=300)
    requests = [
        ({"prompt_token_ids": greedy_prompt}, _greedy(16)),
        ({"prompt_token_ids": corpus_token_ids(target, 30, offset=7)},
         SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)),
        ({"prompt_token_ids": corpus_token_ids(target, 35, offset=400)},
         SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, ignore_eos=True, n=2,
                        seed=5)),
    ]
    outputs = llm.generate([r[0] for r in requests], [r[1] for r in requests],
                           use_tqdm=False)
    assert list(outputs[0].outputs[0].token_ids) == oracle.generate(greedy_prompt, 16)
    logprobs = outputs[1].outputs[0]
    assert list(logprobs.token_ids) == oracle.generate(requests[1][0]["prompt_token_ids"], 16)
    assert len(logprobs.logprobs) == 16
    assert all(len(o.token_ids) == 16 for o in outputs[2].outputs)


def test_validate_judges_the_speculation_case_with_the_head(eagle_heads, tmp_path):
    """`neuron-plugin validate` with an EAGLE-3 head turned on: its speculation case
    passes against the oracle and reports how many of the head's drafts were accepted."""
    from tests.e2e.test_validate import _validate

    target, _, eagle3 = eagle_heads
    spec = {"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": DRAFTS}
    done, report = _validate(target, tmp_path / "eagle3",
                             ["--speculative-config", json.dumps(spec), "--cases", "speculation"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    case = next(c for c in report["cases"] if c["name"] == "speculation")
    drafted, accepted = (case["evidence"][k] for k in ("drafted_tokens", "accepted_tokens"))
    assert case["status"] == "pass" and drafted > 0 and accepted > 0, case
    assert f"{accepted:.0f} of {drafted:.0f} draft tokens accepted" in case["detail"]
    assert "eagle3 speculation" in case["detail"]
