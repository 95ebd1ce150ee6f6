"""The NxD backend against the NxDI double: architecture resolution (built-in table and
entry points), settings -> NeuronConfig, the forward arguments (seq-id reorder/restore,
padding removal, block-layout context), on-device sampling decisions, compile/load
through the compile cache, and the up-front checks."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys

# vLLM resolves its platform once per process, possibly while this module is imported:
# make it the Neuron platform (reference backend), as the other plugin tests do.
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from neuron_plugin.backends import nxd
from neuron_plugin.backends.nxd import (
    DISTRIBUTIONS,
    ENTRY_POINT_GROUP,
    NxDBackend,
    describe_architecture,
    model_arguments,
    neuron_config_kwargs,
    on_device_refusal,
    padding_arguments,
    resolve_model_class,
    sampling_rows,
    seq_order,
    unknown_kwargs,
)
from neuron_plugin.config import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.inputs import (
    TOKEN_GENERATION,
    context_encoding_inputs,
    padding_inputs,
    token_generation_inputs,
)
from neuron_plugin.loader import cache_manifest
from neuron_plugin.patches.base import is_patched
from tests.plugin.fake_nxdi.nxdi_release import load_release, purge

VOCAB = 977
LIMITS = EngineLimits(max_model_len=256, max_num_seqs=4, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32", tp_degree=2)
PREFIX = dict(enable_prefix_caching=True, block_size=32)


def settings(limits: dict | None = None, override: dict | None = None,
             architecture: str = "LlamaForCausalLM"):
    return resolve_settings(dataclasses.replace(LIMITS, **(limits or {})), override,
                            backend="nxd", architecture=architecture)


@pytest.fixture
def release(monkeypatch, tmp_path):
    """The 2.27 double on sys.path, two visible NeuronCores, a private compile cache."""
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "neuronx-cc"))
    yield load_release("2.27", monkeypatch)
    purge()


@pytest.fixture
def tiny(model_dirs):
    return model_dirs["llama"]


def loaded(s, model_dir, folder) -> NxDBackend:
    backend = NxDBackend(s, model_dir)
    backend.compile(folder)
    backend.load(folder)
    return backend


def context_sum(tokens) -> int:
    return int(np.sum(tokens)) % VOCAB


def write_dist_info(path, entry_points: str) -> None:
    info = path / "fake_contrib-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-contrib\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_points}\n")


# -- architecture resolution ----------------------------------------------------------
def test_builtin_architectures_resolve_through_model_types(release):
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    cls = resolve_model_class("Qwen3ForCausalLM", MODEL_TYPES, [])
    assert cls is MODEL_TYPES["qwen3"]["causal-lm"]


def test_builtin_architecture_missing_from_installed_nxdi(release):
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    with pytest.raises(NeuronConfigError, match="NxD Inference 0.7.0 has no 'mistral'"):
        resolve_model_class("MistralForCausalLM", MODEL_TYPES, [], "0.7.0")


def test_unsupported_architecture_names_the_entry_point_group(release):
    with pytest.raises(NeuronConfigError) as info:
        resolve_model_class("GPT2LMHeadModel", {}, [])
    assert "LlamaForCausalLM" in str(info.value)
    assert ENTRY_POINT_GROUP in str(info.value)
    assert "VLLM_NEURON_BACKEND=reference" in str(info.value)


def test_entry_point_registered_contrib_model(release, monkeypatch, tmp_path):
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    write_dist_info(tmp_path, "TinyContribForCausalLM = "
                              "fake_contrib.modeling_tiny:NeuronTinyContribForCausalLM\n"
                              "LlamaForCausalLM = "
                              "fake_contrib.modeling_tiny:NeuronTinyContribForCausalLM")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = nxd.model_entry_points()
    assert {ep.name for ep in found} == {"TinyContribForCausalLM", "LlamaForCausalLM"}
    contrib = resolve_model_class("TinyContribForCausalLM", MODEL_TYPES, found)
    assert contrib.__name__ == "NeuronTinyContribForCausalLM"
    # a registered class wins over the built-in table
    assert resolve_model_class("LlamaForCausalLM", MODEL_TYPES, found) is contrib
    assert "entry point" in describe_architecture("TinyContribForCausalLM", found)


def test_entry_point_that_is_not_an_nxdi_class(release):
    bad = importlib.metadata.EntryPoint(
        name="TinyContribForCausalLM", value="fake_contrib.modeling_tiny:NotAModel",
        group=ENTRY_POINT_GROUP)
    with pytest.raises(NeuronConfigError, match="not an NxDI application class"):
        resolve_model_class("TinyContribForCausalLM", {}, [bad])


def test_describe_architecture_needs_no_nxdi():
    assert "neuronx_distributed_inference" not in sys.modules
    assert describe_architecture("Qwen3ForCausalLM", []) == \
        "NxDI MODEL_TYPES['qwen3']['causal-lm']"
    with pytest.raises(NeuronConfigError, match="has no NxD Inference model"):
        describe_architecture("BertModel", [])


def test_missing_nxdi_is_a_clear_error(monkeypatch):
    purge()
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    with pytest.raises(NeuronConfigError, match="VLLM_NEURON_BACKEND=reference"):
        nxd.import_nxdi()


# -- settings -> NeuronConfig -------------------------------------------------------------
def test_neuron_config_kwargs_contiguous():
    kwargs = neuron_config_kwargs(settings(override={"save_sharded_checkpoint": True}))
    assert kwargs["tp_degree"] == 2 and kwargs["batch_size"] == 4
    assert kwargs["seq_len"] == 256 and kwargs["max_context_length"] == 256
    assert kwargs["context_encoding_buckets"] == [128, 256]
    assert kwargs["enable_bucketing"] is True and kwargs["is_continuous_batching"] is True
    assert kwargs["is_block_kv_layout"] is False and kwargs["is_prefix_caching"] is False
    assert kwargs["save_sharded_checkpoint"] is True
    assert not {"pa_num_blocks", "prefix_buckets", "token_generation_batches",
                "output_logits"} & kwargs.keys()


def test_neuron_config_kwargs_block_layout_and_null_block():
    s = settings(PREFIX, {"prefix_buckets": [64, 255]})
    kwargs = neuron_config_kwargs(s)
    assert kwargs["is_block_kv_layout"] and kwargs["is_prefix_caching"]
    assert kwargs["pa_num_blocks"] == s.num_blocks == 4 * 8 + 1
    assert kwargs["pa_block_size"] == 32
    assert kwargs["prefix_buckets"] == [64, 255]  # NxDI adds prefix 0 itself


def test_neuron_config_kwargs_sampling_and_batches():
    s = settings(override={"on_device_sampling_config": {"global_topk": 8},
                           "token_generation_batches": [2, 4]})
    kwargs = neuron_config_kwargs(s)
    assert kwargs["output_logits"] is True
    assert kwargs["on_device_sampling_config"] == {"global_topk": 8}
    assert kwargs["token_generation_batches"] == [2, 4]


def test_passthrough_key_the_backend_sets_differently_is_an_error():
    s = settings(override={"on_device_sampling_config": {}, "output_logits": False})
    with pytest.raises(NeuronConfigError, match="output_logits=False but the nxd backend "
                                                "needs True"):
        neuron_config_kwargs(s)
    kept = neuron_config_kwargs(settings({"max_num_seqs": 1},
                                         {"is_continuous_batching": True}))
    assert kept["is_continuous_batching"] is True


@pytest.mark.parametrize("limits,override", [({}, {}), (PREFIX, {}),
                                             ({}, {"on_device_sampling_config": {}})])
def test_nxdi_neuron_config_knows_every_key(release, limits, override):
    from neuronx_distributed_inference.models.config import NeuronConfig

    kwargs = neuron_config_kwargs(settings(limits, override))
    assert unknown_kwargs(NeuronConfig(**dict(kwargs)), kwargs) == []


def test_key_unknown_to_installed_nxdi_is_rejected(release, tiny, tmp_path):
    backend = NxDBackend(settings(override={"token_generation_batches": [2, 4]}), tiny)
    with pytest.raises(NeuronConfigError, match="does not know token_generation_batches"):
        backend.compile(tmp_path / "out")


# -- forward arguments ---------------------------------------------------------------------
def test_seq_order_sorts_and_restores():
    seq_ids = np.array([3, 0, 2, 1])
    order, restore = seq_order(seq_ids)
    assert seq_ids[order].tolist() == [0, 1, 2, 3]
    assert seq_ids[order][restore].tolist() == [3, 0, 2, 1]


def test_contiguous_decode_arguments_are_sorted_and_unpadded():
    s = settings()
    inputs = token_generation_inputs(s, np.array([40, 10, 30]), np.array([5, 9, 7]),
                                     np.array([3, 0, 2]), None)
    assert inputs.bucket == (4, 128) and inputs.num_real == 3  # one pad row
    args, restore = model_arguments(s, inputs)
    assert args["seq_ids"].tolist() == [0, 2, 3]
    assert args["input_ids"].tolist() == [[10], [30], [40]]
    assert args["position_ids"].tolist() == [[9], [7], [5]]
    assert args["full_context_lens"].tolist() == [[10], [8], [6]]
    assert args["computed_context_lens"].tolist() == [[9], [7], [5]]
    assert args["seq_ids"][restore].tolist() == [3, 0, 2]


def test_context_encoding_arguments_drop_pad_tokens():
    s = settings()
    inputs = context_encoding_inputs(s, np.array([5, 6, 7]), 0, 1, None)
    args, restore = model_arguments(s, inputs)
    assert inputs.input_ids.shape == (1, 128)
    assert args["input_ids"].tolist() == [[5, 6, 7]]
    assert args["position_ids"].tolist() == [[0, 1, 2]]
    assert restore.tolist() == [0]


def test_block_context_after_prefix_sends_the_whole_context():
    s = settings(PREFIX)
    context = np.arange(100, 134)
    inputs = context_encoding_inputs(s, context, 32, 0, [3, 5])
    args, _ = model_arguments(s, inputs)
    assert args["input_ids"].tolist() == [context.tolist()]
    assert args["position_ids"].tolist() == [list(range(34))]
    assert args["slot_mapping"].tolist() == [[5 * 32, 5 * 32 + 1]]
    assert args["full_context_lens"].tolist() == [[34]]
    assert args["computed_context_lens"].tolist() == [[32]]
    assert args["block_table"].shape == (1, 8)


def test_padding_arguments_reach_the_bucket():
    s = settings(PREFIX)
    cte = padding_arguments(s, padding_inputs(s, "context_encoding", (128, 64)))
    assert cte["input_ids"].shape == (1, 192)
    assert cte["computed_context_lens"].tolist() == [[64]]
    assert (cte["slot_mapping"] == -1).all() and cte["slot_mapping"].shape == (1, 128)
    tkg = padding_arguments(s, padding_inputs(s, TOKEN_GENERATION, (4, 256)))
    assert tkg["position_ids"].tolist() == [[255]] * 4 and tkg["seq_ids"].tolist() == [0, 1, 2, 3]


# -- on-device sampling decisions ------------------------------------------------------------
@pytest.mark.parametrize("params,refusal", [
    (SamplingParams(temperature=0.0), None),
    (SamplingParams(temperature=0.8, top_k=50, top_p=0.9), None),
    (SamplingParams(temperature=0.8), "global_topk=256"),
    (SamplingParams(temperature=0.8, top_k=300), "top_k=300"),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), "presence_penalty"),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), "repetition_penalty"),
    (SamplingParams(temperature=0.7, top_k=5, min_p=0.1), "min_p"),
    (SamplingParams(temperature=0.0, logprobs=2), "logprobs"),
    (SamplingParams(temperature=0.7, top_k=5, seed=3), "seed"),
    (SamplingParams(temperature=0.0, min_tokens=4), "min_tokens"),
    (SamplingParams(temperature=0.0, logit_bias={5: 1.0}), "logit_bias"),
])
def test_on_device_refusal(params, refusal):
    got = on_device_refusal(params)
    assert got is None if refusal is None else refusal in got


def test_sampling_rows_match_nxdi_encoding():
    rows = sampling_rows([SamplingParams(temperature=0.0),
                          SamplingParams(temperature=0.5, top_k=40, top_p=0.8),
                          SamplingParams(temperature=0.5, top_k=-1)], global_topk=64)
    assert rows == ([1, 40, 64], [1.0, 0.8, 1.0], [1.0, 0.5, 0.5])


# -- the backend end to end on the double ----------------------------------------------------
def test_contiguous_forward_restores_request_order(release, tiny, tmp_path):
    s = settings()
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompts = {2: np.arange(1, 129), 0: np.array([5, 6, 7]), 3: np.array([9] * 20)}
    for seq, prompt in prompts.items():
        inputs = context_encoding_inputs(s, prompt, 0, seq, None)
        assert backend.forward(inputs).argmax(-1).tolist() == [context_sum(prompt)]
    # a 128-token prompt runs the 128 graph the plugin chose (cte-exact-bucket patch)
    assert backend.model.context_encoding_model.selected_buckets == [128, 128, 128]
    inputs = token_generation_inputs(s, np.array([11, 22, 33]),
                                     np.array([128, 3, 20]), np.array([2, 0, 3]), None)
    logits = backend.forward(inputs)
    assert logits.shape == (3, VOCAB)
    assert logits.argmax(-1).tolist() == [context_sum([*prompts[2], 11]),
                                          context_sum([*prompts[0], 22]),
                                          context_sum([*prompts[3], 33])]
    assert backend.model.token_generation_model.selected_buckets == [inputs.bucket[1]]


def test_block_layout_prefix_hit_and_decode(release, tiny, tmp_path):
    s = settings(PREFIX)
    backend = loaded(s, tiny, tmp_path / "graphs")
    shared = np.arange(1, 33)                      # one full block, cached
    first = np.concatenate([shared, [50, 51]])
    second = np.concatenate([shared, [60, 61, 62]])
    miss = context_encoding_inputs(s, first, 0, 0, [1, 2])
    assert backend.forward(miss).argmax(-1).tolist() == [context_sum(first)]
    hit = context_encoding_inputs(s, second, 32, 0, [1, 3])
    out = backend.run(hit)
    assert out.logits.argmax(-1).tolist() == [context_sum(second)]
    decode = token_generation_inputs(s, np.array([70, 80]), np.array([34, 35]),
                                     np.array([0, 1]), [[1, 2], [1, 3]])
    assert backend.forward(decode).argmax(-1).tolist() == [
        context_sum([*first, 70]), context_sum([*second, 80])]


@pytest.mark.parametrize("limits", [{}, PREFIX])
def test_padding_only_calls_run_each_graph(release, tiny, tmp_path, limits):
    s = settings(limits)
    backend = loaded(s, tiny, tmp_path / "graphs")
    for graph in nxd.graph_specs(s):
        logits = backend.forward(padding_inputs(s, graph.phase, graph.shape))
        assert logits.shape == (0, VOCAB)
    model = backend.model
    ran = [tuple(np.atleast_1d(b)) for b in model.context_encoding_model.selected_buckets]
    assert ran == [g.shape for g in nxd.graph_specs(s) if g.phase != TOKEN_GENERATION]


def test_artifacts_of_another_block_count_are_refused(release, tiny, tmp_path):
    folder = tmp_path / "graphs"
    NxDBackend(settings(PREFIX), tiny).compile(folder)
    other = settings({**PREFIX, "num_gpu_blocks_override": 40})
    with pytest.raises(NeuronConfigError, match="num_blocks: compiled 33, configured 40"):
        NxDBackend(other, tiny).load(folder)


def test_compile_points_neuronx_cc_cache_into_the_store(release, tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL")
    NxDBackend(settings(), tiny).compile(tmp_path / "graphs")
    assert (tmp_path / "cache" / "neuronx-cc").is_dir()
    import os

    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "cache" / "neuronx-cc")


def test_load_backend_through_the_compile_cache(release, tiny, tmp_path):
    from neuron_plugin.loader import load_backend

    s = settings()
    backend, first = load_backend(s, tiny, str(tmp_path / "cache"))
    assert isinstance(backend, NxDBackend) and not first.hit
    assert backend.forward(context_encoding_inputs(s, np.array([4, 5]), 0, 0, None)
                           ).argmax(-1).tolist() == [9]
    _, second = load_backend(s, tiny, str(tmp_path / "cache"))
    assert second.hit and second.key == first.key


def test_tensor_parallel_above_visible_cores_fails_up_front(release, tiny, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    with pytest.raises(NeuronConfigError, match="tensor_parallel_size=2 needs 2 NeuronCores "
                                                "but only 1 are visible"):
        NxDBackend(settings(), tiny)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    if not nxd.host_visible_cores()[0]:
        with pytest.raises(NeuronConfigError, match="none are visible"):
            NxDBackend(settings(), tiny)


def test_cache_manifest_fields(release, tiny, monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type transformer -O1")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    backend = NxDBackend(settings(), tiny)
    fields = backend.cache_manifest_fields()
    assert fields["weights_fingerprint"] is None
    assert set(fields["versions"]) == set(DISTRIBUTIONS)
    assert fields["compiler_flags"] == ["--model-type", "transformer", "-O1"]
    manifest = cache_manifest(backend.settings, backend)
    assert manifest["model"]["num_hidden_layers"] == 2
    assert "transformers_version" not in manifest["model"]  # volatile: dropped
    if nxd.detect_instance_type() is None:
        assert fields["target"]["platform"] == "inf2"
    embedded = NxDBackend(settings(override={"save_sharded_checkpoint": True}), tiny)
    assert len(embedded.cache_manifest_fields()["weights_fingerprint"]) == 64


def test_sharded_checkpoint_is_loaded_from_the_artifacts(release, tiny, tmp_path):
    backend = loaded(settings(override={"save_sharded_checkpoint": True}), tiny,
                     tmp_path / "graphs")
    assert (tmp_path / "graphs" / "weights" / "tp1_sharded_checkpoint.safetensors").exists()
    assert len(backend.model.loaded_weights) == 2


def test_quantized_checkpoint_is_written_before_compiling(release, tiny, tmp_path):
    quantized = tmp_path / "quantized"
    s = settings(override={"quantized": True, "quantized_checkpoints_path": str(quantized)})
    backend = loaded(s, tiny, tmp_path / "graphs")
    assert (quantized / "model.safetensors").exists()
    weights = backend.model.loaded_weights[0]
    assert next(iter(weights.values())).dtype == torch.float16


def test_kv_cache_tensors_in_vllm_neuron_order(release, tiny, tmp_path):
    backend = loaded(settings(), tiny, tmp_path / "graphs")
    tensors = backend.kv_cache_tensors()
    state = backend.model.context_encoding_model.model.nxd_model.state
    assert len(tensors) == 2 * 2 * 2  # (K, V) x 2 layers x 2 ranks
    assert tensors[0] is state[0]["kv_mgr.past_key_values.0"]
    assert tensors[1] is state[1]["kv_mgr.past_key_values.0"]
    assert tensors[0].shape == (4, 1, 256, 1)


def test_on_device_sampling_serves_eligible_rows(release, tiny, tmp_path):
    s = settings(override={"on_device_sampling_config": {"global_topk": 8}})
    backend = loaded(s, tiny, tmp_path / "graphs")
    for seq, prompt in ((1, [3, 4]), (0, [5])):
        backend.run(context_encoding_inputs(s, np.array(prompt), 0, seq, None),
                    [SamplingParams(temperature=0.0)])
    inputs = token_generation_inputs(s, np.array([1, 2]), np.array([2, 1]),
                                     np.array([1, 0]), None)
    out = backend.run(inputs, [SamplingParams(temperature=0.0),
                               SamplingParams(temperature=0.0, presence_penalty=1.0)])
    assert out.on_device.tolist() == [True, False]
    assert out.tokens[0].item() == context_sum([3, 4, 1])
    assert out.logits.argmax(-1).tolist() == [context_sum([3, 4, 1]), context_sum([5, 2])]


def test_release_with_hook_parameter_needs_no_adapter_patch(monkeypatch, tiny, tmp_path):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "neuronx-cc"))
    modules = load_release("2.29", monkeypatch)
    try:
        backend = loaded(settings(), tiny, tmp_path / "graphs")
        prepare = modules.hf_adapter.HuggingFaceGenerationAdapter.prepare_inputs_for_generation
        assert not is_patched(prepare, "adapter-forward-kwargs")
        assert is_patched(prepare, "adapter-prefix-lens")
        inputs = context_encoding_inputs(backend.settings, np.array([1, 2]), 0, 0, None)
        assert backend.forward(inputs).argmax(-1).tolist() == [3]
    finally:
        purge()


def test_vocab_size_of_multimodal_style_config():
    backend = object.__new__(NxDBackend)
    backend.hf_config = {"text_config": {"vocab_size": 5}}
    assert backend.vocab_size == 5
    backend.hf_config = {"vocab_size": 7}
    assert backend.vocab_size == 7
