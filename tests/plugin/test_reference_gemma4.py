"""Gemma 4's text model on the reference backend against transformers 5: the tiny
checkpoints have every text feature of the released configs at test sizes
(scripts/build_tiny_model.py: `gemma4`, sliding layers of head_dim 32 beside full layers
of head_dim 64 with proportional RoPE and keys as values, the last two layers sharing
earlier layers' keys and values with the double-wide MLP, per-layer embeddings, a 16-token
window, soft-capped logits; `gemma4_moe`, a MoE block beside every dense MLP). Logits
equal transformers' before and past the window, in the contiguous and the block
(prefix-caching) layout, in one prefill and over a prefix hit; greedy decoding equals
transformers' generate; the config's two forms (the Hub's global_head_dim and
transformers 5's per_layer_config) read alike; each feature moves transformers' own
logits, so parity checks that it is computed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from neuron_plugin.backends.reference.architectures import DecoderSpec, UnsupportedModelError
from neuron_plugin.backends.reference.backend import ReferenceBackend
from neuron_plugin.core.checkpoint import read_hf_config
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, resolve_settings

ARCH = "Gemma4ForCausalLM"
WINDOW = 16
PROMPT = 40  # past two windows; decoding goes further
STEPS = 10
LAYOUTS = {
    "contiguous": (
        EngineLimits(
            max_model_len=128,
            max_num_seqs=2,
            block_size=None,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
            max_num_batched_tokens=128,
            dtype="float32",
        ),
        {"context_encoding_buckets": [64, 128], "token_generation_buckets": [128]},
        None,
    ),
    "block": (
        EngineLimits(
            max_model_len=128,
            max_num_seqs=2,
            block_size=16,
            enable_prefix_caching=True,
            enable_chunked_prefill=False,
            max_num_batched_tokens=128,
            dtype="float32",
        ),
        {},
        [5, 2, 7, 1, 3],  # out of order; never block 0 (vLLM's null block)
    ),
}


@pytest.fixture(scope="module", params=["gemma4", "gemma4_moe"])
def model(request, tiny_model):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def hf_model(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(3, 900, PROMPT)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def backend(request, model, tmp_path_factory):
    limits, buckets, _ = LAYOUTS[request.param]
    settings = resolve_settings(limits, buckets, backend="reference", architecture=ARCH)
    folder = tmp_path_factory.mktemp("gemma4-graphs")
    ReferenceBackend(settings, model).compile(folder)
    loaded = ReferenceBackend(settings, model)
    loaded.load(folder)
    return request.param, loaded


def hf_logits(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([list(ids)])).logits[0]


def test_the_tiny_checkpoints_have_every_text_feature(model):
    spec = DecoderSpec.from_hf_config(read_hf_config(model))
    assert spec.windows == (WINDOW, WINDOW, None) * 2
    assert spec.layer_geometry == ((2, 32), (2, 32), (1, 64)) * 2
    assert spec.values_from_keys == (False, False, True) * 2
    assert spec.score_scale == 1.0 and spec.final_softcap == 30.0
    if model.name == "tiny-gemma4":
        assert spec.kv_rows == (0, 1, 2, 3, 3, 2)  # the last two read layers 3 and 2
        assert spec.cache_geometry == (4, 1, 64)  # 4 rows of 64-value lines: 2 x 32 or 1 x 64
        assert spec.per_layer_input == 16
    else:
        assert spec.moe_layers == (True,) * 6 and spec.num_experts == 4
        assert spec.kv_rows == tuple(range(6)) and spec.per_layer_input == 0


@pytest.mark.parametrize("length", [5, WINDOW + 1, PROMPT])
def test_prefill_logits_equal_transformers(backend, hf_model, prompt, length):
    layout, loaded = backend
    ids = prompt[:length]
    inputs = context_encoding_inputs(loaded.settings, ids, 0, 0, LAYOUTS[layout][2])
    logits = loaded.forward(inputs)[0]
    np.testing.assert_allclose(
        logits.numpy(), hf_logits(hf_model, ids)[-1].numpy(), atol=1e-4, rtol=1e-4
    )


def test_greedy_decoding_equals_transformers_generate(backend, hf_model, prompt):
    layout, loaded = backend
    blocks = LAYOUTS[layout][2]
    with torch.no_grad():
        expected = hf_model.generate(
            input_ids=torch.tensor([prompt.tolist()]), max_new_tokens=STEPS, do_sample=False
        )[0, PROMPT:].tolist()
    inputs = context_encoding_inputs(loaded.settings, prompt, 0, 0, blocks)
    tokens = [int(loaded.forward(inputs)[0].argmax())]
    for position in range(PROMPT, PROMPT + STEPS - 1):
        step = token_generation_inputs(
            loaded.settings,
            np.array([tokens[-1]]),
            np.array([position]),
            np.array([0]),
            None if blocks is None else [blocks],
        )
        tokens.append(int(loaded.forward(step)[0].argmax()))
    assert tokens == expected


@pytest.mark.parametrize("backend", ["block"], indirect=True)
def test_a_prefix_hit_reads_the_shared_layers_keys_from_the_cache(backend, hf_model, prompt):
    """A prefill of 32 tokens, then the prompt over the cached 32: the KV-shared layers'
    queries read their source layers' cached keys and values."""
    layout, loaded = backend
    blocks = LAYOUTS[layout][2]
    loaded.forward(context_encoding_inputs(loaded.settings, prompt[:32], 0, 0, blocks))
    logits = loaded.forward(context_encoding_inputs(loaded.settings, prompt, 32, 0, blocks))[0]
    np.testing.assert_allclose(
        logits.numpy(), hf_logits(hf_model, prompt)[-1].numpy(), atol=1e-4, rtol=1e-4
    )


