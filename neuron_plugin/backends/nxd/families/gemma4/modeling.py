"""Gemma 4's text model as a class of the plugin's own on NxD Inference's base classes:
`NeuronGemma4ForCausalLM` (NeuronBaseForCausalLM), its `NeuronGemma4TextModel`
(NeuronBaseModel: NxDI's forward, masks, sampler, KV cache managers and bucket handling),
`NeuronGemma4Attention` (NeuronAttentionBase: NxDI's GQA projections, sharded and padded
for tensor parallelism per layer type) and NxD's parallel layers. Written from
transformers 5.19's `modeling_gemma4.py` (Gemma4TextModel, Gemma4TextDecoderLayer,
Gemma4TextAttention, Gemma4TextRouter, Gemma4TextExperts); the same on NxDI 0.8 (cd3abf3,
NxD 0.17) and 0.9 (ef2731e, NxD 0.18): it overrides `get_model_output` and the
attention's forward, so nothing of the releases' differing attention paths
(0.8 divides scores by sqrt(head_dim), 0.9 by its `softmax_scale`; their windowed
attention keeps window - 1 keys of a full-length cache; their prefix prefill leaves the
cached part unmasked without a kernel) is on its path. The config is read from
config.json (`core.gemma4`), since the SDK's transformers 4.57 has no Gemma 4:
`NeuronGemma4ForCausalLM.config_loader` is the `load_config` the backend hands NxDI.

Design (what differs from NxDI's Llama, and why):
- Heterogeneous KV geometry. Sliding and full layers have their own (KV heads, head
  dim); NxDI's KV cache managers give every layer one (heads, head dim). Each writing
  layer's keys and values are packed into one cache row geometry: rows of
  g = gcd(head dims) values, as many rows as the widest layer type needs per rank
  (`core.gemma4.cache_geometry`). A layer whose (heads per rank x head dim) fill fewer rows
  leaves the rest zero and never reads them. Packing is a reshape of (heads, head dim)
  into (heads x head dim / g, g); in the block layout (tokens, heads, dim) it is a view,
  in the contiguous (heads, tokens, dim) one a transpose. HBM per token and layer with
  the cache for L_s sliding and L_f full writing layers, h_t x d_t per rank:
  (L_s + L_f) x max(h_s d_s, h_f d_f) against L_s h_s d_s + L_f h_f d_f exactly
  (31B at TP 1: 16 x 256 sliding, 4 x 512 full, 50 + 10 layers: 1.09x; padding every
  layer to (16 heads, 512) would be 2.18x; E2B/E4B 1.67x/1.71x either way, their
  sliding rows being the narrower). NxDI's managers (`KVCacheManager`,
  `BlockKVCacheManager`) are used as they are, with that geometry and one cache layer
  per writing layer, so the block layout, prefix caching, the plugin's KV-block reads
  and the CPU mode's cache copies see NxDI's own tensors.
- KV-shared layers (the last num_kv_shared_layers) have no k/v projections and no
  cache: they attend the keys and values of the last earlier layer of their type, its
  cached prefix and the keys this call computed, with their own queries and masks.
- Attention: q, k RMS-normed per head (Gemma4RMSNorm multiplies by the weight, no
  1 + w), v normed without a weight; with attention_k_eq_v a full layer's values are its
  keys' projection before norm and RoPE (no v_proj); scaling 1.0 (scores are not
  divided); sliding layers see keys with q - k < window in every phase (prefill, decode,
  prefill over a cached prefix), full-length caches masked per layer type; prior
  (cached) and active scores share one float32 softmax, and the weights meet the
  values in one matmul over [cached; active] (NxDI's manual_softmax path adds two
  matmuls' results, a second rounding: with one, a bfloat16 decode gives transformers'
  logits bit for bit, measured on the tiny checkpoint; it costs a copy of the layer's
  cached values per call).
- RoPE per layer type: sliding `default`, full `proportional` (frequencies over the
  whole head dim, zero past partial_rotary_factor: pairs (j, j + d/2) rotate for
  j < int(prf x d / 2), the rest pass through), computed in float32 from constants made
  on the host, cast to the dtype before the multiply (not NxDI's partial rotary, which
  rotates the first dims with frequencies over the rotary dim).
- Per-layer embeddings: a second table [vocab_per_layer, layers x width] (sharded
  across its embedding dim), the token's row scaled by sqrt(width) rounded to the dtype,
  plus the RMS-normed projection of the scaled embedding over sqrt(hidden), both over
  sqrt(2); layer i takes its slice, gated into its output.
- The MoE block beside the dense MLP (enable_moe_block): a router (RMS norm without a
  weight, x scale x hidden^-0.5, a projection, softmax over every expert in float32,
  top-k renormalised, x per_expert_scale), experts gate_up_proj [E, 2I, H] and down_proj
  [E, H, I] as NxD's expert-fused column/row parallel layers (I sharded over the ranks),
  every expert on every token weighted by its routing (zero off the top-k): static
  shapes, exact; its cost is E / top_k times the routed experts' matmuls.
- layer_scalar scales the residual stream after each layer; the embedding is scaled by
  sqrt(hidden) rounded to the dtype; the final logits are soft-capped (tanh(x / c) x c,
  elementwise: right on vocabulary shards) inside the lm_head, before NxDI masks its
  vocabulary padding and samples.
The configurations this class does not compute (its NeuronConfig keys for kernels,
sequence/context/data parallelism, flash decoding, transposed or tiled KV caches,
speculation, LoRA, quantization) are refused before anything compiles
(`families.gemma4.problems`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from neuronx_distributed.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
)
from neuronx_distributed_inference.models.config import (
    InferenceConfig,
    NeuronConfig,
)
from neuronx_distributed_inference.models.model_base import (
    NeuronBaseForCausalLM,
    NeuronBaseModel,
)
from neuronx_distributed_inference.modules.attention.attention_base import NeuronAttentionBase
from neuronx_distributed_inference.modules.generation.sampling import create_sampler
from neuronx_distributed_inference.modules.kvcache.block_kv_cache_manager import (
    BlockKVCacheManager,
)
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager
from neuronx_distributed_inference.utils.distributed import get_tp_group
from torch import nn
from torch.nn import functional

from neuron_plugin.backends.nxd.families.gemma4 import UNSUPPORTED_DEGREES, UNSUPPORTED_KEYS
from neuron_plugin.backends.nxd.own_classes import refusals
from neuron_plugin.backends.nxd.own_classes.attention import (
    attend,
    causal_masks,
    rope_tables,
    rotate,
)
from neuron_plugin.backends.nxd.own_classes.config_loader import (
    json_config_loader,
    language_model_tensors,
)
from neuron_plugin.backends.nxd.own_classes.parallel_mlp import (
    EveryExpert,
    GatedMLP,
    dense_routing,
)
from neuron_plugin.core.gemma4 import (
    FULL,
    SLIDING,
    Gemma4Layout,
    Rope,
    cache_geometry,
    read_layout,
)


def layout_of(config: Any) -> Gemma4Layout:
    """The layout of an InferenceConfig this module's loader filled (`gemma4_text`: the
    text model's config.json keys)."""
    return read_layout(config.gemma4_text)


