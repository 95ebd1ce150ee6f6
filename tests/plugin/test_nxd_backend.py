"""The NxD backend against the NxDI double (tests/plugin/fake_nxdi, which reproduces NxDI
0.7, 0.8 and 0.9 as published): architecture resolution (built-in table and entry
points), settings -> NeuronConfig, the forward arguments, on-device sampling, compile/load
through the compile cache, the up-front checks, and the seam defects NxDI's real
behaviour exposes (one test each: sampling_params rows, the prefix-caching partial-batch
return, the on-device sampler's mode, one-token prompts, the 2-D decode bucket rule,
NxDI's prefix-caching bucket choice, block tables cropped to whole blocks)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
import sys
from collections import Counter

import numpy as np
import pytest
import torch

from neuron_plugin.backends.base import graph_specs, run_graph_once
from neuron_plugin.backends.kv_blocks import KVGeometry
from neuron_plugin.backends.nxd.arguments import model_arguments, padding_arguments
from neuron_plugin.backends.nxd.backend import DISTRIBUTIONS, NxDBackend
from neuron_plugin.backends.nxd.graphs import LOGITS_TAG
from neuron_plugin.backends.nxd.models import (
    describe_architecture,
    release_for,
    resolve_model_class,
)
from neuron_plugin.core.nxdi_releases import NXDI_0_8, NXDI_0_9
from neuron_plugin.models.third_party import ENTRY_POINT_GROUP, entry_points
from neuron_plugin.backends.nxd.neuron_config import (
    batch_bucketing,
    neuron_config_kwargs,
    unknown_kwargs,
)
from neuron_plugin.backends.nxd.nxdi import import_nxdi
from neuron_plugin.core.instances import detect_instance_type, host_visible_cores
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.inputs import (
    TOKEN_GENERATION,
    context_encoding_inputs,
    padding_inputs,
    token_generation_inputs,
)
from neuron_plugin.backends.loader import cache_manifest
from neuron_plugin.core.sampling import SamplingInputs
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


# The releases whose code paths differ for the plugin: 0.8 adds batch bucketing and
# passes adapter_ids to the prefix-caching graphs, 0.9 changes kernel-only details.
SEAM_RELEASES = ["0.7", "0.8", "0.9"]


def use_release(name: str, monkeypatch, tmp_path):
    """The double as `name`, two visible NeuronCores, a private compile cache."""
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "neuronx-cc"))
    return load_release(name, monkeypatch)


@pytest.fixture
def release(monkeypatch, tmp_path):
    """NxDI 0.7, the oldest release the plugin supports."""
    yield use_release("0.7", monkeypatch, tmp_path)
    purge()


@pytest.fixture(params=SEAM_RELEASES)
def seam(request, monkeypatch, tmp_path):
    """Each release whose seam behaviour differs; yields its name."""
    use_release(request.param, monkeypatch, tmp_path)
    yield request.param
    purge()


@pytest.fixture
def tiny(model_dirs):
    return model_dirs["llama"]


def loaded(s, model_dir, folder) -> NxDBackend:
    backend = NxDBackend(s, model_dir)
    backend.compile(folder)
    backend.load(folder)
    return backend


def expected(tokens) -> int:
    """The double's answer for a query attending exactly `tokens`."""
    return (int(np.sum(tokens)) + len(tokens) - 1) % VOCAB


def sampling(rows: int, *, top_k=1, top_p=1.0, temperature=1.0,
             needs_logits=True) -> SamplingInputs:
    """Per-row values in NxDI's encoding (greedy: top-k 1); logits back by default."""
    return SamplingInputs(top_k=np.full(rows, top_k, dtype=np.int32),
                          top_p=np.full(rows, top_p, dtype=np.float32),
                          temperature=np.full(rows, temperature, dtype=np.float32),
                          uniform=np.zeros((rows, 1), dtype=np.float32),
                          needs_logits=np.full(rows, needs_logits))


def graph_tag(graph) -> str:
    """The NxDI submodel a plugin graph belongs to."""
    if graph.phase != TOKEN_GENERATION:
        return "context_encoding_model"
    return LOGITS_TAG if graph.logits else "token_generation_model"


def ran(backend: NxDBackend) -> list[tuple]:
    """(phase, bucket) of every graph NxD's router ran, in order."""
    return [("context_encoding" if tag.startswith("context") else "token_generation",
             tuple(np.atleast_1d(bucket)))
            for tag, bucket in backend.model.traced_model.ran]


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


def test_mapped_architectures_resolve_without_warnings(release, caplog):
    """DBRX, once served behind an 'untested' warning, is equal to transformers on real
    NxDI (tests/e2e/test_nxdi_architectures.py); what each architecture serves is
    backends/nxd/compat.py's table (test_nxd_compat.py)."""
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    stand_in = {"dbrx": {"causal-lm": MODEL_TYPES["llama"]["causal-lm"]}}
    with caplog.at_level("WARNING", logger="vllm.neuron_plugin"):
        resolve_model_class("DbrxForCausalLM", stand_in, [])
    assert caplog.text == ""
    assert describe_architecture("DbrxForCausalLM", [], NXDI_0_9) == \
        "NxDI MODEL_TYPES['dbrx']['causal-lm']"


def test_nxdi_0_8_serves_mistral_and_gemma3_with_classes_it_ships(tiny_model, monkeypatch,
                                                                 tmp_path):
    """0.8 (inf2/trn1) lists neither in MODEL_TYPES. Mistral is built with 0.8's Llama
    class, which applies the checkpoint's sliding_window (the double's graphs honour it as
    NxDI's rolling cache line): a prompt longer than the window decodes attending the
    newest 16 tokens. Gemma3 is built with the module 0.8 ships unlisted, its config
    patched to the checkpoint's values (gemma3-config)."""
    use_release("0.8", monkeypatch, tmp_path)
    try:
        from neuronx_distributed_inference.models.gemma3 import modeling_gemma3
        from neuronx_distributed_inference.utils.constants import MODEL_TYPES

        assert "mistral" not in MODEL_TYPES and "gemma3" not in MODEL_TYPES
        s = settings({"tp_degree": 1}, architecture="MistralForCausalLM")
        mistral = loaded(s, tiny_model("mistral"), tmp_path / "graphs")
        assert mistral.model_cls is MODEL_TYPES["llama"]["causal-lm"]
        assert mistral.model.config.sliding_window == 16
        prompt = np.random.default_rng(5).integers(1, VOCAB, 40)
        first = mistral.forward(context_encoding_inputs(s, prompt, 0, 0, None)).argmax(-1)
        assert first.tolist() == [expected(prompt[-16:])]
        step = token_generation_inputs(s, first, np.array([40]), np.array([0]), None)
        context = [*prompt.tolist(), int(first[0])]
        assert mistral.forward(step).argmax(-1).tolist() == [expected(context[-16:])]

        gemma = NxDBackend(settings(architecture="Gemma3ForCausalLM"), tiny_model("gemma3"))
        assert gemma.model_cls is modeling_gemma3.NeuronGemma3ForCausalLM
        config = gemma._new_model().config
        assert (config.vocab_size, config.rope_scaling) == (977, None)  # not 262208, 8.0
        assert "gemma3-scale" in gemma.nxdi.patches_for("Gemma3ForCausalLM")
    finally:
        purge()