def test_the_hub_form_of_the_config_reads_as_transformers_5_saves_it(model):
    """The Hub's configs name global_head_dim and num_global_key_value_heads;
    transformers 5 saves per_layer_config (zero-padded layer keys past 9 layers)."""
    config = read_hf_config(model)
    saved = DecoderSpec.from_hf_config(config)
    hub = DecoderSpec.from_hf_config({k: v for k, v in config.items() if k != "per_layer_config"})
    padded = {
        **config,
        "per_layer_config": {f"{int(k):02d}": v for k, v in config["per_layer_config"].items()},
        "global_head_dim": 512,
    }  # per_layer_config wins, as in transformers
    assert hub == saved == DecoderSpec.from_hf_config(padded)
    no_k_eq_v = {**config, "attention_k_eq_v": False}
    no_k_eq_v.pop("per_layer_config")
    # num_global_key_value_heads counts only with attention_k_eq_v
    assert DecoderSpec.from_hf_config(no_k_eq_v).layer_geometry == ((2, 32), (2, 32), (2, 64)) * 2


def test_each_feature_changes_the_logits(model, hf_model, prompt):
    """Parity rests on these: halving a layer_scalar, the per-layer embeddings' gate, the
    MoE router's logits or the proportional RoPE's frequencies in transformers' own
    model moves its logits past the tolerance."""
    expected = hf_logits(hf_model, prompt)[-1]
    text = hf_model.model
    changes = [("layer_scalar", lambda: text.layers[1].layer_scalar)]
    if model.name == "tiny-gemma4":
        changes.append(("per_layer_input_gate", lambda: text.layers[1].per_layer_input_gate.weight))
    else:
        changes.append(("router", lambda: text.layers[1].router.proj.weight))
    changes.append(("full_attention_inv_freq", lambda: text.rotary_emb.full_attention_inv_freq))
    for name, tensor in changes:
        saved = tensor().clone()
        with torch.no_grad():
            tensor().mul_(0.5)
        try:
            assert (hf_logits(hf_model, prompt)[-1] - expected).abs().max() > 1e-3, name
        finally:
            with torch.no_grad():
                tensor().copy_(saved)


def test_configs_transformers_cannot_run_are_refused(model):
    config = read_hf_config(model)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention='all'"):
        DecoderSpec.from_hf_config({**config, "use_bidirectional_attention": "all"})
    only_full = {
        **config,
        "layer_types": ["full_attention"] * 4 + ["sliding_attention"] * 2,
        "num_kv_shared_layers": 2,
    }
    with pytest.raises(UnsupportedModelError, match="no sliding_attention|none before"):
        DecoderSpec.from_hf_config(only_full)


def test_the_multimodal_checkpoint_reads_its_nested_text_config(model):
    """Gemma4ForConditionalGeneration nests the text config (text_config) and its
    tensors (model.language_model.), which the reference backend reads as the text
    model's."""
    config = read_hf_config(model)
    nested = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {k: v for k, v in config.items() if k != "architectures"},
        "tie_word_embeddings": True,
    }
    spec = DecoderSpec.from_hf_config(json.loads(json.dumps(nested)))
    assert spec.architecture == "Gemma4ForConditionalGeneration"
    assert spec.layer_geometry == DecoderSpec.from_hf_config(config).layer_geometry
