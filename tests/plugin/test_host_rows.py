"""A mixed step pays for its host rows only: vLLM's Sampler runs over the host-sampled
rows alone (their own metadata, logits processors, logprobs), device rows never enter
it, and the results land in the step's row order. Checked against the same requests
with on-device sampling off (every row through the Sampler), through the real model
runner and reference backend, across finishes and new requests that reorder the two
persistent batches."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

PROMPT = 16
BATCH = 4


def params(kind: str):
    from vllm import SamplingParams

    if kind == "device":  # greedy: the device's argmax
        return SamplingParams(temperature=0.0, max_tokens=64)
    if kind == "random":
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=64)
    if kind == "logprobs":
        return SamplingParams(temperature=0.0, logprobs=3, max_tokens=64)
    if kind == "logprobs2":
        return SamplingParams(temperature=0.0, logprobs=2, max_tokens=64)
    # penalties, min_tokens and a logit bias: every per-row host option at once
    return SamplingParams(
        temperature=0.0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        min_tokens=4,
        logit_bias={7: 100.0},
        max_tokens=64,
    )


KINDS = {"r0": "device", "r1": "logprobs", "r2": "random", "r3": "penalties"}
LATER = {"r4": "logprobs2", "r5": "device"}  # after r0 and r1 finish
GREEDY = ("r0", "r1", "r3", "r4", "r5")


@pytest.fixture(scope="module", params=[True, False], ids=["device", "host"])
def engine(request, model_dirs, tmp_path_factory):
    from bench_sampling import engine_config
    from vllm.config import set_current_vllm_config

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model_dirs["llama"], BATCH, request.param, None)
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
        backend = open_backend(
            settings, model_dirs["llama"], str(tmp_path_factory.mktemp("host-rows-cache"))
        )
        yield config, settings, backend


def new_request(req_id: str, kind: str, slot: int):
    from vllm.v1.core.sched.output import NewRequestData

    seed = int(req_id[1:])
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=np.random.default_rng(seed).integers(5, 200, PROMPT).tolist(),
        mm_features=[],
        sampling_params=params(kind),
        pooling_params=None,
        block_ids=([slot],),
        num_computed_tokens=0,
        lora_request=None,
    )


def drive(config, settings, backend):
    """Prefill r0-r3, decode 3 steps, finish r0 and r1, add r4 and r5 in their slots,
    decode 3 more steps. Per request: its tokens and, per token, its logprobs row (top
    ids, logprobs) where it asked for them; and the host Sampler's row count per step."""
    from bench_host_overhead import scheduler_output
    from vllm.v1.core.sched.output import CachedRequestData

    from neuron_plugin.serving.model_runner import NeuronModelRunner

    runner = NeuronModelRunner(config, settings, backend, [])
    sampler_rows: list[int] = []
    sample = runner.host.sampler.forward

    def counted(logits, metadata, *args, **kwargs):
        sampler_rows.append(logits.shape[0])
        return sample(logits, metadata, *args, **kwargs)

    runner.host.sampler.forward = counted  # type: ignore[method-assign]  # a spy
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[tuple[list[int], list[float]]]] = {}
    computed: dict[str, int] = {}

    def step(so):
        runner.execute_model(so)
        out = runner.sample_tokens(None)
        for req_id, index in out.req_id_to_index.items():
            new = out.sampled_token_ids[index]
            if not new:
                continue
            tokens.setdefault(req_id, []).extend(new)
            computed[req_id] = computed.get(req_id, 0) + so.num_scheduled_tokens[req_id]
            if params(KINDS.get(req_id) or LATER[req_id]).logprobs is not None:
                assert out.logprobs is not None
                row = out.logprobs.slice_request(index, 1)
                assert row.logprob_token_ids[0][0] == new[0]  # the sampled token first
                logprobs.setdefault(req_id, []).append(
                    (row.logprob_token_ids[0].tolist(), row.logprobs[0].tolist())
                )

    def decode(ids, finished=(), new=()):
        cached = CachedRequestData(
            req_ids=list(ids),
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * len(ids),
            num_computed_tokens=[computed[r] for r in ids],
            num_output_tokens=[len(tokens[r]) for r in ids],
        )
        scheduled = dict.fromkeys(ids, 1) | {r.req_id: PROMPT for r in new}
        so = scheduler_output(new=new, cached=cached, scheduled=scheduled)
        so.finished_req_ids = set(finished)
        step(so)

    first = [new_request(r, k, i + 1) for i, (r, k) in enumerate(KINDS.items())]
    step(scheduler_output(new=first, scheduled={r.req_id: PROMPT for r in first}))
    for _ in range(3):
        decode(KINDS)
    later = [new_request("r4", LATER["r4"], 1), new_request("r5", LATER["r5"], 2)]
    decode(["r2", "r3"], finished=["r0", "r1"], new=later)
    for _ in range(3):
        decode(["r2", "r3", "r4", "r5"])
    return tokens, logprobs, sampler_rows, runner


@pytest.fixture(scope="module")
def reference(model_dirs, tmp_path_factory):
    """The same requests with on-device sampling off: every row through the Sampler."""
    from bench_sampling import engine_config
    from vllm.config import set_current_vllm_config

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    config = engine_config(model_dirs["llama"], BATCH, False, None)
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
        backend = open_backend(
            settings, model_dirs["llama"], str(tmp_path_factory.mktemp("host-rows-ref"))
        )
        return drive(config, settings, backend)[:2]


def test_host_rows_only_enter_the_sampler(engine, reference):
    config, settings, backend = engine
    tokens, logprobs, sampler_rows, runner = drive(config, settings, backend)
    if settings.on_device_sampling:
        # r1 and r3 (prefill and 3 decodes), then r3 and r4 (prefill, 3 decodes): two
        # host rows every step whatever the batch holds.
        assert sampler_rows == [2] * 8
        assert runner.host.num_rows == 2
    else:
        assert sampler_rows == [4] * 8
    ref_tokens, ref_logprobs = reference
    for req_id in GREEDY:
        assert tokens[req_id] == ref_tokens[req_id], req_id
    assert set(logprobs) == {"r1", "r4"}
    for req_id, rows in logprobs.items():
        assert len(rows) == len(tokens[req_id])
        for (ids, values), (ref_ids, ref_values) in zip(rows, ref_logprobs[req_id], strict=True):
            assert ids == ref_ids
            assert values == pytest.approx(ref_values, abs=1e-4)
    # The logit bias (a logits processor with per-row state) acts on r3 alone.
    assert tokens["r3"] == [7] * 8
    assert all(7 not in tokens[r] for r in ("r1", "r4"))
