"""What the nxd backend serves per architecture and feature (backends/nxd/compat.py): the
configurations NxDI 0.9's modelling code computes differently from transformers are
refused before anything compiles, each message naming architecture, NxDI release,
feature and fix; the rest pass untouched. The tiny checkpoints are the ones the real-NxDI
tests serve (tests/e2e/test_nxdi_architectures.py), so what passes here is what was
measured equal there."""

from __future__ import annotations

import dataclasses
import json

import pytest

from neuron_plugin.backends.nxd import compat, support
from neuron_plugin.backends.nxd.families import gemma3, gemma4, qwen3_5
from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings

LIMITS = EngineLimits(max_model_len=256, max_num_seqs=2, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=256, dtype="float32", tp_degree=1)
MAPPED = ["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM",
          "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DbrxForCausalLM", "GptOssForCausalLM",
          "Gemma3ForCausalLM", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
          "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
          "Qwen3_5MoeForConditionalGeneration"]
APPLIED = dict.fromkeys([*gemma3.PATCHES, "prefix-prefill-mask"], "applied")


def problems(config: dict, block: bool = False, max_model_len: int = 256,
             patches: dict | None = None, version: str = "0.9.0",
             override: dict | None = None, tp_degree: int = 1) -> list[str]:
    limits = dataclasses.replace(LIMITS, max_model_len=max_model_len,
                                 max_num_batched_tokens=max_model_len,
                                 enable_prefix_caching=block, block_size=32 if block else None,
                                 tp_degree=tp_degree)
    settings = resolve_settings(limits, override or {}, backend="nxd",
                                architecture=config["architectures"][0])
    return compat.problems(settings, config, version, APPLIED if patches is None else patches)


def config_of(tiny_model, arch: str, **changes) -> dict:
    config = json.loads((tiny_model(arch) / "config.json").read_text())
    return {**config, **changes}


@pytest.mark.parametrize("release", nxdi_releases.CHECKED, ids=lambda r: r.release)
def test_every_mapped_architecture_states_every_feature_per_checked_release(release):
    for name in MAPPED:
        table = compat.support(name, release)
        assert list(table) == list(support.FEATURES)
        assert all(v.split(":")[0] in (support.EQUAL, support.REFUSED, support.UNTESTED)
                   for v in table.values()), name
        assert set(compat.family_of(name).support) == {r.release for r in nxdi_releases.CHECKED}
    assert compat.support("GptOssForCausalLM", release)["block"].startswith("refused: ")
    assert compat.support("LlamaForCausalLM", release)["speculation"].startswith("untested: ")
    assert compat.support("DbrxForCausalLM", release)["prefix_hit"] == support.EQUAL
    assert compat.support("SomeContribForCausalLM", release)["contiguous"].startswith("untested")


def test_what_differs_between_checked_releases():
    """NxDI 0.8 (inf2/trn1) lists no Mistral or Gemma3: it serves Mistral with its Llama
    class and Gemma3 with the module it ships unlisted, each equal to transformers where
    0.9's own class is (measured); it loads no adapter at run time; windowed
    architectures refuse speculation on both."""
    old, new = nxdi_releases.NXDI_0_8, nxdi_releases.NXDI_0_9
    for name in ("MistralForCausalLM", "Gemma3ForCausalLM"):
        for release in (old, new):
            table = compat.support(name, release)
            assert {f: v.split(":")[0] for f, v in table.items()
                    if f in ("contiguous", "block", "prefix_hit", "on_device_sampling")} == \
                dict.fromkeys(["contiguous", "block", "prefix_hit", "on_device_sampling"],
                              support.EQUAL), (name, release)
            assert table["speculation"].startswith("refused: sliding-window")
    assert "NxDI 0.8's Llama class" in compat.support("MistralForCausalLM", old)["contiguous"]
    assert "max_model_len <= sliding_window" in compat.support("MistralForCausalLM", old)["block"]
    gemma_old = compat.support("Gemma3ForCausalLM", old)["contiguous"]
    gemma_new = compat.support("Gemma3ForCausalLM", new)["contiguous"]
    assert "unlisted models/gemma3" in gemma_old and "gemma3-scale" in gemma_old
    assert "gemma3-norms" not in gemma_old
    assert "gemma3-norms" in gemma_new and "gemma3-scale" not in gemma_new
    assert "loads no adapter at run time" in compat.support("LlamaForCausalLM", old)["lora"]
    assert "loads no adapter at run time" in compat.support("Gemma3ForCausalLM", old)["lora"]
    assert "run time" not in compat.support("LlamaForCausalLM", new)["lora"]
    assert compat.support("GptOssForCausalLM", new)["speculation"].startswith(
        "refused: sliding-window")


