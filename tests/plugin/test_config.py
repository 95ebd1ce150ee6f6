"""Configuration resolution over a table: vLLM limits + override_neuron_config ->
NeuronSettings, and every contradiction rejected with both settings and the fix named."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from neuron_plugin.core.settings import (
    BLOCK,
    CONTIGUOUS,
    EngineLimits,
    NeuronConfigError,
    NeuronSettings,
    required_blocks,
    resolve_settings,
)

BASE = EngineLimits(max_model_len=2048, max_num_seqs=4, block_size=None,
                    enable_prefix_caching=False, enable_chunked_prefill=False,
                    max_num_batched_tokens=2048, dtype="bfloat16")
PREFIX = dict(enable_prefix_caching=True, block_size=32)
CHUNKED = dict(enable_chunked_prefill=True, block_size=32, max_num_batched_tokens=256)
POW2 = (128, 256, 512, 1024, 2048)


def resolve(limits: dict | None = None, override: dict | None = None,
            backend: str = "nxd") -> NeuronSettings:
    return resolve_settings(dataclasses.replace(BASE, **(limits or {})), override,
                            backend=backend, architecture="LlamaForCausalLM")


# id, vLLM limits, override_neuron_config, backend, expected fields of NeuronSettings
ACCEPTED = [
    ("defaults-contiguous", {}, {}, "nxd",
     dict(kv_layout=CONTIGUOUS, block_size=2048, num_blocks=5, context_encoding_buckets=POW2,
          token_generation_buckets=POW2, token_generation_batches=(4,), prefix_buckets=())),
    ("prefix-caching-block-layout", PREFIX, {}, "nxd",
     dict(kv_layout=BLOCK, kv_layout_reason="prefix caching on", block_size=32,
          num_blocks=4 * 64 + 1, prefix_buckets=(0,) + POW2, is_prefix_caching=True)),
    ("chunked-prefill-block-layout", CHUNKED, {}, "nxd",
     dict(kv_layout=BLOCK, kv_layout_reason="chunked prefill on", is_chunked_prefill=True,
          num_blocks=257)),
    ("both-features", {**PREFIX, **CHUNKED}, {}, "nxd",
     dict(kv_layout_reason="prefix caching and chunked prefill on")),
    ("block-layout-asked-for", {"block_size": 32}, {"is_block_kv_layout": True}, "nxd",
     dict(kv_layout=BLOCK, kv_layout_reason="override_neuron_config.is_block_kv_layout=true")),
    ("block-layout-default-block-size", {"enable_prefix_caching": True}, {}, "nxd",
     dict(block_size=32, num_blocks=257)),
    ("non-divisible-length-ceil", {**PREFIX, "max_model_len": 1000}, {}, "nxd",
     dict(num_blocks=4 * 32 + 1)),
    ("exact-minimum-override", {**PREFIX, "max_model_len": 1000,
                                "num_gpu_blocks_override": 129}, {}, "nxd",
     dict(num_blocks=129)),
    ("pa-num-blocks-alone", PREFIX, {"pa_num_blocks": 300}, "nxd", dict(num_blocks=300)),
    ("pa-num-blocks-equal-override", {**PREFIX, "num_gpu_blocks_override": 300},
     {"pa_num_blocks": 300}, "nxd", dict(num_blocks=300)),
    ("pa-block-size-equal", PREFIX, {"pa_block_size": 32}, "nxd", dict(block_size=32)),
    ("bucketing-off-contiguous", {}, {"enable_bucketing": False}, "nxd",
     dict(enable_bucketing=False, context_encoding_buckets=(2048,),
          token_generation_buckets=(2048,))),
    ("bucketing-off-block", PREFIX, {"enable_bucketing": False}, "nxd",
     dict(prefix_buckets=(0, 2048), context_encoding_buckets=(2048,))),
    ("explicit-grids", {}, {"context_encoding_buckets": [64, 256, 2048],
                            "token_generation_buckets": [512, 2048],
                            "token_generation_batches": [1, 2, 4]}, "nxd",
     dict(context_encoding_buckets=(64, 256, 2048), token_generation_buckets=(512, 2048),
          token_generation_batches=(1, 2, 4))),
    ("explicit-prefix-grid-gets-zero", PREFIX, {"prefix_buckets": [512, 2048]}, "nxd",
     dict(prefix_buckets=(0, 512, 2048))),
    ("max-context-length-below-max-model-len", {}, {"max_context_length": 512}, "nxd",
     dict(max_context_length=512, context_encoding_buckets=(128, 256, 512))),
    ("nxdi-rounding-drops-closer-power", {"max_model_len": 2500}, {}, "nxd",
     dict(token_generation_buckets=(128, 256, 512, 1024, 2500))),
    ("short-model-single-bucket", {"max_model_len": 64}, {}, "nxd",
     dict(context_encoding_buckets=(64,), token_generation_buckets=(64,), num_blocks=5)),
    ("agreeing-duplicates", {"tp_degree": 2}, {"tp_degree": 2, "batch_size": 4,
                                               "tkg_batch_size": 4, "seq_len": 2048,
                                               "torch_dtype": "bfloat16"}, "nxd",
     dict(tp_degree=2)),
    ("on-device-sampling-nxd", {}, {"on_device_sampling_config": {"global_topk": 64}}, "nxd",
     dict(on_device_sampling=True,
          passthrough={"on_device_sampling_config": {"global_topk": 64}})),
    ("on-device-sampling-reference", {}, {"on_device_sampling_config": {"global_topk": 64}},
     "reference", dict(on_device_sampling=True, global_topk=64)),
    ("passthrough-keys", {}, {"save_sharded_checkpoint": True, "quantized": False,
                              "fused_qkv": True}, "nxd",
     dict(passthrough={"save_sharded_checkpoint": True, "quantized": False,
                       "fused_qkv": True})),
    ("skip-warmup", {}, {"skip_warmup": True}, "nxd", dict(skip_warmup=True)),
    ("batch-buckets-contiguous-nxd", {}, {"token_generation_batches": [2, 4]}, "nxd",
     dict(token_generation_batches=(2, 4))),
    # decode batch buckets by default: powers of two up to max_num_seqs, at most
    # max_batch_buckets of them (thinned evenly on the log scale)
    ("default-batches-32", {"max_num_seqs": 32}, {}, "reference",
     dict(token_generation_batches=(1, 2, 4, 8, 16, 32), token_generation_batches_reason="")),
    ("default-batches-not-a-power", {"max_num_seqs": 24}, {}, "reference",
     dict(token_generation_batches=(1, 2, 4, 8, 16, 24))),
    ("max-batch-buckets-bounds", {"max_num_seqs": 32}, {"max_batch_buckets": 3}, "nxd",
     dict(token_generation_batches=(1, 8, 32))),
    ("max-batch-buckets-one", {"max_num_seqs": 32}, {"max_batch_buckets": 1}, "reference",
     dict(token_generation_batches=(32,))),
    ("default-batches-thinned", {"max_num_seqs": 256}, {}, "reference",
     dict(token_generation_batches=(1, 4, 8, 32, 64, 256))),
    # NxDI batch-buckets neither the block layout nor LoRA: one batch size, and why
    ("default-batches-block-nxd", PREFIX, {}, "nxd",
     dict(token_generation_batches=(4,), token_generation_batches_reason="NxDI does not "
          "batch-bucket the block KV layout, chosen for prefix caching on")),
    ("default-batches-lora-nxd", {"max_loras": 2, "max_lora_rank": 8}, {}, "nxd",
     dict(token_generation_batches=(4,), token_generation_batches_reason="NxDI's LoRA "
          "weight_active holds one row per sequence of the full batch")),
    ("default-batches-block-reference", PREFIX, {}, "reference",
     dict(token_generation_batches=(1, 2, 4), token_generation_batches_reason="")),
    ("default-batches-one-seq", {"max_num_seqs": 1}, {}, "reference",
     dict(token_generation_batches=(1,))),
    ("harmless-values-of-unsupported-keys", {}, {"async_mode": False, "speculation_length": 0,
                                                 "padding_side": "right",
                                                 "is_continuous_batching": True}, "nxd",
     dict(kv_layout=CONTIGUOUS)),
    ("reference-backend", {"dtype": "float32"}, {}, "reference",
     dict(backend="reference", dtype="float32")),
    ("null-feature-configs", {}, {"chunked_prefill_config": None, "lora_config": None},
     "nxd", dict(kv_layout=CONTIGUOUS, is_chunked_prefill=False)),
]


@pytest.mark.parametrize("limits,override,backend,expected",
                         [row[1:] for row in ACCEPTED], ids=[row[0] for row in ACCEPTED])
def test_accepted_configurations(limits, override, backend, expected):
    settings = resolve(limits, override, backend)
    assert {k: getattr(settings, k) for k in expected} == expected


# id, vLLM limits, override_neuron_config, backend, fragments the message must contain
REJECTED = [
    ("prefix-caching-needs-block-layout", PREFIX, {"is_block_kv_layout": False}, "nxd",
     ["is_block_kv_layout=false", "prefix caching", "remove is_block_kv_layout"]),
    ("chunked-prefill-needs-block-layout", CHUNKED, {"is_block_kv_layout": False}, "nxd",
     ["is_block_kv_layout=false", "chunked prefill"]),
    ("pa-block-size-differs", PREFIX, {"pa_block_size": 16}, "nxd",
     ["pa_block_size=16", "block_size=32", "--block-size 16"]),
    ("pa-num-blocks-vs-override", {**PREFIX, "num_gpu_blocks_override": 300},
     {"pa_num_blocks": 400}, "nxd",
     ["pa_num_blocks=400", "num_gpu_blocks_override=300", "null block"]),
    # floor(1000 // 32) = 31 would accept 4 * 31 + 1 = 125; the true need is 4 * 32 + 1.
    ("override-too-small-ceil", {**PREFIX, "max_model_len": 1000,
                                 "num_gpu_blocks_override": 128}, {}, "nxd",
     ["num_gpu_blocks_override=128", "max_num_seqs=4", "max_model_len=1000",
      "ceil(1000/32)", "= 129", ">= 129"]),
    ("pa-num-blocks-too-small", PREFIX, {"pa_num_blocks": 256}, "nxd",
     ["pa_num_blocks=256", "pa_num_blocks >= 257"]),
    ("bucket-above-max-model-len", {}, {"token_generation_buckets": [1024, 4096]}, "nxd",
     ["token_generation_buckets", "4096", "max_model_len 2048"]),
    ("bucket-above-max-context-length", {}, {"max_context_length": 512,
                                             "context_encoding_buckets": [256, 1024]}, "nxd",
     ["context_encoding_buckets", "1024", "max_context_length 512"]),
    ("tkg-buckets-short-of-max-model-len", {}, {"token_generation_buckets": [128, 1024]},
     "nxd", ["token_generation_buckets", "must reach 2048", "max_model_len=2048"]),
    ("chunk-does-not-fit", CHUNKED, {"context_encoding_buckets": [64, 128]}, "nxd",
     ["context_encoding_buckets", "must reach 256", "max_num_batched_tokens=256"]),
    ("prefix-grid-short", PREFIX, {"prefix_buckets": [512]}, "nxd",
     ["prefix_buckets", "must reach 2047", "max_model_len - 1"]),
    ("is-prefix-caching-vs-vllm", {}, {"is_prefix_caching": True}, "nxd",
     ["is_prefix_caching=True", "enable_prefix_caching=False", "--enable-prefix-caching"]),
    ("is-chunked-prefill-vs-vllm", CHUNKED, {"is_chunked_prefill": False}, "nxd",
     ["is_chunked_prefill=False", "enable_chunked_prefill=True",
      "--no-enable-chunked-prefill"]),
    ("pa-block-size-on-contiguous", {}, {"pa_block_size": 32}, "nxd",
     ["pa_block_size", "contiguous", "--enable-prefix-caching"]),
    ("pa-num-blocks-on-contiguous", {}, {"pa_num_blocks": 10}, "nxd",
     ["pa_num_blocks", "contiguous"]),
    ("bucketing-off-with-lists", {}, {"enable_bucketing": False,
                                      "context_encoding_buckets": [128]}, "nxd",
     ["enable_bucketing=false", "context_encoding_buckets"]),
    ("prefix-buckets-on-contiguous", {}, {"prefix_buckets": [128]}, "nxd",
     ["prefix_buckets", "block KV layout"]),
    ("tp-degree-vs-vllm", {}, {"tp_degree": 8}, "nxd",
     ["tp_degree=8", "tensor_parallel_size=1"]),
    ("batch-size-vs-vllm", {}, {"batch_size": 8}, "nxd", ["batch_size=8", "max_num_seqs=4"]),
    ("seq-len-vs-vllm", {}, {"seq_len": 4096}, "nxd", ["seq_len=4096", "max_model_len=2048"]),
    ("torch-dtype-vs-vllm", {}, {"torch_dtype": "float16"}, "nxd",
     ["torch_dtype='float16'", "dtype='bfloat16'"]),
    ("ctx-batch-size", {}, {"ctx_batch_size": 2}, "nxd", ["ctx_batch_size=2", "remove"]),
    ("max-context-above-max-model-len", {}, {"max_context_length": 4096}, "nxd",
     ["max_context_length=4096", "max_model_len=2048", "--max-model-len"]),
    ("reference-with-tp", {"tp_degree": 2}, {}, "reference",
     ["tensor_parallel_size=2", "VLLM_NEURON_BACKEND=nxd"]),
    ("unknown-backend", {}, {}, "cuda", ["backend 'cuda'", "VLLM_NEURON_BACKEND"]),
    ("chunked-prefill-config", CHUNKED, {"chunked_prefill_config": {"max_num_seqs": 4}},
     "nxd", ["chunked_prefill_config", "remove chunked_prefill_config"]),
    ("async-mode", {}, {"async_mode": True}, "nxd",
     ["async_mode=True", "_process_async_inputs", "TaggedGraphs", "vLLM's async scheduling",
      "remove async_mode"]),
    ("input-truncation", {}, {"allow_input_truncation": True}, "nxd",
     ["allow_input_truncation=True", "truncat"]),
    ("speculation", {}, {"speculation_length": 4}, "nxd", ["speculation_length=4"]),
    ("lora", {}, {"lora_config": {"max_loras": 2}}, "nxd", ["lora_config", "LoRA"]),
    ("left-padding", {}, {"padding_side": "left"}, "nxd", ["padding_side='left'", "right"]),
    ("static-batching", {}, {"is_continuous_batching": False}, "nxd",
     ["is_continuous_batching=false", "max_num_seqs=4", "--max-num-seqs 1"]),
    ("sampling-config-not-object", {}, {"on_device_sampling_config": True}, "nxd",
     ["on_device_sampling_config=True", "global_topk"]),
    ("batch-buckets-on-block-layout-nxd", PREFIX, {"token_generation_batches": [2, 4]},
     "nxd", ["token_generation_batches=[2, 4]", "contiguous", "prefix caching on"]),
    ("max-batch-buckets-with-list", {}, {"max_batch_buckets": 2,
                                         "token_generation_batches": [2, 4]}, "nxd",
     ["max_batch_buckets=2", "token_generation_batches=[2, 4]", "remove one"]),
    ("max-batch-buckets-where-one-size", PREFIX, {"max_batch_buckets": 3}, "nxd",
     ["max_batch_buckets=3", "block KV layout", "set it to 1"]),
    ("max-batch-buckets-zero", {}, {"max_batch_buckets": 0}, "nxd",
     ["max_batch_buckets=0", "positive integer"]),
    ("max-batch-buckets-typo", {}, {"max_batch_bucket": 2}, "nxd",
     ["max_batch_bucket=2", "did you mean max_batch_buckets"]),
    ("max-batch-buckets-bucketing-off", {}, {"enable_bucketing": False,
                                             "max_batch_buckets": 2}, "nxd",
     ["enable_bucketing=false", "max_batch_buckets"]),
    ("pa-num-blocks-not-integer", PREFIX, {"pa_num_blocks": 300.5}, "nxd",
     ["pa_num_blocks=300.5", "positive integer"]),
    ("block-layout-flag-not-bool", {}, {"is_block_kv_layout": "yes"}, "nxd",
     ["is_block_kv_layout='yes'", "true or false"]),
]


@pytest.mark.parametrize("limits,override,backend,fragments",
                         [row[1:] for row in REJECTED], ids=[row[0] for row in REJECTED])
def test_rejected_configurations(limits, override, backend, fragments):
    with pytest.raises(NeuronConfigError) as info:
        resolve(limits, override, backend)
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{missing} not in: {message}"


@pytest.mark.parametrize("seqs,length,block", [
    (4, 1000, 32), (1, 1, 32), (3, 33, 32), (8, 4096, 128), (5, 257, 16), (2, 31, 32)])
def test_required_blocks_is_true_ceiling_plus_null_block(seqs, length, block):
    partial = length % block != 0
    whole = length // block
    assert required_blocks(seqs, length, block) == seqs * (whole + partial) + 1
    assert required_blocks(seqs, length, block) == seqs * math.ceil(length / block) + 1


@pytest.mark.parametrize("length", [1000, 1024, 1025, 33])
def test_minimum_block_count_is_accepted_and_one_less_rejected(length):
    need = required_blocks(4, length, 32)
    assert resolve({**PREFIX, "max_model_len": length, "num_gpu_blocks_override": need}
                   ).num_blocks == need
    with pytest.raises(NeuronConfigError, match=f">= {need}"):
        resolve({**PREFIX, "max_model_len": length, "num_gpu_blocks_override": need - 1})


def test_contiguous_layout_counts_one_block_per_slot_plus_null_block():
    settings = resolve({"max_num_seqs": 7})
    assert (settings.block_size, settings.num_blocks) == (2048, 8)


def test_settings_round_trip_through_json():
    settings = resolve(PREFIX, {"on_device_sampling_config": {"global_topk": 8},
                                "prefix_buckets": [512, 2048]})
    restored = NeuronSettings.from_dict(json.loads(json.dumps(settings.to_dict())))
    assert restored == settings
    # the nxd backend with on-device sampling adds the largest decode graph's logits twin
    assert restored.graph_count() == len(settings.context_encoding_shapes()) + len(
        settings.token_generation_shapes()) + 1


# -- the override_neuron_config schema, vLLM flags and vllm-neuron variables ------------
def test_schema_knows_every_key_the_plugin_interprets_or_refuses():
    """A key the plugin reads (or refuses with its own reason) must never be refused as
    unknown first."""
    from neuron_plugin.core.override_schema import PLUGIN_KEYS, release_keys
    from neuron_plugin.core.settings import INTERPRETED_KEYS, UNSUPPORTED_KEYS

    known = release_keys(None) | set(PLUGIN_KEYS)
    assert not (set(INTERPRETED_KEYS) | set(UNSUPPORTED_KEYS)) - known


@pytest.mark.parametrize("version,backend,refused", [
    ("0.7.14366", "nxd", True),        # NxDI 0.7 has no batch bucketing: it would ignore it
    ("0.8.16251", "nxd", False),
    ("0.9.17334", "nxd", False),
    (None, "nxd", False),              # unknown (runner process): any supported release
    ("0.10.18399", "nxd", False),      # newer than the releases read: same
    ("0.7.14366", "reference", False),  # the reference backend does not run NxDI
])
def test_keys_follow_the_installed_nxdi_release(version, backend, refused):
    override = {"token_generation_batches": [2, 4]}
    if not refused:
        assert resolve({}, override, backend).token_generation_batches == (2, 4)
        return
    with pytest.raises(NeuronConfigError, match="token_generation_batches=.* needs NxDI 0.8 "
                                                "or newer, but the installed NxDI is 0.7.14366"):
        resolve_settings(BASE, override, backend=backend, architecture="LlamaForCausalLM",
                         nxdi_version=version)


@pytest.mark.parametrize("version,override,batches,reason", [
    ("0.7.14366", {}, (4,), "0.7.14366 has no batch bucketing"),
    ("0.8.16251", {}, (1, 2, 4), ""),
    ("0.9.0", {"max_batch_buckets": 2}, (1, 4), ""),
    # unknown release: one size, unless max_batch_buckets asks for them
    (None, {}, (4,), "the NxDI release is unknown here"),
    (None, {"max_batch_buckets": 6}, (1, 2, 4), ""),
])
def test_default_decode_batches_follow_the_nxdi_release(version, override, batches, reason):
    settings = resolve_settings(BASE, override, backend="nxd",
                                architecture="LlamaForCausalLM", nxdi_version=version)
    assert settings.token_generation_batches == batches
    assert reason in settings.token_generation_batches_reason
    assert bool(reason) == bool(settings.token_generation_batches_reason)


def test_default_decode_batches_with_nxdi_speculation(tmp_path):
    """NxDI refuses batch bucketing with speculation: the nxd default is one size, the
    reference backend's batch-buckets it."""
    limits = dataclasses.replace(BASE, speculative_method="ngram", num_speculative_tokens=2)
    nxd = resolve_settings(limits, {}, backend="nxd", architecture="LlamaForCausalLM")
    assert nxd.token_generation_batches == (4,)
    assert "speculative decoding" in nxd.token_generation_batches_reason
    reference = resolve_settings(limits, {}, backend="reference",
                                 architecture="LlamaForCausalLM")
    assert reference.token_generation_batches == (1, 2, 4)


