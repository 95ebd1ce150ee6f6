"""Prompt logprobs below vLLM: the setting, the targets a prefill call scores, and the
reference backend's prompt-logprob graphs (in this process and across the runner's
boundary) against transformers' log-softmax."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch

from neuron_plugin.backends.base import graph_specs
from neuron_plugin.backends.loader import open_backend
from neuron_plugin.backends.runner.client import RunnerBackend
from neuron_plugin.core.inputs import context_encoding_inputs
from neuron_plugin.core.prompt_logprobs import NO_TARGET, prompt_targets
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.vision import VisionLimits
from tests.e2e.support import float32_model

K = 3
BUCKETS = {"context_encoding_buckets": [16, 32, 64], "token_generation_buckets": [64]}


def limits(block: bool, **changes) -> EngineLimits:
    base = EngineLimits(max_model_len=64, max_num_seqs=2, block_size=16 if block else None,
                        enable_prefix_caching=block, enable_chunked_prefill=block,
                        max_num_batched_tokens=64, dtype="float32", max_logprobs=K)
    return dataclasses.replace(base, **changes)


def settings_for(block: bool, prompt_logprobs: object = True, backend: str = "reference",
                 sampling_off: bool = False, **changes):
    return resolve_settings(limits(block, **changes), BUCKETS, backend=backend,
                            architecture="LlamaForCausalLM", prompt_logprobs=prompt_logprobs,
                            on_device_sampling_disabled="1" if sampling_off else None)


def test_setting_compiles_one_prompt_graph_per_context_encoding_shape():
    on, off = settings_for(False), settings_for(False, prompt_logprobs=None)
    assert on.prompt_logprobs == K and off.prompt_logprobs is None
    assert settings_for(False, prompt_logprobs=False).prompt_logprobs is None
    extra = [g for g in graph_specs(on) if g.prompt_logprobs]
    assert [g.shape for g in extra] == on.context_encoding_shapes() == [(16,), (32,), (64,)]
    assert [g.name for g in extra] == ["cte_plp_16", "cte_plp_32", "cte_plp_64"]
    assert on.graph_count() == off.graph_count() + 3 == len(graph_specs(on))


@pytest.mark.parametrize(("value", "changes", "backend", "named"), [
    ("yes", {}, "reference", "additional_config.prompt_logprobs='yes' must be true or false"),
    (True, {"max_logprobs": -1}, "reference", "set --max-logprobs to the largest k"),
    (True, {"logprobs_mode": "raw_logits"}, "reference", "--logprobs-mode raw_logits"),
    (True, {"vision": VisionLimits(4, 1024, 4)}, "reference", "with a vision-language model"),
])
def test_what_cannot_be_served_is_refused_naming_the_setting(value, changes, backend, named):
    with pytest.raises(NeuronConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        settings_for(False, prompt_logprobs=value, backend=backend, **changes)


def test_targets_follow_vllms_rule_across_chunks():
    """Position i scores prompt token i + 1 (gpu_model_runner `_get_prompt_logprobs_dict`):
    a middle chunk scores all its positions (its last one the next chunk's first token),
    the last chunk all but the prompt's last position, and padding nothing."""
    prompt = np.arange(100, 110)
    first = prompt_targets(prompt, 0, 4, 8)
    assert first.tolist() == [[101, 102, 103, 104, NO_TARGET, NO_TARGET, NO_TARGET, NO_TARGET]]
    last = prompt_targets(prompt, 4, 6, 8)
    assert last.tolist() == [[105, 106, 107, 108, 109, NO_TARGET, NO_TARGET, NO_TARGET]]
    assert (prompt_targets(prompt, 9, 1, 4) == NO_TARGET).all()


@pytest.fixture(scope="module")
def cache_url(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("prompt-logprobs-cache"))


@pytest.fixture(scope="module")
def expected(model_dirs):
    """transformers' float32 log-softmax of every position of PROMPT."""
    model = float32_model(model_dirs["llama"])
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)


PROMPT = list(range(7, 47))  # 40 tokens


def _score(backend, settings, chunks: list[int]):
    """Encode PROMPT in chunks of the given sizes, each call scoring its positions: the
    calls' prompt logprobs (a runner's are copied out of its arena) and the last call's
    logits. open_backend has warmed every graph up, the prompt-logprob ones included."""
    answers, start, logits = [], 0, None
    ids = np.array(PROMPT, dtype=np.int64)
    blocks = [1, 2, 3] if settings.is_block_layout else None
    for count in chunks:
        inputs = context_encoding_inputs(settings, ids[: start + count], start, 0, blocks)
        targets = prompt_targets(ids, start, count, inputs.input_ids.shape[1])
        inputs = dataclasses.replace(inputs, prompt_targets=targets)
        out = backend.run(inputs, SamplingInputs.host_rows(1))
        assert out.prompt_logprobs is not None
        answers.append(out.prompt_logprobs)
        logits = out.logits.clone()
        start += count
    return answers, logits


