"""Which requests the device samples, how on-device sampling is switched on and off, and
that the switch reaches the compile-cache key (it changes the compiled graphs)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

from vllm import SamplingParams  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402

from neuron_plugin.backends.loader import cache_manifest, make_backend  # noqa: E402
from neuron_plugin.core.sampling import (  # noqa: E402
    DISABLED_ENV,
    SamplingInputs,
    on_device_refusal,
)
from neuron_plugin.core.settings import (  # noqa: E402
    EngineLimits,
    NeuronConfigError,
    resolve_settings,
)

LIMITS = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32")


def resolve(override=None, backend="reference", disabled=None):
    return resolve_settings(LIMITS, override, backend=backend,
                            architecture="LlamaForCausalLM",
                            on_device_sampling_disabled=disabled)


@pytest.mark.parametrize("params,refusal", [
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(temperature=0.8, top_k=50, top_p=0.9), None),
    (SamplingParams(temperature=0.8, top_k=256), None),
    (SamplingParams(temperature=0.8), "top_k=0"),  # the whole vocabulary
    (SamplingParams(temperature=0.8, top_k=257), "global_topk=256"),
    (SamplingParams(temperature=0.0, logprobs=0), "logprobs"),
    (SamplingParams(temperature=0.0, logprob_token_ids=[3]), "logprob_token_ids"),
    (SamplingParams(temperature=0.0, frequency_penalty=0.1), "frequency_penalty"),
    (SamplingParams(temperature=0.7, top_k=5, min_p=0.1), "min_p"),
    (SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]), "allowed_token_ids"),
    (SamplingParams(temperature=0.7, top_k=5, seed=3), "seed"),
    (SamplingParams(temperature=0.0, thinking_token_budget=8), "thinking_token_budget"),
    (SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(
        choice=["a", "b"])), "structured_outputs"),
])
def test_which_requests_the_device_samples(params, refusal):
    got = on_device_refusal(params)
    assert got is None if refusal is None else refusal in got


def test_rows_are_encoded_as_nxdi_takes_them():
    """Greedy and host rows become top-k 1 at temperature 1 (vllm-neuron's encoding);
    sampled rows keep their values."""
    rows = SamplingInputs.for_rows(
        temperature=np.array([0.0, 0.7, 0.7], dtype=np.float32),
        top_k=np.array([1024, 40, 40]), top_p=np.array([1.0, 0.9, 0.9], dtype=np.float32),
        needs_logits=np.array([False, False, True]),
        uniform=np.array([0.5, 0.25, 0.75], dtype=np.float32))
    assert rows.top_k.tolist() == [1, 40, 1]
    assert rows.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0])
    assert rows.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    padded = rows.take(np.array([2, 1])).padded(4)
    assert padded.top_k.tolist() == [1, 40, 1, 1]
    assert padded.needs_logits.tolist() == [True, False, False, False]


@pytest.mark.parametrize("backend", ["reference", "nxd"])
def test_on_by_default_with_global_topk_256(backend):
    settings = resolve(backend=backend)
    assert (settings.on_device_sampling, settings.global_topk) == (True, 256)
    assert resolve({"on_device_sampling_config": {"global_topk": 64}},
                   backend=backend).global_topk == 64


@pytest.mark.parametrize("override,disabled,on", [
    ({"on_device_sampling_config": None}, None, False),
    ({}, "1", False),
    ({"on_device_sampling_config": {"global_topk": 8}}, " 2 ", False),
    ({}, "0", True),
    ({}, "", True),
])
def test_switched_off_by_null_config_or_vllm_neurons_variable(override, disabled, on):
    settings = resolve(override, disabled=disabled)
    assert settings.on_device_sampling is on
    # Off, NxDI must not get a sampler config either (it would compile one in).
    assert on or "on_device_sampling_config" not in settings.passthrough


@pytest.mark.parametrize("override,disabled,fragments", [
    ({}, "yes", [DISABLED_ENV, "'yes'", "set it to 1"]),
    ({"on_device_sampling_config": {"global_topk": 0}}, None,
     ["global_topk=0", "positive integer"]),
    ({"on_device_sampling_config": {"global_topk": "256"}}, None, ["global_topk='256'"]),
])
def test_bad_values_name_setting_value_and_fix(override, disabled, fragments):
    with pytest.raises(NeuronConfigError) as info:
        resolve(override, disabled=disabled)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_sampler_settings_are_part_of_the_compile_cache_key(model_dirs):
    on = resolve()
    off = resolve({"on_device_sampling_config": None})
    fewer = resolve({"on_device_sampling_config": {"global_topk": 64}})

    def key(settings):
        return cache_manifest(settings, make_backend(settings, model_dirs["llama"]))

    assert len({str(key(s)) for s in (on, off, fewer)}) == 3
    # The backend's process is no part of it.
    assert key(on) == key(dataclasses.replace(on, backend_python="/usr/bin/python3"))


def test_vllm_settings_pass_the_variable_in(model_dirs, monkeypatch):
    """`NEURON_ON_DEVICE_SAMPLING_DISABLED=1` in the environment of the process that
    resolves vLLM's config turns on-device sampling off."""
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.serving.vllm_settings import resolve_from_vllm_config

    config = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256,
                        max_num_seqs=4, enable_prefix_caching=False,
                        enable_chunked_prefill=False).create_engine_config()
    assert resolve_from_vllm_config(config).on_device_sampling
    monkeypatch.setenv(DISABLED_ENV, "1")
    assert not resolve_from_vllm_config(config).on_device_sampling
