"""The math the reference graphs share: RMSNorm in the architectures' formulas, RoPE
rotations, soft-capping. Pure torch functions, imported by the decoder and the vision
towers alike (so a tower need not import the decoder)."""

from __future__ import annotations

import torch


def rms_norm(kind: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 with the architecture's weight formula (`Architecture.norm`)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms":
        return weight * normed.to(x.dtype)
    if kind == "rms_one_plus":
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama4TextL2Norm: RMSNorm without a weight, in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(-x1, x0) of each interleaved pair (x0, x1): i times the pair as a complex number."""
    pairs = x.view(*x.shape[:-1], -1, 2)
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool) -> torch.Tensor:
    """RoPE: halves rotated in x's dtype (transformers' apply_rotary_pos_emb), or
    interleaved pairs rotated in float32 and cast back (Llama 4's apply_rotary_emb, a
    complex product)."""
    if not pairs:
        return x * cos + rotate_half(x) * sin
    x32 = x.float()
    return (x32 * cos + rotate_pairs(x32) * sin).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (-x2, x1) of x's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap
