"""Patch llama4-rope-temperature on stand-ins of the NxDI code it replaces (what it does
on real NxDI 0.8 and 0.9: tests/e2e/test_nxdi_llama4_served.py, equal to transformers;
the shipped defects: tests/e2e/test_nxdi_llama4.py). The stand-ins reproduce
modules/attention/attention_base.py NeuronAttentionBase.apply_rotary_embedding (0.8
cd3abf3 lines 554-569, 0.9 ef2731e 472-487: the polar branch calls NxD's
precompute_freqs_cis without scaling arguments, then apply_rotary_polar_compatible; a
layer without a rotary embedding is left as it is) and models/llama4/modeling_llama4_text.py NeuronLlama4Attention (no
override of it)."""

from __future__ import annotations

import types

import pytest
import torch

from neuron_plugin.backends.reference.decoder import _tuned_temperature
from neuron_plugin.patches import llama4_rope
from neuron_plugin.patches.base import NxDIModules, unpatched

ROTATED: list[torch.Tensor] = []
NXD_DEFAULTS = {"factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                "original_max_position_embeddings": 8192}


def precompute_freqs_cis(dim, end, theta=10000.0, use_scaled=False, device=None, **kwargs):
    """NxD's (modules/attention/utils.py), without its scaling (ROPE_DEFAULTS' llama3
    with factor 8: what the shipped code applies whatever the checkpoint says)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if use_scaled:
        inv = llama4_rope.llama3_frequencies(dim, 2, theta, NXD_DEFAULTS)[1]
    return torch.outer(torch.arange(end, dtype=torch.float32), inv)


def apply_rotary_polar_compatible(query, key, freqs):
    ROTATED.append(freqs)  # [B, S, D / 2] angles
    return query, key  # [B, S, H, D] in and out, as NxD's


def _modules() -> NxDIModules:
    base = types.ModuleType("attention_base")
    base.precompute_freqs_cis = precompute_freqs_cis
    base.apply_rotary_polar_compatible = apply_rotary_polar_compatible

    class NeuronAttentionBase:
        def apply_rotary_embedding(self, Q, K, V, position_ids, cos_cache, sin_cache,
                                   use_polar_compatible_rope):
            if not use_polar_compatible_rope and self.rotary_emb is not None:
                raise AssertionError("no rotary embedding module in Llama 4's attention")
            if use_polar_compatible_rope:
                freqs = precompute_freqs_cis(self.head_dim,
                                             self.neuron_config.max_context_length * 2,
                                             self.rope_theta, self.use_scaled_rope)
                Q, K = apply_rotary_polar_compatible(Q.transpose(1, 2), K.transpose(1, 2),
                                                     freqs[position_ids])
                Q, K = Q.transpose(1, 2), K.transpose(1, 2)
            return Q, K, cos_cache, sin_cache

    base.NeuronAttentionBase = NeuronAttentionBase
    text = types.ModuleType("modeling_llama4_text")
    text.NeuronLlama4Attention = type("NeuronLlama4Attention", (NeuronAttentionBase,), {})
    return NxDIModules(*(types.ModuleType(n) for n in (
        "model_base", "model_wrapper", "hf_adapter")), base, types.ModuleType("sampling"),
        vision_text=(text,))


def _attention(cls, **config):
    layer = cls()
    layer.config = types.SimpleNamespace(**config)
    layer.head_dim, layer.rope_theta, layer.use_scaled_rope = 8, 500000.0, True
    layer.neuron_config = types.SimpleNamespace(max_context_length=32)
    layer.rotary_emb = None
    return layer


# Llama 4 Scout's (NxDI's own config_16E_4layer.json) and Llama 3.1's llama3 scaling
SCALING = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
           "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
SHORT_BAND = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TUNING = {"attn_temperature_tuning": True, "floor_scale": 8, "attn_scale": 0.5}


def test_the_probe_finds_the_shipped_rotary_embedding_and_the_patch_replaces_it_once():
    modules = _modules()
    cls = modules.vision_text[0].NeuronLlama4Attention
    shipped = cls.apply_rotary_embedding
    assert "fixed RoPE scaling" in llama4_rope.probe(modules)
    assert llama4_rope.apply(modules)
    assert not llama4_rope.apply(modules)  # idempotent
    assert llama4_rope.probe(modules) is None
    assert unpatched(cls.apply_rotary_embedding) is shipped
    base = modules.attention_base.NeuronAttentionBase
    assert base.apply_rotary_embedding is shipped  # every other model keeps it


@pytest.mark.parametrize("scaling", [SCALING, SHORT_BAND])
def test_llama3_frequencies_are_transformers(scaling):
    """transformers' llama3 RoPE (modeling_rope_utils, the oracle), with Scout's factors
    (no blended band: low_freq_factor == high_freq_factor) and Llama 3.1's."""
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Llama4TextConfig(head_dim=64, hidden_size=256, num_attention_heads=4,
                              rope_theta=500000.0, rope_scaling=dict(scaling))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert factor == 1.0
    expected = torch.outer(torch.arange(300, dtype=torch.float32), inv_freq.float())
    ours = llama4_rope.llama3_frequencies(64, 300, 500000.0, scaling)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)


def test_a_rope_layer_rotates_by_the_checkpoints_scaling():
    modules = _modules()
    llama4_rope.apply(modules)
    layer = _attention(modules.vision_text[0].NeuronLlama4Attention,
                       rope_scaling=SCALING, **TUNING)
    q = torch.randn(1, 2, 5, 8)
    positions = torch.tensor([[3, 4, 5, 6, 7]])
    ROTATED.clear()
    out, _, _, _ = layer.apply_rotary_embedding(q, q.clone(), q, positions, None, None, True)
    table = llama4_rope.llama3_frequencies(8, 64, 500000.0, SCALING)
    assert len(ROTATED) == 1 and torch.equal(ROTATED[0], table[positions])
    shipped = precompute_freqs_cis(8, 64, 500000.0, True)[positions]
    assert not torch.allclose(ROTATED[0], shipped)  # what the patch fixes
    assert torch.equal(out, q)  # no temperature on a RoPE layer


def test_a_nope_layer_scales_its_queries_as_transformers_does():
    """transformers' Llama4TextAttention: log1p(floor((position + 1) / floor_scale)) x
    attn_scale + 1, here against the reference backend's own reading of it."""
    modules = _modules()
    llama4_rope.apply(modules)
    layer = _attention(modules.vision_text[0].NeuronLlama4Attention, **TUNING)
    q = torch.randn(2, 3, 20, 8)  # BHSD
    positions = torch.stack([torch.arange(20), torch.arange(100, 120)])
    out, k, _, _ = layer.apply_rotary_embedding(q, q, q, positions, None, None, False)
    expected = _tuned_temperature(q.transpose(1, 2), positions, 8, 0.5).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(k, q)  # keys are never scaled
    assert not torch.equal(out[0, :, 0], out[0, :, 10])  # the scale steps at position 7
    untuned = _attention(modules.vision_text[0].NeuronLlama4Attention,
                         **{**TUNING, "attn_temperature_tuning": False})
    same, _, _, _ = untuned.apply_rotary_embedding(q, q, q, positions, None, None, False)
    assert torch.equal(same, q)