@pytest.mark.parametrize(("block", "runner", "chunks", "sampling_off"), [
    (False, False, [40], False),
    (False, False, [40], True),
    (True, False, [16, 24], False),
    (True, True, [16, 24], False),
], ids=["contiguous", "contiguous-host-sampling", "block-chunked", "runner-block-chunked"])
def test_prompt_logprobs_equal_transformers(model_dirs, cache_url, expected, block, runner,
                                           chunks, sampling_off):
    """Every scored position: the target's logprob and rank, the top k ids and values, as
    transformers' log-softmax gives them; k + 1 ids and values and a rank per position
    come back (8 (k + 1) + 8 bytes), never the vocabulary. With on-device sampling off
    (no sampler in the graphs) the serving call answers them too."""
    settings = settings_for(block, sampling_off=sampling_off)
    assert settings.on_device_sampling != sampling_off
    if runner:
        settings = dataclasses.replace(settings, backend_python=sys.executable)
    backend = open_backend(settings, model_dirs["llama"], cache_url)
    try:
        assert isinstance(backend, RunnerBackend) == runner
        answers, logits = _score(backend, settings, chunks)
    finally:
        if isinstance(backend, RunnerBackend):
            backend.close()
    ids = np.concatenate([a.token_ids for a in answers])
    values = np.concatenate([a.logprobs for a in answers])
    ranks = np.concatenate([a.ranks for a in answers])
    positions = len(PROMPT) - 1
    assert ids.shape == values.shape == (positions, K + 1) and ranks.shape == (positions,)
    assert sum(a.nbytes() for a in answers) == positions * (8 * (K + 1) + 8)
    targets = torch.tensor(PROMPT[1:])
    want = expected[:-1]
    target_logprobs = want.gather(-1, targets[:, None])[:, 0]
    top = want.topk(K, dim=-1)
    assert (ids[:, 0] == PROMPT[1:]).all()
    assert np.allclose(values[:, 0], target_logprobs.numpy(), atol=1e-5)
    assert (ids[:, 1:] == top.indices.numpy()).all()
    assert np.allclose(values[:, 1:], top.values.numpy(), atol=1e-5)
    # the rank counts the tokens at least as likely: those within float noise of the
    # target may fall either way
    surely_above = (want > target_logprobs[:, None] + 1e-5).sum(-1).numpy()
    maybe_above = (want >= target_logprobs[:, None] - 1e-5).sum(-1).numpy()
    assert ((surely_above <= ranks) & (ranks <= maybe_above)).all()
    assert (ranks >= 1).all()
    # the call's usual answer too: the last prompt token's logits
    assert torch.allclose(logits[0].log_softmax(-1), expected[-1], atol=1e-5)



def test_measure_prices_context_encoding_on_the_usual_graph_alone(model_dirs, cache_url):
    """The cost tables (neuron-plugin measure, validate's speed section) get one entry per
    context-encoding shape: the prompt-logprob twin is not priced as a second one."""
    from neuron_plugin.tools.measure import time_buckets

    backend = open_backend(settings_for(False), model_dirs["llama"], cache_url)
    timings = time_buckets(backend, repeats=1, warmup=0)
    encoded = [shape for rows in timings.values() for shape, _ in rows if len(shape) == 1]
    assert sorted(encoded) == [(16,), (32,), (64,)]



@pytest.mark.parametrize("backend", ["reference", "nxd"])
def test_validate_runs_the_case_on_both_backends(model_dirs, backend):
    """`neuron-plugin validate` does not list prompt-logprobs as refused on either
    backend: the setting serves it on the reference backend and on nxd (the backend is
    chosen when the platform activates: a process of its own)."""
    import json
    import os
    import subprocess

    code = f"""
import json
from vllm.engine.arg_utils import EngineArgs
from neuron_plugin.tools.validate import _refusals
args = EngineArgs(model={str(model_dirs["llama"])!r}, max_model_len=128, max_num_seqs=2,
                  dtype="float32")
print("REFUSED", json.dumps(_refusals(args)))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_NEURON_BACKEND": backend})
    line = next(x for x in done.stdout.splitlines() if x.startswith("REFUSED"))
    refused = json.loads(line.removeprefix("REFUSED "))
    assert "prompt-logprobs" not in refused, refused
