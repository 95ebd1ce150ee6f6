"""Which requests the device samples, how on-device sampling is switched on and off, and
that the switch reaches the compile-cache key (it changes the compiled graphs) while
exact sampling does not (it only moves rows between device and host)."""

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
    EXACT_SAMPLING_KEY,
    SamplingInputs,
    on_device_refusal,
    sampling_summary,
)
from neuron_plugin.core.settings import (  # noqa: E402
    EngineLimits,
    NeuronConfigError,
    resolve_settings,
)

LIMITS = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32")


def resolve(override=None, backend="reference", disabled=None, exact=None):
    return resolve_settings(LIMITS, override, backend=backend,
                            architecture="LlamaForCausalLM",
                            on_device_sampling_disabled=disabled, exact_sampling=exact)


@pytest.mark.parametrize("params,refusal", [
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(temperature=0.8, top_k=50, top_p=0.9), None),
    (SamplingParams(temperature=0.8, top_k=256), None),
    # Without top_k, or above global_topk: clamped to global_topk on the device.
    (SamplingParams(temperature=0.7, top_p=0.9), None),
    (SamplingParams(temperature=0.8, top_k=-1), None),
    (SamplingParams(temperature=0.8, top_k=257), None),
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
    # Exact mode refuses what the clamp serves; the rest is decided alike.
    exact = on_device_refusal(params, exact=True)
    if params.temperature > 0 and params.top_k in (0, -1, 257):
        assert exact is not None
    else:
        assert exact == got


@pytest.mark.parametrize("params,refusal", [
    (SamplingParams(temperature=0.7, top_p=0.9), "top_k=0"),  # the whole vocabulary
    (SamplingParams(temperature=0.8, top_k=-1), "top_k=-1"),
    (SamplingParams(temperature=0.8, top_k=257), "global_topk=256"),
    (SamplingParams(temperature=0.8, top_k=256), None),
    (SamplingParams(temperature=0.0), None),  # greedy needs no top-k
])
def test_exact_mode_samples_the_whole_vocabulary_on_the_host(params, refusal):
    got = on_device_refusal(params, 256, exact=True)
    assert got is None if refusal is None else (refusal in got and EXACT_SAMPLING_KEY in got)
    # A smaller global_topk moves the line.
    assert on_device_refusal(SamplingParams(temperature=0.8, top_k=64), 32, exact=True)
    assert on_device_refusal(SamplingParams(temperature=0.8, top_k=64), 32) is None


def test_rows_are_encoded_as_nxdi_takes_them():
    """Greedy and host rows become top-k 1 at temperature 1 (vllm-neuron's encoding);
    sampled rows keep their values."""
    rows = SamplingInputs.for_rows(
        temperature=np.array([0.0, 0.7, 0.7], dtype=np.float32),
        top_k=np.array([1024, 40, 40]), top_p=np.array([1.0, 0.9, 0.9], dtype=np.float32),
        needs_logits=np.array([False, False, True]),
        uniform=np.array([[0.5], [0.25], [0.75]], dtype=np.float32))
    assert rows.top_k.tolist() == [1, 40, 1]
    assert rows.temperature.tolist() == pytest.approx([1.0, 0.7, 1.0])
    assert rows.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    padded = rows.take(np.array([2, 1])).padded(4)
    assert padded.top_k.tolist() == [1, 40, 1, 1]
    assert padded.needs_logits.tolist() == [True, False, False, False]


def test_rows_without_top_k_get_global_topk_explicitly():
    """vLLM's input batch holds "no top-k" as the vocabulary size (a request's 0 or -1
    also reaches here as 0 or -1): a device row gets global_topk, never 0/-1 (NxDI's
    uniform draw) nor a value above it (NxDI refuses it). Host and greedy rows stay 1."""
    rows = SamplingInputs.for_rows(
        temperature=np.array([0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.0], dtype=np.float32),
        top_k=np.array([151936, 0, -1, 257, 64, 151936, 151936]),
        top_p=np.full(7, 0.9, dtype=np.float32),
        needs_logits=np.array([False, False, False, False, False, True, False]),
        uniform=np.zeros((7, 1), dtype=np.float32), global_topk=64)
    assert rows.top_k.tolist() == [64, 64, 64, 64, 64, 1, 1]
    assert rows.top_k.dtype == np.int32
    assert SamplingInputs.for_rows(
        temperature=np.array([0.7], dtype=np.float32), top_k=np.array([151936]),
        top_p=np.ones(1, dtype=np.float32), needs_logits=np.zeros(1, dtype=bool),
        uniform=np.zeros((1, 1), dtype=np.float32)).top_k.tolist() == [256]


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


def test_exact_sampling_is_off_by_default_and_a_boolean():
    assert resolve().exact_sampling is False
    assert resolve(exact=False).exact_sampling is False
    assert resolve(exact=True).exact_sampling is True
    for bad in ("yes", 1, "true"):
        with pytest.raises(NeuronConfigError) as info:
            resolve(exact=bad)
        message = str(info.value)
        assert f"additional_config.{EXACT_SAMPLING_KEY}={bad!r}" in message
        assert "true or false" in message and "remove it" in message


@pytest.mark.parametrize("on,exact,fragments", [
    (True, False, ["256 most likely tokens", "without top_k", '{"exact_sampling": true}']),
    (True, True, ["exactly on the host", "whole vocabulary"]),
    (False, False, ["on the host"]),
])
def test_start_up_line_says_what_the_default_means(on, exact, fragments):
    line = sampling_summary(on, 256, exact)
    for fragment in fragments:
        assert fragment in line


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
    # The backend's process is no part of it, nor exact sampling (it changes no graph).
    assert key(on) == key(dataclasses.replace(on, backend_python="/usr/bin/python3"))
    assert key(on) == key(resolve(exact=True))


def test_vllm_settings_pass_the_variable_in(model_dirs, monkeypatch):
    """`NEURON_ON_DEVICE_SAMPLING_DISABLED=1` in the environment of the process that
    resolves vLLM's config turns on-device sampling off."""
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.serving.vllm_settings import resolve_from_vllm_config

    config = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256,
                        max_num_seqs=4, enable_prefix_caching=False,
                        enable_chunked_prefill=False).create_engine_config()
    assert resolve_from_vllm_config(config).on_device_sampling
    assert not resolve_from_vllm_config(config).exact_sampling
    monkeypatch.setenv(DISABLED_ENV, "1")
    assert not resolve_from_vllm_config(config).on_device_sampling


def test_vllm_settings_read_exact_sampling_from_additional_config(model_dirs):
    """`--additional-config '{"exact_sampling": true}'` reaches the settings the engine
    reads back; a wrong value is refused before anything compiles."""
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.serving.vllm_settings import resolve_from_vllm_config

    def config(value):
        return EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256,
                          max_num_seqs=4, enable_prefix_caching=False,
                          enable_chunked_prefill=False,
                          additional_config={EXACT_SAMPLING_KEY: value}).create_engine_config()

    assert resolve_from_vllm_config(config(True)).exact_sampling
    with pytest.raises(ValueError, match=r"exact_sampling=.on. must be true or false"):
        config("on")