@pytest.mark.parametrize("arch", ["llama", "mistral", "mixtral", "qwen2", "qwen3",
                                  "qwen3_moe_hub", "dbrx", "gemma3", "gemma3_nxdi",
                                  "mistral_wide", "mistral_small", "gemma4", "gemma4_moe",
                                  "gemma4_mm", "qwen3_5", "qwen3_5_moe", "qwen3_5_mm"])
def test_tiny_checkpoints_pass_in_the_contiguous_layout(arch, tiny_model):
    assert problems(config_of(tiny_model, arch)) == []


@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen2", "qwen3", "qwen3_moe_hub",
                                  "dbrx", "gemma3", "gemma3_nxdi", "mistral_wide",
                                  "mistral_small", "gemma4", "gemma4_moe", "gemma4_mm"])
def test_tiny_checkpoints_pass_in_the_block_layout(arch, tiny_model):
    assert problems(config_of(tiny_model, arch), block=True) == []


# -- sliding windows ----------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.8.0+cd3abf3", "0.9.0"])
def test_mistral_window_in_the_block_layout_is_refused(tiny_model, version):
    """On both releases (0.8 through its Llama class: the same windowed attention and
    BlockKVCacheManager, measured failing at the first prefill)."""
    found = problems(config_of(tiny_model, "mistral"), block=True, version=version)
    assert len(found) == 1
    assert "MistralForCausalLM with sliding_window=16 below max_model_len=256 in the block " \
           "KV layout" in found[0]
    assert f"NxDI {version}" in found[0] and "get_last_kv_window" in found[0]
    assert "serve without --enable-prefix-caching and chunked prefill" in found[0]


def test_mistral_windows_are_transformers_on_every_release(tiny_model):
    """NxDI's model (0.9's Mistral, 0.8's Llama: both read config.sliding_window for every
    layer) applies the window transformers' Mistral applies, so nothing is refused in the
    contiguous layout; at max_model_len <= window both drop it."""
    from neuron_plugin.backends.nxd.families import transformers_windows

    text = config_of(tiny_model, "mistral")
    assert compat.nxdi_windows("MistralForCausalLM", text, 256) == \
        transformers_windows("MistralForCausalLM", text) == (16, 16)
    for version in ("0.8.0+cd3abf3", "0.9.0"):
        assert problems(text, version=version) == []


def test_a_window_no_sequence_reaches_is_dropped(tiny_model):
    """Mistral-7B-v0.1's 4096-token window at max_model_len 256: full attention is what
    transformers computes, and NxDI's block layout then works (measured equal)."""
    config = config_of(tiny_model, "mistral_wide")
    for block in (False, True):
        limits = dataclasses.replace(LIMITS, enable_prefix_caching=block,
                                     block_size=32 if block else None)
        settings = resolve_settings(limits, {}, backend="nxd",
                                    architecture="MistralForCausalLM")
        assert compat.config_adjustments(settings, config) == {"sliding_window": None}
    narrow = resolve_settings(LIMITS, {}, backend="nxd", architecture="MistralForCausalLM")
    assert compat.config_adjustments(narrow, config_of(tiny_model, "mistral")) == {}


@pytest.mark.parametrize("arch, changes, layers", [
    ("mixtral", {"sliding_window": 16}, "[0, 1]"),
    # the reverse: NxDI's Llama reads a sliding_window key transformers' ignores
    ("llama", {"sliding_window": 16}, "[0, 1]"),
    # a Hub config without layer_types (transformers derives them from max_window_layers)
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
               "layer_types": None}, "[1]"),
    ("qwen3_moe_hub", {"use_sliding_window": True, "sliding_window": 16}, "[0, 1]"),
])
def test_windows_nxdi_does_not_apply_are_refused_once_reachable(arch, changes, layers,
                                                                tiny_model):
    config = config_of(tiny_model, arch, **changes)
    found = problems(config)
    assert len(found) == 1 and f"layers {layers} have sliding windows" in found[0]
    assert "--max-model-len 16 or less" in found[0]
    assert problems(config, max_model_len=16) == []