def test_builtin_architecture_missing_from_installed_nxdi(release):
    """The table's MODEL_TYPES key absent from the installed release's MODEL_TYPES."""
    with pytest.raises(NeuronConfigError, match="NxD Inference 0.9.3 has no 'qwen3'") as info:
        resolve_model_class("Qwen3ForCausalLM", {"llama": {}}, [], "0.9.3")
    assert "VLLM_NEURON_BACKEND=reference" in str(info.value)


@pytest.mark.parametrize(("version", "expected"), [
    ("0.8.16251", "0.8"), ("0.9.0+ef2731e", "0.9"), ("0.10.18399", "0.9"), ("0.7.0", "0.8"),
    (None, "0.8"), ("not-a-version", "0.8")])
def test_the_table_row_of_an_installed_release(version, expected):
    """An unchecked release takes the row of the newest checked release below it (the
    oldest for an older or unknown one)."""
    assert release_for(version).release == expected


def test_unsupported_architecture_names_the_entry_point_group(release):
    with pytest.raises(NeuronConfigError) as info:
        resolve_model_class("GPT2LMHeadModel", {}, [])
    assert "LlamaForCausalLM" in str(info.value)
    assert ENTRY_POINT_GROUP in str(info.value)
    assert "VLLM_NEURON_BACKEND=reference" in str(info.value)


def test_llama_vision_is_refused_by_name(release):
    """NxDI lists mllama (MODEL_TYPES, with an image-encoding application), but vLLM
    serves it no more: the nxd backend refuses it before any work with vLLM's registry
    entry, and explain-config (describe_architecture) says the same."""
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    architecture = "MllamaForConditionalGeneration"
    for call in (lambda: resolve_model_class(architecture, MODEL_TYPES, []),
                 lambda: describe_architecture(architecture, [], NXDI_0_9)):
        with pytest.raises(NeuronConfigError) as info:
            call()
        message = str(info.value)
        assert f"{architecture!r} is a vision-language model" in message
        assert "supported until vLLM 0.10.2" in message
        assert "the reference backend does not serve it either" in message


def test_entry_point_registered_contrib_model(release, monkeypatch, tmp_path):
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES

    write_dist_info(tmp_path, "TinyContribForCausalLM = "
                              "fake_contrib.modeling_tiny:NeuronTinyContribForCausalLM\n"
                              "LlamaForCausalLM = "
                              "fake_contrib.modeling_tiny:NeuronTinyContribForCausalLM")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = entry_points()
    assert {ep.name for ep in found} == {"TinyContribForCausalLM", "LlamaForCausalLM"}
    contrib = resolve_model_class("TinyContribForCausalLM", MODEL_TYPES, found)
    assert contrib.__name__ == "NeuronTinyContribForCausalLM"
    # a registered class wins over the built-in table
    assert resolve_model_class("LlamaForCausalLM", MODEL_TYPES, found) is contrib
    assert "entry point" in describe_architecture("TinyContribForCausalLM", found, NXDI_0_8)


def test_entry_point_that_is_not_an_nxdi_class(release):
    bad = importlib.metadata.EntryPoint(
        name="TinyContribForCausalLM", value="fake_contrib.modeling_tiny:NotAModel",
        group=ENTRY_POINT_GROUP)
    with pytest.raises(NeuronConfigError, match="not an NxDI application class"):
        resolve_model_class("TinyContribForCausalLM", {}, [bad])


def test_describe_architecture_needs_no_nxdi():
    assert "neuronx_distributed_inference" not in sys.modules
    assert describe_architecture("Qwen3ForCausalLM", [], NXDI_0_8) == \
        "NxDI MODEL_TYPES['qwen3']['causal-lm']"
    with pytest.raises(NeuronConfigError, match="has no NxD Inference model"):
        describe_architecture("BertModel", [], NXDI_0_8)


def test_missing_nxdi_is_a_clear_error(monkeypatch):
    purge()
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    with pytest.raises(NeuronConfigError, match="VLLM_NEURON_BACKEND=reference"):
        import_nxdi()


# -- settings -> NeuronConfig -------------------------------------------------------------
def test_neuron_config_kwargs_contiguous():
    kwargs = neuron_config_kwargs(settings(override={"save_sharded_checkpoint": True,
                                                    "on_device_sampling_config": None}))
    assert kwargs["tp_degree"] == 2 and kwargs["batch_size"] == 4
    assert kwargs["seq_len"] == 256 and kwargs["max_context_length"] == 256
    assert kwargs["context_encoding_buckets"] == [128, 256]
    assert kwargs["enable_bucketing"] is True and kwargs["is_continuous_batching"] is True
    assert kwargs["is_block_kv_layout"] is False and kwargs["is_prefix_caching"] is False
    assert kwargs["save_sharded_checkpoint"] is True
    assert not {"pa_num_blocks", "prefix_buckets", "token_generation_batches",
                "output_logits"} & kwargs.keys()


def test_neuron_config_kwargs_block_layout_and_null_block():
    s = settings(PREFIX, {"prefix_buckets": [64, 256]})
    kwargs = neuron_config_kwargs(s)
    assert kwargs["is_block_kv_layout"] and kwargs["is_prefix_caching"]
    assert kwargs["pa_num_blocks"] == s.num_blocks == 4 * 8 + 1
    assert kwargs["pa_block_size"] == 32
    assert kwargs["prefix_buckets"] == [64, 256]  # NxDI adds prefix 0 itself


def test_neuron_config_kwargs_sampling_and_batches():
    s = settings(override={"on_device_sampling_config": {"global_topk": 8},
                           "token_generation_batches": [2, 4]})
    kwargs = neuron_config_kwargs(s)
    assert kwargs["output_logits"] is True
    assert kwargs["on_device_sampling_config"] == {"global_topk": 8, "dynamic": True,
                                                   "deterministic": False}
    default = neuron_config_kwargs(settings())["on_device_sampling_config"]
    assert default == {"global_topk": 256, "dynamic": True, "deterministic": False}
    assert kwargs["token_generation_batches"] == [2, 4]
    kept = neuron_config_kwargs(settings(override={"on_device_sampling_config": {
        "deterministic": True, "do_sample": True}}))
    assert kept["on_device_sampling_config"] == {"deterministic": True, "do_sample": True,
                                                 "dynamic": True, "global_topk": 256}


def test_static_on_device_sampler_is_refused():
    s = settings(override={"on_device_sampling_config": {"dynamic": False}})
    with pytest.raises(NeuronConfigError, match="on_device_sampling_config.dynamic=False.*"
                                                "temperature and top-p.*remove dynamic"):
        neuron_config_kwargs(s)


