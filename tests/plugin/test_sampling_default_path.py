"""The path of a chat client's default request (temperature 0.7, top_p 0.9, no top_k)
through the real model runner and reference backend (the harness of
scripts/bench_sampling.py): by default the device samples it with top_k = global_topk and
no logits leave the backend; with `additional_config.exact_sampling` the host samples it
over the whole vocabulary from its logits."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

PROMPT = 16
MAX_MODEL_LEN = 128
DECODE_STEPS = 2


class PathRecorder:
    """bench_sampling's SeamMeter, also keeping each call's sampling rows."""

    def __init__(self, backend):
        from bench_sampling import SeamMeter

        self.meter = SeamMeter(backend)
        self.calls: list[dict[str, np.ndarray]] = []
        self.logits_rows: list[int] = []

    def __getattr__(self, name):
        return getattr(self.meter, name)

    def run(self, inputs, sampling):
        out = self.meter.run(inputs, sampling)
        self.calls.append({k: v.copy() for k, v in sampling.arrays().items()})
        self.logits_rows.append(out.logits.shape[0] if out.logits.ndim == 2 else 0)
        return out


@pytest.fixture(scope="module", params=[None, True], ids=["default", "exact"])
def engine(request, model_dirs, tmp_path_factory):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    extra = {} if request.param is None else {"exact_sampling": request.param}
    config = EngineArgs(
        model=str(model_dirs["llama"]),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=1,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        additional_config={
            "override_neuron_config": {
                "context_encoding_buckets": [PROMPT * 2],
                "token_generation_buckets": [MAX_MODEL_LEN],
            },
            **extra,
        },
    ).create_engine_config()
    with set_current_vllm_config(config):
        settings = settings_from_vllm_config(config)
        backend = open_backend(
            settings, model_dirs["llama"], str(tmp_path_factory.mktemp("path-cache"))
        )
        yield config, settings, backend


def run_request(config, settings, backend, params) -> tuple[PathRecorder, list[int]]:
    """Prefill one request and decode DECODE_STEPS tokens; the recorder and its tokens."""
    from bench_host_overhead import scheduler_output
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from neuron_plugin.serving.model_runner import NeuronModelRunner

    recorder = PathRecorder(backend)
    runner = NeuronModelRunner(config, settings, recorder, [])
    prompt = np.random.default_rng(0).integers(5, 200, PROMPT).tolist()
    new = NewRequestData(
        req_id="chat",
        prompt_token_ids=prompt,
        mm_features=[],
        sampling_params=params,
        pooling_params=None,
        block_ids=([1],),
        num_computed_tokens=0,
        lora_request=None,
    )
    runner.execute_model(scheduler_output(new=[new], scheduled={"chat": PROMPT}))
    tokens = list(runner.sample_tokens(None).sampled_token_ids[0])
    for step in range(DECODE_STEPS):
        cached = CachedRequestData(
            req_ids=["chat"],
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None],
            num_computed_tokens=[PROMPT + step],
            num_output_tokens=[1 + step],
        )
        runner.execute_model(scheduler_output(cached=cached, scheduled={"chat": 1}))
        tokens += runner.sample_tokens(None).sampled_token_ids[0]
    return recorder, tokens


def test_default_request_path(engine):
    from vllm import SamplingParams

    config, settings, backend = engine
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=MAX_MODEL_LEN)
    assert params.top_k in (0, -1)  # "no top_k": the whole vocabulary in vLLM
    recorder, tokens = run_request(config, settings, backend, params)
    vocab = config.model_config.get_vocab_size()
    assert len(tokens) == 1 + DECODE_STEPS
    assert all(0 <= t < vocab for t in tokens)
    assert len(recorder.calls) == 1 + DECODE_STEPS  # one prefill call, then decode calls
    rows = recorder.calls  # one real row per call: the request
    if not settings.exact_sampling:
        # Device-sampled: top_k clamped to global_topk, its own temperature and top_p,
        # no logits back.
        assert all(row["needs_logits"].tolist() == [False] for row in rows)
        assert all(row["top_k"].tolist() == [settings.global_topk] for row in rows)
        assert all(row["temperature"].tolist() == pytest.approx([0.7]) for row in rows)
        assert all(row["top_p"].tolist() == pytest.approx([0.9]) for row in rows)
        assert recorder.counts["logits"] == 0
        assert recorder.counts["device_rows"] == 1 + DECODE_STEPS
    else:
        # Host-sampled: its logits come back (the whole vocabulary) for vLLM's sampler.
        assert all(row["needs_logits"].tolist() == [True] for row in rows)
        assert recorder.logits_rows == [1] * (1 + DECODE_STEPS)
        assert recorder.counts["logits"] == (1 + DECODE_STEPS) * vocab * 4
        assert recorder.counts["device_rows"] == 0
