"""Qwen3.5 and Qwen3.6's text models, dense and MoE (Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM, and the text of the multimodal Qwen3_5ForConditionalGeneration /
Qwen3_5MoeForConditionalGeneration served with --language-model-only), as transformers 5
computes them (`modeling_qwen3_5.py`, `modeling_qwen3_5_moe.py`: Qwen3_5GatedDeltaNet,
Qwen3_5Attention, Qwen3_5RMSNorm, Qwen3_5RMSNormGated, Qwen3_5MoeSparseMoeBlock;
`configuration_qwen3_5.py`).

Most layers are gated DeltaNet linear attention (`layer_types` "linear_attention", the
`linear_*` config keys), every few a gated full-attention layer:
- linear attention: q, k and v through a short causal depthwise convolution (kernel
  linear_conv_kernel_dim, SiLU) whose last kernel - 1 inputs are the conv state; q and k
  L2-normed, q scaled by key_dim^-0.5, value heads sharing key heads; the gated delta
  rule S <- S exp(g) + k (beta (v - S^T k))^T with g = -exp(A_log) softplus(a + dt_bias),
  beta = sigmoid(b), read out as S^T q: in a context encoding its chunked form (chunks of
  64, the UT transform by a triangular solve), in a decode its recurrent form, both as
  transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule compute
  them; the output RMS-normed per head and gated by SiLU(z) (Qwen3_5RMSNormGated);
- full attention: q_proj twice as wide, its second half a per-head output gate
  (sigmoid) on the attention output; q and k RMS-normed per head; RoPE on the first
  partial_rotary_factor of each head (default 0.25);
- every RMSNorm but the gated one multiplies by (1 + weight), in float32;
- MoE: softmax routing over every expert, top-k renormalised (Qwen3-MoE's with
  norm_topk_prob), plus a shared expert scaled by sigmoid(shared_expert_gate).

The per-sequence state (core.recurrent_state) is a graph input mutated in place, as the
KV cache is (`decoder.StateStep`): a call reads each row's state from its read slot
(zeros for a new sequence) and writes it to its write slot. A bucket's padding tokens
leave it as it was: their beta and g are zero, so in the chunked form they add nothing
to the state and decay nothing, and the conv state is the last kernel - 1 real inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.nn import functional

from neuron_plugin.backends.gated_delta import CHUNK, gated_norm, prepared, recurrent_rule
from neuron_plugin.backends.reference.architecture import Architecture, UnsupportedModelError
from neuron_plugin.backends.reference.architectures import DecoderSpec
from neuron_plugin.backends.reference.decoder import DecoderGraph, Step, attend
from neuron_plugin.backends.reference.layers import rms_norm, rotate_half
from neuron_plugin.backends.reference.mlp import Adapt, activation, mlp, mlp_weights
from neuron_plugin.core.recurrent_state import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    layer_types,
    state_geometry,
)

NORM = "rms_one_plus"  # Qwen3_5RMSNorm: normed * (1 + weight) in float32


def qwen3_5_fields(arch: Architecture, config: dict, layers: int) -> dict[str, Any]:
    """The DecoderSpec fields Qwen3_5TextConfig derives: layer types (full attention
    every full_attention_interval-th layer without layer_types), the state layers'
    geometry, a KV cache row per full-attention layer, MoE routing renormalised."""
    state = state_geometry(config)
    if state is None:
        raise UnsupportedModelError(
            f"{arch.family}: config.json has no linear_attention layers (layer_types) or "
            f"linear_* keys; it is not a Qwen3.5 checkpoint"
        )
    types = layer_types(config)
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise UnsupportedModelError(f"Qwen3.5 layer_types {unknown} are not known")
    rows = {layer: row for row, layer in enumerate(state.attention_layers)}
    fields: dict[str, Any] = {
        "layer_types": tuple(types),
        "windows": (None,) * layers,
        # a KV cache row per full-attention layer; the state layers read none
        "kv_rows": tuple(rows.get(i, 0) for i in range(layers)),
        "state": state,
    }
    if arch.mlp != "dense":
        fields["norm_topk_prob"] = True  # Qwen3_5MoeTopKRouter always renormalises
    return fields


def weight_sources(spec: DecoderSpec, own_head: bool) -> list[tuple[str, tuple[str, ...]]]:
    """The graph's weight inputs: per layer its token mixer's (linear or full attention)
    and its MLP's (the MoE block's shared expert where there are experts)."""
    assert spec.state is not None  # qwen3_5_fields
    names = ["model.embed_tokens.weight"]
    sources: list[tuple[str, tuple[str, ...]]] = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if i in spec.state.layers:
            a = p + "linear_attn."
            names += [a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
            names += [a + n for n in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")]
            names.append(a + "out_proj.weight")
        else:
            a = p + "self_attn."
            names += [a + f"{x}_proj.weight" for x in "qkvo"]
            names += [a + f"{x}_proj.bias" for x in spec.biased_projections]
            names += [a + "q_norm.weight", a + "k_norm.weight"]
        sources += [(n, (n,)) for n in names] + mlp_weights(spec, i)
        names = []
        if spec.moe_layers[i]:
            shared = p + "mlp.shared_expert."
            names += [shared + f"{x}_proj.weight" for x in ("gate", "up", "down")]
            names.append(p + "mlp.shared_expert_gate.weight")
    names.append("model.norm.weight")
    if own_head or not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return sources + [(n, (n,)) for n in names]


class Qwen35Graph(DecoderGraph):
    """Qwen3.5's decoder: the generic graph's embedding, RoPE table and masks, its own
    layers (see the module docstring)."""

    def layer(
        self,
        w: dict[str, torch.Tensor],
        layer: int,
        x: torch.Tensor,
        step: Step,
        adapt: Adapt | None,
    ) -> torch.Tensor:
        s = self.spec
        assert s.state is not None  # qwen3_5_fields
        p = f"model.layers.{layer}."
        h = rms_norm(NORM, x, w[p + "input_layernorm.weight"], s.rms_norm_eps)
        if layer in s.state.layers:
            x = x + self._linear_attention(w, layer, h, step)
        else:
            x = x + self._attention(w, layer, h, step)
        h = rms_norm(NORM, x, w[p + "post_attention_layernorm.weight"], s.rms_norm_eps)
        out = mlp(s, w, layer, h)
        if s.moe_layers[layer]:  # the shared expert beside the routed ones
            shared = p + "mlp.shared_expert."
            gate, up, down = (w[shared + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
            expert = (activation(s.activation, h @ gate.t()) * (h @ up.t())) @ down.t()
            out = out + torch.sigmoid(h @ w[p + "mlp.shared_expert_gate.weight"].t()) * expert
        return x + out

    def _attention(
        self, w: dict[str, torch.Tensor], layer: int, h: torch.Tensor, step: Step
    ) -> torch.Tensor:
        """Qwen3_5Attention: gated, q/k-normed, RoPE on the first part of each head."""
        s = self.spec
        a = f"model.layers.{layer}.self_attn."
        batch, active = h.shape[:2]
        heads, kv_heads, head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        query, gate = torch.chunk(
            self.linear(w, a + "q_proj", h).view(batch, active, heads, 2 * head_dim), 2, dim=-1
        )
        gate = gate.reshape(batch, active, heads * head_dim)
        q = rms_norm(NORM, query, w[a + "q_norm.weight"], s.rms_norm_eps)
        k = self.linear(w, a + "k_proj", h).view(batch, active, kv_heads, head_dim)
        k = rms_norm(NORM, k, w[a + "k_norm.weight"], s.rms_norm_eps)
        v = self.linear(w, a + "v_proj", h).view(batch, active, kv_heads, head_dim)
        cos, sin = step.rope[s.rope_kind(layer)]
        q, k = (_partial_rotate(t, cos, sin) for t in (q, k))
        row = s.kv_row(layer)
        step.write(row, k, v)
        visible = step.mask(s, layer)
        keys, values = step.read(row, kv_heads, head_dim, visible)
        out = attend(s, q, keys, values, visible, None)
        return self.linear(w, a + "o_proj", out * torch.sigmoid(gate))

    def _linear_attention(
        self, w: dict[str, torch.Tensor], layer: int, h: torch.Tensor, step: Step
    ) -> torch.Tensor:
        """Qwen3_5GatedDeltaNet over this call's tokens from each row's state, which it
        leaves at the row's last real token."""
        s = self.spec
        geometry, state = s.state, step.state
        assert geometry is not None and state is not None  # a hybrid model's graph
        a = f"model.layers.{layer}.linear_attn."
        batch, active = h.shape[:2]
        index = geometry.layers.index(layer)
        conv_state, recurrent = state.load(index)
        mixed = self.linear(w, a + "in_proj_qkv", h).transpose(1, 2)  # [b, channels, a]
        z = self.linear(w, a + "in_proj_z", h).view(batch, active, -1, geometry.value_dim)
        b = self.linear(w, a + "in_proj_b", h)
        decay_in = self.linear(w, a + "in_proj_a", h)
        # the causal convolution over the state's last inputs and this call's
        inputs = torch.cat((conv_state.to(mixed.dtype), mixed), dim=-1)
        weight = w[a + "conv1d.weight"]
        conv = functional.conv1d(inputs.to(weight.dtype), weight, groups=inputs.shape[1])
        conv = activation(s.activation, conv).to(h.dtype).transpose(1, 2)  # [b, a, channels]
        kept = geometry.conv_kernel - 1
        last = state.tokens.view(-1, 1, 1) + torch.arange(kept).view(1, 1, -1)
        new_conv = inputs.gather(2, last.expand(batch, inputs.shape[1], kept))
        key_width = geometry.key_heads * geometry.key_dim
        q, k, v = torch.split(conv, [key_width, key_width, conv.shape[-1] - 2 * key_width], -1)
        q = q.reshape(batch, active, -1, geometry.key_dim)
        k = k.reshape(batch, active, -1, geometry.key_dim)
        v = v.reshape(batch, active, -1, geometry.value_dim)
        beta = b.sigmoid()
        g = -w[a + "A_log"].float().exp() * functional.softplus(decay_in.float() + w[a + "dt_bias"])
        # padding tokens neither write (beta 0) nor decay (g 0) the state
        real = (torch.arange(active).view(1, -1) < state.tokens.view(-1, 1)).unsqueeze(-1)
        beta, g = torch.where(real, beta, 0), torch.where(real, g, 0)
        repeat = geometry.value_heads // geometry.key_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        if active == 1:
            out, recurrent = recurrent_rule(q, k, v, g, beta, recurrent)
        else:
            out, recurrent = _chunked_rule(q, k, v, g, beta, recurrent)
        state.store(index, new_conv, recurrent)
        normed = gated_norm(out, z, w[a + "norm.weight"], s.rms_norm_eps)
        return self.linear(w, a + "out_proj", normed.reshape(batch, active, -1))