@pytest.mark.parametrize("arch, window, max_model_len", [("mistral", 16, 64),
                                                         ("gpt_oss", 128, 256)])
def test_the_cpu_mode_refuses_context_buckets_shorter_than_a_window(arch, window,
                                                                    max_model_len, tiny_model):
    """Found by the XLA test (tests/e2e/test_nxdi_xla.py) on NxDI 0.8 and 0.9: NxDI's
    windowed attention gathers the last window - 1 keys of a prefill from the bucket's
    own keys (get_last_kv_window), past the end of a shorter bucket: eager torch raises
    IndexError at the first prompt in it (NxDI's CPU mode); XLA clamps the indices, so a
    device is left alone."""
    config = config_of(tiny_model, arch)
    keep = window - 1
    short = {"context_encoding_buckets": [8, max_model_len],
             "token_generation_buckets": [max_model_len]}
    found = problems(config, max_model_len=max_model_len, override={"on_cpu": True, **short})
    assert len(found) == 1, found
    assert f"context_encoding_buckets [8] are shorter than sliding_window - 1 = {keep}" in \
        found[0]
    assert "get_last_kv_window" in found[0] and "IndexError" in found[0]
    assert problems(config, max_model_len=max_model_len, override=short) == []
    enough = {**short, "on_cpu": True, "context_encoding_buckets": [keep, max_model_len]}
    assert problems(config, max_model_len=max_model_len, override=enough) == []


def test_qwen3_moe_dense_layers_are_refused(tiny_model):
    """The builder's Qwen3-MoE has a dense layer (mlp_only_layers [1]); NxDI's has none."""
    found = problems(config_of(tiny_model, "qwen3_moe"))
    assert len(found) == 1 and "layers [1] have a dense MLP in transformers" in found[0]
    sparse = problems(config_of(tiny_model, "qwen3_moe_hub", decoder_sparse_step=2))
    assert len(sparse) == 1 and "layers [0] have a dense MLP" in sparse[0]


# -- gpt-oss ------------------------------------------------------------------------------
ONE_DECODE_LENGTH = {"token_generation_buckets": [256]}


def test_gpt_oss_as_openai_ships_it_passes_contiguous_and_refuses_block(tiny_model):
    config = config_of(tiny_model, "gpt_oss")
    assert problems(config, override=ONE_DECODE_LENGTH) == []
    found = problems(config, block=True, override=ONE_DECODE_LENGTH)
    assert len(found) == 1 and "GptOssForCausalLM on NxDI 0.9.0 in the block KV layout" in \
        found[0] and "GptOssKVCacheManager" in found[0]


def test_gpt_oss_decodes_at_one_length_only(tiny_model):
    """Found by the XLA test (tests/e2e/test_nxdi_xla.py) on NxDI 0.8 and 0.9: NxDI's
    gpt-oss cache manager reads a full-attention layer's cache over max_length whatever
    the bucket (gpt_oss_kv_cache_manager.py get_kv_by_layer_id), so a shorter
    token-generation bucket's graph fails to trace (its mask is the bucket's width):
    the compile on a device, every decode in that bucket in the CPU mode."""
    config = config_of(tiny_model, "gpt_oss")
    found = problems(config)  # the default grid: 128 and 256
    assert len(found) == 1, found
    assert "token_generation_buckets [128] are shorter than the largest, 256" in found[0]
    assert "get_kv_by_layer_id" in found[0]
    assert '"token_generation_buckets": [256]' in found[0]
    assert problems(config, override={"token_generation_buckets": [64, 256]})[0].count("[64]")


