"""The gated delta rule of Qwen3.5's DeltaNet layers (transformers 5 modeling_qwen3_5.py
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, Qwen3_5RMSNormGated) as
plain torch, shared by the reference backend's graphs and the nxd backend's class.

Everything here but `solve_free_chunked_rule`'s Python loop over chunks (a count fixed
by the shapes, unrolled when traced) is fixed-shape tensor algebra, so the nxd class can
trace it into one XLA graph: no triangular solve (torch-xla runs it on the host and
neuronx-cc has no operator for it), no cumsum (a reduce-window), no in-place row writes,
no -inf. The state is float32, as transformers keeps it."""

from __future__ import annotations

import torch
from torch.nn import functional

CHUNK = 64  # torch_chunk_gated_delta_rule's chunk_size
L2_EPS = 1e-6  # its l2norm's


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def prepared(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """[batch, tokens, heads, ...] -> float32 [batch, heads, tokens, ...], q and k
    L2-normed, q scaled by key_dim^-0.5 (use_qk_l2norm_in_kernel)."""
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v, beta, g)
    )
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def gated_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Qwen3_5RMSNormGated: weight x normed (in x's dtype), times SiLU(gate) in float32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out * functional.silu(gate.float())).to(x.dtype)


def recurrent_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_recurrent_gated_delta_rule of one token per row from `state` [b, heads,
    key dim, value dim]: (output [b, 1, heads, value dim] in v's dtype, new state)."""
    dtype = v.dtype
    q, k, v, g, beta = prepared(q, k, v, g, beta)
    q_t, k_t, v_t = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    state = state * g[:, :, 0].exp()[..., None, None]
    memory = (state * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - memory) * beta[:, :, 0].unsqueeze(-1)
    state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.unsqueeze(2).transpose(1, 2).contiguous().to(dtype), state


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I - lower)^-1 for strictly lower triangular [..., n, n] `lower` (n a power of
    two) by recursive block inversion: with the inverses A' and D' of the two diagonal
    halves of a block known, the block's inverse is [[A', 0], [D' B A', D']] (B its
    lower-left part of `lower`). Each of the log2(n) levels updates every block at once
    with two matmuls, and every intermediate is a block of the exact inverse, so rounding
    stays at float32's level. The power series (I + N)(I + N^2)(I + N^4)... computes the
    same inverse in matmuls too, but its factors grow like binomial coefficients where
    keys repeat within a chunk (a repeated token: N close to beta times a lower triangle
    of ones) and float32 loses every digit of the result (tests/plugin/test_gated_delta.py's
    repeated-token cases: outputs off by 1e6 to 1e27 where transformers' stay below 0.3)."""
    size = lower.shape[-1]
    index = torch.arange(size, device=lower.device)
    inverse = torch.eye(size, dtype=lower.dtype, device=lower.device)
    width = 1
    while width < size:
        halves = index[:, None] // width == index[None, :] // width
        pairs = index[:, None] // (2 * width) == index[None, :] // (2 * width)
        inverse = inverse + inverse @ torch.where(pairs & ~halves, lower, 0.0) @ inverse
        width *= 2
    return inverse


def solve_free_chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_chunk_gated_delta_rule from a zero state over [b, tokens, heads, ...] inputs
    whose padding tokens have beta = g = 0 (they neither write nor decay the state), in
    matmuls only: (output [b, tokens, heads, value dim] in v's dtype, final state).

    Per chunk the rule needs (I - N)^-1 X for the strictly lower triangular
    N = -tril((k beta) k^T exp(cum_i - cum_j), -1), computed by `unit_lower_inverse`.
    The within-chunk cumulative decay is a matmul with an upper triangle of ones;
    pairwise decays are exponentiated only where i >= j."""
    dtype = v.dtype
    batch, tokens = q.shape[:2]
    q, k, v, g, beta = prepared(q, k, v, g, beta)
    heads, value_dim = v.shape[1], v.shape[-1]
    pad = (CHUNK - tokens % CHUNK) % CHUNK
    q, k, v = (functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (functional.pad(x, (0, pad)) for x in (beta, g))
    chunks = (tokens + pad) // CHUNK
    q, k, v = (x.reshape(batch, heads, chunks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, chunks, CHUNK) for x in (g, beta))
    ones = torch.ones(CHUNK, CHUNK, dtype=torch.float32, device=q.device)
    cum = g @ ones.triu()  # cum[..., t] = sum of g[..., :t + 1]
    lower = ones.tril()
    below = lower.to(torch.bool)
    pairwise = torch.where(below, cum[..., :, None] - cum[..., None, :], 0.0).exp() * lower
    k_beta = k * beta[..., None]
    nilpotent = -((k_beta @ k.transpose(-1, -2)) * pairwise).tril(-1)
    solved = unit_lower_inverse(nilpotent) @ torch.cat(
        (v * beta[..., None], k_beta * cum.exp()[..., None]), dim=-1
    )
    new_values, k_cumdecay = solved[..., :value_dim], solved[..., value_dim:]
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = q.new_zeros(batch, heads, q.shape[-1], value_dim)
    outputs = []
    for i in range(chunks):
        fresh = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ fresh)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ fresh
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, value_dim)[:, :, :tokens]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state
