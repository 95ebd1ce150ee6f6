"""The matmul-only chunked gated delta rule the nxd backend's Qwen3.5 class traces
(backends/gated_delta.py solve_free_chunked_rule) against transformers 5's
torch_chunk_gated_delta_rule on the real tokens of a padded bucket: inside one 64-token
chunk, across chunks with a ragged tail, whole chunks, a one-token prompt, and a repeated
token (one key at every position, the ill-conditioned case of the within-chunk solve).
Padding tokens (beta = g = 0) leave the final state as the real tokens left it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from neuron_plugin.backends.gated_delta import solve_free_chunked_rule, unit_lower_inverse

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.mark.parametrize("bucket, real, repeated", [
    (32, 23, False), (128, 100, False), (256, 256, False), (128, 1, False),
    (128, 100, True), (256, 256, True),
])
def test_solve_free_chunked_rule_equals_transformers(bucket, real, repeated):
    """`repeated`: every token has the same keys and little decay, as a repeated token
    gives (the XLA replay's trace example of tiny qwen3_5_moe is 128 copies of token 1):
    the power-series inverse the rule used before was off by up to 2e8 here."""
    generator = torch.Generator().manual_seed(bucket + real)
    heads, key_dim, value_dim = 4, 32, 16

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, v = randn(1, bucket, heads, key_dim), randn(1, bucket, heads, value_dim)
    k = randn(1, 1, heads, key_dim).expand(1, bucket, heads, key_dim) if repeated else randn(
        1, bucket, heads, key_dim
    )
    g = -functional.softplus(randn(1, bucket, heads) - (6.0 if repeated else 0.0))
    beta = torch.rand(1, bucket, heads, generator=generator)
    if repeated:
        beta = 0.5 + beta / 2
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


def test_unit_lower_inverse_is_the_inverse():
    generator = torch.Generator().manual_seed(0)
    lower = torch.randn(3, 64, 64, generator=generator, dtype=torch.float64).tril(-1) / 8
    found = unit_lower_inverse(lower)
    identity = torch.eye(64, dtype=torch.float64)
    assert torch.allclose(found @ (identity - lower), identity.expand(3, 64, 64), atol=1e-9)
