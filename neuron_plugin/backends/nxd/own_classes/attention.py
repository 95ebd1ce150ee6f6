"""Attention pieces shared by the plugin's own NxDI classes (families/gemma4,
families/qwen3_5): RoPE from host-made constants, and an attention over the cached
(prior) keys and the call's (active) keys with one float32 softmax, so that the classes
round as transformers' eager attention does instead of as NxDI's two-part softmax."""

from __future__ import annotations

import torch
from neuronx_distributed_inference.modules.attention.utils import repeat_kv
from torch.nn import functional

Masks = tuple[torch.Tensor | None, torch.Tensor]  # (prior mask or None, active mask)


def rope_tables(
    frequencies: list[float], position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [batch, tokens, 1, 2 x len(frequencies)]: the frequencies are constants
    made on the host in float32, so a cast of the module to bfloat16 cannot round them."""
    inverse = torch.tensor(frequencies, dtype=torch.float32, device=position_ids.device)
    angles = position_ids[..., None].float() * inverse
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb on [batch, tokens, heads, dim] (rotate_half over the whole
    head dim)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def causal_masks(
    attention_mask: torch.Tensor, position_ids: torch.Tensor, tokens: int, prior: bool
) -> Masks:
    """(prior mask or None, active mask), bool. The active keys are the call's tokens in
    order (causal over their index: their positions are consecutive where they are
    real); the prior keys are cache positions 0.. as NxDI's prior mask shows them
    ([batch, 1, 1, n] in a decode, [batch, prefix] in a prefill over a cached prefix,
    true below the first active position)."""
    index = torch.arange(tokens, device=position_ids.device)
    causal = (index[None, :] <= index[:, None])[None, None]
    if not prior:
        return None, causal
    visible = attention_mask.to(torch.bool)
    if visible.dim() == 2:
        visible = visible[:, None, None, :]
    return visible, causal


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: Masks,
    prior: tuple[torch.Tensor, torch.Tensor] | None,
    groups: int,
    scaling: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T x scaling, float32, masked) v over [prior keys; active keys]
    ([batch, heads, tokens, dim] each; `groups` query heads per KV head): the scores of
    the two parts apart (each is its own dot product), the values in one matmul, as
    transformers' eager attention rounds them. No scaling: the scores as they are."""

    def scores(keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        found = torch.matmul(q, repeat_kv(keys, groups).transpose(2, 3))
        if scaling is not None:
            found = found * scaling
        return torch.where(mask, found, torch.finfo(found.dtype).min)

    prior_mask, active_mask = masks
    active = scores(k, active_mask)
    if prior is None:
        weights = functional.softmax(active, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, repeat_kv(v, groups))
    k_prior, v_prior = prior
    assert prior_mask is not None, "cached keys come with their mask"
    both = torch.cat((scores(k_prior, prior_mask), active), dim=-1)
    weights = functional.softmax(both, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, repeat_kv(torch.cat((v_prior, v), dim=2), groups))