# -- Llama 4 ------------------------------------------------------------------------------
def test_llama4_decodes_at_one_length_with_llama3_rope_only(tiny_model):
    """Found by the XLA test on NxDI 0.8 and 0.9: with chunked attention NxDI's Llama 4
    hands its global layers their whole KV cache whatever the bucket, so a shorter
    decode bucket fails; and patch llama4-rope-temperature computes llama3 scaling only."""
    config = config_of(tiny_model, "llama4")
    patches = {**APPLIED, **dict.fromkeys(
        ["llama4-rope-temperature", "vision-scatter-scratch-row"], "applied")}
    assert problems(config, override=ONE_DECODE_LENGTH, patches=patches) == []
    found = problems(config, override={"token_generation_buckets": [64, 256]},
                     patches=patches)
    assert len(found) == 1, found
    assert "token_generation_buckets [64] are shorter than the largest, 256" in found[0]
    assert "global (NoPE) layers" in found[0]
    assert '"token_generation_buckets": [256]' in found[0]
    text = {**config["text_config"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    found = problems({**config, "text_config": text}, override=ONE_DECODE_LENGTH,
                     patches=patches)
    assert len(found) == 1 and "rope_scaling" in found[0] and "llama3 way only" in found[0]
    assert "VLLM_NEURON_BACKEND=reference" in found[0]
    disabled = {**patches, "llama4-rope-temperature": "disabled"}
    found = problems(config, override=ONE_DECODE_LENGTH, patches=disabled)
    assert len(found) == 1 and "llama4-rope-temperature" in found[0]
    assert "remove them from VLLM_NEURON_DISABLE_PATCHES" in found[0]


@pytest.mark.parametrize("changes, wanted", [
    ({"quantization_config": None}, "experts are not MXFP4"),
    ({"initial_context_length": None}, "initial_context_length=None"),
    ({"initial_context_length": 4096}, "initial_context_length=4096"),
    ({"sliding_window": 16}, "sliding_window=16; NxDI sizes the window's KV cache"),
    ({"rms_norm_eps": 1e-6}, "rms_norm_eps=1e-06, which NxDI hard-codes as 1e-05"),
    ({"swiglu_limit": 5.0}, "swiglu_limit=5.0"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "default"}}, "rope type 'default'"),
])
def test_gpt_oss_checkpoints_nxdi_reads_otherwise_are_refused(changes, wanted, tiny_model):
    found = problems(config_of(tiny_model, "gpt_oss", **changes), override=ONE_DECODE_LENGTH)
    assert any(wanted in p for p in found), found


# -- Gemma3 -------------------------------------------------------------------------------
@pytest.mark.parametrize("version, patch", [("0.9.0", "gemma3-rope"),
                                            ("0.8.0+cd3abf3", "gemma3-scale")])
def test_gemma3_without_its_patches_is_refused(tiny_model, version, patch):
    config = config_of(tiny_model, "gemma3")
    found = problems(config, patches={**APPLIED, patch: "disabled"}, version=version)
    assert len(found) == 1
    assert f"Gemma3ForCausalLM on NxDI {version} without the plugin's patches {patch}" in \
        found[0]
    assert "VLLM_NEURON_DISABLE_PATCHES" in found[0]
    # a fixed NxDI needs none
    assert problems(config, patches=dict.fromkeys(gemma3.PATCHES, "not needed")) == []
    prefix = problems(config, block=True, patches={**APPLIED, "prefix-prefill-mask": "disabled"})
    assert len(prefix) == 1 and "without the prefix-prefill-mask patch" in prefix[0]


@pytest.mark.parametrize("changes, wanted", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "scales RoPE linearly only"),
])
def test_gemma3_keys_nxdi_does_not_implement_are_refused(changes, wanted, tiny_model):
    found = problems(config_of(tiny_model, "gemma3", **changes))
    assert len(found) == 1 and wanted in found[0]


# -- Gemma 4: the plugin's own class ---------------------------------------------------------
def test_gemma4_is_the_plugins_own_class_on_both_releases():
    from neuron_plugin.models.table import TABLE, PluginClass

    for name in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):
        for release in nxdi_releases.CHECKED:
            assert TABLE[name].nxd[release.release] == PluginClass(gemma4.CLASS)
            table = compat.support(name, release)
            assert all(table[f].startswith(support.EQUAL) for f in
                       ("contiguous", "block", "prefix_hit", "on_device_sampling"))
            assert all(table[f].startswith("refused: ") for f in
                       ("speculation", "lora", "quantization"))


