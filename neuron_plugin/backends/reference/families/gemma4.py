"""Gemma 4's text model (Gemma4ForCausalLM, and the text of Gemma4ForConditionalGeneration
served with --language-model-only), as transformers 5 computes it (`modeling_gemma4.py`
Gemma4TextModel, Gemma4TextDecoderLayer, Gemma4TextAttention, Gemma4TextRouter,
Gemma4TextExperts; `configuration_gemma4.py` Gemma4TextConfig; `modeling_rope_utils.py`
proportional RoPE).

What differs from the generic decoder, all read from config.json (`gemma4_fields`), in
either of its forms (the Hub's `global_head_dim` / `num_global_key_value_heads`, or
transformers 5's `per_layer_config` with layer-index keys):
- sliding and full layers with their own head dim and KV heads (full: global_head_dim;
  its KV heads num_global_key_value_heads where attention_k_eq_v), their own RoPE
  (sliding: default; full: proportional, partial_rotary_factor of the pairs rotating at
  frequencies over the whole head dim), the last layer always full;
- attention scaling 1; q, k and v RMS-normed per head (v without a weight); with
  attention_k_eq_v a full layer's values are its keys before their norm and RoPE;
- the last num_kv_shared_layers layers read the keys and values of the last earlier
  layer of their type and write none (the KV cache has a row per writing layer);
- per-layer embeddings (hidden_size_per_layer_input): a second embedding table and a
  projection of the embeddings, one slice per layer, gated into each layer's output;
- with enable_moe_block a MoE block beside the dense MLP (an RMS-normed router, softmax
  over every expert, top-k renormalised and scaled per expert), each summed after its
  own norm; the dense MLP twice as wide on KV-shared layers with use_double_wide_mlp
  (the checkpoint's shapes say so);
- norms multiply by their weight in float32 (no 1 + weight), every layer scales the
  residual stream by its layer_scalar, the final logits are soft-capped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from neuron_plugin.backends.reference.architecture import (
    FULL,
    SLIDING,
    Architecture,
    UnsupportedModelError,
)
from neuron_plugin.backends.reference.architectures import DecoderSpec
from neuron_plugin.backends.reference.decoder import DecoderGraph, Step, attend
from neuron_plugin.backends.reference.layers import l2_norm, rms_norm, rotate
from neuron_plugin.backends.reference.mlp import Adapt, activation, mlp, mlp_weights
from neuron_plugin.core.gemma4 import layer_geometry, layer_types

NORM = "rms_float"  # Gemma4RMSNorm: normed * weight in float32, then the input's dtype
DEFAULT_ROPE = {  # Gemma4TextConfig's, where config.json has no rope_parameters
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
}


def gemma4_fields(arch: Architecture, config: dict, layers: int) -> dict[str, Any]:
    """The DecoderSpec fields Gemma4TextConfig derives (see the module docstring)."""
    if config.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(
            "Gemma 4 with use_bidirectional_attention='all' attends in both directions, "
            "which a causal language model server does not serve"
        )
    types = layer_types(config, layers)
    geometry = layer_geometry(config, types)
    shared = int(config.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    kv_rows = []
    for i, kind in enumerate(types):
        if i < first_shared:
            kv_rows.append(i)
            continue
        sources = [j for j in range(first_shared) if types[j] == kind]
        if not sources:
            raise UnsupportedModelError(
                f"Gemma 4 with num_kv_shared_layers={shared}: layer {i} ({kind}) shares the "
                f"keys and values of an earlier {kind} layer, and there is none before layer "
                f"{first_shared} (transformers fails too)"
            )
        kv_rows.append(sources[-1])
    window = int(config.get("sliding_window") or 512)
    moe = bool(config.get("enable_moe_block"))
    return {
        "layer_types": tuple(types),
        "windows": tuple(window if kind == SLIDING else None for kind in types),
        "layer_geometry": tuple(geometry),
        "kv_rows": tuple(kv_rows),
        "values_from_keys": tuple(
            bool(config.get("attention_k_eq_v")) and kind == FULL for kind in types
        ),
        "per_layer_input": int(config.get("hidden_size_per_layer_input") or 0),
        "score_scale": 1.0,
        "attn_softcap": None,
        "moe_layers": (moe,) * layers,
        "num_experts": int(config.get("num_experts") or 0) if moe else 0,
        "experts_per_token": int(config.get("top_k_experts") or 0) if moe else 0,
        "moe_intermediate_size": int(config.get("moe_intermediate_size") or 0) if moe else 0,
    }


def weight_sources(spec: DecoderSpec, own_head: bool) -> list[tuple[str, tuple[str, ...]]]:
    """The graph's weight inputs: a KV-shared layer has no k/v projections or norms, a
    keys-as-values layer no v_proj; the per-layer embeddings and MoE block where the
    config has them."""
    names = ["model.embed_tokens.weight"]
    if spec.per_layer_input:
        names += [
            "model.embed_tokens_per_layer.weight",
            "model.per_layer_model_projection.weight",
            "model.per_layer_projection_norm.weight",
        ]
    sources: list[tuple[str, tuple[str, ...]]] = [(n, (n,)) for n in names]
    for i in range(spec.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        own = spec.owns_kv(i)
        projections = (
            "q" + ("k" if own else "") + ("v" if own and not spec.values_from_keys[i] else "")
        )
        names = [p + "input_layernorm.weight"]
        names += [f"{a}{x}_proj.weight" for x in projections + "o"]
        names += [f"{a}{x}_proj.bias" for x in spec.biased_projections if x in projections + "o"]
        names += [a + "q_norm.weight"] + ([a + "k_norm.weight"] if own else [])
        names += [
            p + f"{n}.weight" for n in ("post_attention_layernorm", "pre_feedforward_layernorm")
        ]
        names += [p + "post_feedforward_layernorm.weight"]
        sources += [(n, (n,)) for n in names] + mlp_weights(_dense(spec), i)
        names = []
        if spec.moe_layers[i]:
            names += [p + f"router.{n}" for n in ("proj.weight", "scale", "per_expert_scale")]
            names += [p + "experts.gate_up_proj", p + "experts.down_proj"]
            names += [
                p + f"{n}.weight"
                for n in (
                    "post_feedforward_layernorm_1",
                    "post_feedforward_layernorm_2",
                    "pre_feedforward_layernorm_2",
                )
            ]
        if spec.per_layer_input:
            names += [
                p + f"{n}.weight"
                for n in (
                    "per_layer_input_gate",
                    "per_layer_projection",
                    "post_per_layer_input_norm",
                )
            ]
        names.append(p + "layer_scalar")
        sources += [(n, (n,)) for n in names]
    names = ["model.norm.weight"]
    if own_head or not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return sources + [(n, (n,)) for n in names]


def _dense(spec: DecoderSpec) -> DecoderSpec:
    """The spec as the dense MLP's reader sees it: Gemma 4's MoE block is beside it."""
    return dataclasses.replace(spec, moe_layers=(False,) * spec.num_layers)


class Gemma4Graph(DecoderGraph):
    """Gemma 4's decoder: the generic graph's embedding, RoPE tables and masks, its own
    per-layer embeddings and layers (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # the per-layer table's scale, sqrt(width) rounded to the weights' dtype
        self.per_layer_scale = {
            dtype: float(torch.tensor(self.spec.per_layer_input**0.5).to(dtype))
            for dtype in self.embed_scale
        }

    def per_layer_inputs(
        self, w: dict[str, torch.Tensor], input_ids: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor | None:
        """[batch, active, layers, width]: the token's row of the per-layer table (ids
        past it read row 0, as vLLM does; transformers fails) plus the normed projection
        of its scaled embedding, over sqrt(2)."""
        s = self.spec
        width = s.per_layer_input
        if not width:
            return None
        table = w["model.embed_tokens_per_layer.weight"]
        ids = torch.where(input_ids < table.shape[0], input_ids, 0)
        tokens = (table[ids] * self.per_layer_scale[table.dtype]).view(
            *ids.shape, s.num_layers, width
        )
        projected = (x @ w["model.per_layer_model_projection.weight"].t()) * s.hidden_size**-0.5
        projected = rms_norm(
            NORM,
            projected.view(*ids.shape, s.num_layers, width),
            w["model.per_layer_projection_norm.weight"],
            s.rms_norm_eps,
        )
        return (projected + tokens) * 2**-0.5

    def layer(
        self,
        w: dict[str, torch.Tensor],
        layer: int,
        x: torch.Tensor,
        step: Step,
        adapt: Adapt | None,
    ) -> torch.Tensor:
        s = self.spec
        eps = s.rms_norm_eps
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        batch, active = x.shape[:2]
        kv_heads, head_dim = s.kv_heads_of(layer), s.head_dim_of(layer)
        cos, sin = step.rope[s.rope_kind(layer)]
        h = rms_norm(NORM, x, w[p + "input_layernorm.weight"], eps)
        q = self.linear(w, a + "q_proj", h).view(batch, active, s.num_heads, head_dim)
        q = rotate(rms_norm(NORM, q, w[a + "q_norm.weight"], eps), cos, sin, pairs=False)
        if s.owns_kv(layer):
            shape = (batch, active, kv_heads, head_dim)
            raw_k = self.linear(w, a + "k_proj", h).view(shape)
            raw_v = (
                raw_k if s.values_from_keys[layer] else self.linear(w, a + "v_proj", h).view(shape)
            )
            k = rotate(rms_norm(NORM, raw_k, w[a + "k_norm.weight"], eps), cos, sin, pairs=False)
            step.write(layer, k, l2_norm(raw_v, eps))
        visible = step.mask(s, layer)
        keys, values = step.read(s.kv_row(layer), kv_heads, head_dim, visible)
        attn = attend(s, q, keys, values, visible, None)
        out = self.linear(w, a + "o_proj", attn)
        x = x + rms_norm(NORM, out, w[p + "post_attention_layernorm.weight"], eps)
        h = rms_norm(NORM, x, w[p + "pre_feedforward_layernorm.weight"], eps)
        out = mlp(_dense(s), w, layer, h, adapt)
        if s.moe_layers[layer]:
            dense = rms_norm(NORM, out, w[p + "post_feedforward_layernorm_1.weight"], eps)
            experts = rms_norm(
                NORM, self._moe(w, p, x), w[p + "post_feedforward_layernorm_2.weight"], eps
            )
            out = dense + experts
        x = x + rms_norm(NORM, out, w[p + "post_feedforward_layernorm.weight"], eps)
        if step.per_layer is not None:
            gate = activation(s.activation, x @ w[p + "per_layer_input_gate.weight"].t())
            gated = (gate * step.per_layer[:, :, layer]) @ w[p + "per_layer_projection.weight"].t()
            x = x + rms_norm(NORM, gated, w[p + "post_per_layer_input_norm.weight"], eps)
        return x * w[p + "layer_scalar"]

    def _moe(self, w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
        """The MoE block on the residual stream `x` (Gemma4TextRouter, Gemma4TextExperts):
        every expert on every token, each weighted by its routing (zero off the top-k),
        summed in the hidden dtype in expert order, as transformers' index_add."""
        s = self.spec
        tokens = x.reshape(-1, s.hidden_size)
        routed = l2_norm(tokens, s.rms_norm_eps) * w[p + "router.scale"] * s.hidden_size**-0.5
        probs = torch.softmax((routed @ w[p + "router.proj.weight"].t()).float(), dim=-1)
        top, chosen = torch.topk(probs, s.experts_per_token, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True) * w[p + "router.per_expert_scale"][chosen].float()
        routing = (chosen.unsqueeze(-1) == torch.arange(s.num_experts)).float()
        routing = (routing * top.unsqueeze(-1)).sum(dim=1)  # [tokens, experts]
        h = rms_norm(NORM, tokens, w[p + "pre_feedforward_layernorm_2.weight"], s.rms_norm_eps)
        fused = h.unsqueeze(0) @ w[p + "experts.gate_up_proj"].transpose(1, 2)
        inner = fused.shape[-1] // 2
        gate, up = fused[..., :inner], fused[..., inner:]
        out = (activation(s.activation, gate) * up) @ w[p + "experts.down_proj"].transpose(1, 2)
        combined = (out * routing.t().unsqueeze(-1)).to(x.dtype).sum(dim=0)
        return combined.view(x.shape)


_GEMMA4 = Architecture(
    "gemma4",
    norm=NORM,
    qk_norm=True,
    gemma=True,
    default_rope_theta=1_000_000.0,
    spec_fields=gemma4_fields,
    default_rope=DEFAULT_ROPE,
    graph=Gemma4Graph,
    weight_sources=weight_sources,
    refuses=("lora", "quantization", "eagle"),
)
ARCHITECTURES = {
    "Gemma4ForCausalLM": _GEMMA4,
    "Gemma4ForConditionalGeneration": _GEMMA4,
}
