"""Self-attention among an image's patches, shared by the vision towers (`vision`'s
Qwen family and `pixtral`): both rotate q and k by per-patch angles and let a patch see
only the patches of its own image (or window), as a mask rather than per-image calls, so
one graph per vision bucket serves every mix of images."""

from __future__ import annotations

import torch

from neuron_plugin.backends.reference.layers import rotate_half


def patch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    visible: torch.Tensor,
    rotary_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q, k, v [patches, heads, head_dim]; the rotary in `rotary_dtype` (the Qwen towers
    rotate in float32, transformers' apply_rotary_pos_emb_vision; Pixtral in the model's
    dtype); `visible` [patches, patches]. Returns [patches, heads * head_dim]."""
    n, heads, head_dim = q.shape
    dtype = rotary_dtype or q.dtype

    def rotated(t: torch.Tensor) -> torch.Tensor:
        return (t.to(dtype) * cos + rotate_half(t.to(dtype)) * sin).to(t.dtype)

    q, k = rotated(q), rotated(k)
    scores = (q.transpose(0, 1) @ k.permute(1, 2, 0)) * head_dim**-0.5  # [heads, n, n]
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return (probs @ v.transpose(0, 1)).transpose(0, 1).reshape(n, heads * head_dim)
