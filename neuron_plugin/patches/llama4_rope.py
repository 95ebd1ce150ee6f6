"""Patch `llama4-rope-temperature`: NxDI's Llama 4 text model ignores the checkpoint's
RoPE scaling and its attention temperature tuning (0.8 cd3abf3 and 0.9 ef2731e alike;
measured: tests/e2e/test_nxdi_llama4.py).

- RoPE scaling: `NeuronAttentionBase.apply_rotary_embedding`
  (modules/attention/attention_base.py, 0.8 lines 554-569, 0.9 472-487) builds Llama 4's
  polar-compatible frequencies with NxD's `precompute_freqs_cis` and no scaling
  arguments, so NxD's fixed defaults (modules/attention/utils.py `ROPE_DEFAULTS`: factor
  8, frequency factors 1 and 4, original context 8192) stand in for the checkpoint's
  llama3 `rope_scaling`.
- Temperature tuning: nothing in NxDI reads `attn_temperature_tuning`, `floor_scale` or
  `attn_scale`; transformers scales the queries of the layers without RoPE by
  log1p(floor((position + 1) / floor_scale)) x attn_scale + 1 (Llama4TextAttention).

The fix sets `NeuronLlama4Attention.apply_rotary_embedding` (models/llama4
/modeling_llama4_text.py; the base class stays as it is for every other model): a RoPE
layer's frequencies with the checkpoint's llama3 scaling (`llama3_frequencies`), rotated
by NxD's own polar-compatible rotation; a layer without RoPE (NoPE: no rotary
embedding, not polar) its queries [B, H, S, D] scaled by their positions. Traced into
Llama 4's graphs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from neuron_plugin.patches.base import NxDIModules, Patch, code_mentions, replace_method

NAME = "llama4-rope-temperature"
CLASS = "NeuronLlama4Attention"
METHOD = "apply_rotary_embedding"
ARCHITECTURES = frozenset({"Llama4ForConditionalGeneration"})


def _attention_classes(modules: NxDIModules) -> list[type]:
    return [getattr(m, CLASS) for m in modules.vision_text if hasattr(m, CLASS)]


def _inherits_unscaled(cls: type, base: ModuleType) -> bool:
    """Whether the class runs the base class's rotary embedding, which never passes
    the checkpoint's scaling (nor anything about temperature) to NxD."""
    method = getattr(cls, METHOD)
    shipped = getattr(base.NeuronAttentionBase, METHOD)
    return method is shipped and not code_mentions(shipped.__code__, "rope_scaling")


def probe(modules: NxDIModules) -> str | None:
    base = modules.attention_base
    found = [c for c in _attention_classes(modules) if _inherits_unscaled(c, base)]
    if not found:
        return None
    return (
        f"{CLASS}.{METHOD} is NeuronAttentionBase's, which applies NxD's fixed RoPE "
        f"scaling defaults and no attention temperature tuning"
    )


def temperature_scales(
    positions: torch.Tensor, floor_scale: float, attn_scale: float
) -> torch.Tensor:
    """transformers' Llama 4 query scales [B, 1, S, 1] for positions [B, S]."""
    steps = torch.floor((positions.to(torch.float32) + 1.0) / floor_scale)
    return (torch.log1p(steps) * attn_scale + 1.0)[:, None, :, None]


def llama3_frequencies(
    dim: int, positions: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """Rotation angles [positions, dim / 2] with llama3 scaling: frequencies whose
    wavelength is below original_max_position_embeddings / high_freq_factor stay, those
    above original / low_freq_factor are divided by factor, those between blend the two
    (transformers' _compute_llama3_parameters, NxD's apply_scaling). Tensor operations
    only: NxD's apply_scaling branches in Python on each frequency, a host sync per
    frequency inside a traced graph (measured in the XLA replay)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    smooth = (original / wavelength - low) / (high - low) if high != low else torch.zeros_like(inv)
    blended = (1 - smooth) * inv / factor + smooth * inv
    scaled = torch.where(
        wavelength < original / high,
        inv,
        torch.where(wavelength > original / low, inv / factor, blended),
    )
    return torch.outer(torch.arange(positions, dtype=torch.float32), scaled)


def with_checkpoint_rope(base: ModuleType) -> Callable[[Callable], Callable]:
    """The replacement, built on `base` (attention_base), which holds NxD's
    apply_rotary_polar_compatible."""

    def make(shipped: Callable) -> Callable:
        def apply_rotary_embedding(
            self: Any,
            Q: torch.Tensor,
            K: torch.Tensor,
            V: torch.Tensor,
            position_ids: torch.Tensor,
            cos_cache: Any,
            sin_cache: Any,
            use_polar_compatible_rope: bool,
        ) -> tuple:
            config = self.config
            scaling = getattr(config, "rope_scaling", None)
            if use_polar_compatible_rope and self.use_scaled_rope and scaling:
                freqs = llama3_frequencies(
                    self.head_dim,
                    self.neuron_config.max_context_length * 2,
                    self.rope_theta,
                    scaling,
                ).to(Q.device)
                q, k = base.apply_rotary_polar_compatible(
                    Q.transpose(1, 2), K.transpose(1, 2), freqs[position_ids]
                )
                return q.transpose(1, 2), k.transpose(1, 2), cos_cache, sin_cache
            Q, K, cos_cache, sin_cache = shipped(
                self, Q, K, V, position_ids, cos_cache, sin_cache, use_polar_compatible_rope
            )
            if self.rotary_emb is None and getattr(config, "attn_temperature_tuning", False):
                scales = temperature_scales(position_ids, config.floor_scale, config.attn_scale)
                Q = (Q * scales).to(Q.dtype)
            return Q, K, cos_cache, sin_cache

        return apply_rotary_embedding

    return make


def apply(modules: NxDIModules) -> bool:
    changed = False
    for cls in _attention_classes(modules):
        if _inherits_unscaled(cls, modules.attention_base):
            make = with_checkpoint_rope(modules.attention_base)
            changed |= replace_method(cls, METHOD, NAME, make)
    return changed


PATCH = Patch(
    name=NAME,
    defect="NxDI's Llama 4 ignores the checkpoint's RoPE scaling and attention temperature tuning",
    probe=probe,
    apply=apply,
    architectures=ARCHITECTURES,
)
