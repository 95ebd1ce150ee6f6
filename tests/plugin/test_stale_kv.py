"""A KV cache slot no query of a call sees never reaches its output (issue 32, case 4):
the reference backend's cache filled with NaN (what an earlier request could leave in
blocks that are freed and handed out again), then a prompt encoded into some of those
blocks: its logits are finite and those of a clean cache. Attention weights of masked
positions are zero, but 0 x NaN is NaN, so the values there are zeroed first."""

from __future__ import annotations

import numpy as np
import torch

from neuron_plugin.backends.loader import open_backend
from neuron_plugin.core.inputs import context_encoding_inputs, token_generation_inputs
from neuron_plugin.core.settings import EngineLimits, resolve_settings


def test_nan_left_in_stale_blocks_never_reaches_another_request(model_dirs, tmp_path):
    limits = EngineLimits(max_model_len=128, max_num_seqs=2, block_size=16,
                          enable_prefix_caching=True, enable_chunked_prefill=False,
                          max_num_batched_tokens=128, dtype="float32")
    settings = resolve_settings(limits, {"context_encoding_buckets": [32, 128]},
                                backend="reference", architecture="LlamaForCausalLM")
    backend = open_backend(settings, model_dirs["llama"], str(tmp_path / "cache"))
    geometry = backend.kv_geometry()
    every = np.arange(1, settings.num_blocks, dtype=np.int64)

    def logits(fill: float) -> torch.Tensor:
        for start in range(0, len(every), settings.max_blocks_per_seq):
            ids = every[start:start + settings.max_blocks_per_seq]
            backend.write_kv_blocks(ids, torch.full(geometry.shape(len(ids)), fill))
        prompt = np.arange(5, 25)
        blocks = [3, 7]  # 20 tokens: the second block mostly stale
        first = backend.forward(context_encoding_inputs(settings, prompt, 0, 0, blocks))
        nxt = token_generation_inputs(settings, np.array([9]), np.array([20]),
                                      np.array([0]), [blocks])
        return torch.cat([first, backend.forward(nxt)])

    clean = logits(0.0).clone()
    poisoned = logits(float("nan"))
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean)
