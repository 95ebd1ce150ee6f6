"""The nxd backend's CPU mode (`override_neuron_config` `"on_cpu": true`) against the NxDI
double: what it refuses, the size attributes it sets per call as NxDI's model builder sets
them per traced bucket, and the eager modules it hooks (one per submodel with continuous
batching, one shared otherwise, as NxDI's to_cpu builds them). Serving through real NxDI's
CPU mode is tests/e2e/test_nxdi_cpu_mode.py."""

from __future__ import annotations

import pytest
import torch

from neuron_plugin.backends.nxd import cpu_mode, graphs
from neuron_plugin.backends.nxd.backend import NxDBackend
from neuron_plugin.core.inputs import CONTEXT_ENCODING, TOKEN_GENERATION
from neuron_plugin.core.nxdi_cpu_mode import sharded_sampler_problem
from neuron_plugin.core.settings import NeuronConfigError
from tests.plugin.test_nxd_backend import (  # noqa: F401  (fixtures)
    PREFIX,
    release,
    settings,
    tiny,
)

CPU = {"on_cpu": True}


def test_cpu_mode_is_off_unless_asked():
    assert not cpu_mode.requested(settings())
    assert cpu_mode.requested(settings({"tp_degree": 1}, CPU))


@pytest.mark.parametrize("limits,override,message", [
    ({}, {}, r"--tensor-parallel-size 2: to_cpu\(\) needs one process per rank"),
    ({"tp_degree": 1, "dtype": "float16"}, {}, r"--dtype float16: NxDI's CPU mode refuses it"),
])
def test_cpu_mode_refuses_what_nxdis_cpu_mode_cannot_run(limits, override, message):
    with pytest.raises(NeuronConfigError, match=message):
        cpu_mode.requested(settings(limits, {**CPU, **override}))