def test_nxdi_seq_len_reaches_the_whole_last_block():
    assert neuron_config_kwargs(settings({**PREFIX, "max_model_len": 1000}))["seq_len"] == 1024
    assert neuron_config_kwargs(settings({"max_model_len": 1000}))["seq_len"] == 1000


def test_block_layout_too_short_for_nxdis_tiled_cache_is_refused():
    """block_kv_cache_manager.py _init_kv_shape_for_prefix_caching: 64 tokens are 2 blocks
    of 32, tiled 64 ways, so a tile would hold 32 // 64 = 0 rows (the double's cache is as
    empty as NxDI's: every write is out of bounds)."""
    with pytest.raises(NeuronConfigError, match=r"max_model_len=64 is too short.*"
                                                r"--block-size 32.*--max-model-len 97 or more"):
        neuron_config_kwargs(settings({**PREFIX, "max_model_len": 64}))
    assert neuron_config_kwargs(settings({**PREFIX, "max_model_len": 97}))["pa_block_size"] == 32
    kernel = {"attn_block_tkg_nki_kernel_enabled": True}  # NxDI does not tile with it
    kwargs = neuron_config_kwargs(settings({**PREFIX, "max_model_len": 64}, override=kernel))
    assert kwargs["attn_block_tkg_nki_kernel_enabled"] and kwargs["pa_block_size"] == 32


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
def test_contiguous_decode_arguments_fill_the_batch():
    s = settings()
    inputs = token_generation_inputs(s, np.array([40, 10, 30]), np.array([5, 9, 7]),
                                     np.array([3, 0, 2]), None)
    assert inputs.bucket == (4, 128) and inputs.num_real == 3
    args, answer = model_arguments(s, inputs)
    # sorted by seq_id; the missing seq_id 1 writes at the last position, attends nothing
    assert args["seq_ids"].tolist() == [0, 1, 2, 3]
    assert args["input_ids"].tolist() == [[10], [0], [30], [40]]
    assert args["position_ids"].tolist() == [[9], [255], [7], [5]]
    assert args["full_context_lens"].tolist() == [[10], [256], [8], [6]]
    assert args["computed_context_lens"].tolist() == [[9], [255], [7], [5]]
    assert answer.tolist() == [3, 0, 2]
    # 1-D path: NxDI takes the first bucket > width, so the width is the largest position
    assert args["attention_mask"].shape == (4, 9)
    assert args["attention_mask"].sum(axis=1).tolist() == [9, 0, 7, 5]


def test_batch_bucketing_mask_is_one_wider():
    s = settings(override={"token_generation_batches": [2, 4]})
    inputs = token_generation_inputs(s, np.array([1]), np.array([127]), np.array([1]), None)
    assert inputs.bucket == (2, 128)
    args, answer = model_arguments(s, inputs)
    assert args["seq_ids"].tolist() == [0, 1] and answer.tolist() == [1]
    # 2-D path: NxDI takes the first bucket >= width
    assert args["attention_mask"].shape == (2, 128)


def test_block_decode_pads_write_nowhere():
    s = settings(PREFIX)
    inputs = token_generation_inputs(s, np.array([7, 8]), np.array([33, 40]),
                                     np.array([1, 0]), [[3, 6], [1, 2]])
    args, answer = model_arguments(s, inputs)
    assert args["seq_ids"].tolist() == [0, 1, 2, 3] and answer.tolist() == [1, 0]
    assert args["slot_mapping"].tolist() == [[2 * 32 + 8], [6 * 32 + 1], [-1], [-1]]
    assert args["block_table"][2].tolist() == args["block_table"][1].tolist()
    assert "attention_mask" not in args


def test_context_encoding_arguments_keep_the_bucket_width():
    s = settings()
    inputs = context_encoding_inputs(s, np.array([5, 6, 7]), 0, 1, None)
    args, answer = model_arguments(s, inputs)
    assert args["input_ids"].shape == args["position_ids"].shape == (1, 128)
    assert args["input_ids"][0, :4].tolist() == [5, 6, 7, 0]
    assert args["position_ids"][0, :4].tolist() == [0, 1, 2, 1]  # NxDI's pad position
    assert args["attention_mask"].tolist() == [[1, 1, 1]]
    assert answer.tolist() == [0]


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
    assert s.context_encoding_shapes() == [(128, 0), (128, 128), (256, 0)]
    cte = padding_arguments(s, padding_inputs(s, "context_encoding", (128, 128)))
    assert cte["input_ids"].shape == (1, 256)
    assert cte["computed_context_lens"].tolist() == [[128]]
    assert (cte["slot_mapping"] == -1).all() and cte["slot_mapping"].shape == (1, 128)
    tkg = padding_arguments(s, padding_inputs(s, TOKEN_GENERATION, (4, 256)))
    assert tkg["position_ids"].tolist() == [[255]] * 4 and tkg["seq_ids"].tolist() == [0, 1, 2, 3]
    assert (tkg["slot_mapping"] == -1).all()


# -- the backend end to end on the double ----------------------------------------------------
def test_contiguous_forward_restores_request_order(seam, tiny, tmp_path):
    s = settings()
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompts = {2: np.arange(1, 129), 0: np.array([5, 6, 7]), 3: np.array([9] * 20)}
    for seq, prompt in prompts.items():
        inputs = context_encoding_inputs(s, prompt, 0, seq, None)
        assert backend.forward(inputs).argmax(-1).tolist() == [expected(prompt)]
    # a 128-token prompt runs the 128 graph the plugin chose (cte-exact-bucket patch)
    assert ran(backend) == [("context_encoding", (128,))] * 3
    inputs = token_generation_inputs(s, np.array([11, 22, 33]),
                                     np.array([128, 3, 20]), np.array([2, 0, 3]), None)
    logits = backend.forward(inputs)
    assert logits.shape == (3, VOCAB)
    assert logits.argmax(-1).tolist() == [expected([*prompts[2], 11]),
                                          expected([*prompts[0], 22]),
                                          expected([*prompts[3], 33])]
    assert ran(backend)[-1] == ("token_generation", (inputs.bucket[1],))


def test_block_layout_prefix_hit_and_decode(seam, tiny, tmp_path):
    s = settings(PREFIX)
    backend = loaded(s, tiny, tmp_path / "graphs")
    shared = np.arange(1, 33)                      # one full block, cached
    first = np.concatenate([shared, [50, 51]])
    second = np.concatenate([shared, [60, 61, 62]])
    miss = context_encoding_inputs(s, first, 0, 0, [1, 2])
    assert backend.forward(miss).argmax(-1).tolist() == [expected(first)]
    hit = context_encoding_inputs(s, second, 32, 1, [1, 3])
    assert backend.forward(hit).argmax(-1).tolist() == [expected(second)]
    # forward() asks for logits: with on-device sampling, the largest length's logits twin
    decode = token_generation_inputs(s, np.array([70, 80]), np.array([34, 35]),
                                     np.array([0, 1]), [[1, 2], [1, 3]], logits=True)
    assert backend.forward(decode).argmax(-1).tolist() == [
        expected([*first, 70]), expected([*second, 80])]
    assert ran(backend) == [("context_encoding", miss.bucket), ("context_encoding", hit.bucket),
                            ("token_generation", (1, 256))]