@pytest.mark.parametrize("changes, wanted", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
    ({"hidden_activation": "gelu_new"}, "hidden_activation='gelu_new'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}},
     "rope_parameters['sliding_attention'].rope_type='yarn'"),
    ({"per_layer_config": {"2": {"head_dim": 64, "intermediate_size": 8}}},
     "per_layer_config sets ['intermediate_size'] per layer"),
    ({"num_kv_shared_layers": 4, "layer_types": ["sliding_attention"] * 2
      + ["full_attention"] * 4}, "layer 2 (full_attention) shares the keys"),
    ({"enable_moe_block": True}, "enable_moe_block without num_experts"),
])
def test_gemma4_configs_the_class_does_not_compute_are_refused(changes, wanted, tiny_model):
    found = problems(config_of(tiny_model, "gemma4", **changes))
    assert len(found) == 1 and wanted in found[0], found
    assert "Gemma4ForCausalLM on NxDI 0.9.0 (the plugin's own Gemma 4 class)" in found[0]
    assert "VLLM_NEURON_BACKEND=reference" in found[0]


@pytest.mark.parametrize("override, wanted", [
    ({"fused_qkv": True}, "fused_qkv=True: its attention reads the q, k and v projections"),
    ({"k_cache_transposed": True}, "k_cache_transposed=True"),
    ({"sequence_parallel_enabled": True}, "sequence_parallel_enabled=True"),
    ({"cp_degree": 2}, "cp_degree=2: the class does not implement context parallelism"),
])
def test_gemma4_neuron_config_keys_the_class_does_not_take_are_refused(override, wanted,
                                                                      tiny_model):
    settings = resolve_settings(LIMITS, override, backend="nxd",
                                architecture="Gemma4ForCausalLM")
    found = compat.problems(settings, config_of(tiny_model, "gemma4"), "0.8.0", {})
    assert len(found) == 1 and wanted in found[0], found
    assert found[0].endswith("remove it from override_neuron_config.")


def test_gemma4_windows_are_transformers(tiny_model):
    text = config_of(tiny_model, "gemma4")
    assert compat.nxdi_windows("Gemma4ForCausalLM", text, 256) == (16, 16, None) * 2
    assert compat.transformers_windows("Gemma4ForCausalLM", text) == (16, 16, None) * 2


def test_gemma4_layout_reads_both_config_forms(tiny_model):
    """The Hub's global_head_dim / num_global_key_value_heads and transformers 5's
    per_layer_config (zero-padded keys once saved) give one layout; a multimodal
    checkpoint's text_config too."""
    from neuron_plugin.core.gemma4 import cache_geometry, read_layout

    saved = config_of(tiny_model, "gemma4")
    hub = {k: v for k, v in saved.items() if k != "per_layer_config"}
    padded = {**saved, "per_layer_config": {"02": saved["per_layer_config"]["2"],
                                            "05": saved["per_layer_config"]["5"]}}
    layout = read_layout(saved)
    assert read_layout(hub) == layout == read_layout(padded)
    assert layout.kv_heads == (2, 2, 1, 2, 2, 1)
    assert layout.head_dims == (32, 32, 64, 32, 32, 64)
    assert layout.kv_sources == (0, 1, 2, 3, 3, 2)
    assert layout.values_from_keys == (False, False, True) * 2
    assert layout.mlp_widths == (256,) * 4 + (512,) * 2
    assert layout.cache_layers == 4
    assert read_layout({**hub, "attention_k_eq_v": False}).kv_heads == (2,) * 6
    nested = config_of(tiny_model, "gemma4_mm")
    assert read_layout(nested).kv_sources == layout.kv_sources
    # (KV heads per rank, head dim) of the writing layers -> one cache row geometry
    assert cache_geometry([(2, 32), (1, 64)]) == (2, 32)
    assert cache_geometry([(4, 32), (1, 64)]) == (4, 32)
    assert cache_geometry([(16, 256), (4, 512)]) == (16, 256)
    assert cache_geometry([(1, 256), (1, 512)]) == (2, 256)


