"""Llama 4's text decoder (Llama4ForConditionalGeneration, text prompts) on the reference
backend against transformers: the tiny checkpoint has every text feature at test
lengths (scripts/build_tiny_model.py LLAMA4: NoPE layer 3 with temperature tuning from
position 7, RoPE layers 0-2 with L2 qk-norm and chunked attention over 16 tokens, dense
layers 0 and 2, MoE layers 1 and 3 with a shared expert, llama3 RoPE scaling). Logits
equal transformers' before and across chunk boundaries, in the contiguous and the block
(prefix-caching) layout, in one prefill and in two (a prefix hit), and greedy decoding
equals transformers' generate well past two chunk boundaries; the config as transformers
4.57 writes it reads the same; the SDK environment's runner answers as in-process."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from neuron_plugin.backends.reference.architectures import (
    DecoderSpec,
    UnsupportedModelError,
    rope_tables,
)
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, resolve_settings

ARCH = "Llama4ForConditionalGeneration"
CHUNK = 16
PROMPT = 40  # crosses two chunk boundaries; decoding crosses a third
STEPS = 12
LAYOUTS = {
    "contiguous": (
        EngineLimits(max_model_len=128, max_num_seqs=2, block_size=None,
                     enable_prefix_caching=False, enable_chunked_prefill=False,
                     max_num_batched_tokens=128, dtype="float32"),
        {"context_encoding_buckets": [64, 128], "token_generation_buckets": [128]},
        None,
    ),
    "block": (
        EngineLimits(max_model_len=128, max_num_seqs=2, block_size=16,
                     enable_prefix_caching=True, enable_chunked_prefill=False,
                     max_num_batched_tokens=128, dtype="float32"),
        {},
        [5, 2, 7, 1, 3],  # out of order; never block 0 (vLLM's null block, pads write there)
    ),
}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama4")


@pytest.fixture(scope="module")
def hf_model(model):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(3, 900, PROMPT)


def _backend(model, folder, layout: str) -> ReferenceBackend:
    limits, buckets, _ = LAYOUTS[layout]
    settings = resolve_settings(limits, buckets, backend="reference", architecture=ARCH)
    ReferenceBackend(settings, model).compile(folder)
    loaded = ReferenceBackend(settings, model)
    loaded.load(folder)
    return loaded


@pytest.fixture(scope="module", params=list(LAYOUTS))
def backend(request, model, tmp_path_factory):
    return request.param, _backend(model, tmp_path_factory.mktemp("llama4-graphs"), request.param)


def hf_logits(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([list(ids)])).logits[0]


def test_the_tiny_checkpoint_has_every_text_feature(model):
    spec = DecoderSpec.from_hf_config(read_hf_config(model))
    assert spec.rope_layers == (True, True, True, False)
    assert spec.chunks == (CHUNK, CHUNK, CHUNK, None)
    assert spec.moe_layers == (False, True, False, True)
    assert spec.l2_qk_norm and spec.temperature_tuning == (8.0, 0.5)
    assert spec.num_experts == 4 and spec.experts_per_token == 1
    assert PROMPT > 2 * CHUNK and PROMPT + STEPS > 3 * CHUNK


@pytest.mark.parametrize("length", [5, 17, PROMPT])
def test_prefill_logits_equal_transformers(backend, hf_model, prompt, length):
    """Within the first chunk, just past its boundary, and two chunks on."""
    layout, loaded = backend
    ids = prompt[:length]
    inputs = context_encoding_inputs(loaded.settings, ids, 0, 0, LAYOUTS[layout][2])
    logits = loaded.forward(inputs)[0]
    np.testing.assert_allclose(logits.numpy(), hf_logits(hf_model, ids)[-1].numpy(),
                               atol=1e-4, rtol=1e-4)


def test_greedy_decoding_equals_transformers_generate(backend, hf_model, prompt):
    layout, loaded = backend
    blocks = LAYOUTS[layout][2]
    with torch.no_grad():
        expected = hf_model.generate(input_ids=torch.tensor([prompt.tolist()]),
                                     max_new_tokens=STEPS, do_sample=False)[0, PROMPT:].tolist()
    inputs = context_encoding_inputs(loaded.settings, prompt, 0, 0, blocks)
    tokens = [int(loaded.forward(inputs)[0].argmax())]
    for position in range(PROMPT, PROMPT + STEPS - 1):
        step = token_generation_inputs(loaded.settings, np.array([tokens[-1]]),
                                       np.array([position]), np.array([0]),
                                       None if blocks is None else [blocks])
        tokens.append(int(loaded.forward(step)[0].argmax()))
    assert tokens == expected


@pytest.mark.parametrize("backend", ["block"], indirect=True)
def test_a_prefix_hit_continues_across_a_chunk_boundary(backend, hf_model, prompt):
    """A prefill of 20 tokens, then the rest of the prompt over the cached 20 (a prefix
    hit): its queries in chunk 1 see keys 16-19 from the cache and not 0-15."""
    layout, loaded = backend
    blocks = LAYOUTS[layout][2]
    loaded.forward(context_encoding_inputs(loaded.settings, prompt[:20], 0, 0, blocks))
    logits = loaded.forward(context_encoding_inputs(loaded.settings, prompt, 20, 0, blocks))[0]
    np.testing.assert_allclose(logits.numpy(), hf_logits(hf_model, prompt)[-1].numpy(),
                               atol=1e-4, rtol=1e-4)


def test_each_feature_changes_the_logits(model, hf_model, prompt):
    """What the parity above rests on: switching off any one feature in transformers'
    own model moves the logits past the tolerance, so each is computed, not skipped."""
    expected = hf_logits(hf_model, prompt)[-1]
    config = hf_model.config.text_config
    for name, value in (("attention_chunk_size", 4096), ("attn_temperature_tuning", False)):
        saved = getattr(config, name)
        setattr(config, name, value)
        layers = hf_model.language_model.model.layers
        if name == "attn_temperature_tuning":
            for layer in layers:
                layer.self_attn.attn_temperature_tuning = value
        try:
            assert (hf_logits(hf_model, prompt)[-1] - expected).abs().max() > 1e-3, name
        finally:
            setattr(config, name, saved)
            if name == "attn_temperature_tuning":
                for layer in layers:
                    layer.self_attn.attn_temperature_tuning = saved


def test_config_as_transformers_4_57_writes_it_reads_the_same(model):
    """4.57 reads rope_theta and rope_scaling, and a Hub config may leave out
    layer_types, moe_layers and no_rope_layers (derived from the interval keys)."""
    config = read_hf_config(model)
    spec = DecoderSpec.from_hf_config(config)
    old = {k: v for k, v in config["text_config"].items()
           if k not in ("rope_parameters", "layer_types", "moe_layers", "no_rope_layers")}
    legacy = {**config, "text_config": {**old, "no_rope_layer_interval": 4}}
    legacy_spec = DecoderSpec.from_hf_config(legacy)
    assert legacy_spec.rope_layers == spec.rope_layers and legacy_spec.chunks == spec.chunks
    assert legacy_spec.moe_layers == spec.moe_layers
    (inv_freq, scaling), = rope_tables(config, spec).values()
    (legacy_freq, legacy_scaling), = rope_tables(legacy, legacy_spec).values()
    torch.testing.assert_close(legacy_freq, inv_freq, rtol=0, atol=0)
    assert scaling == legacy_scaling == 1.0
    default = 1.0 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32)
    assert not torch.allclose(inv_freq, default)  # llama3 scaling took effect


def test_chunked_layers_without_a_chunk_size_are_refused(model):
    config = read_hf_config(model)
    broken = {**config, "text_config": {**config["text_config"], "attention_chunk_size": None}}
    with pytest.raises(UnsupportedModelError, match="attention_chunk_size is unset"):
        DecoderSpec.from_hf_config(broken)


def test_an_eagle_head_for_llama4_is_refused(model, tmp_path):
    """Its heads are Llama 4 layers; the reference head graph is a Llama layer."""
    from neuron_plugin.backends.reference.decoder import DecoderGraph
    from neuron_plugin.backends.reference.eagle import EagleState

    config = read_hf_config(model)
    spec = DecoderSpec.from_hf_config(config)
    with pytest.raises(UnsupportedModelError, match="EagleLlama4ForCausalLM"):
        EagleState("eagle", tmp_path, DecoderGraph(spec, rope_tables(config, spec)))


@pytest.mark.parametrize("backend", ["contiguous"], indirect=True)
def test_llama4_crosses_the_runner_boundary(backend, model, prompt, sdk_python, tmp_path):
    """A real runner process in the SDK's environment (torch 2.9, transformers 4.57)
    reads the config, compiles the graphs and answers a prefill as in-process."""
    from neuron_plugin.backends.loader import open_backend
    from neuron_plugin.backends.runner.client import RunnerBackend

    _, loaded = backend
    settings = dataclasses.replace(loaded.settings, backend_python=sdk_python)
    remote = open_backend(settings, model, str(tmp_path))
    try:
        assert isinstance(remote, RunnerBackend)
        inputs = context_encoding_inputs(settings, prompt, 0, 1, None)
        np.testing.assert_allclose(remote.forward(inputs)[0].numpy(),
                                   loaded.forward(inputs)[0].numpy(), atol=1e-5, rtol=1e-5)
    finally:
        remote.close()
    assert remote.runner.process.returncode == 0