def nxdi_bucket(s, graph) -> tuple:
    """The bucket NxDI names a plugin graph by: a bare length for 1-D token generation,
    [1, length] for prefix-caching token generation (one active token)."""
    if graph.phase == TOKEN_GENERATION and s.is_block_layout:
        return 1, graph.shape[1]
    if graph.phase == TOKEN_GENERATION and (graph.logits or not batch_bucketing(s)):
        return (graph.shape[1],)  # a logits graph is 1-D (graphs.add_logits_graphs)
    return graph.shape


@pytest.mark.parametrize("limits,override", [({}, {}), (PREFIX, {}),
                                             ({}, {"token_generation_batches": [1, 2, 4]})])
def test_padding_only_calls_run_each_graph(seam, tiny, tmp_path, limits, override):
    if seam == "0.7" and override:
        pytest.skip("NxDI 0.7 has no batch bucketing")
    s = settings(limits, override)
    backend = loaded(s, tiny, tmp_path / "graphs")
    for graph in graph_specs(s):
        run_graph_once(backend, graph)
    assert ran(backend) == [(g.phase, nxdi_bucket(s, g)) for g in graph_specs(s)]
    tags = [tag for tag, _ in backend.model.traced_model.ran]
    assert tags == [graph_tag(g) for g in graph_specs(s)]
    for graph in graph_specs(s):
        logits = backend.forward(padding_inputs(s, graph.phase, graph.shape))
        assert logits.shape == (0, VOCAB)


# -- the seam defects, each against every release whose code differs ---------------------------
@pytest.mark.parametrize("limits", [{}, PREFIX])
def test_1_every_call_carries_sampling_params_of_its_rows(seam, tiny, tmp_path, limits):
    """NxD's router matches sampling_params too: NxDI's default has max_num_seqs rows
    and context encoding is compiled for one row."""
    s = settings(limits)
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompt = np.array([3, 4, 5])
    blocks = [[1], [2]] if s.is_block_layout else None
    for seq in (0, 1):
        inputs = context_encoding_inputs(s, prompt, 0, seq, blocks and blocks[seq])
        assert backend.forward(inputs).argmax(-1).tolist() == [expected(prompt)]
    decode = token_generation_inputs(s, np.array([6]), np.array([3]), np.array([1]),
                                     blocks and blocks[1:])
    assert backend.forward(decode).argmax(-1).tolist() == [expected([3, 4, 5, 6])]


@pytest.mark.parametrize("rows", [1, 2])
def test_2_prefix_caching_decode_with_on_device_sampling(seam, tiny, tmp_path, rows):
    """A prefix-caching decode with fewer rows than the compiled batch: NxDI cuts the list
    [tokens, logits] instead of the tensors (IndexError for one row)."""
    s = settings(PREFIX, {"on_device_sampling_config": {"global_topk": 8}})
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompts = [np.array([3, 4]), np.array([5, 6, 7])]
    for seq, prompt in enumerate(prompts):
        out = backend.run(context_encoding_inputs(s, prompt, 0, seq, [seq + 1]), sampling(1))
        assert out.tokens[:, 0].tolist() == [expected(prompt)] == out.logits.argmax(-1).tolist()
    decode = token_generation_inputs(s, np.array([9, 8][:rows]), np.array([2, 3][:rows]),
                                     np.arange(rows), [[1], [2]][:rows])
    out = backend.run(decode, sampling(rows))
    want = [expected([3, 4, 9]), expected([5, 6, 7, 8])][:rows]
    assert out.tokens[:, 0].tolist() == want == out.logits.argmax(-1).tolist()
    assert out.logits.shape == (rows, VOCAB)


def test_3_on_device_sampler_samples_non_greedy_requests(seam, tiny, tmp_path):
    """NxDI's sampler is argmax unless do_sample or dynamic is compiled in."""
    s = settings(override={"on_device_sampling_config": {"global_topk": 8,
                                                         "deterministic": True}})
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompt = np.array([3, 4])
    out = backend.run(context_encoding_inputs(s, prompt, 0, 0, None),
                      sampling(1, top_k=8, temperature=2.0))
    # the double's logits fall by 1 per token id after the best, so at temperature 2
    # the best has probability 0.41 of the 8 and a fixed 0.5 draw picks the second best
    assert out.tokens[:, 0].tolist() == [(expected(prompt) + 1) % VOCAB]
    assert out.logits.argmax(-1).tolist() == [expected(prompt)]
    greedy = backend.run(context_encoding_inputs(s, prompt, 0, 1, None), sampling(1))
    assert greedy.tokens[:, 0].tolist() == [expected(prompt)]


def test_4_one_token_prompt_answers_for_its_token(seam, tiny, tmp_path):
    """NxDI pads positions with 1 and reads the last token at argmax(position_ids)."""
    s = settings()
    backend = loaded(s, tiny, tmp_path / "graphs")
    for seq, prompt in enumerate(([7], [7, 8], [7, 8, 9])):
        inputs = context_encoding_inputs(s, np.array(prompt), 0, seq, None)
        assert backend.forward(inputs).argmax(-1).tolist() == [expected(prompt)]


@pytest.mark.parametrize("seam", ["0.8", "0.9"], indirect=True)
def test_5_batch_bucketing_decode_runs_the_plugins_bucket(seam, tiny, tmp_path):
    """NxDI's 2-D token-generation choice fits lengths with <=, its 1-D choice with <; and
    a batch bucket b serves seq_ids 0..b-1 only. (Without on-device sampling: forward()
    then runs the batch-bucketed graphs, which return logits.)"""
    s = settings({"tp_degree": 1}, {"token_generation_batches": [1, 2, 4],
                                     "on_device_sampling_config": None})
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompts = {0: np.arange(1, 129), 3: np.array([5, 6])}
    for seq, prompt in prompts.items():
        backend.forward(context_encoding_inputs(s, prompt, 0, seq, None))
    at_bucket = token_generation_inputs(s, np.array([11]), np.array([128]), np.array([0]), None)
    assert at_bucket.bucket == (1, 256)
    assert backend.forward(at_bucket).argmax(-1).tolist() == [expected([*prompts[0], 11])]
    assert ran(backend)[-1] == ("token_generation", (1, 256))
    high_seq = token_generation_inputs(s, np.array([12]), np.array([2]), np.array([3]), None)
    assert high_seq.bucket == (4, 128)
    assert backend.forward(high_seq).argmax(-1).tolist() == [expected([5, 6, 12])]
    assert ran(backend)[-1] == ("token_generation", (4, 128))


