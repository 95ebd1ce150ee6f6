"""Where vLLM's defaults are sized for GPUs, the platform picks Neuron's, says why, and
reports one KV capacity figure (the server log and explain-config print the same line)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.memory import GIB, SequenceBudget, sequence_budget
from neuron_plugin.core.settings import (
    MAX_NUM_SEQS_CHOSEN,
    NEURON_DEFAULT_MAX_NUM_SEQS,
    EngineLimits,
    resolve_max_num_seqs,
    resolve_settings,
)

os.environ.setdefault("VLLM_NEURON_BACKEND", "reference")

LIMITS = EngineLimits(max_model_len=2048, max_num_seqs=128, block_size=None,
                      enable_prefix_caching=False, enable_chunked_prefill=False,
                      max_num_batched_tokens=2048, dtype="bfloat16",
                      max_num_seqs_is_default=True)
# Llama-3.1-8B (config.json) in bf16 on one inf2 NeuronCore pair (TP 2).
LLAMA_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 32}


def test_a_value_the_user_chose_is_kept():
    chosen = dataclasses.replace(LIMITS, max_num_seqs_is_default=False)
    assert resolve_max_num_seqs(chosen, {}, "nxd", None) == (128, MAX_NUM_SEQS_CHOSEN)


def test_vllms_gpu_default_becomes_vllm_neurons():
    seqs, reason = resolve_max_num_seqs(LIMITS, {}, "nxd", None)
    assert seqs == NEURON_DEFAULT_MAX_NUM_SEQS == 32
    assert "vLLM's default of 128 is sized for GPUs" in reason
    assert "--max-num-seqs sets another value" in reason


def test_vllm_neurons_batch_size_key_sets_the_slots():
    assert resolve_max_num_seqs(LIMITS, {"batch_size": 8}, "nxd", None)[0] == 8
    settings = resolve_settings(LIMITS, {"tkg_batch_size": 6}, backend="reference",
                                architecture="LlamaForCausalLM")
    assert settings.max_num_seqs == 6 and settings.num_blocks == 7
    assert "tkg_batch_size=6" in settings.max_num_seqs_reason


def test_the_largest_decode_batch_bucket_sets_the_slots_left_at_the_default():
    """`LLM(max_num_seqs=128, ...)` reads as vLLM's default; batch buckets up to 128 say
    what the user means (they were refused as above 32 before)."""
    override = {"token_generation_batches": [1, 4, 32, 128]}
    seqs, reason = resolve_max_num_seqs(LIMITS, override, "nxd", None)
    assert seqs == 128
    assert "token_generation_batches tops out at 128" in reason
    settings = resolve_settings(LIMITS, override, backend="reference",
                                architecture="LlamaForCausalLM")
    assert settings.max_num_seqs == 128
    assert settings.token_generation_batches == (1, 4, 32, 128)
    assert resolve_max_num_seqs(LIMITS, {"token_generation_batches": [1, 8]}, "nxd", None)[0] == 8
    # batch_size first, as vllm-neuron's key; a value the user chose is kept
    both = {"batch_size": 16, "token_generation_batches": [1, 16]}
    assert resolve_max_num_seqs(LIMITS, both, "nxd", None)[0] == 16
    chosen = dataclasses.replace(LIMITS, max_num_seqs_is_default=False, max_num_seqs=64)
    assert resolve_max_num_seqs(chosen, override, "nxd", None) == (64, MAX_NUM_SEQS_CHOSEN)
    # a malformed list is refused by the grid check, naming the key
    with pytest.raises(NeuronConfigError, match="token_generation_batches"):
        resolve_settings(LIMITS, {"token_generation_batches": [1, True]}, backend="reference",
                         architecture="LlamaForCausalLM")


def test_device_memory_lowers_the_default_to_what_fits():
    """8B bf16 at TP 2 leaves 6.9 GiB of 90% of a 16 GiB core for KV cache; a 2048-token
    sequence takes 2 x 32 layers x 4 KV heads x 128 x 2 bytes x 2048 = 128 MiB per core,
    so 55 fit and the default stays 32; at 32k tokens (2 GiB each) 3 fit -> 2."""
    budget = sequence_budget(LLAMA_8B, 8_030_000_000, "bfloat16", 2, 16 * GIB,
                             "inf2.48xlarge")
    assert budget.kv_bytes_per_token * 2048 == 128 * (1 << 20)
    assert budget.sequences(2048) == 55
    assert resolve_max_num_seqs(LIMITS, {}, "nxd", budget)[0] == 32
    long = dataclasses.replace(LIMITS, max_model_len=32768)
    seqs, reason = resolve_max_num_seqs(long, {}, "nxd", budget)
    assert (seqs, budget.sequences(32768)) == (2, 3)
    assert "3 sequences of 32768 tokens fit in the 6.9 GiB of HBM per NeuronCore " \
           "(inf2.48xlarge) the weights leave, so 2" in reason
    # The CPU reference backend holds its KV cache in host memory: no device budget.
    assert resolve_max_num_seqs(long, {}, "reference", budget)[0] == 32
    assert resolve_max_num_seqs(long, {}, "nxd", SequenceBudget(0, 1, "x"))[0] == 1


def test_capacity_counts_what_sequences_can_use():
    contiguous = resolve_settings(dataclasses.replace(LIMITS, max_num_seqs_is_default=False,
                                                      max_num_seqs=4, max_model_len=1024),
                                  {}, backend="reference", architecture="LlamaForCausalLM")
    assert contiguous.capacity() == (
        "4 sequences of up to 1,024 tokens (4,096 tokens); vLLM's \"KV cache size\" line "
        "also counts its null block (5,120 tokens)")
    block = resolve_settings(dataclasses.replace(LIMITS, max_num_seqs_is_default=False,
                                                 max_num_seqs=4, enable_prefix_caching=True),
                             {"pa_num_blocks": 300}, backend="reference",
                             architecture="LlamaForCausalLM")
    assert block.capacity() == (
        "9,568 tokens in 299 blocks of 32, 4 sequences of up to 2,048 tokens at once; "
        "vLLM's \"KV cache size\" line also counts its null block (9,600 tokens)")


def test_the_server_log_and_explain_config_give_the_same_capacity(model_dirs, plugin_log,
                                                                 monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from neuron_plugin.serving.vllm_settings import settings_from_vllm_config
    from neuron_plugin.tools import explain

    monkeypatch.setenv("VLLM_LOGGING_STREAM", os.environ.get("VLLM_LOGGING_STREAM",
                                                             "ext://sys.__stdout__"))
    config = EngineArgs(model=str(model_dirs["llama"]), max_model_len=1024,
                        enable_prefix_caching=False,
                        enable_chunked_prefill=False).create_engine_config()
    settings = settings_from_vllm_config(config)
    assert settings.max_num_seqs == config.scheduler_config.max_num_seqs == 32
    logged = [line for line in plugin_log if "KV cache capacity" in line]
    assert logged == [f"neuron platform: KV cache capacity {settings.capacity()}"]
    assert any("max_num_seqs 128 -> 32 (vLLM's default of 128 is sized for GPUs" in line
               or "max_num_seqs 256 -> 32 (vLLM's default of 256 is sized for GPUs" in line
               for line in plugin_log), plugin_log
    report, _ = explain.explain([str(model_dirs["llama"]), "--max-model-len", "1024",
                                 "--backend", "reference"])
    assert f"capacity         {settings.capacity()}" in explain.render(report)
    assert report["kv_layout"]["capacity"] == settings.capacity()
