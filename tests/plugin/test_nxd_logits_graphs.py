"""Logits only when a row needs them, on the NxD path (backends/nxd/graphs.py), against
the NxDI double, which reproduces what the design relies on (tests/plugin/fake_nxdi,
_nxd_runtime: NxD's shape router with its identical-shape collision, the per-tag bucket
models and flatteners, the one packer traced from the first submodel, and each
submodel's own output_logits; application_base: submodels compiled from their own
configs, eval() in to_cpu):
- with on-device sampling NxDI gets a token-generation submodel without logits and a
  logits variant beside it, sharing the weights and KV state;
- a decode whose rows are all device-sampled returns no logits from NxDI's graphs and
  none across the seam; a mixed decode runs the logits graph and hands the host rows'
  logits only across the seam; a prefill's graph returns its one row;
- routing through NxD's router instead would run the logits graph for every decode (its
  shapes take over the token-generation ones) or fail in the shared packer.
Real NxDI in its CPU mode: tests/e2e/test_nxdi_cpu_mode.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from neuron_plugin.backends.base import graph_specs
from neuron_plugin.backends.nxd import graphs
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.backends.nxd.graphs import LOGITS_TAG
from neuron_plugin.core.inputs import (
    CONTEXT_ENCODING,
    context_encoding_inputs,
    token_generation_bucket,
    token_generation_inputs,
)
from neuron_plugin.core.settings import NeuronConfigError, resolve_settings
from tests.plugin.fake_nxdi.nxdi_release import purge
from tests.plugin.test_nxd_backend import (  # noqa: F401  (fixtures)
    LIMITS,
    PREFIX,
    VOCAB,
    expected,
    loaded,
    release,
    sampling,
    seam,
    settings,
    tiny,
    use_release,
)

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")  # before vLLM picks a platform

ODS = {"on_device_sampling_config": {"global_topk": 8}}
# The double's graphs return logits over the vocabulary padded to the TP degree (2),
# in float32; tokens are int32.
ROW_BYTES = 4 * (VOCAB + VOCAB % 2)
PROMPTS = [[3, 4], [5], [6, 7, 8], [9, 10, 11, 12]]


def last(backend: NxDBackend) -> tuple[str, dict[str, int]]:
    """(tag, output bytes by name) of the last graph that ran."""
    traced = backend.model.traced_model
    return traced.ran[-1][0], traced.returned[-1]


def prefill(backend: NxDBackend, prompts, blocks) -> dict[int, list[int]]:
    """Each prompt into its sequence slot, device-sampled: seq -> context so far."""
    s = backend.settings
    contexts = {}
    for seq, prompt in enumerate(prompts):
        inputs = context_encoding_inputs(s, np.array(prompt), 0, seq, blocks and blocks[seq])
        out = backend.run(inputs, sampling(1, needs_logits=False))
        assert out.logits.shape == (0, VOCAB)
        if inputs.phase == CONTEXT_ENCODING:
            # NxDI's context encoding returns its one row of logits whoever samples it
            assert last(backend) == ("context_encoding_model",
                                     {"tokens": 4, "logits": ROW_BYTES})
        else:  # a one-token prompt in the block layout is a decode (core.inputs)
            assert last(backend) == ("token_generation_model", {"tokens": 4 * 4})
        contexts[seq] = [*prompt, int(out.tokens[0, 0])]
    return contexts


def decode(backend: NxDBackend, contexts, blocks, host: list[bool]):
    """One decode of every context, the rows in `host` sampled on the host."""
    seqs = sorted(contexts)
    rows = sampling(len(seqs), needs_logits=False)
    rows.needs_logits[:] = host
    inputs = token_generation_inputs(
        backend.settings,
        np.array([contexts[s][-1] for s in seqs]),
        np.array([len(contexts[s]) - 1 for s in seqs]),
        np.array(seqs),
        blocks and [blocks[s] for s in seqs],
        logits=any(host),
    )
    out = backend.run(inputs, rows)
    want = [expected(contexts[s]) for s in seqs]
    assert out.tokens[:, 0].tolist() == want
    for s, token in zip(seqs, want, strict=True):
        contexts[s].append(token)
    return out, want


def test_submodels_and_the_graphs_they_compile(seam, tiny, tmp_path):
    """By default one logits twin, of the largest token-generation graph."""
    s = settings(override=ODS)
    assert s.token_generation_logits_shapes() == [(4, 256)]
    names = [g.name for g in graph_specs(s)]
    assert names == ["cte_128", "cte_256", "tkg_4x128", "tkg_4x256", "tkg_logits_4x256"]
    assert s.graph_count() == 5
    model = loaded(s, tiny, tmp_path / "graphs").model
    assert [(w.tag, w.neuron_config.output_logits) for w in model.models] == [
        ("context_encoding_model", True), ("token_generation_model", False), (LOGITS_TAG, True)]
    variant = model.token_generation_logits_model
    assert variant is graphs.logits_variant(model)
    assert variant.neuron_config.buckets == [256]
    assert model.token_generation_model.neuron_config.buckets == [128, 256]
    assert model.traced_model.nxd_model.output_logits == {
        "context_encoding_model": True, "token_generation_model": False, LOGITS_TAG: True}
    assert model.neuron_config.output_logits  # NxDI's own parsing between calls
    off = settings({"tp_degree": 1}, {"on_device_sampling_config": None})
    assert off.token_generation_logits_shapes() == [] and off.graph_count() == 4
    plain = NxDBackend(off, tiny)._new_model()
    assert [w.tag for w in plain.models] == ["context_encoding_model", "token_generation_model"]
    assert not plain.neuron_config.output_logits


def test_logits_graphs_key_the_compile_cache(release, tiny):
    """Artifacts compiled before the split lack the logits graphs: a new key, not a
    load refused for its graph list."""
    from neuron_plugin.backends.loader import cache_manifest

    on = settings(override=ODS)
    manifest = cache_manifest(on, NxDBackend(on, tiny))
    assert manifest["neuron"]["token_generation_logits_shapes"] == [[4, 256]]
    off = settings({"tp_degree": 1}, {"on_device_sampling_config": None})
    assert "token_generation_logits_shapes" not in cache_manifest(off, NxDBackend(off, tiny))[
        "neuron"]


@pytest.mark.parametrize("limits", [{}, PREFIX], ids=["contiguous", "block"])
def test_decode_moves_logits_only_when_a_row_needs_them(seam, tiny, tmp_path, limits):
    s = settings(limits, ODS)
    backend = loaded(s, tiny, tmp_path / "graphs")
    blocks = [[1], [2], [3], [4]] if s.is_block_layout else None
    contexts = prefill(backend, PROMPTS, blocks)
    for host in ([False] * 4, [False, True, False, False], [False] * 4, [True] * 4):
        out, want = decode(backend, contexts, blocks, host)
        tag, returned = last(backend)
        if not any(host):
            assert tag == "token_generation_model"
            assert returned == {"tokens": 4 * 4}  # no logits left the "device"
            assert out.logits.shape == (0, VOCAB)
        else:
            assert tag == LOGITS_TAG
            assert returned == {"tokens": 4 * 4, "logits": 4 * ROW_BYTES}
            # only the host rows cross the seam
            assert out.logits.shape == (sum(host), VOCAB)
            assert out.logits.argmax(-1).tolist() == [w for w, h in zip(want, host) if h]


@pytest.mark.parametrize("seam", ["0.8", "0.9"], indirect=True)
def test_batch_bucketing_mixed_decode_runs_the_full_batch_logits_graph(seam, tiny, tmp_path):
    """NxDI batch-buckets the token_generation_model tag only: the logits graph is 1-D at
    the full batch, and a mixed decode of a smaller batch is padded up to it."""
    s = settings(override={**ODS, "token_generation_batches": [1, 2, 4]})
    backend = loaded(s, tiny, tmp_path / "graphs")
    model = backend.model
    assert model.token_generation_logits_model.neuron_config.buckets == [256]
    assert [4, 128] in model.token_generation_model.neuron_config.buckets
    contexts = prefill(backend, PROMPTS[:2], None)
    decode(backend, contexts, None, [False, False])
    assert model.traced_model.ran[-1] == ("token_generation_model", [2, 128])
    assert last(backend)[1] == {"tokens": 2 * 4}
    out, want = decode(backend, contexts, None, [True, False])
    assert model.traced_model.ran[-1] == (LOGITS_TAG, 256)
    assert last(backend)[1] == {"tokens": 4 * 4, "logits": 4 * ROW_BYTES}
    assert out.logits.argmax(-1).tolist() == want[:1]
    # forward() of a decode built for the (2, 128) graph: the logits graph, padded
    built = token_generation_inputs(s, np.array([contexts[0][-1], contexts[1][-1]]),
                                    np.array([len(contexts[0]) - 1, len(contexts[1]) - 1]),
                                    np.array([0, 1]), None)
    assert built.bucket == (2, 128)
    assert backend.forward(built).argmax(-1).tolist() == [expected(contexts[0]),
                                                         expected(contexts[1])]
    assert model.traced_model.ran[-1] == (LOGITS_TAG, 256)


def test_routing_by_nxds_router_would_run_the_logits_graph(seam, tiny, tmp_path, monkeypatch):
    """The regression explicit routing prevents: NxD's router maps the token-generation
    shapes to the logits graph added after it, so an all-device decode moves logits
    again (and NxDI hands the plugin [tokens, logits] where it parses tokens). With a
    twin at every length, every token-generation shape collides."""
    monkeypatch.setattr(graphs, "route_by_tag", lambda model: None)
    s = settings(override={**ODS, "token_generation_logits_buckets": [128, 256]})
    backend = loaded(s, tiny, tmp_path / "graphs")
    nxd_model = backend.model.traced_model.nxd_model
    example = backend.model.token_generation_model.input_generator()[0]
    assert nxd_model.router(list(example)) == (LOGITS_TAG, 0)
    contexts = prefill(backend, PROMPTS, None)
    with pytest.raises(AttributeError, match="reshape"):
        decode(backend, contexts, None, [False] * 4)
    assert last(backend) == (LOGITS_TAG, {"tokens": 4 * 4, "logits": 4 * ROW_BYTES})


@pytest.mark.parametrize("seam", ["0.8", "0.9"], indirect=True)
def test_shared_packer_cannot_unpack_a_tokens_only_graph(seam, tiny, tmp_path, monkeypatch):
    """Without explicit routing a batch-bucketed decode (shapes no logits graph has)
    reaches its own graph, whose one output the packer traced from the context encoder
    (tokens and logits) cannot unpack."""
    monkeypatch.setattr(graphs, "route_by_tag", lambda model: None)
    s = settings(override={**ODS, "token_generation_batches": [1, 2, 4]})
    backend = loaded(s, tiny, tmp_path / "graphs")
    contexts = prefill(backend, PROMPTS[:1], None)
    with pytest.raises(IndexError, match="packer was traced for 2 outputs"):
        decode(backend, contexts, None, [False])


def test_a_call_of_no_compiled_shape_names_the_submodel(seam, tiny, tmp_path):
    backend = loaded(settings(override=ODS), tiny, tmp_path / "graphs")
    wrapper = backend.model.token_generation_model
    example = list(wrapper.input_generator()[0])
    example[0] = example[0][:1]
    with pytest.raises(ValueError, match="token_generation_model has no graph for input "
                                         "shapes.*plugin bug"):
        wrapper._forward(*example)


# -- the model runner: bytes across the seam per engine step ------------------------------
def test_model_runner_moves_logits_only_for_host_rows(tiny, monkeypatch, tmp_path):
    """Engine steps through the real NeuronModelRunner on the nxd backend: an all-device
    decode step moves no logits out of NxDI's graphs nor across the backend seam (what a
    runner process writes into its output arena); a step with a logprobs request runs
    the logits graph and hands that request's row alone to vLLM's sampler."""
    from bench_host_overhead import scheduler_output
    from vllm import SamplingParams
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from neuron_plugin.serving.model_runner import NeuronModelRunner
    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    use_release("0.9-ef2731e", monkeypatch, tmp_path)
    config = EngineArgs(
        model=str(tiny), dtype="float32", max_model_len=64, max_num_seqs=4,
        enable_prefix_caching=False, enable_chunked_prefill=False,
        additional_config={"override_neuron_config": {
            "context_encoding_buckets": [16, 32], "token_generation_buckets": [64],
            # resolved for the reference backend here: the nxd default, one batch size
            "max_batch_buckets": 1}},
    ).create_engine_config()
    prompts = {"a": [3, 4, 5], "b": [6, 7], "c": [8, 9, 10, 11]}
    params = {"a": SamplingParams(temperature=0.0, max_tokens=8),
              "b": SamplingParams(temperature=0.0, max_tokens=8),
              "c": SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)}
    try:
        with set_current_vllm_config(config):
            s = dataclasses.replace(settings_from_vllm_config(config), backend="nxd")
            backend = loaded(s, tiny, tmp_path / "graphs")
            seam_bytes: list[int] = []
            run = backend.run

            def counted(inputs, rows):
                out = run(inputs, rows)
                seam_bytes.append(out.logits.numpy().nbytes)
                return out

            monkeypatch.setattr(backend, "run", counted)
            runner = NeuronModelRunner(config, s, backend, [])
            slots = {"a": 1, "b": 2, "c": 3}
            out_tokens = {r: [] for r in prompts}

            def new(req_id: str) -> NewRequestData:
                return NewRequestData(
                    req_id=req_id, prompt_token_ids=prompts[req_id], mm_features=[],
                    sampling_params=params[req_id], pooling_params=None,
                    block_ids=([slots[req_id]],), num_computed_tokens=0, lora_request=None)

            def running(ids: list[str]) -> CachedRequestData:
                return CachedRequestData(
                    req_ids=ids, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                    new_block_ids=[None] * len(ids),
                    num_computed_tokens=[len(prompts[r]) + len(out_tokens[r]) - 1
                                         for r in ids],
                    num_output_tokens=[len(out_tokens[r]) for r in ids])

            def step(so) -> tuple[list[tuple[str, dict[str, int]]], list[int], object]:
                traced = backend.model.traced_model
                start, seam_start = len(traced.ran), len(seam_bytes)
                runner.execute_model(so)
                out = runner.sample_tokens(None)
                for i, r in enumerate(out.req_ids):
                    out_tokens[r].extend(out.sampled_token_ids[i])
                graphs_ran = [(tag, returned) for (tag, _), returned in
                              zip(traced.ran[start:], traced.returned[start:], strict=True)]
                return graphs_ran, seam_bytes[seam_start:], out

            step(scheduler_output(new=[new("a"), new("b")], scheduled={"a": 3, "b": 2}))
            for _ in range(2):  # all-device decode steps
                ran, moved, _ = step(scheduler_output(cached=running(["a", "b"]),
                                                      scheduled={"a": 1, "b": 1}))
                assert ran == [("token_generation_model", {"tokens": 4 * 4})]
                assert moved == [0]
            # c (logprobs, host-sampled) is prefilled while a and b decode
            ran, moved, _ = step(scheduler_output(new=[new("c")], cached=running(["a", "b"]),
                                                  scheduled={"a": 1, "b": 1, "c": 4}))
            assert ran == [("token_generation_model", {"tokens": 4 * 4}),
                           ("context_encoding_model", {"tokens": 4, "logits": 4 * VOCAB})]
            assert moved == [0, 4 * VOCAB]
            ran, moved, out = step(scheduler_output(cached=running(["a", "b", "c"]),
                                                    scheduled={"a": 1, "b": 1, "c": 1}))
            assert ran == [(LOGITS_TAG, {"tokens": 4 * 4, "logits": 4 * 4 * VOCAB})]
            assert moved == [4 * VOCAB]  # c's row only
            assert out.logprobs is not None
    finally:
        purge()
    for req_id, prompt in prompts.items():
        context = list(prompt)
        for token in out_tokens[req_id]:
            assert token == expected(context)
            context.append(token)


# -- token_generation_logits_buckets: where logits twins are compiled ---------------------
def test_logits_twin_of_the_largest_length_by_default_widened_by_the_key():
    """A host-sampled row can land in a decode of any length; by default the one twin,
    at the largest length, takes it (a graph that exists); the key adds shorter ones,
    and a host row then runs the first that fits."""
    s = settings(override=ODS)
    assert s.token_generation_logits_buckets == (256,)
    assert s.token_generation_logits_shapes() == [(4, 256)]
    assert s.graph_count() == 5
    assert token_generation_bucket(s, 1, 10, logits=True) == (4, 256)
    assert token_generation_bucket(s, 1, 10) == (4, 128)
    wide = settings(override={**ODS, "token_generation_logits_buckets": [128, 256]})
    assert wide.token_generation_logits_shapes() == [(4, 128), (4, 256)]
    assert wide.graph_count() == 6
    assert token_generation_bucket(wide, 1, 10, logits=True) == (4, 128)
    assert token_generation_bucket(wide, 1, 200, logits=True) == (4, 256)
    reference = dataclasses.replace(s, backend="reference")
    assert reference.token_generation_logits_shapes() == []
    assert token_generation_bucket(reference, 1, 10, logits=True) == (4, 128)


def test_logits_twins_follow_what_a_request_that_sets_nothing_needs():
    """A request that sets no sampling parameters takes the model's defaults (vLLM's
    get_diff_sampling_param): where they need the host sampler (a penalty, min_p) or
    exact sampling keeps a default random request on the host, every token-generation
    length gets a twin and the resolution says what it costs; a user's shorter list is
    kept, with a warning naming the lengths such steps then run at. Not for the
    reference backend (its graphs all return logits) nor a fused drafter (no logits)."""
    penalty = {"default_sampling": {"repetition_penalty": 1.05, "temperature": 0.7}}
    s = settings(penalty, ODS)
    assert s.token_generation_logits_buckets == (128, 256) and s.graph_count() == 6
    assert token_generation_bucket(s, 1, 10, logits=True) == (4, 128)
    assert s.logits_buckets_note.startswith("a request that sets no sampling parameters is "
                                            "sampled on the host (repetition_penalty needs")
    assert "every token-generation length has a logits twin (2 graphs more" in \
        s.logits_buckets_note
    short = settings(penalty, {**ODS, "token_generation_logits_buckets": [256]})
    assert short.token_generation_logits_buckets == (256,)
    assert "has no twin at [128]" in short.logits_buckets_note
    assert "(up to 256 positions a row instead of 128)" in short.logits_buckets_note
    for defaults in ({}, {"temperature": 0.6, "top_p": 0.9, "top_k": 20}):
        plain = settings({"default_sampling": defaults}, ODS)
        assert plain.token_generation_logits_buckets == (256,) and not plain.logits_buckets_note
    limits = dataclasses.replace(LIMITS, default_sampling={"top_p": 0.9})
    exact = resolve_settings(limits, ODS, backend="nxd", architecture="LlamaForCausalLM",
                             exact_sampling=True)
    assert exact.token_generation_logits_buckets == (128, 256)
    assert "top_k=0 samples beyond" in exact.logits_buckets_note
    greedy = resolve_settings(dataclasses.replace(limits, default_sampling={"temperature": 0}),
                              ODS, backend="nxd", architecture="LlamaForCausalLM",
                              exact_sampling=True)
    assert greedy.token_generation_logits_buckets == (256,)
    reference = resolve_settings(dataclasses.replace(LIMITS, tp_degree=1, **penalty), ODS,
                                 backend="reference", architecture="LlamaForCausalLM")
    assert not reference.logits_buckets_note and not reference.token_generation_logits_shapes()


@pytest.mark.parametrize("limits, override", [
    ({}, {}), (PREFIX, {}), ({}, {"token_generation_buckets": [64, 256]}),
    ({}, {"enable_bucketing": False}),
    ({"speculative_method": "ngram", "num_speculative_tokens": 3}, {"enable_bucketing": False}),
    ({"speculative_method": "ngram", "num_speculative_tokens": 3}, {}),
], ids=["contiguous", "block", "two-lengths", "one-graph", "ngram-one-graph", "ngram"])
def test_every_logits_twin_has_its_token_generation_graph(limits, override):
    """The twin is the largest token-generation graph's, so a host row's decode finds
    its graph whatever the grid (with bucketing off and n-gram speculation, the one
    graph reaches past max_model_len by the lookahead: so does its twin)."""
    s = settings(limits, {**ODS, **override})
    tkg = s.token_generation_shapes()
    assert s.token_generation_logits_shapes() == [tkg[-1]]
    for length in (1, s.max_model_len // 2, s.max_model_len):
        assert token_generation_bucket(s, 1, length, logits=True) == tkg[-1]


@pytest.mark.parametrize("override,message", [
    ({**ODS, "token_generation_logits_buckets": [64, 256]},
     r"token_generation_logits_buckets has \[64\], not in token_generation_buckets "
     r"\[128, 256\].*choose among those lengths"),
    ({**ODS, "token_generation_logits_buckets": [128]},
     r"token_generation_logits_buckets=\[128\] lacks the largest token-generation bucket "
     r"256.*add 256"),
    ({**ODS, "token_generation_logits_buckets": []}, r"must be a non-empty list"),
    ({"on_device_sampling_config": None, "token_generation_logits_buckets": [256]},
     r"exist with on-device sampling only, and it is off.*remove "
     r"token_generation_logits_buckets"),
    ({"enable_bucketing": False, "token_generation_logits_buckets": [256]},
     r"enable_bucketing=false but token_generation_logits_buckets given"),
])
def test_logits_buckets_that_cannot_work_are_refused(override, message):
    with pytest.raises(NeuronConfigError, match=message):
        settings(override=override)


def test_a_host_row_at_a_short_length_runs_the_twin_at_the_largest(seam, tiny, tmp_path):
    s = settings(override=ODS)
    backend = loaded(s, tiny, tmp_path / "graphs")
    assert backend.model.token_generation_logits_model.neuron_config.buckets == [256]
    contexts = prefill(backend, PROMPTS, None)
    decode(backend, contexts, None, [False] * 4)
    assert backend.model.traced_model.ran[-1] == ("token_generation_model", 128)
    out, want = decode(backend, contexts, None, [True, False, False, False])
    assert backend.model.traced_model.ran[-1] == (LOGITS_TAG, 256)
    assert out.logits.argmax(-1).tolist() == want[:1]
    decode(backend, contexts, None, [False] * 4)  # the KV state both graphs share


@pytest.mark.parametrize("generation_config, twins, graph", [
    # every default request is host-sampled: a twin at each length, its own one runs
    ({"repetition_penalty": 1.1}, (32, 64), (LOGITS_TAG, 32)),
    # sampled on the device: the one twin, the tokens-only graph at its length
    ({"temperature": 0.7, "top_p": 0.9}, (64,), ("token_generation_model", 32)),
], ids=["penalty", "device"])
def test_a_default_request_of_a_model_with_a_penalty_decodes_at_its_bucket(
        tiny, monkeypatch, tmp_path, generation_config, twins, graph):
    """vLLM applies the model's generation_config.json to every request that leaves a
    parameter unset (--generation-config auto, the default): a checkpoint that sets a
    repetition penalty sends every default request to the host sampler. Its decode steps
    then run logits twins at their own length (32 here), not the largest (64) reading
    the KV cache over max_model_len every step; the resolution (the platform's, from
    vLLM's config) compiles a twin per length and says so. A model whose defaults the
    device samples keeps the one twin at the largest length."""
    from bench_host_overhead import scheduler_output
    from vllm import SamplingParams
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    from neuron_plugin.serving.model_runner import NeuronModelRunner
    from neuron_plugin.serving.vllm_settings import resolve_from_vllm_config

    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    (model / "generation_config.json").write_text(json.dumps(generation_config))
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    use_release("0.9-ef2731e", monkeypatch, tmp_path)
    config = EngineArgs(
        model=str(model), dtype="float32", max_model_len=64, max_num_seqs=4,
        enable_prefix_caching=False, enable_chunked_prefill=False,
        additional_config={"override_neuron_config": {
            "context_encoding_buckets": [16, 32], "token_generation_buckets": [32, 64]}},
    ).create_engine_config()
    # a request that sets nothing, as vLLM's LLM and OpenAI server build it
    default = SamplingParams.from_optional(**config.model_config.get_diff_sampling_param())
    try:
        with set_current_vllm_config(config):
            s = resolve_from_vllm_config(config, backend="nxd")
            assert s.token_generation_logits_buckets == twins
            assert ("repetition_penalty needs the host sampler" in s.logits_buckets_note) \
                is (len(twins) > 1)
            backend = loaded(s, model, tmp_path / "graphs")
            runner = NeuronModelRunner(config, s, backend, [])
            new = NewRequestData(
                req_id="a", prompt_token_ids=[3, 4, 5], mm_features=[],
                sampling_params=default, pooling_params=None, block_ids=([1],),
                num_computed_tokens=0, lora_request=None)
            runner.execute_model(scheduler_output(new=[new], scheduled={"a": 3}))
            runner.sample_tokens(None)
            running = CachedRequestData(
                req_ids=["a"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                new_block_ids=[None], num_computed_tokens=[3], num_output_tokens=[1])
            runner.execute_model(scheduler_output(cached=running, scheduled={"a": 1}))
            runner.sample_tokens(None)
            assert backend.model.traced_model.ran[-1] == graph
    finally:
        purge()


def test_runner_process_carries_logits_only_for_host_rows(tiny, sdk_python, monkeypatch,
                                                          tmp_path):
    """The backend in a runner process (the SDK environment, NxDI being the double):
    the reply of an all-device decode carries no logits through the output arena, a
    mixed decode the host row's alone."""
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.backends.runner.client import RunnerBackend
    from tests.plugin.fake_nxdi.nxdi_release import ROOT as FAKE_ROOT

    repo = FAKE_ROOT.parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(FAKE_ROOT), str(repo), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_NXDI_RELEASE", "0.9-ef2731e")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))
    s = dataclasses.replace(settings(override=ODS), backend_python=sdk_python)
    backend = open_backend(s, tiny, str(tmp_path / "cache"))
    assert isinstance(backend, RunnerBackend)
    replies: list[dict[str, int]] = []
    receive = backend._receive

    def counted(op: str):
        arrays = receive(op)
        replies.append({name: int(a.nbytes) for name, a in arrays.items()})
        return arrays

    monkeypatch.setattr(backend, "_receive", counted)
    try:
        contexts = {}
        for seq, prompt in enumerate(PROMPTS):
            inputs = context_encoding_inputs(s, np.array(prompt), 0, seq, None)
            contexts[seq] = [*prompt, int(backend.run(inputs, sampling(1, needs_logits=False))
                                          .tokens[0, 0])]
        assert replies[-1] == {"tokens": 4, "logits": 0}
        for host in ([False] * 4, [False, False, True, False]):
            rows = sampling(4, needs_logits=False)
            rows.needs_logits[:] = host
            inputs = token_generation_inputs(
                s, np.array([contexts[q][-1] for q in range(4)]),
                np.array([len(contexts[q]) - 1 for q in range(4)]), np.arange(4), None,
                logits=any(host))
            out = backend.run(inputs, rows)
            want = [expected(contexts[q]) for q in range(4)]
            assert out.tokens[:, 0].tolist() == want
            assert replies[-1] == {"tokens": 4 * 4, "logits": 4 * VOCAB * sum(host)}
            if any(host):
                assert out.logits.argmax(-1).tolist() == [want[2]]
            for q in range(4):
                contexts[q].append(want[q])
    finally:
        backend.close()


def test_tensor_capture_keeps_every_graph_with_logits():
    """NxDI forces output_logits on with tensor capture (models/config.py) and its
    captured tensors follow the logits in every output."""
    s = settings(override={**ODS, "tensor_capture_config": {"modules_to_capture": ["x"]}})
    assert s.token_generation_logits_shapes() == [] and s.graph_count() == 4