def test_cpu_mode_shards_under_torchrun_and_refuses_its_sharded_sampler(monkeypatch):
    """One process per rank (torchrun's WORLD_SIZE equal to the TP degree) is what
    to_cpu() shards with. NxDI's CPU sampler would take each rank's own vocabulary shard,
    so sampling on the device is refused there (its logits are right)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    sharded = settings({}, CPU)
    assert cpu_mode.requested(sharded)
    assert "each rank's own vocabulary shard" in sharded_sampler_problem(sharded)
    assert sharded_sampler_problem(settings({"tp_degree": 1}, CPU)) is None
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's ranks must be the TP degree's
    with pytest.raises(NeuronConfigError, match=r"started by torchrun \(WORLD_SIZE=2\)"):
        cpu_mode.requested(settings({}, CPU))


def test_cpu_mode_runs_batch_bucketing_with_on_device_sampling():
    """NxDI's CPU padding path unpacks `logits, *kv_caches` and so fails on a graph that
    returns logits beside tokens; the batch-bucketed graphs return tokens alone now."""
    assert cpu_mode.requested(settings({"tp_degree": 1},
                                       {**CPU, "token_generation_batches": [1, 2, 4]}))


@pytest.mark.parametrize("bucket,prefix,tkg,expected", [
    (64, False, False, {"n_positions": 64}),
    (128, False, True, {"n_positions": 128}),
    ([2, 256], False, True, {"n_positions": 256}),  # batch bucketing [batch, seq]
    ([128, 256], True, False, {"prefix_size": 256, "n_active_tokens": 128,
                               "n_positions": 384}),
    ([512, 0], True, False, {"prefix_size": 0, "n_active_tokens": 512, "n_positions": 512}),
    ([1024, 1024], True, False, {"prefix_size": 1024, "n_active_tokens": 1024,
                                 "n_positions": 1536}),  # capped at max_context_length
    ([4, 256], True, True, {"prefix_size": 256, "n_active_tokens": 4, "n_positions": 256}),
])
def test_bucket_attributes_follow_nxdis_model_builder(bucket, prefix, tkg, expected):
    assert cpu_mode.bucket_attributes(bucket, prefix_caching=prefix, token_generation=tkg,
                                      max_context_length=1536) == expected


@pytest.mark.parametrize("limits,override,shared", [
    ({"tp_degree": 1}, {}, False),
    ({"tp_degree": 1, "max_num_seqs": 1}, {}, True),
    ({"tp_degree": 1, **PREFIX}, {}, False),
    ({"tp_degree": 1}, {"on_device_sampling_config": None}, False),
])
def test_each_call_runs_with_its_buckets_attributes(release, tiny, limits, override, shared):
    """Every compiled bucket's example inputs through the hooked eager modules: the module
    sees the attributes NxDI's tracing would have set, and a prefill over a cached prefix
    a bool mask (eager torch.where refuses NxDI's integer one)."""
    s = settings(limits, {**CPU, **override})
    backend = NxDBackend(s, tiny)
    model = backend._new_model()
    cpu_mode.load(model, backend.nxdi.layer_boundary_marker)
    modules = {id(w.model) for w in model.models}
    assert len(modules) == (1 if shared else len(model.models))
    for wrapper in model.models:
        config = wrapper.neuron_config
        tkg = wrapper.config.neuron_config.n_active_tokens == 1
        for bucket, example in zip(config.buckets, wrapper.input_generator(), strict=True):
            wrapper.model(*example)
            call = wrapper.model.calls[-1]
            want = cpu_mode.bucket_attributes(
                bucket, prefix_caching=config.is_prefix_caching, token_generation=tkg,
                max_context_length=config.max_context_length)
            assert {k: call[k] for k in want} == want, (wrapper.tag, bucket)
            prefix_prefill = not tkg and want.get("prefix_size", 0) > 0
            assert (call["mask_dtype"] == torch.bool) == prefix_prefill, (wrapper.tag, bucket)


def test_layer_boundary_markers_are_the_identity_in_the_cpu_mode(release):
    """NxD's layer-boundary markers (a Neuron custom call; Qwen3-MoE's decoder layer always
    calls them) return their inputs in the CPU mode: measured, with them Qwen3-MoE gives
    transformers' tokens on real NxDI (tests/e2e/test_nxdi_architectures.py)."""
    from neuronx_distributed_inference.models import layer_boundary_marker as markers

    hidden, positions = torch.ones(1, 2, 4), torch.arange(2)
    with pytest.raises(NotImplementedError, match="custom call"):
        markers.ModuleMarkerStartWrapper()(hidden)
    cpu_mode.identity_markers(markers)
    assert markers.ModuleMarkerStartWrapper()(hidden) is hidden
    out = markers.ModuleMarkerEndWrapper()(hidden, positions)
    assert out[0] is hidden and out[1] is positions


def test_a_call_of_no_compiled_shape_is_a_clear_error(release, tiny):
    s = settings({"tp_degree": 1}, CPU)
    backend = NxDBackend(s, tiny)
    model = backend._new_model()
    cpu_mode.load(model, backend.nxdi.layer_boundary_marker)
    wrapper = model.token_generation_model
    example = list(wrapper.input_generator()[0])
    example[0] = torch.ones((3, 1), dtype=torch.int32)
    with pytest.raises(ValueError, match="matches no compiled bucket"):
        wrapper.model(*example)


def test_cpu_mode_compiles_nothing_and_keys_its_own_target(release, tiny, tmp_path):
    s = settings({"tp_degree": 1}, CPU)
    backend = NxDBackend(s, tiny)
    (tmp_path / "graphs").mkdir()
    backend.compile(tmp_path / "graphs")
    assert sorted(p.name for p in (tmp_path / "graphs").iterdir()) == ["graphs.json"]
    assert backend.cache_manifest_fields()["target"] == {"device": "cpu"}


@pytest.mark.parametrize("limits,shared", [({"tp_degree": 1}, False),
                                           ({"tp_degree": 1, "max_num_seqs": 1}, True),
                                           ({"tp_degree": 1, **PREFIX}, False)])
def test_each_call_returns_logits_only_from_its_logits_graph(release, tiny, limits, shared):
    """In the CPU mode the eager model reads output_logits from its config at each call:
    the logits graph's own with continuous batching, the application's (which `selected`
    sets per call) when to_cpu shares one model; and the logits graph reads the KV cache
    of the token-generation model it stands in for (NxDI copies each call's cache into
    that one and the context encoder only)."""
    s = settings(limits, CPU)
    backend = NxDBackend(s, tiny)
    model = backend._new_model()
    cpu_mode.load(model, backend.nxdi.layer_boundary_marker)
    plain, variant = model.token_generation_model, graphs.logits_variant(model)
    assert (variant.model is plain.model) == shared
    assert variant.model.kv_mgr.past_key_values is plain.model.kv_mgr.past_key_values
    cte = model.context_encoding_model
    assert (cte.model.kv_mgr.past_key_values is plain.model.kv_mgr.past_key_values) == shared
    for phase, logits, wrapper, want in ((CONTEXT_ENCODING, False, cte, True),
                                         (TOKEN_GENERATION, False, plain, False),
                                         (TOKEN_GENERATION, True, variant, True)):
        with graphs.selected(model, phase, logits) as chosen:
            assert chosen is wrapper
            wrapper.model(*wrapper.input_generator()[0])
        assert wrapper.model.calls[-1]["output_logits"] is want, (phase, logits)
    assert model.token_generation_model is plain and model.neuron_config.output_logits
