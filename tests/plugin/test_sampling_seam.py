"""A serving call with on-device sampling on the reference backend, in-process and
through the runner (a real subprocess in the SDK environment: torch 2.9, the graphs
compiled there): a token for every row from the compiled sampler, logits back for only
the rows that need the host, and both paths agreeing with the logits-only `forward`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from neuron_plugin.backends.loader import open_backend
from neuron_plugin.backends.runner.client import RunnerBackend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import EngineLimits, resolve_settings

ROWS = 4
TOP_K = 3


@pytest.fixture(scope="module")
def settings():
    limits = EngineLimits(max_model_len=64, max_num_seqs=ROWS, block_size=None,
                          enable_prefix_caching=False, enable_chunked_prefill=False,
                          max_num_batched_tokens=64, dtype="float32")
    return resolve_settings(limits, {"context_encoding_buckets": [32],
                                     "token_generation_buckets": [64]},
                            backend="reference", architecture="LlamaForCausalLM")


@pytest.fixture(scope="module", params=["in-process", "runner-sdk"])
def backend(request, settings, model_dirs, tmp_path_factory):
    """A loaded backend whose sequences 0..3 hold 20-token prompts."""
    if request.param == "runner-sdk":
        settings = dataclasses.replace(settings,
                                       backend_python=request.getfixturevalue("sdk_python"))
    loaded = open_backend(settings, model_dirs["llama"],
                          str(tmp_path_factory.mktemp("sampling-cache")))
    for seq in range(ROWS):
        prompt = np.arange(5 + seq, 25 + seq, dtype=np.int64)
        loaded.run(context_encoding_inputs(settings, prompt, 0, seq, None),
                   SamplingInputs.greedy(1))
    yield loaded
    if isinstance(loaded, RunnerBackend):
        loaded.close()


def _decode(settings):
    return token_generation_inputs(settings, np.array([3, 4, 5, 6]), np.full(ROWS, 20),
                                   np.arange(ROWS), None)


def test_device_rows_get_tokens_and_only_host_rows_get_logits(backend, settings):
    decode = _decode(settings)
    expected = backend.forward(decode).clone()
    # rows: greedy (device), host, top-k at a high temperature (device), host
    sampling = SamplingInputs.for_rows(
        temperature=np.array([0.0, 0.8, 4.0, 0.0], dtype=np.float32),
        top_k=np.array([0, 0, TOP_K, 0]), top_p=np.ones(ROWS, dtype=np.float32),
        needs_logits=np.array([False, True, False, True]),
        uniform=np.array([[0.1], [0.2], [0.9], [0.4]], dtype=np.float32))
    out = backend.run(decode, sampling)
    assert out.tokens.dtype == np.int32 and out.tokens.shape == (ROWS, 1)
    assert out.logits.shape == (2, expected.shape[1])  # only the host rows crossed
    assert torch.allclose(out.logits, expected[[1, 3]], atol=1e-5)
    assert out.tokens[0, 0] == int(expected[0].argmax())
    assert out.tokens[2, 0] in expected[2].topk(TOP_K).indices.tolist()
    # the uniform draw decides among the three: a low draw takes the most likely one
    low = dataclasses.replace(sampling, uniform=np.zeros((ROWS, 1), dtype=np.float32))
    assert backend.run(decode, low).tokens[2, 0] == int(expected[2].argmax())


def test_all_device_call_returns_no_logits(backend, settings):
    decode = _decode(settings)
    expected = backend.forward(decode).argmax(-1).numpy()
    out = backend.run(decode, SamplingInputs.greedy(ROWS))
    assert out.logits.shape[0] == 0
    assert out.tokens[:, 0].tolist() == expected.tolist()