def test_unsupported_vllm_flag_values_are_refused():
    limits = dataclasses.replace(BASE, vllm_flags={"--enable-expert-parallel": True,
                                                   "--kv-cache-dtype": "auto"})
    with pytest.raises(NeuronConfigError) as info:
        resolve_settings(limits, {}, backend="nxd", architecture="LlamaForCausalLM")
    message = str(info.value)
    assert "--enable-expert-parallel (enable_expert_parallel) is not supported" in message
    assert "moe_ep_degree" in message and "--kv-cache-dtype" not in message


@pytest.mark.parametrize("environ,accepted", [
    ({"VLLM_NEURON_FRAMEWORK": "neuronx-distributed-inference"}, True),
    ({"VLLM_NEURON_FRAMEWORK": " Neuronx-Distributed-Inference "}, True),
    ({"VLLM_NEURON_FRAMEWORK": "transformers-neuronx"}, False),
    ({"DISABLE_NEURON_CUSTOM_SCHEDULER": "0"}, True),
    ({"DISABLE_NEURON_CUSTOM_SCHEDULER": "1"}, False),
    ({"NEURON_CONTEXT_LENGTH_BUCKETS": ""}, True),
    ({"NEURON_TOKEN_GEN_BUCKETS": "128,x"}, False),
])
def test_vllm_neuron_variables(environ, accepted):
    if accepted:
        resolve_settings(BASE, {}, backend="nxd", architecture="LlamaForCausalLM",
                         environ=environ)
        return
    with pytest.raises(NeuronConfigError, match=next(iter(environ))):
        resolve_settings(BASE, {}, backend="nxd", architecture="LlamaForCausalLM",
                         environ=environ)