def _partial_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb over the first cos.shape[-1] of each head."""
    width = cos.shape[-1]
    rotated, kept = x[..., :width], x[..., width:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, kept), dim=-1)


def _chunked_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_chunk_gated_delta_rule over this call's tokens from `state`, in chunks of
    64 from the call's first token: (output [b, tokens, heads, value dim] in v's dtype,
    the state after the last token whose beta and g are not zero)."""
    dtype = v.dtype
    batch, tokens = q.shape[:2]
    q, k, v, g, beta = prepared(q, k, v, g, beta)
    pad = (CHUNK - tokens % CHUNK) % CHUNK
    q, k, v = (functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (functional.pad(x, (0, pad)) for x in (beta, g))
    heads, value_dim = v.shape[1], v.shape[-1]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(batch, heads, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(batch, heads, -1, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, decayed_k_beta, upper=False, unitriangular=True
    )
    state = state.to(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, heads, -1, value_dim)[:, :, :tokens]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


_DENSE = Architecture(
    "qwen3_5",
    norm=NORM,
    qk_norm=True,
    partial_rotary=0.25,
    spec_fields=qwen3_5_fields,
    graph=Qwen35Graph,
    weight_sources=weight_sources,
    refuses=("lora", "quantization", "eagle"),
)
_MOE = dataclasses.replace(_DENSE, mlp="qwen3_moe")
# The multimodal checkpoints (the Hub's Qwen3.5 and 3.6 ship as these) served text-only
# (--language-model-only): text_config nested, tensors under model.language_model.
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": _DENSE,
    "Qwen3_5MoeForCausalLM": _MOE,
    "Qwen3_5ForConditionalGeneration": _DENSE,
    "Qwen3_5MoeForConditionalGeneration": _MOE,
}
