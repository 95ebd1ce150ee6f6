"""The reference backend's EAGLE head (backends/reference/eagle.py) against the plain
PyTorch head that trained it (scripts/build_eagle_heads.py, written apart from the
plugin): the same states from the same elements, with the plugin's slot-keyed KV cache,
its one-position shift (element t at token t's slot, RoPE position t - 1) and EAGLE-3's
draft-to-target id mapping."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from neuron_plugin.backends.reference.architectures import DecoderSpec, rope_tables
from neuron_plugin.backends.reference.decoder import DecoderGraph, load_weights
from neuron_plugin.backends.reference.eagle import EagleState


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_plugins_head_computes_the_trained_head(method, eagle_heads):
    from build_eagle_heads import DRAFT_VOCAB, _head_module

    target_dir, head_dir = eagle_heads[0], eagle_heads[1 if method == "eagle" else 2]
    config = json.loads((target_dir / "config.json").read_text())
    spec = DecoderSpec.from_hf_config(config)
    target = DecoderGraph(spec, rope_tables(config, spec))
    state = EagleState(method, head_dir, target)
    seq = 12
    state.load(seq + 1, torch.float32)
    hw = state.module.named(state.weights)
    w = target.named(load_weights(target_dir, spec, torch.float32))

    head_config = json.loads((head_dir / "config.json").read_text())
    params, forward = _head_module({**head_config, "rope_theta": 10000.0}, method, DRAFT_VOCAB)
    saved = load_file(str(head_dir / "model.safetensors"))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name.replace("__", ".")])

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (1, seq + 1), generator=generator)
    hidden = torch.randn(1, seq, spec.hidden_size, generator=generator)
    with torch.no_grad():
        wanted, wanted_next = forward(w["model.embed_tokens.weight"][tokens[:, 1:]], hidden)
        positions = torch.arange(1, seq + 1).unsqueeze(0)  # element t: token t, state t - 1
        k_cache, v_cache, _ = state.state
        states, chained = state.module.run(
            hw, w, tokens[:, 1:], hidden, positions, positions, torch.arange(seq + 1)[None],
            k_cache, v_cache)
    torch.testing.assert_close(states, wanted, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chained, wanted_next, rtol=1e-4, atol=1e-4)
    drafted = state.module.draft(hw, w, states)
    if method == "eagle3":
        draft_ids = (wanted @ saved["lm_head.weight"].t()).argmax(-1)
        assert torch.equal(drafted, draft_ids + saved["d2t"][draft_ids])
        assert bool(saved["t2d"][drafted].all())  # every draft is in the draft vocabulary
    else:
        assert torch.equal(drafted, (wanted @ w["lm_head.weight"].t()).argmax(-1))