def test_gemma4_rope_and_kv_memory_per_layer_type(tiny_model):
    """RoPE per layer type (config.json's, else Gemma4TextConfig's defaults), and the
    memory plan's KV bytes per token: the class's packed rows per writing layer."""
    from neuron_plugin.core.gemma4 import Rope, read_layout
    from neuron_plugin.core.memory import kv_bytes_per_token

    config = config_of(tiny_model, "gemma4")
    assert read_layout(config).rope == {"sliding_attention": Rope("default", 1e4),
                                        "full_attention": Rope("proportional", 1e6, 0.25)}
    assert read_layout({**config, "rope_parameters": None}).rope == read_layout(config).rope
    # 4 writing layers, rows of (2 heads x 32) at TP 1, K and V, float32
    assert kv_bytes_per_token(config, "float32", 1) == 4 * 2 * 2 * 32 * 4
    e4b = {"model_type": "gemma4_text", "num_hidden_layers": 42, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
           "hidden_size": 2560, "intermediate_size": 10240, "vocab_size": 262144,
           "num_kv_shared_layers": 18,
           "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7}
    # 24 writing layers of 2 x 512 (full) / 2 x 256 (sliding, padded to the full rows)
    assert kv_bytes_per_token({"text_config": e4b}, "bfloat16", 1) == 24 * 2 * 4 * 256 * 2


# -- through the backend, before anything compiles ------------------------------------------
@pytest.mark.parametrize("release", ["0.8", "0.9-ef2731e"])
def test_backend_refuses_before_compiling(tiny_model, monkeypatch, tmp_path, release):
    """On 0.8 too: Mistral through its Llama class, Gemma3 through its unlisted module."""
    from tests.plugin.fake_nxdi.nxdi_release import load_release, purge
    from neuron_plugin.backends.nxd.backend import NxDBackend

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    load_release(release, monkeypatch)
    try:
        limits = dataclasses.replace(LIMITS, enable_prefix_caching=True, block_size=32)
        settings = resolve_settings(limits, {}, backend="nxd",
                                    architecture="MistralForCausalLM")
        with pytest.raises(NeuronConfigError, match="sliding_window=16 below max_model_len"):
            NxDBackend(settings, tiny_model("mistral"))
        monkeypatch.setenv("VLLM_NEURON_DISABLE_PATCHES", "gemma3-window")
        gemma = resolve_settings(LIMITS, {}, backend="nxd", architecture="Gemma3ForCausalLM")
        with pytest.raises(NeuronConfigError, match="without the plugin's patches gemma3-window"):
            NxDBackend(gemma, tiny_model("gemma3"))
    finally:
        purge()


@pytest.mark.parametrize("release", ["0.8", "0.9-ef2731e"])
def test_without_the_refusal_nxdi_fails_at_the_first_prefill(tiny_model, monkeypatch,
                                                             tmp_path, release):
    """What the Mistral refusal prevents: NxDI's windowed prefill in the block layout
    fails (the double reproduces BlockKVCacheManager's failure, measured on NxDI 0.9 and
    on 0.8's Llama class: block_kv_cache_manager.py line 299 in both)."""
    import numpy as np

    from tests.plugin.fake_nxdi.nxdi_release import load_release, purge
    from neuron_plugin.backends.nxd.backend import NxDBackend
    from neuron_plugin.core.inputs import context_encoding_inputs

    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "neuronx-cc"))
    monkeypatch.setenv("VLLM_NEURON_CACHE_URL", str(tmp_path / "cache"))
    monkeypatch.setattr(compat, "problems", lambda *args: [])
    load_release(release, monkeypatch)
    try:
        limits = dataclasses.replace(LIMITS, enable_prefix_caching=True, block_size=32)
        settings = resolve_settings(limits, {}, backend="nxd",
                                    architecture="MistralForCausalLM")
        backend = NxDBackend(settings, tiny_model("mistral"))
        backend.compile(tmp_path / "graphs")
        backend.load(tmp_path / "graphs")
        inputs = context_encoding_inputs(settings, np.arange(1, 41), 0, 0, [1, 2])
        with pytest.raises(RuntimeError, match="block_kv_cache_manager.py update_cache"):
            backend.forward(inputs)
    finally:
        purge()


def test_host_sampling_is_refused_where_nxdi_masks_real_tokens(tiny_model):
    """A TP degree that does not divide the vocabulary: NxDI cuts the lm_head's padding
    off the gathered logits and then masks their tail as padding (measured at TP 2 on
    real 0.8 and 0.9, tests/e2e/test_nxdi_tensor_parallel.py). On-device sampling reads
    the logits before the cut, and a dividing TP degree has no padding."""
    config = config_of(tiny_model, "llama")  # a vocabulary of 977
    host = {"on_device_sampling_config": None}
    [found] = problems(config, override=host, tp_degree=2)
    assert ("on-device sampling off (on_device_sampling_config: null) at "
            "--tensor-parallel-size 2 with a vocabulary of 977") in found
    assert "masks the last 1 real tokens' logits" in found and "so token 976 could never" in found
    assert problems(config, tp_degree=2) == []
    assert problems(config, override=host) == []
    assert problems({**config, "vocab_size": 976}, override=host, tp_degree=2) == []


