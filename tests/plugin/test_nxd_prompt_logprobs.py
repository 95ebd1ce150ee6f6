"""Prompt logprobs on the NxD path (backends/nxd/prompt_graphs.py) against the NxDI
double (tests/plugin/fake_nxdi: NxD traces a submodel's own NeuronBaseModel subclass,
whose get_model_output has every position's hidden state, models/model_base.py;
_nxd_runtime computes every position's logits for it; NxD's router and packer, which the
prompt-logprob submodel's shapes would collide with, and NxDI's re-encoding of the
prefix tail in the block layout, model_wrapper.py `_pad_prefix_caching_inputs`).
Expected values: torch's float32 log-softmax of the logits the double's decoder gives
each prefix (_nxd_runtime: the peak at `expected(prefix)`, one lower per id above),
independent of the plugin. Real NxDI in its CPU mode against transformers:
tests/e2e/test_nxdi_prompt_logprobs.py."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from neuron_plugin.backends.base import graph_specs, run_graph_once
from neuron_plugin.backends.nxd.prompt_graphs import PROMPT_TAG
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.prompt_logprobs import PromptLogprobs, prompt_targets
from neuron_plugin.core.sampling import SamplingInputs
from neuron_plugin.core.settings import NeuronConfigError, resolve_settings
from tests.plugin.test_nxd_backend import (  # noqa: F401  (fixtures)
    LIMITS,
    PREFIX,
    VOCAB,
    expected,
    loaded,
    sampling,
    seam,
    settings,
    tiny,
)

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

K = 5
CHUNKED = dict(PREFIX, enable_chunked_prefill=True, max_num_batched_tokens=64)


def plp_settings(limits: dict | None = None, override: dict | None = None,
                 sampling_off: bool = False):
    return resolve_settings(
        dataclasses.replace(LIMITS, max_logprobs=K, **(limits or {})), override,
        backend="nxd", architecture="LlamaForCausalLM", prompt_logprobs=True,
        on_device_sampling_disabled="1" if sampling_off else None)


def oracle(prompt: np.ndarray) -> PromptLogprobs:
    """Positions 0..n-2 of `prompt`: the double's logits of each prefix (its peak at
    expected(prefix)), torch's log-softmax, vLLM's layout and rank rule
    (Sampler.gather_logprobs: tokens at least as likely as the target)."""
    ids, values, ranks = [], [], []
    vocab = torch.arange(VOCAB)
    for q in range(len(prompt) - 1):
        logits = -((vocab - expected(prompt[: q + 1])) % VOCAB).float()
        logprobs = logits.log_softmax(-1)
        top = torch.topk(logprobs, K)
        target = int(prompt[q + 1])
        ids.append([target, *top.indices.tolist()])
        values.append([float(logprobs[target]), *top.values.tolist()])
        ranks.append(int((logprobs >= logprobs[target]).sum()))
    return PromptLogprobs(np.array(ids), np.array(values, dtype=np.float32), np.array(ranks))


def scored(backend, prompt, seq, blocks, chunk=None, sample=None) -> PromptLogprobs:
    """`prompt` prefilled into `seq` in chunks of `chunk` tokens (all at once without),
    each call scoring its positions; their prompt logprobs joined."""
    s = backend.settings
    parts, start, chunk = [], 0, chunk or len(prompt)
    while start < len(prompt):
        end = min(start + chunk, len(prompt))
        inputs = context_encoding_inputs(s, prompt[:end], start, seq, blocks)
        targets = prompt_targets(prompt, start, end - start, inputs.input_ids.shape[1])
        inputs = dataclasses.replace(inputs, prompt_targets=targets)
        out = backend.run(inputs, sample or sampling(1, needs_logits=False))
        assert out.prompt_logprobs is not None
        parts.append(out.prompt_logprobs)
        start = end
    return PromptLogprobs(*(np.concatenate([getattr(p, n) for p in parts])
                            for n in PromptLogprobs.ARRAYS))


def check(answer: PromptLogprobs, prompt: np.ndarray) -> None:
    want = oracle(prompt)
    assert answer.token_ids.tolist() == want.token_ids.tolist()
    np.testing.assert_allclose(answer.logprobs, want.logprobs, rtol=0, atol=1e-5)
    assert answer.ranks.tolist() == want.ranks.tolist()


def test_contiguous_batch_of_prompts_equal_log_softmax(seam, tiny, tmp_path):
    """Three sequences, each prompt scored in one call, then a decode of all three:
    values equal the oracle's and the cache holds what a plain prefill leaves."""
    s = plp_settings()
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompts = {0: np.arange(1, 20), 2: np.array([7, 3, 9, 4]), 1: np.arange(30, 130)}
    for seq, prompt in prompts.items():
        check(scored(backend, prompt, seq, None), prompt)
    tokens = np.array([11, 22, 33])
    seqs = np.array(list(prompts))
    positions = np.array([len(p) for p in prompts.values()])
    decode = token_generation_inputs(s, tokens, positions, seqs, None, logits=True)
    assert backend.forward(decode).argmax(-1).tolist() == [
        expected([*p, t]) for p, t in zip(prompts.values(), tokens, strict=True)]