def test_prefix_cache_hit_in_a_128_bucket_is_wrong_unpatched_and_right_patched(
        seam, tiny, tmp_path, monkeypatch):
    """NxDI's unmasked prefix prefill (patch prefix-prefill-mask): 40 new tokens after 96
    cached run the (128, 128) graph, whose active part re-encodes 88 cached positions."""
    s = settings({**PREFIX, "max_model_len": 1024})
    context = np.random.default_rng(1).integers(1, VOCAB, 136)
    blocks = list(range(1, 6))
    for disabled, right in (("prefix-prefill-mask", False), ("", True)):
        monkeypatch.setenv("VLLM_NEURON_DISABLE_PATCHES", disabled)
        use_release(seam, monkeypatch, tmp_path / disabled)  # a fresh, unpatched import
        backend = loaded(s, tiny, tmp_path / disabled / "graphs")
        backend.forward(context_encoding_inputs(s, context[:96], 0, 0, blocks))
        hit = context_encoding_inputs(s, context, 96, 0, blocks)
        assert hit.bucket == (128, 128)
        got = backend.forward(hit).argmax(-1).tolist()
        assert (got == [expected(context)]) is right


def test_6_prefix_caching_bucket_is_nxdis_choice(seam, tiny, tmp_path):
    """NxDI moves the prefix tail into spare active slots and sends 257-512 tokens to
    (512, 0); the plugin's bucket, graphs and outputs follow it."""
    s = settings({**PREFIX, "max_model_len": 1024})
    backend = loaded(s, tiny, tmp_path / "graphs")
    rng = np.random.default_rng(0)
    cases = [(96, 32, (128, 0)), (200, 256, (512, 0)), (40, 96, (128, 128)),
             (300, 0, (512, 0)), (100, 640, (128, 1024)), (600, 320, (1024, 0))]
    for new, cached, bucket in cases:
        context = rng.integers(1, VOCAB, new + cached)
        blocks = list(range(1, 1 + -(-(new + cached) // 32)))
        if cached:  # the cached prefix, as a first chunk
            backend.forward(context_encoding_inputs(s, context[:cached], 0, 0, blocks))
        inputs = context_encoding_inputs(s, context, cached, 0, blocks)
        assert inputs.bucket == bucket
        assert backend.forward(inputs).argmax(-1).tolist() == [expected(context)]
        assert ran(backend)[-1] == ("context_encoding", bucket)
        assert bucket in s.context_encoding_shapes()


def test_6_context_encoding_shapes_are_those_nxdi_can_run(seam, tiny):
    """Every need NxDI serves lands on a listed shape, and every listed shape is served."""
    from neuronx_distributed_inference.models.model_wrapper import ModelWrapper

    s = settings({**PREFIX, "max_model_len": 1024})
    model = NxDBackend(s, tiny)._new_model()
    wrapper = model.context_encoding_model
    reached = set()
    for total in range(2, 1025, 7):
        for new in range(1, total + 1, 5):
            args = [None] * 13 + [torch.tensor([[new]]), torch.tensor([[total - new]])]
            reached.add(tuple(int(v) for v in ModelWrapper.get_target_2d_bucket_for_prefix_caching(
                wrapper, *args)))
    assert reached == set(s.context_encoding_shapes())
    assert len(reached) < len(s.context_encoding_buckets) * len(s.prefix_buckets)


def test_7_decode_past_a_partial_block(seam, tiny, tmp_path):
    """NxDI hands a length-L graph the first L // block_size blocks of the table: the
    largest bucket must reach max_model_len in whole blocks."""
    s = settings({**PREFIX, "max_model_len": 1000, "max_num_seqs": 1})
    backend = loaded(s, tiny, tmp_path / "graphs")
    prompt = np.arange(1, 996) % VOCAB
    blocks = list(range(1, 33))
    backend.forward(context_encoding_inputs(s, prompt, 0, 0, blocks))
    decode = token_generation_inputs(s, np.array([4]), np.array([995]), np.array([0]), [blocks])
    assert backend.forward(decode).argmax(-1).tolist() == [expected([*prompt, 4])]
    assert ran(backend)[-1] == ("token_generation", (1, 1024))


def test_7_block_grids_are_whole_blocks():
    with pytest.raises(NeuronConfigError, match=r"token_generation_buckets has 200, not a "
                                                r"multiple of 32.*use 224"):
        settings(PREFIX, {"token_generation_buckets": [200, 256]})
    with pytest.raises(NeuronConfigError, match=r"prefix_buckets has 100, not a multiple"):
        settings(PREFIX, {"prefix_buckets": [100, 256]})
    big = settings({**PREFIX, "block_size": 256, "max_model_len": 512})
    assert big.token_generation_buckets == (256, 512)
    assert big.prefix_buckets == (0, 256, 512)
    assert settings({"max_model_len": 1000}).token_generation_buckets[-1] == 1000


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
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "cache" / "neuronx-cc")


def test_load_backend_through_the_compile_cache(release, tiny, tmp_path):
    from neuron_plugin.backends.loader import load_backend

    s = settings()
    backend, first = load_backend(s, tiny, str(tmp_path / "cache"))
    assert isinstance(backend, NxDBackend) and not first.hit
    assert backend.forward(context_encoding_inputs(s, np.array([4, 5]), 0, 0, None)
                           ).argmax(-1).tolist() == [expected([4, 5])]
    _, second = load_backend(s, tiny, str(tmp_path / "cache"))
    assert second.hit and second.key == first.key


def test_tensor_parallel_above_visible_cores_fails_up_front(release, tiny, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    with pytest.raises(NeuronConfigError, match="tensor_parallel_size=2 needs 2 NeuronCores "
                                                "but only 1 are visible"):
        NxDBackend(settings(), tiny)
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    if not host_visible_cores()[0]:
        with pytest.raises(NeuronConfigError, match="none are visible"):
            NxDBackend(settings(), tiny)


def test_cache_manifest_fields(release, tiny, monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type transformer -O1")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    backend = NxDBackend(settings(), tiny)
    fields = backend.cache_manifest_fields()
    assert fields["weights_fingerprint"] is None
    assert set(fields["versions"]) == {*DISTRIBUTIONS, "nxdi_patches"}
    # The patches change what NxDI traces (0.7 needs all five), so they key the cache.
    assert fields["versions"]["nxdi_patches"] == (
        "adapter-forward-kwargs,adapter-prefix-lens,cte-exact-bucket,prefix-prefill-mask,"
        "sampler-top-p")
    assert fields["compiler_flags"] == ["--model-type", "transformer", "-O1"]
    manifest = cache_manifest(backend.settings, backend)
    assert manifest["model"]["num_hidden_layers"] == 2
    assert "transformers_version" not in manifest["model"]  # volatile: dropped
    if detect_instance_type() is None:
        assert fields["target"]["platform"] == "inf2"
    embedded = NxDBackend(settings(override={"save_sharded_checkpoint": True}), tiny)
    assert len(embedded.cache_manifest_fields()["weights_fingerprint"]) == 64


def test_sharded_checkpoint_is_loaded_from_the_artifacts(release, tiny, tmp_path):
    backend = loaded(settings(override={"save_sharded_checkpoint": True}), tiny,
                     tmp_path / "graphs")
    assert (tmp_path / "graphs" / "weights" / "tp1_sharded_checkpoint.safetensors").exists()
    assert len(backend.model.loaded_weights) == 2


def test_quantized_checkpoint_is_written_by_nxdi_ahead_of_serving(release, tiny, tmp_path):
    """`neuron-plugin quantize` (backend.quantize) writes NxDI's checkpoint through NxDI's
    save_quantized_state_dict into a folder; compiling writes nothing; loading reads
    it (int8 weights, float32 scales, the rest cast to the model dtype)."""
    quantized = tmp_path / "quantized"
    s = settings(override={"quantized": True, "quantized_checkpoints_path": str(quantized),
                           "quantization_type": "per_channel_symmetric"})
    backend = NxDBackend(s, tiny)
    backend.compile(tmp_path / "graphs")
    assert not quantized.exists()
    with pytest.raises(NeuronConfigError, match="neuron-plugin quantize"):
        backend.load(tmp_path / "graphs")
    written = backend.quantize()
    assert written["path"] == str(quantized) and (quantized / "model.safetensors").exists()
    backend.load(tmp_path / "graphs")
    weights = backend.model.loaded_weights[0]
    assert weights["layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert weights["layers.0.self_attn.q_proj.scale"].dtype == torch.float32
    assert weights["layers.0.self_attn.q_proj.scale"].shape == (256, 1)
    assert weights["lm_head.weight"].dtype == torch.int8


def test_kv_cache_tensors_in_vllm_neuron_order(release, tiny, tmp_path):
    backend = loaded(settings(), tiny, tmp_path / "graphs")
    tensors = backend.kv_cache_tensors()
    state = backend.model.context_encoding_model.model.nxd_model.state
    assert len(tensors) == 2 * 2 * 2  # (K, V) x 2 layers x 2 ranks
    assert tensors[0] is state[0]["kv_mgr.past_key_values.0"]
    assert tensors[1] is state[1]["kv_mgr.past_key_values.0"]
    assert tensors[0].shape == (4, 1, 256, 1)


def test_gemma4_kv_blocks_are_not_transferred(tiny_model):
    """The Gemma 4 class's packed cache rows are no blocks of [KV heads, head_dim] per
    layer: a disaggregated server says so before reading any (the model is never read)."""
    from neuron_plugin.backends.nxd.kv_state import NxDKVState
    from neuron_plugin.core.checkpoint import read_hf_config

    config = read_hf_config(tiny_model("gemma4"))
    with pytest.raises(NeuronConfigError, match="Gemma 4 on the nxd backend with "
                       "--kv-transfer-config: .* serve it without --kv-transfer-config"):
        NxDKVState(None, settings(), True, config, "nxd")


def test_run_returns_logits_of_the_rows_that_need_them(seam, tiny, tmp_path):
    s = settings(override={"on_device_sampling_config": {"global_topk": 8}})
    backend = loaded(s, tiny, tmp_path / "graphs")
    for seq, prompt in ((1, [3, 4]), (0, [5])):
        backend.run(context_encoding_inputs(s, np.array(prompt), 0, seq, None),
                    sampling(1, needs_logits=False))
    inputs = token_generation_inputs(s, np.array([1, 2]), np.array([2, 1]),
                                     np.array([1, 0]), None)
    rows = sampling(2)
    rows.needs_logits[0] = False
    out = backend.run(inputs, rows)
    assert out.tokens[:, 0].tolist() == [expected([3, 4, 1]), expected([5, 2])]
    assert out.tokens.dtype == np.int32
    assert out.logits.shape == (1, VOCAB)
    assert out.logits.argmax(-1).tolist() == [expected([5, 2])]


def test_run_needs_on_device_sampling(release, tiny, tmp_path):
    s = settings({"tp_degree": 1}, {"on_device_sampling_config": None})
    backend = loaded(s, tiny, tmp_path / "graphs")
    inputs = context_encoding_inputs(s, np.array([3, 4]), 0, 0, None)
    assert backend.forward(inputs).argmax(-1).tolist() == [expected([3, 4])]
    with pytest.raises(ValueError, match="call forward"):
        backend.run(inputs, sampling(1))


def test_release_with_hook_parameter_needs_no_adapter_patch(monkeypatch, tiny, tmp_path):
    modules = use_release("0.9-ef2731e", monkeypatch, tmp_path)
    try:
        backend = loaded(settings(), tiny, tmp_path / "graphs")
        prepare = modules.hf_adapter.HuggingFaceGenerationAdapter.prepare_inputs_for_generation
        assert not is_patched(prepare, "adapter-forward-kwargs")
        assert is_patched(prepare, "adapter-prefix-lens")
        inputs = context_encoding_inputs(backend.settings, np.array([1, 2]), 0, 0, None)
        assert backend.forward(inputs).argmax(-1).tolist() == [expected([1, 2])]
    finally:
        purge()


def test_vocab_size_of_multimodal_style_config():
    backend = object.__new__(NxDBackend)
    backend.hf_config = {"text_config": {"vocab_size": 5}}
    assert backend.vocab_size == 5
    backend.hf_config = {"vocab_size": 7}
    assert backend.vocab_size == 7


def test_decode_pads_leave_other_requests_lines_alone(seam, tiny, tmp_path):
    """A decode batch's pad rows run on the cache lines of the seq_ids it lacks; copying
    the first row (NxDI's own padding) would write its token at its position into a
    request prefilled earlier in the same step."""
    s = settings()
    backend = loaded(s, tiny, tmp_path / "graphs")
    first, second = np.arange(1, 6), np.arange(100, 120)
    backend.forward(context_encoding_inputs(s, first, 0, 0, None))
    backend.forward(context_encoding_inputs(s, second, 0, 1, None))
    alone = token_generation_inputs(s, np.array([7]), np.array([5]), np.array([0]), None)
    assert backend.forward(alone).argmax(-1).tolist() == [expected([*first, 7])]
    later = token_generation_inputs(s, np.array([8]), np.array([20]), np.array([1]), None)
    assert backend.forward(later).argmax(-1).tolist() == [expected([*second, 8])]


# -- KV blocks (prefill/decode disaggregation) ------------------------------------------------
def test_kv_blocks_are_nxdi_state_tensors_moved_between_servers(seam, tiny, tmp_path):
    """The double holds NxDI's prefix-caching state (block_kv_cache_manager: pa_num_blocks
    + 1 blocks, the block dimension tiled under 128 blocks a sequence, KV heads split over
    the TP ranks): a prompt's blocks read from one backend and written into other blocks
    of another decode there as they would where they were computed."""
    s = settings(PREFIX)
    prefill = loaded(s, tiny, tmp_path / "p")
    decode = loaded(s, tiny, tmp_path / "d")
    state = prefill.model.context_encoding_model.model.nxd_model.state
    assert state[0]["kv_mgr.past_key_values.0"].shape == (s.num_blocks + 1, 16, 2, 1, 64)
    geometry = prefill.kv_geometry()
    assert geometry == KVGeometry(layers=2, block_size=32, kv_heads=2, head_dim=64,
                                  dtype="float32", computation=geometry.computation)
    # how the values are computed: NxDI and its math-changing patches (issue 39)
    patches = prefill.nxdi.patches_for(s.architecture)
    assert geometry.computation == f"nxd, patches: {', '.join(patches) or 'none'}"
    prompt = np.arange(1, 41)  # a block and a part
    prefill.forward(context_encoding_inputs(s, prompt, 0, 0, [1, 2]))
    kv = prefill.read_kv_blocks(np.array([1, 2])).clone()
    assert kv.shape == geometry.shape(2)
    decode.write_kv_blocks(np.array([5, 7]), kv)
    assert torch.equal(decode.read_kv_blocks(np.array([5, 7])), kv)
    step = token_generation_inputs(s, np.array([70]), np.array([40]), np.array([0]), [[5, 7]])
    assert decode.forward(step).argmax(-1).tolist() == [expected([*prompt, 70])]


def test_kv_blocks_are_layer_major_with_ranks_heads_in_order(release, tiny, tmp_path):
    s = settings(PREFIX)
    backend = loaded(s, tiny, tmp_path / "graphs")
    kv = torch.randn(backend.kv_geometry().shape(2))
    backend.write_kv_blocks(np.array([3, 9]), kv)
    state = backend.model.context_encoding_model.model.nxd_model.state
    for layer in range(2):
        for kind in range(2):  # K, V
            for rank in range(2):
                tensor = state[rank][f"kv_mgr.past_key_values.{2 * layer + kind}"]
                blocks = tensor.view(s.num_blocks + 1, 32, 1, 64)
                assert torch.equal(blocks[9], kv[layer, kind, 1, :, rank : rank + 1])
    assert torch.equal(backend.read_kv_blocks(np.array([9, 3])), kv[:, :, [1, 0]])


def test_nxd_state_tensors_refuse_what_the_neuron_runtime_refuses(release, tiny, tmp_path):
    """The double's state tensors stand in for NxD's device tensors (_device.py): views
    and contiguous host copies work, gathers, scatters, copies between two device
    tensors and host copies of non-contiguous views do not."""
    backend = loaded(settings(PREFIX), tiny, tmp_path / "graphs")
    state = backend.model.context_encoding_model.model.nxd_model.state
    k0, k1 = state[0]["kv_mgr.past_key_values.0"], state[1]["kv_mgr.past_key_values.0"]
    blocks = k0.view(k0.shape[0], 32, 1, 64)
    assert blocks.narrow(0, 3, 2).cpu().shape == (2, 32, 1, 64)
    blocks.narrow(0, 3, 2).copy_(torch.ones(2, 32, 1, 64))
    with pytest.raises(RuntimeError, match="index_select"):
        blocks.index_select(0, torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match="index_copy_"):
        blocks.index_copy_(0, torch.tensor([3]), torch.zeros(1, 32, 1, 64))
    with pytest.raises(RuntimeError, match="indexing by a tensor"):
        blocks[torch.tensor([3, 4])]
    with pytest.raises(RuntimeError, match="different parent tensors"):
        k0.copy_(k1)
    with pytest.raises(RuntimeError, match="non-contiguous"):
        blocks[:, :16].cpu()
    with pytest.raises(RuntimeError, match="contiguous tensors on both sides"):
        blocks.narrow(0, 3, 1).copy_(torch.ones(64, 1, 32, 1).transpose(0, 3))


@pytest.mark.parametrize("blocks", [64, 256])
def test_kv_block_moves_cost_the_blocks_moved_not_the_cache(release, tiny, tmp_path, blocks):
    """A read or a write moves each run of consecutive blocks of each state tensor in one
    contiguous host<->device copy: the bytes and copies depend on the blocks and runs,
    whatever the cache's size."""
    from neuronx_distributed_inference._device import TRANSFERS

    s = settings({**PREFIX, "num_gpu_blocks_override": blocks})
    backend = loaded(s, tiny, tmp_path / "graphs")
    geometry = backend.kv_geometry()
    ids = np.array([3, 4, 5, 9])  # two runs
    TRANSFERS.clear()
    kv = backend.read_kv_blocks(ids)
    tensors = 2 * geometry.layers * 2  # (K, V) x layers x TP ranks
    assert [d for d, _ in TRANSFERS] == ["to_host"] * 2 * tensors
    assert sum(n for _, n in TRANSFERS) == 4 * geometry.block_bytes
    TRANSFERS.clear()
    backend.write_kv_blocks(np.array([20, 7, 8, 9]), kv)
    assert [d for d, _ in TRANSFERS] == ["to_device"] * 2 * tensors
    assert sum(n for _, n in TRANSFERS) == 4 * geometry.block_bytes
    assert torch.equal(backend.read_kv_blocks(np.array([20, 7, 8, 9])), kv)


def multi_head_copy(tiny, folder):
    """The tiny Llama as a multi-head attention model (4 KV heads): its files with
    num_key_value_heads = num_attention_heads (the double's graphs read no weights)."""
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# The tiny Llama has 4 attention heads and 2 KV heads. TP 4: each KV head on 2 ranks
# (REPLICATE_TO_TP_DEGREE); TP 3: multi-head attention over 6 padded heads, 2 a rank,
# rank 0 holding head 0 twice, rank 1 head 1 twice, rank 2 two padding heads. As a
# multi-head model (4 KV heads): TP 8 replicates each KV head on 2 ranks, the odd rank's
# query a padding head (gqa.py maybe_pad_interleaved), so only the even ranks' copies are
# read; TP 6 converts to multi-head attention over 6 padded heads, 1 a rank.
# `stale`: a KV slot a real query head reads; `unread`: one only a padding query reads.
@pytest.mark.parametrize("mha, tp, slots, ranks_read, stale, unread", [
    (False, 4, [[0], [0], [1], [1]], [0, 2], 1, None),
    (False, 3, [[0, 0], [1, 1], [None, None]], [0, 1], 1, None),
    (True, 8, [[0], [0], [1], [1], [2], [2], [3], [3]], [0, 2, 4, 6], 2, 1),
    (True, 6, [[0], [1], [2], [3], [None], [None]], [0, 1, 2, 3], 1, None),
], ids=["gqa-tp4", "gqa-tp3", "mha-tp8", "mha-tp6"])
def test_kv_blocks_move_each_distinct_head_once(release, tiny, tmp_path, monkeypatch,
                                                mha, tp, slots, ranks_read, stale, unread):
    """NxDI's GQA sharding (gqa.py determine_sharding_strategy, get_shardable_head_counts,
    the preshard hook's replicate_kv and padding), reproduced by the double: a block's
    payload holds the model's KV heads once at any TP, a read copies one rank per replica
    group, a write reaches every replica (a decode reads every copy a real query head
    attends: one stale such replica shows) and zeroes the padding heads; the bytes read
    are the model's true KV size. Each rank's copies are issued by a thread of their own:
    the copies one after another are 2 x layers x runs whatever the TP degree."""
    from neuronx_distributed_inference._device import TRANSFER_THREADS, TRANSFERS

    model = multi_head_copy(tiny, tmp_path / "mha") if mha else tiny
    heads = 4 if mha else 2
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", f"0-{tp - 1}")
    s = settings({**PREFIX, "tp_degree": tp})
    prefill = loaded(s, model, tmp_path / "p")
    decode = loaded(s, model, tmp_path / "d")
    geometry = prefill.kv_geometry()
    assert geometry == KVGeometry(layers=2, block_size=32, kv_heads=heads, head_dim=64,
                                  dtype="float32", computation=geometry.computation)
    data = torch.randn(geometry.shape(3))
    TRANSFERS.clear()
    TRANSFER_THREADS.clear()
    decode.write_kv_blocks(np.array([9, 4, 12]), data)
    tensors = 2 * geometry.layers
    assert [d for d, _ in TRANSFERS] == ["to_device"] * tensors * 3 * tp  # 3 runs, every rank
    assert sorted(Counter(TRANSFER_THREADS).values()) == [tensors * 3] * tp
    state = decode.model.context_encoding_model.model.nxd_model.state
    for rank, rank_heads in enumerate(slots):
        blocks = state[rank]["kv_mgr.past_key_values.3"].view(s.num_blocks + 1, 32,
                                                               len(rank_heads), 64)
        for local, head in enumerate(rank_heads):
            want = data[1, 1, 0, :, head] if head is not None else torch.zeros(32, 64)
            assert torch.equal(blocks[9, :, local], want), (rank, local)
    TRANSFERS.clear()
    TRANSFER_THREADS.clear()
    assert torch.equal(decode.read_kv_blocks(np.array([9, 4, 12])), data)
    assert [d for d, _ in TRANSFERS] == ["to_host"] * tensors * 3 * len(ranks_read)
    assert sorted(Counter(TRANSFER_THREADS).values()) == [tensors * 3] * len(ranks_read)
    per_rank_bytes = 3 * geometry.block_bytes // heads * len(slots[0])  # a rank's heads
    assert sum(n for _, n in TRANSFERS) == per_rank_bytes * len(ranks_read)
    if len(slots[0]) == 1:  # one head a rank: the bytes read are the payload's
        assert sum(n for _, n in TRANSFERS) == 3 * geometry.block_bytes
    # a prompt's blocks computed on the prefill server decode on the other
    prompt = np.arange(1, 41)
    prefill.forward(context_encoding_inputs(s, prompt, 0, 0, [1, 2]))
    decode.write_kv_blocks(np.array([5, 7]), prefill.read_kv_blocks(np.array([1, 2])))
    step = token_generation_inputs(s, np.array([70]), np.array([40]), np.array([0]), [[5, 7]])
    right = [expected([*prompt, 70])]
    assert decode.forward(step).argmax(-1).tolist() == right

    def spoil(slot):
        per = len(slots[0])
        replica = state[slot // per]["kv_mgr.past_key_values.0"].view(s.num_blocks + 1, 32,
                                                                      per, 64)
        spoilt = replica.narrow(0, 5, 1).cpu()
        spoilt[:, :, slot % per] = 0
        replica.narrow(0, 5, 1).copy_(spoilt)
        return decode.forward(step).argmax(-1).tolist()

    if unread is not None:  # NxDI never reads it: the answer stands
        assert spoil(unread) == right
    assert spoil(stale) != right  # one stale copy a real query reads changes the answer


@pytest.mark.parametrize("block_ids, message", [
    ([0], r"outside 1\.\.32 \(block 0 is vLLM's null block\)"),
    ([33], "outside 1..32"),
    ([4, 4], "repeat a block"),
    (list(range(1, 10)), "a request holds 1 to 8"),
])
def test_kv_block_ids_outside_a_request_are_refused(release, tiny, tmp_path, block_ids, message):
    backend = loaded(settings(PREFIX), tiny, tmp_path / "graphs")
    with pytest.raises(ValueError, match=message):
        backend.read_kv_blocks(np.array(block_ids))
    with pytest.raises(ValueError, match="do not fit this backend's cache"):
        backend.write_kv_blocks(np.array([1]), torch.zeros(2, 2, 1, 32, 2, 32))


def test_kv_blocks_need_the_block_layout(release, tiny, tmp_path):
    backend = loaded(settings(), tiny, tmp_path / "graphs")
    with pytest.raises(NeuronConfigError, match="block KV layout only.*--enable-prefix-caching"):
        backend.kv_geometry()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_blocks_through_the_runner_arena(tiny, sdk_python, monkeypatch, tmp_path, dtype):
    """The nxd backend in a runner process (the SDK environment, NxDI being the double):
    blocks cross the KV arena as raw bytes in NxDI's cache dtype, and a prompt's blocks
    moved to other blocks decode there as where they were computed."""
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.backends.runner.client import RunnerBackend
    from tests.plugin.fake_nxdi.nxdi_release import ROOT as FAKE_ROOT

    repo = FAKE_ROOT.parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(FAKE_ROOT), str(repo), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_NXDI_RELEASE", "0.9-ef2731e")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    s = dataclasses.replace(settings({**PREFIX, "dtype": dtype}), backend_python=sdk_python)
    backend = open_backend(s, tiny, str(tmp_path / "cache"))
    assert isinstance(backend, RunnerBackend)
    try:
        geometry = backend.kv_geometry()
        assert geometry == KVGeometry(2, 32, 2, 64, dtype, geometry.computation)
        assert geometry.computation.startswith("nxd, patches: ")
        assert backend.runner.kv.size == geometry.block_bytes * s.max_blocks_per_seq
        data = torch.randn(geometry.shape(3)).to(geometry.torch_dtype)
        backend.write_kv_blocks(np.array([9, 4, 12]), data)
        assert torch.equal(backend.read_kv_blocks(np.array([9, 4, 12])), data)
        if dtype == "float32":  # the double's token values are exact in float32
            prompt = np.arange(1, 41)
            backend.forward(context_encoding_inputs(s, prompt, 0, 0, [1, 2]))
            backend.write_kv_blocks(np.array([5, 7]), backend.read_kv_blocks(np.array([1, 2])))
            step = token_generation_inputs(s, np.array([70]), np.array([40]), np.array([0]),
                                           [[5, 7]])
            assert backend.forward(step).argmax(-1).tolist() == [expected([*prompt, 70])]
    finally:
        backend.close()
