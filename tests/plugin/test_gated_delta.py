"""The matmul-only chunked gated delta rule the nxd backend's Qwen3.5 class traces
(backends/gated_delta.py solve_free_chunked_rule) against transformers 5's
torch_chunk_gated_delta_rule on the real tokens of a padded bucket: inside one 64-token
chunk, across chunks with a ragged tail, whole chunks, a one-token prompt. Padding tokens
(beta = g = 0) leave the final state as the real tokens left it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from neuron_plugin.backends.gated_delta import solve_free_chunked_rule

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.mark.parametrize("bucket, real", [(32, 23), (128, 100), (256, 256), (128, 1)])
def test_solve_free_chunked_rule_equals_transformers(bucket, real):
    generator = torch.Generator().manual_seed(bucket + real)
    heads, key_dim, value_dim = 4, 32, 16

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k = randn(1, bucket, heads, key_dim), randn(1, bucket, heads, key_dim)
    v = randn(1, bucket, heads, value_dim)
    g = -functional.softplus(randn(1, bucket, heads))
    beta = torch.rand(1, bucket, heads, generator=generator)
    mask = (torch.arange(bucket) < real)[None, :, None]
    out, state = solve_free_chunked_rule(
        q, k, v, torch.where(mask, g, 0.0), torch.where(mask, beta, 0.0)
    )
    expected, expected_state = qwen3_5.torch_chunk_gated_delta_rule(
        q[:, :real], k[:, :real], v[:, :real], g[:, :real], beta[:, :real],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert out.shape == (1, bucket, heads, value_dim)
    assert float((out[:, :real] - expected).abs().max()) < 1e-5
    assert float((state - expected_state).abs().max()) < 1e-5