@pytest.mark.parametrize("seam", ["0.8"], indirect=True)  # the inf2/trn1 release
def test_chunked_prefill_scores_every_chunk_equal_log_softmax(seam, tiny, tmp_path):
    """Block layout with chunked prefill: a 200-token prompt in four 64-token chunks
    (NxDI re-encodes the cached prefix tail in front of a chunk, so a graph's rows start
    before it), each chunk's last position scoring the next chunk's first token; a
    second sequence prefilled whole beside it; their decode after."""
    s = plp_settings(CHUNKED)
    backend = loaded(s, tiny, tmp_path / "graphs")
    long, short = np.arange(3, 203) % 50 + 1, np.array([9, 8, 7, 6, 5])
    check(scored(backend, long, 0, list(range(1, 8)), chunk=64), long)
    check(scored(backend, short, 1, [8]), short)
    chunks = [row for row in backend.model.traced_model.inputs if row[0].shape[1] > 1][:4]
    starts = [int(row[2][0, 0]) for row in chunks]  # each graph's first row's position
    # the 128-token prefill bucket takes 64 (then 120) prefix tokens in front of the
    # chunks at 128 and 192 (model_wrapper._pad_prefix_caching_inputs)
    assert starts == [0, 0, 128 - 64, 192 - 120]
    decode = token_generation_inputs(s, np.array([40, 41]), np.array([200, 5]),
                                     np.array([0, 1]), [list(range(1, 8)), [8]], logits=True)
    assert backend.forward(decode).argmax(-1).tolist() == [
        expected([*long, 40]), expected([*short, 41])]


def test_what_leaves_the_device_is_o_of_k_per_position(seam, tiny, tmp_path):
    """A scoring prefill runs the prompt-logprob submodel, which returns the context
    encoding's usual answer (a token, one row of logits) and, per bucket position,
    K + 1 ids and logprobs and a rank: no [positions, vocab] tensor. A prefill that
    does not score runs NxDI's own context encoding, whose shapes the prompt-logprob
    submodel shares (NxD's router would pick the later one)."""
    s = plp_settings()
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompt = np.arange(1, 41)
    scored(backend, prompt, 0, None)
    tag, returned = backend.model.traced_model.ran[-1][0], backend.model.traced_model.returned[-1]
    width = context_encoding_inputs(s, prompt, 0, 0, None).input_ids.shape[1]
    row = 4 * (VOCAB + VOCAB % 2)  # the double's logits: vocabulary padded to TP 2, float32
    assert (tag, returned) == (PROMPT_TAG, {
        "tokens": 4, "logits": row, "appended_0": width * (K + 1) * 4,
        "appended_1": width * (K + 1) * 4, "appended_2": width * 4, "appended_3": 4})
    per_position = (sum(returned.values()) - 4 - row) / width
    assert per_position == 8 * (K + 1) + 4 + 4 / width
    plain = context_encoding_inputs(s, prompt, 0, 1, None)
    backend.run(plain, sampling(1, needs_logits=False))
    assert backend.model.traced_model.ran[-1][0] == "context_encoding_model"
    assert backend.model.traced_model.returned[-1] == {"tokens": 4, "logits": row}


def test_every_context_bucket_has_its_prompt_logprob_graph(seam, tiny, tmp_path):
    """The bucket plan lists a prompt-logprob graph per context-encoding bucket; NxDI's
    application compiles exactly those (the submodel's buckets are the context
    encoder's), and warm-up runs each one through its own graph."""
    s = plp_settings(PREFIX)
    backend = loaded(s, tiny, tmp_path / "graphs")
    plp = [g for g in graph_specs(s) if g.prompt_logprobs]
    assert [g.shape for g in plp] == s.context_encoding_shapes()
    submodel = getattr(backend.model, str(PROMPT_TAG))
    assert submodel.neuron_config.buckets == backend.model.context_encoding_model.neuron_config.buckets
    for graph in plp:
        run_graph_once(backend, graph)
        tag, bucket = backend.model.traced_model.ran[-1]
        assert (tag, tuple(bucket)) == (PROMPT_TAG, graph.shape)