def inverse_frequencies(rope: Rope, head_dim: int) -> list[float]:
    """[head_dim // 2] RoPE frequencies as transformers computes them in float32
    (modeling_rope_utils.py `_compute_proportional_rope_parameters`,
    Gemma4TextRotaryEmbedding.compute_default_rope_parameters): `default` rotates every
    pair at theta^(-2j/d); `proportional` the first int(partial_rotary_factor * d // 2)
    at the same frequencies (the exponent over the whole head dim), the rest at zero;
    proportional ones / factor."""
    half = head_dim // 2
    angles = half if rope.kind == "default" else int(rope.partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(torch.float) / head_dim
    freq = 1.0 / (rope.theta**exponents)
    if angles < half:
        freq = torch.cat((freq, torch.zeros(half - angles, dtype=torch.float32)))
    if rope.kind != "default":
        freq = freq / rope.factor
    return [float(f) for f in freq]


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ACT2FN for the activations `layout.ACTIVATIONS` names."""
    if name == "gelu_pytorch_tanh":
        return lambda x: functional.gelu(x, approximate="tanh")
    if name == "gelu":
        return functional.gelu
    return functional.silu


class Gemma4RMSNorm(nn.Module):
    """transformers' Gemma4RMSNorm: x * (mean(x^2) + eps)^-0.5 in float32, times the
    weight (no 1 + w) where it has one, in the input's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        normed = hidden * torch.pow(hidden.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class SoftcappedHead(ColumnParallelLinear):
    """NxD's column-parallel lm_head whose logits are soft-capped, tanh(x / c) * c, as
    Gemma4ForCausalLM does after its lm_head (elementwise, so right on each shard)."""

    def __init__(self, softcap: float | None, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.softcap = softcap

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        logits = super().forward(*args, **kwargs)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class NeuronGemma4Attention(NeuronAttentionBase):
    """One layer's attention: NxDI's GQA projections for this layer's (KV heads, head
    dim), Gemma 4's q/k/v norms, RoPE and keys-as-values, and an attention of its own over
    the call's active keys and the cached (prior) ones (see the module docstring)."""

    def __init__(self, config: InferenceConfig, layout: Gemma4Layout, layer: int):
        kind = layout.layer_types[layer]
        head_dim = layout.head_dims[layer]
        super().__init__(
            config,
            hidden_size=layout.hidden_size,
            num_attention_heads=layout.num_heads,
            num_key_value_heads=layout.kv_heads[layer],
            head_dim=head_dim,
            rms_norm_eps=layout.rms_norm_eps,
            qkv_bias=layout.attention_bias,
            o_bias=layout.attention_bias,
        )
        dtype = config.neuron_config.torch_dtype
        self.layer = layer
        self.kind = kind
        self.owns_kv = layout.owns_kv(layer)
        self.keys_as_values = layout.values_from_keys[layer]
        self.frequencies = inverse_frequencies(layout.rope[kind], head_dim)
        qkv = self.get_qkv_proj()
        if not self.owns_kv:  # a KV-shared layer has no k/v projections
            qkv.k_proj = None
            qkv.v_proj = None
        elif self.keys_as_values:
            qkv.v_proj = None
        self.q_norm = Gemma4RMSNorm(head_dim, layout.rms_norm_eps, dtype)
        if self.owns_kv:
            self.k_norm = Gemma4RMSNorm(head_dim, layout.rms_norm_eps, dtype)
            self.v_norm = Gemma4RMSNorm(head_dim, layout.rms_norm_eps, dtype, with_scale=False)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        masks: tuple[torch.Tensor | None, torch.Tensor],
        prior: tuple[torch.Tensor, torch.Tensor] | None,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(output [batch, tokens, hidden], this layer's active (K, V) [batch, heads, tokens,
        dim] or None for a KV-shared layer). `masks`: (prior [batch|1, 1, tokens, prior
        length] or None, active [batch|1, 1, tokens, tokens]); `prior`: the cached (K, V)
        of the layer whose keys this one attends; `shared`: that layer's active (K, V)."""
        batch, tokens, _ = hidden.shape
        qkv = self.get_qkv_proj()
        cos, sin = rope_tables(self.frequencies, position_ids, hidden.dtype)
        q = qkv.q_proj(hidden).view(batch, tokens, self.num_heads, self.head_dim)
        q = rotate(self.q_norm(q), cos, sin).transpose(1, 2)
        own = None
        if self.owns_kv:
            shape = (batch, tokens, self.num_key_value_heads, self.head_dim)
            raw_k = qkv.k_proj(hidden).view(shape)
            raw_v = raw_k if self.keys_as_values else qkv.v_proj(hidden).view(shape)
            k = rotate(self.k_norm(raw_k), cos, sin).transpose(1, 2)
            v = self.v_norm(raw_v).transpose(1, 2)
            own = (k, v)
        else:
            assert shared is not None, "a KV-shared layer runs after its source layer"
            k, v = shared
        out = attend(q, k, v, masks, prior, self.num_key_value_groups)
        out = out.transpose(1, 2).reshape(batch, tokens, self.num_heads * self.head_dim)
        return self.get_o_proj()(out), own


class Gemma4Router(nn.Module):
    """Gemma4TextRouter: the routing weights [tokens, experts] (zero off the top-k)."""

    def __init__(self, layout: Gemma4Layout, dtype: torch.dtype):
        super().__init__()
        hidden, experts = layout.hidden_size, layout.num_experts
        self.eps = layout.rms_norm_eps
        self.top_k = layout.experts_per_token
        self.root = hidden**-0.5
        self.proj = nn.Linear(hidden, experts, bias=False, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.per_expert_scale = nn.Parameter(torch.ones(experts, dtype=dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = tokens.float()
        normed = (
            hidden * torch.pow(hidden.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        ).type_as(tokens)
        scores = self.proj(normed * self.scale * self.root)
        probs = functional.softmax(scores, dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True) * self.per_expert_scale[chosen].float()
        return dense_routing(chosen, top, probs.shape[-1])


class NeuronGemma4DecoderLayer(nn.Module):
    """Gemma4TextDecoderLayer (see the module docstring)."""

    def __init__(self, config: InferenceConfig, layout: Gemma4Layout, layer: int):
        super().__init__()
        dtype = config.neuron_config.torch_dtype
        hidden, eps = layout.hidden_size, layout.rms_norm_eps

        def norm(dim: int = hidden) -> Gemma4RMSNorm:
            return Gemma4RMSNorm(dim, eps, dtype)

        self.self_attn = NeuronGemma4Attention(config, layout, layer)
        self.mlp = GatedMLP(config, hidden, layout.mlp_widths[layer], activation(layout.activation))
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.moe = layout.num_experts > 0
        if self.moe:
            self.router = Gemma4Router(layout, dtype)
            self.experts = EveryExpert(
                config,
                layout.num_experts,
                hidden,
                layout.moe_intermediate_size,
                activation(layout.activation),
            )
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()
        self.per_layer = layout.per_layer_input
        if self.per_layer:
            self.per_layer_input_gate = nn.Linear(hidden, self.per_layer, bias=False, dtype=dtype)
            self.per_layer_projection = nn.Linear(self.per_layer, hidden, bias=False, dtype=dtype)
            self.post_per_layer_input_norm = norm()
        self.act = activation(layout.activation)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        masks: tuple[torch.Tensor | None, torch.Tensor],
        prior: tuple[torch.Tensor, torch.Tensor] | None,
        shared: tuple[torch.Tensor, torch.Tensor] | None,
        per_layer: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        attn, kv = self.self_attn(self.input_layernorm(x), position_ids, masks, prior, shared)
        x = x + self.post_attention_layernorm(attn)
        residual = x
        out = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            flat = residual.reshape(-1, residual.shape[-1])
            routing = self.router(flat)
            experts = self.experts(self.pre_feedforward_layernorm_2(flat), routing)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(
                experts.reshape(residual.shape)
            )
        x = residual + self.post_feedforward_layernorm(out)
        if per_layer is not None:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar, kv


def _cache_manager(base: type) -> type:
    """NxDI's KV cache manager `base` with the packed row geometry (heads, head dim) and
    one cache layer per writing layer (see the module docstring)."""

    class Gemma4KVCache(base):
        def __init__(self, config: InferenceConfig, heads: int, head_dim: int, **kwargs: Any):
            self.gemma4_rows = (heads, head_dim)  # read by _init_kv_shape, before Module init
            super().__init__(config, num_kv_head=heads, **kwargs)

        def _get_num_kv_heads_per_rank(self, config: InferenceConfig) -> int:
            return self.gemma4_rows[0]

        def _get_hidden_dim_per_head(self, config: InferenceConfig) -> int:
            return self.gemma4_rows[1]

    Gemma4KVCache.__name__ = Gemma4KVCache.__qualname__ = f"Gemma4{base.__name__}"
    return Gemma4KVCache


Gemma4KVCacheManager = _cache_manager(KVCacheManager)
Gemma4BlockKVCacheManager = _cache_manager(BlockKVCacheManager)


class NeuronGemma4TextModel(NeuronBaseModel):
    """Gemma4TextModel on NxDI's NeuronBaseModel (see the module docstring)."""

    def setup_attr_for_model(self, config: InferenceConfig) -> None:
        self.layout = layout_of(config)
        self.on_device_sampling = config.neuron_config.on_device_sampling_config is not None
        self.tp_degree = config.neuron_config.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size = config.neuron_config.max_batch_size
        self.buckets = config.neuron_config.buckets

    def init_model(self, config: InferenceConfig) -> None:
        layout = self.layout
        dtype, group = config.neuron_config.torch_dtype, get_tp_group(config)
        hidden = layout.hidden_size
        self.padding_idx = layout.pad_token_id
        # transformers scales by a tensor of sqrt(width) cast to the weights' dtype
        self.embed_scale = float(torch.tensor(hidden**0.5).to(dtype))
        self.embed_tokens = ParallelEmbedding(
            layout.vocab_size,
            hidden,
            layout.pad_token_id,
            dtype=dtype,
            shard_across_embedding=True,
            pad=True,
            tensor_model_parallel_group=group,
        )
        if layout.per_layer_input:
            width = layout.num_layers * layout.per_layer_input
            self.per_layer_scale = float(torch.tensor(layout.per_layer_input**0.5).to(dtype))
            self.embed_tokens_per_layer = ParallelEmbedding(
                layout.per_layer_vocab,
                width,
                layout.pad_token_id,
                dtype=dtype,
                shard_across_embedding=True,
                pad=True,
                tensor_model_parallel_group=group,
            )
            self.per_layer_model_projection = ColumnParallelLinear(
                hidden,
                width,
                bias=False,
                gather_output=True,
                dtype=dtype,
                pad=True,
                tensor_model_parallel_group=group,
            )
            self.per_layer_projection_norm = Gemma4RMSNorm(
                layout.per_layer_input, layout.rms_norm_eps, dtype
            )
        self.layers = nn.ModuleList(
            [NeuronGemma4DecoderLayer(config, layout, i) for i in range(layout.num_layers)]
        )
        self.norm = Gemma4RMSNorm(hidden, layout.rms_norm_eps, dtype)
        self.lm_head = SoftcappedHead(
            layout.final_logit_softcapping,
            hidden,
            layout.vocab_size,
            bias=False,
            gather_output=not self.on_device_sampling,
            dtype=dtype,
            pad=True,
            tensor_model_parallel_group=group,
        )

    def attention(self, layer: int) -> NeuronGemma4Attention:
        found = self.layers[layer]
        assert isinstance(found, NeuronGemma4DecoderLayer)
        return found.self_attn

    def geometry(self, layer: int) -> tuple[int, int]:
        """(KV heads on this rank, head dim) of `layer`, as NxDI's GQA sharding gives them
        (gqa.py get_shardable_head_counts)."""
        attention = self.attention(layer)
        return attention.num_key_value_heads, attention.head_dim

    def init_inference_optimization(self, config: InferenceConfig) -> None:
        """NxDI's sampler and KV cache manager (NeuronBaseModel's), the manager holding the
        writing layers' keys and values in packed rows."""
        if self.on_device_sampling:
            self.sampler = create_sampler(
                config.neuron_config, self.lm_head.tensor_parallel_group.size()
            )
        writing = [i for i in range(self.layout.num_layers) if self.layout.owns_kv(i)]
        # (heads, head dim) of the packed KV cache rows on this rank
        self.rows = cache_geometry([self.geometry(i) for i in writing])
        heads, head_dim = self.rows
        cache_config = copy.copy(config)
        cache_config.num_hidden_layers = self.layout.cache_layers
        if config.neuron_config.is_block_kv_layout:
            self.kv_mgr = Gemma4BlockKVCacheManager(cache_config, heads, head_dim)
        else:
            self.kv_mgr = Gemma4KVCacheManager(
                cache_config, heads, head_dim, global_rank=self.rank_util
            )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, heads, tokens, dim] of one layer -> the cache's [batch, rows, tokens,
        row dim] (its first heads x dim / row dim rows, the rest zero)."""
        rows, width = self.rows
        batch, heads, tokens, dim = x.shape
        if dim != width:
            x = x.transpose(1, 2).reshape(batch, tokens, heads * dim // width, width)
            x = x.transpose(1, 2)
        used = x.shape[1]
        return x if used == rows else functional.pad(x, (0, 0, 0, 0, 0, rows - used))

    def unpack(self, x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """The cache's [batch, rows, tokens, row dim] -> one layer's [batch, heads, tokens,
        dim]."""
        width = x.shape[-1]
        used = heads * dim // width
        x = x[:, :used]
        if dim == width:
            return x
        batch, _, tokens, _ = x.shape
        return x.transpose(1, 2).reshape(batch, tokens, heads, dim).transpose(1, 2)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[batch, tokens, layers, width] (Gemma4TextModel.get_per_layer_inputs and
        project_per_layer_inputs): ids past the per-layer table read row 0, as vLLM does."""
        layout = self.layout
        shape = (*input_ids.shape, layout.num_layers, layout.per_layer_input)
        ids = torch.where(
            input_ids < layout.per_layer_vocab, input_ids, torch.zeros_like(input_ids)
        )
        tokens = (self.embed_tokens_per_layer(ids) * self.per_layer_scale).view(shape)
        projected = self.per_layer_model_projection(x) * layout.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + tokens) * 2.0**-0.5

    def masks(
        self,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        tokens: int,
        prior: bool,
    ) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
        """Per layer type (prior mask or None, active mask), bool: `causal_masks`, and
        sliding layers also hide keys `window` or more positions before the query
        (transformers' sliding_window_overlay)."""
        window = self.layout.sliding_window
        visible, causal = causal_masks(attention_mask, position_ids, tokens, prior)
        index = torch.arange(tokens, device=position_ids.device)
        local = causal & (index[:, None] - index[None, :] < window)[None, None]
        if visible is None:
            return {FULL: (None, causal), SLIDING: (None, local)}
        cached = torch.arange(visible.shape[-1], device=position_ids.device)
        distance = position_ids[:, None, :, None] - cached[None, None, None, :]
        return {FULL: (visible, causal), SLIDING: (visible & (distance < window), local)}

    def get_model_output(
        self,
        input_ids: torch.Tensor,
        seq_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        active_mask: Any = None,
        inputs_embeds: Any = None,
        prev_hidden: Any = None,
        adapter_ids: Any = None,
        rotary_position_ids: Any = None,
        update_cache: bool = False,
        is_for_context_encoding: bool = False,
        vision_embeddings: Any = None,
        vision_mask: Any = None,
        deepstack_vision_embeds: Any = None,
        local_attn_mask: Any = None,
        windowed_context_encoding_window_idx: int = -1,
        padding_mask: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, list[Any]]:
        """NeuronBaseModel.get_model_output's contract (hidden states after the final norm,
        the updated KV cache) for Gemma 4's decoder."""
        layout = self.layout
        tokens = input_ids.shape[1]
        assert position_ids is not None and attention_mask is not None
        position_ids = position_ids.view(-1, tokens).long()
        x = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self.per_layer_inputs(input_ids, x) if layout.per_layer_input else None
        table = kwargs.get("active_block_table")
        has_prefix = (
            self.is_prefix_caching
            and is_for_context_encoding
            and table is not None
            and table.dim() > 1
        )
        past = None
        if has_prefix or not is_for_context_encoding:
            past = self.kv_mgr.get_cache(
                seq_ids=seq_ids,
                seq_len=self.n_positions,
                is_for_context_encoding=is_for_context_encoding,
                windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                **kwargs,
            )
        masks = self.masks(attention_mask, position_ids, tokens, past is not None)
        priors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        active: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        cache: list[Any] = []
        for i, layer in enumerate(self.layers):
            source = layout.kv_sources[i]
            if past is not None and source not in priors:
                k, v = past[source]  # writing layers come first: cache row = layer
                heads, dim = self.geometry(source)
                priors[source] = (self.unpack(k, heads, dim), self.unpack(v, heads, dim))
            x, kv = layer(
                x,
                position_ids,
                masks[layout.layer_types[i]],
                priors.get(source),
                active.get(source),
                None if per_layer is None else per_layer[:, :, i],
            )
            if kv is not None:
                active[i] = kv
                cache.append([self.pack(kv[0]), self.pack(kv[1])])
        if update_cache:
            cache = self.kv_mgr.update_cache(
                is_for_context_encoding=is_for_context_encoding,
                seq_ids=seq_ids,
                position_ids=position_ids,
                new_key_values=cache,
                seq_len=self.n_positions,
                windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                **kwargs,
            )
        return self.norm(x), cache


class Gemma4InferenceConfig(InferenceConfig):
    """Gemma 4's InferenceConfig: config.json's text model keys (`config_loader`), with
    `gemma4_text` holding them for `layout_of`."""

    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1
        layout = layout_of(self)
        self.num_hidden_layers = layout.num_layers
        self.tie_word_embeddings = layout.tie_word_embeddings

    def get_required_attributes(self) -> list[str]:
        return [
            "gemma4_text",
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "vocab_size",
        ]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


def config_loader(model_path: str | os.PathLike[str]) -> Callable[[InferenceConfig], None]:
    """`json_config_loader` keeping the text keys as `gemma4_text`, refusing by name
    what `read_layout` cannot serve."""
    return json_config_loader(model_path, read_layout, "gemma4_text")


class NeuronGemma4ForCausalLM(NeuronBaseForCausalLM):
    """Gemma 4's text model on NxDI (see the module docstring): Gemma4ForCausalLM's
    checkpoint (`model.*`) or Gemma4ForConditionalGeneration's language model
    (`model.language_model.*`, its towers left out)."""

    _model_cls = NeuronGemma4TextModel

    @staticmethod
    def config_loader(model_path: str | os.PathLike[str]) -> Callable[[InferenceConfig], None]:
        return config_loader(model_path)

    @staticmethod
    def load_hf_model(model_path: str, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "Gemma 4 has no transformers class in the Neuron SDK's transformers 4.57: "
            "NeuronGemma4ForCausalLM reads the checkpoint's safetensors from its folder"
        )

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Gemma4InferenceConfig

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> None:
        """NxDI's checks, and the NeuronConfig paths the class does not take (the plugin
        refuses them before building it: families.gemma4.problems; this guards a direct
        use of the class)."""
        super().validate_config(config)
        taken = refusals.taken(config.neuron_config, UNSUPPORTED_KEYS, UNSUPPORTED_DEGREES)
        if taken:
            raise ValueError(
                f"NeuronGemma4ForCausalLM does not implement NeuronConfig {taken} "
                f"(neuron_plugin/backends/nxd/families/gemma4/modeling.py); unset them."
            )

    @staticmethod
    def convert_hf_to_neuron_state_dict(
        state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (NxDI took "model." off) as this model names them."""
        state_dict = language_model_tensors(state_dict)
        layout = layout_of(config)
        tp = config.neuron_config.tp_degree
        for i in range(layout.num_layers):
            prefix = f"layers.{i}."
            attn = prefix + "self_attn."
            # NxDI's GQA preshard hook (gqa.py GroupQueryAttention_QKV.preshard_hook) reads
            # q, k and v: stand-ins where this layer has no k (KV-shared) or v (keys as
            # values); NxD drops what the model has no parameter for
            k_shape = (layout.kv_heads[i] * layout.head_dims[i], layout.hidden_size)
            reference = state_dict[attn + "q_proj.weight"]
            for name in ("k_proj", "v_proj"):
                if attn + f"{name}.weight" not in state_dict:
                    state_dict[attn + f"{name}.weight"] = reference.new_zeros(k_shape)
            state_dict[attn + "rank_util.rank"] = torch.arange(0, tp, dtype=torch.int32)
            if layout.num_experts:
                inner = layout.moe_intermediate_size
                gate_up = state_dict.pop(prefix + "experts.gate_up_proj")  # [E, 2I, H]
                down = state_dict.pop(prefix + "experts.down_proj")  # [E, H, I]
                state_dict[prefix + "experts.gate_proj.weight"] = (
                    gate_up[:, :inner].transpose(1, 2).contiguous()
                )
                state_dict[prefix + "experts.up_proj.weight"] = (
                    gate_up[:, inner:].transpose(1, 2).contiguous()
                )
                state_dict[prefix + "experts.down_proj.weight"] = down.transpose(1, 2).contiguous()
        if layout.tie_word_embeddings or "lm_head.weight" not in state_dict:
            state_dict["lm_head.weight"] = state_dict["embed_tokens.weight"].clone()
        state_dict["rank_util.rank"] = torch.arange(0, tp, dtype=torch.int32)
        return state_dict

    @staticmethod
    def update_state_dict_for_tied_weights(state_dict: dict[str, torch.Tensor]) -> None:
        state_dict["lm_head.weight"] = state_dict["embed_tokens.weight"].clone()