# -- Qwen3.5: the plugin's own class (text, dense and MoE) ------------------------------------
def test_qwen3_5_is_the_plugins_own_class_on_both_releases():
    from neuron_plugin.models.table import TABLE, PluginClass

    for release in nxdi_releases.CHECKED:
        for name in ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                     "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
            assert TABLE[name].nxd[release.release] == PluginClass(qwen3_5.CLASS)
            table = compat.support(name, release)
            assert all(table[f].startswith(support.EQUAL) for f in
                       ("contiguous", "on_device_sampling"))
            assert all(table[f].startswith("refused: ") for f in
                       ("block", "prefix_hit", "speculation", "lora", "quantization"))


@pytest.mark.parametrize("limits, wanted", [
    ({"enable_prefix_caching": True, "block_size": 32},
     ["in the block KV layout (", "serve it without --enable-prefix-caching"]),
    ({"enable_chunked_prefill": True, "block_size": 32, "max_num_batched_tokens": 64},
     ["in the block KV layout (", "--enable-chunked-prefill"]),
    ({"tp_degree": 4}, ["with --tensor-parallel-size 4: 4 does not divide num_key_value_heads=2, "
                        "linear_num_key_heads=2", "a --tensor-parallel-size that divides them"]),
])
def test_qwen3_5_settings_the_class_does_not_serve_are_refused(limits, wanted, tiny_model):
    from neuron_plugin.core.recurrent_state import state_geometry

    config = config_of(tiny_model, "qwen3_5")
    settings = resolve_settings(
        dataclasses.replace(LIMITS, state=state_geometry(config), **limits), {},
        backend="nxd", architecture="Qwen3_5ForCausalLM")
    found = compat.problems(settings, config, "0.8.0+cd3abf3", {})
    assert len(found) == 1, found
    assert "Qwen3_5ForCausalLM on NxDI 0.8.0+cd3abf3 (the plugin's own Qwen3.5 class)" in found[0]
    assert all(w in found[0] for w in wanted), found[0]


def test_qwen3_5_state_of_one_core_is_its_share_of_the_heads(tiny_model):
    from neuron_plugin.core.recurrent_state import state_geometry

    whole = state_geometry(config_of(tiny_model, "qwen3_5"))
    share = whole.sharded(2)
    assert (share.key_heads, share.value_heads) == (1, 2)
    assert share.conv_shape == (whole.conv_dim // 2, 3)
    assert share.recurrent_shape == (2, 32, 32)
    assert 2 * share.layer_bytes("float32") == whole.layer_bytes("float32")


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_at_a_tensor_parallel_size_dividing_its_heads_is_served(arch, tiny_model):
    """Each core takes an equal share of the tiny models' 4 query, 2 KV and 2 DeltaNet key
    heads (tests/e2e/test_nxdi_tensor_parallel.py runs them at TP 2)."""
    assert problems(config_of(tiny_model, arch), tp_degree=2) == []


@pytest.mark.parametrize("changes, wanted", [
    ({"attention_bias": True}, "attention_bias=true"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 3},
     "layer_types ['sliding_attention'] are not Qwen3.5's"),
])
def test_qwen3_5_configs_the_class_does_not_compute_are_refused(changes, wanted, tiny_model):
    found = problems(config_of(tiny_model, "qwen3_5", **changes))
    assert len(found) == 1 and wanted in found[0], found
    assert "VLLM_NEURON_BACKEND=reference" in found[0]


def test_qwen3_5_neuron_config_keys_the_class_does_not_take_are_refused(tiny_model):
    found = problems(config_of(tiny_model, "qwen3_5"), override={"fused_qkv": True})
    assert len(found) == 1 and "override_neuron_config fused_qkv=True" in found[0], found
    assert found[0].endswith("remove it from override_neuron_config.")


def test_qwen3_5_adjustment_gives_the_class_max_model_len(tiny_model):
    """The class keeps the state of decode rows at max_model_len - 1 (pad rows)."""
    settings = resolve_settings(LIMITS, {}, backend="nxd", architecture="Qwen3_5ForCausalLM")
    assert compat.config_adjustments(settings, config_of(tiny_model, "qwen3_5")) == {
        qwen3_5.MAX_MODEL_LEN: 256}