def test_on_device_sampling_off_answers_logits_and_prompt_logprobs(tiny, tmp_path, seam):
    """Without on-device sampling every row goes to the host: the prompt-logprob call
    answers its row of logits (the last prompt token's) beside the prompt logprobs."""
    s = plp_settings({"tp_degree": 1}, sampling_off=True)  # host sampling: a TP that
    assert not s.on_device_sampling  # divides the vocabulary (compat, padded vocabulary)
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompt = np.array([4, 9, 2, 7, 7, 1])
    host = SamplingInputs.host_rows(1)
    inputs = context_encoding_inputs(s, prompt, 0, 0, None)
    inputs = dataclasses.replace(
        inputs, prompt_targets=prompt_targets(prompt, 0, len(prompt), inputs.input_ids.shape[1]))
    out = backend.run(inputs, host)
    assert out.logits.shape == (1, VOCAB) and out.logits.argmax(-1).tolist() == [expected(prompt)]
    assert out.prompt_logprobs is not None
    check(out.prompt_logprobs, prompt)


@pytest.mark.parametrize(("override", "named"), [
    ({"sequence_parallel_enabled": True}, "sequence_parallel_enabled=True on the nxd backend"),
    ({"windowed_context_encoding_size": 64}, "windowed_context_encoding_size=64"),
    ({"on_cpu": True}, "prompt_logprobs=true without continuous batching"),
])
def test_context_encodings_without_every_position_are_refused(override, named):
    """NxDI configurations whose context encoding keeps the last hidden state only, and
    NxDI's CPU mode without continuous batching (one module of the first submodel's
    class for all), are refused when the settings are resolved, naming the key."""
    limits = {"max_num_seqs": 1, "tp_degree": 1} if "on_cpu" in override else None
    with pytest.raises(NeuronConfigError, match=named.replace("(", r"\(")):
        plp_settings(limits, override)


def test_prompt_logprobs_above_max_logprobs_keep_vllms_refusal(model_dirs, monkeypatch):
    """On nxd the graphs' k is vLLM's --max-logprobs, the bound vLLM itself checks a
    request against (SamplingParams._validate_logprobs, HTTP 400): a request at the
    bound is served, one above it gets vLLM's own error, not the plugin's."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError

    from neuron_plugin.platform import NeuronPlatform
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    monkeypatch.setenv("VLLM_NEURON_BACKEND", "nxd")
    config = EngineArgs(model=str(model_dirs["llama"]), dtype="float32", max_model_len=256,
                        max_num_seqs=2, max_logprobs=K,
                        additional_config={"prompt_logprobs": True}).create_engine_config()
    assert settings_from_vllm_config(config).prompt_logprobs == K
    prompt = {"prompt_token_ids": [1, 2, 3]}
    at_bound = SamplingParams(prompt_logprobs=K)
    at_bound._validate_logprobs(config.model_config)
    NeuronPlatform.validate_request(prompt, at_bound)
    with pytest.raises(VLLMValidationError, match=f"greater than max allowed: {K}"):
        SamplingParams(prompt_logprobs=K + 1)._validate_logprobs(config.model_config)


def test_vocabulary_sharded_across_ranks_equals_the_whole_log_softmax():
    """With TP the lm_head is column-parallel: each rank holds a slice of the vocabulary
    (the last one padded, at the float minimum as NxDI's mask_padded_logits leaves it).
    Four ranks, each in its own thread with an all-gather along the last dimension,
    answer what the whole vocabulary's log-softmax gives (ranks gathered only their
    statistics and top-k candidates)."""
    import threading

    from neuron_plugin.backends.prompt_logprobs import sharded_top_logprobs

    world, shard, vocab = 4, 10, 37
    torch.manual_seed(0)
    logits = torch.full((2, 6, world * shard), torch.finfo(torch.float32).min)
    logits[..., :vocab] = torch.randn(2, 6, vocab) * 3
    targets = torch.randint(0, vocab, (2, 6))
    targets[0, 0], targets[1, 5] = vocab - 1, 0  # the last rank's last real id, the first's
    want = logits[..., :vocab].log_softmax(-1)
    barrier, slots, answers = threading.Barrier(world), [None] * world, [None] * world

    def all_gather(rank):
        def gather(tensor):
            slots[rank] = tensor
            barrier.wait()
            whole = torch.cat(list(slots), dim=-1)
            barrier.wait()
            return whole
        return gather

    def run(rank):
        local = logits[..., rank * shard:(rank + 1) * shard]
        answers[rank] = sharded_top_logprobs(local, targets, K, torch.tensor([rank]),
                                             all_gather(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    top = want.topk(K, dim=-1)
    target_logprobs = want.gather(-1, targets[..., None])
    for ids, logprobs, ranks in answers:  # every rank holds the same answer
        assert torch.equal(ids[..., 0], targets.to(torch.int32))
        assert torch.equal(ids[..., 1:], top.indices.to(torch.int32))
        torch.testing.assert_close(logprobs[..., 1:], top.values, rtol=0, atol=1e-5)
        torch.testing.assert_close(logprobs[..., :1], target_logprobs, rtol=0, atol=1e-5)
        assert torch.equal(ranks, (want >= target_logprobs).sum(-1))