def test_compiled_artifacts_maps_to_the_compile_cache():
    from neuron_plugin.core.vllm_neuron_env import environment_updates

    assert environment_updates({}) == []
    [(name, value, _)] = environment_updates({"NEURON_COMPILED_ARTIFACTS": "/srv/a"})
    assert (name, value) == ("VLLM_NEURON_CACHE_URL", "/srv/a")
    [(name, value, _)] = environment_updates({"NEURON_COMPILED_ARTIFACTS": "/srv/a",
                                              "VLLM_NEURON_CACHE_URL": "s3://b/p"})
    assert (name, value) == ("VLLM_NEURON_CACHE_LOCAL_DIR", "/srv/a")
    assert environment_updates({"NEURON_COMPILED_ARTIFACTS": "/srv/a",
                                "VLLM_NEURON_CACHE_URL": "/srv/b"}) == []


def test_generated_reference_says_what_each_plugin_key_does():
    """The reference docs_hooks.py renders: every plugin key with its meaning, the logits
    twins' default and how to widen it."""
    from neuron_plugin.core.override_reference import key_reference
    from neuron_plugin.core.override_schema import PLUGIN_KEY_MEANINGS, PLUGIN_KEYS

    assert set(PLUGIN_KEY_MEANINGS) == set(PLUGIN_KEYS)
    rows = {row.key: row for row in key_reference()}
    logits = rows["token_generation_logits_buckets"]
    assert logits.releases == "this plugin"
    assert "Default: the largest token-generation length alone" in logits.treatment
    assert "list shorter lengths of token_generation_buckets to widen it" in logits.treatment
