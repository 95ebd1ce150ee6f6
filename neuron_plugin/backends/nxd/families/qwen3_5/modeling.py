"""Qwen3.5's text model, dense and MoE, as a class of the plugin's own on NxD Inference's
base classes: `NeuronQwen35ForCausalLM` (NeuronBaseForCausalLM), its `NeuronQwen35TextModel`
(NeuronBaseModel: NxDI's forward, sampler, KV cache manager and buckets), the gated
attention on `NeuronAttentionBase` (NxDI's GQA projections) and the gated DeltaNet layers
on plain torch. Written from transformers 5.19's `modeling_qwen3_5.py` (Qwen3_5Attention,
Qwen3_5GatedDeltaNet, Qwen3_5RMSNorm, Qwen3_5DecoderLayer) and `modeling_qwen3_5_moe.py`
(Qwen3_5MoeSparseMoeBlock); the same on NxDI 0.8
(cd3abf3, NxD 0.17) and 0.9 (ef2731e, NxD 0.18), whose attention paths it does not take
(it overrides `get_model_output` and the attention's forward). The config is read from
config.json: the SDK's transformers 4.57 has no Qwen3.5.

Design:
- The per-sequence DeltaNet state (core.recurrent_state: the convolution's last
  kernel - 1 inputs in the model's dtype, the recurrent state in float32) is held as
  entries of the KV cache manager's `past_key_values`, after the attention layers' K and
  V: all convolution states, then all recurrent states, one line per sequence slot like
  the KV lines (`Qwen35StateCacheManager`). NxDI then aliases them as graph state on the
  device (model_wrapper.DecoderModelInstance.get aliases every entry), allocates them with
  their own shapes and dtypes, and copies them back by index in its CPU mode, with no
  override of its wrappers. Rows are read and written by seq_id.
- A prefill starts from a zero state (the contiguous layout re-encodes every prompt from
  position 0) and leaves the state at the last real token: padding tokens have beta and
  g zero, so they neither write nor decay it, and the convolution state is gathered at
  the real length (argmax of position_ids, NxDI's own formula). The delta rule is the
  matmul-only chunked form of `backends.gated_delta` (one XLA graph per bucket).
- A decode row at position max_model_len - 1 is a pad row (its seq_id may be a live
  sequence outside the batch: arguments._decode_arguments): it writes its slot's state
  back unchanged. max_model_len comes from the family's `adjustments`.
- Attention: q_proj's per-head [query | gate] rows are split at conversion into NxDI's
  q_proj and a gate projection; q and k RMS-normed per head (1 + weight, float32); RoPE
  on the first partial_rotary_factor of each head (text-only M-RoPE is 1-D RoPE); scores
  scaled by head_dim^-0.5 with one float32 softmax over [cached; active] keys
  (`own_classes.attention.attend`); the output times sigmoid(gate) before o_proj.
- MoE: softmax routing in float32, top-k renormalised, every expert on every token
  weighted by its routing (`own_classes.parallel_mlp.EveryExpert`, as Gemma 4's), plus
  the shared expert scaled by sigmoid(shared_expert_gate).
- Tensor parallelism: each core holds a share of the DeltaNet heads (its key heads and
  the value heads reading them) with their channels and state: the input projections
  column-parallel, `out_proj` row-parallel, the convolution weight, A_log and dt_bias split
  by rows (`own_classes.sharded_rows`), in_proj_qkv's and the convolution's [q | k | v]
  rows regrouped at conversion into one [q | k | v] block per rank. The block layout,
  NxDI's kernels, speculation, LoRA and quantization are refused
  (`families.qwen3_5.problems`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from neuronx_distributed.parallel_layers.layers import (
    ColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import (
    NeuronBaseForCausalLM,
    NeuronBaseModel,
)
from neuronx_distributed_inference.modules.attention.attention_base import NeuronAttentionBase
from neuronx_distributed_inference.modules.generation.sampling import create_sampler
from neuronx_distributed_inference.modules.kvcache.kv_cache_manager import KVCacheManager
from neuronx_distributed_inference.utils.distributed import get_tp_group
from torch import nn
from torch.nn import functional

from neuron_plugin.backends.gated_delta import gated_norm, recurrent_rule, solve_free_chunked_rule
from neuron_plugin.backends.nxd.families.qwen3_5 import (
    MAX_MODEL_LEN,
    UNSUPPORTED_DEGREES,
    UNSUPPORTED_KEYS,
    config_problems,
)
from neuron_plugin.backends.nxd.own_classes import refusals
from neuron_plugin.backends.nxd.own_classes.attention import (
    Masks,
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
from neuron_plugin.backends.nxd.own_classes.sharded_rows import ShardedRows
from neuron_plugin.core.recurrent_state import StateGeometry, state_geometry

_TEXT = "qwen3_5_text"  # the InferenceConfig attribute holding config.json's text keys


def _check(raw: Mapping[str, Any]) -> None:
    """Raise, naming the problem, for a config.json the class cannot serve."""
    found = config_problems(raw.get("text_config") or raw)
    if found:
        raise ValueError(f"NeuronQwen35ForCausalLM cannot serve this checkpoint: {found}")


def geometry_of(config: InferenceConfig) -> StateGeometry:
    found = state_geometry(getattr(config, _TEXT))
    assert found is not None, "config_loader checked it"
    return found


def rank_blocks(rows: torch.Tensor, geometry: StateGeometry, tp_degree: int) -> torch.Tensor:
    """A DeltaNet layer's [q | k | v] channel rows (in_proj_qkv's, the convolution's) as
    one [q | k | v] block per rank, so that rank r's contiguous share holds the q and k of
    its key heads and the v of its value heads (value head h reads key head h // (value
    heads / key heads): a rank's value heads read its own key heads)."""
    keys = geometry.key_heads * geometry.key_dim
    sections = torch.split(rows, [keys, keys, rows.shape[0] - 2 * keys])
    shares = [section.chunk(tp_degree) for section in sections]
    return torch.cat([share[rank] for rank in range(tp_degree) for share in shares])


def rope_frequencies(text: Mapping[str, Any], head_dim: int) -> list[float]:
    """The inverse frequencies of the rotated part of a head (transformers' default RoPE
    over int(head_dim x partial_rotary_factor) dims, float32)."""
    rope = text.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    dim = int(head_dim * factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return [float(f) for f in 1.0 / (theta**exponents)]


class Qwen35RMSNorm(nn.Module):
    """Qwen3_5RMSNorm: x (mean(x^2) + eps)^-1/2 (1 + weight), in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class NeuronQwen35Attention(NeuronAttentionBase):
    """Qwen3_5Attention (see the module docstring): NxDI's GQA q/k/v/o projections, a
    gate projection beside q, its own norms, partial RoPE and attention."""

    def __init__(self, config: InferenceConfig):
        text = getattr(config, _TEXT)
        head_dim = int(text.get("head_dim") or config.hidden_size // config.num_attention_heads)
        eps = float(text.get("rms_norm_eps", 1e-6))
        super().__init__(
            config,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            qkv_bias=False,
            o_bias=False,
        )
        dtype = config.neuron_config.torch_dtype
        self.gate_proj = ColumnParallelLinear(
            config.hidden_size,
            config.num_attention_heads * head_dim,
            bias=False,
            gather_output=False,
            dtype=dtype,
            pad=True,
            tensor_model_parallel_group=get_tp_group(config),
        )
        self.q_norm = Qwen35RMSNorm(head_dim, eps, dtype)
        self.k_norm = Qwen35RMSNorm(head_dim, eps, dtype)
        self.frequencies = rope_frequencies(text, head_dim)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        width = cos.shape[-1]
        return torch.cat((rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        masks: Masks,
        prior: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(output [batch, tokens, hidden], the active (K, V) [batch, KV heads, tokens,
        dim]); `prior`: the cached (K, V) in a decode."""
        batch, tokens, _ = hidden.shape
        qkv = self.get_qkv_proj()
        cos, sin = rope_tables(self.frequencies, position_ids, hidden.dtype)
        q = self.q_norm(qkv.q_proj(hidden).view(batch, tokens, self.num_heads, self.head_dim))
        shape = (batch, tokens, self.num_key_value_heads, self.head_dim)
        k = self.k_norm(qkv.k_proj(hidden).view(shape))
        v = qkv.v_proj(hidden).view(shape).transpose(1, 2)
        q = self._rotate(q, cos, sin).transpose(1, 2)
        k = self._rotate(k, cos, sin).transpose(1, 2)
        groups = self.num_key_value_groups
        out = attend(q, k, v, masks, prior, groups, scaling=self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(batch, tokens, self.num_heads * self.head_dim)
        out = out * torch.sigmoid(self.gate_proj(hidden))
        return self.get_o_proj()(out), (k, v)


class GatedRMSNorm(nn.Module):
    """Qwen3_5RMSNormGated's weight (`backends.gated_delta.gated_norm` applies it)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_norm(x, gate, self.weight, self.eps)


class NeuronQwen35GatedDeltaNet(nn.Module):
    """Qwen3_5GatedDeltaNet over one call's tokens from a state (see the module
    docstring), on this core's share of the heads (`geometry`: the share); its parameters
    are named as the checkpoint names them (A_log and dt_bias with `.weight`)."""

    def __init__(self, config: InferenceConfig, geometry: StateGeometry):
        super().__init__()
        dtype, tp = config.neuron_config.torch_dtype, config.neuron_config.tp_degree
        hidden = config.hidden_size
        eps = float(getattr(config, _TEXT).get("rms_norm_eps", 1e-6))
        self.geometry = geometry
        channels = geometry.conv_dim * tp
        heads = geometry.value_heads * tp
        group = get_tp_group(config)
        common = {"bias": False, "dtype": dtype, "tensor_model_parallel_group": group}
        column = {**common, "gather_output": False}
        self.in_proj_qkv = ColumnParallelLinear(hidden, channels, **column)
        self.in_proj_z = ColumnParallelLinear(hidden, heads * geometry.value_dim, **column)
        self.in_proj_b = ColumnParallelLinear(hidden, heads, **column)
        self.in_proj_a = ColumnParallelLinear(hidden, heads, **column)
        self.conv1d = ShardedRows(channels, (1, geometry.conv_kernel), dtype, tp)
        self.A_log = ShardedRows(heads, (), dtype, tp)
        self.dt_bias = ShardedRows(heads, (), dtype, tp)
        self.norm = GatedRMSNorm(geometry.value_dim, eps, dtype)
        self.out_proj = RowParallelLinear(
            heads * geometry.value_dim, hidden, input_is_parallel=True, **common
        )

    def _convolve(
        self, mixed: torch.Tensor, conv_state: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal depthwise convolution (SiLU) of mixed [batch, channels, tokens] after
        the state's kernel - 1 inputs, as kernel shifted multiply-adds: (output [batch,
        tokens, channels], the new state: the last kernel - 1 inputs up to each row's
        real length `lengths` [batch])."""
        tokens = mixed.shape[-1]
        kernel = self.geometry.conv_kernel
        weight = self.conv1d.weight[:, 0, :]
        inputs = torch.cat((conv_state.to(mixed.dtype), mixed), dim=-1)
        out = sum(weight[None, :, j, None] * inputs[:, :, j : j + tokens] for j in range(kernel))
        assert isinstance(out, torch.Tensor)
        index = lengths[:, None, None] + torch.arange(kernel - 1, device=mixed.device)
        new_state = inputs.gather(2, index.expand(inputs.shape[0], inputs.shape[1], kernel - 1))
        return functional.silu(out).transpose(1, 2), new_state

    def forward(
        self,
        hidden: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent: torch.Tensor | None,
        real: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output [batch, tokens, hidden], new convolution state, new recurrent state).
        `recurrent` None: a prefill from a zero state (the chunked rule), else a decode of
        one token per row; `real` [batch, tokens] bool: the real tokens (a prefix)."""
        g_ = self.geometry
        batch, tokens, _ = hidden.shape
        mixed = self.in_proj_qkv(hidden).transpose(1, 2)
        z = self.in_proj_z(hidden).view(batch, tokens, -1, g_.value_dim)
        conv, new_conv = self._convolve(mixed, conv_state, real.sum(dim=1))
        key_width = g_.key_heads * g_.key_dim
        q, k, v = torch.split(conv, [key_width, key_width, conv.shape[-1] - 2 * key_width], -1)
        q = q.reshape(batch, tokens, g_.key_heads, g_.key_dim)
        k = k.reshape(batch, tokens, g_.key_heads, g_.key_dim)
        v = v.reshape(batch, tokens, g_.value_heads, g_.value_dim)
        beta = self.in_proj_b(hidden).sigmoid()
        decay = functional.softplus(self.in_proj_a(hidden).float() + self.dt_bias.weight)
        g = -self.A_log.weight.float().exp() * decay
        # padding tokens neither write (beta 0) nor decay (g 0) the state
        mask = real[..., None]
        beta, g = torch.where(mask, beta, 0.0), torch.where(mask, g, 0.0)
        repeat = g_.value_heads // g_.key_heads
        if repeat > 1:  # value head h reads key head h // repeat (repeat_interleave)
            shape = (batch, tokens, g_.value_heads, g_.key_dim)
            q = q[:, :, :, None].expand(-1, -1, -1, repeat, -1).reshape(shape)
            k = k[:, :, :, None].expand(-1, -1, -1, repeat, -1).reshape(shape)
        if recurrent is None:
            out, new_recurrent = solve_free_chunked_rule(q, k, v, g, beta)
        else:
            out, new_recurrent = recurrent_rule(q, k, v, g, beta, recurrent.float())
        normed = self.norm(out, z).reshape(batch, tokens, -1)
        return self.out_proj(normed), new_conv, new_recurrent


class Qwen35SparseMoe(nn.Module):
    """Qwen3_5MoeSparseMoeBlock: softmax routing over every expert (`gate`), top-k
    renormalised, the experts as `EveryExpert`, plus the shared expert scaled by
    sigmoid(shared_expert_gate)."""

    def __init__(self, config: InferenceConfig):
        super().__init__()
        text = getattr(config, _TEXT)
        dtype, hidden = config.neuron_config.torch_dtype, config.hidden_size
        self.experts_count = int(text["num_experts"])
        self.top_k = int(text["num_experts_per_tok"])
        inner = int(text["moe_intermediate_size"])
        shared = int(text.get("shared_expert_intermediate_size") or inner)
        self.gate = nn.Linear(hidden, self.experts_count, bias=False, dtype=dtype)
        self.experts = EveryExpert(config, self.experts_count, hidden, inner, functional.silu)
        self.shared_expert = GatedMLP(config, hidden, shared, functional.silu)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = functional.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.top_k, dim=-1)
        routing = dense_routing(chosen, top / top.sum(dim=-1, keepdim=True), self.experts_count)
        routed = self.experts(flat, routing)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(x.shape)


class NeuronQwen35DecoderLayer(nn.Module):
    """Qwen3_5DecoderLayer: a DeltaNet (`linear_attn`) or gated attention (`self_attn`)
    token mixer, then the dense MLP or the MoE block, each after a (1 + w) RMS norm, each
    residual."""

    linear_attn: NeuronQwen35GatedDeltaNet
    self_attn: NeuronQwen35Attention

    def __init__(self, config: InferenceConfig, geometry: StateGeometry, layer: int):
        super().__init__()
        dtype = config.neuron_config.torch_dtype
        eps = float(getattr(config, _TEXT).get("rms_norm_eps", 1e-6))
        self.linear = layer in geometry.layers
        if self.linear:
            self.linear_attn = NeuronQwen35GatedDeltaNet(config, geometry)
        else:
            self.self_attn = NeuronQwen35Attention(config)
        self.mlp: nn.Module
        if getattr(config, _TEXT).get("num_experts"):
            self.mlp = Qwen35SparseMoe(config)
        else:
            self.mlp = GatedMLP(
                config, config.hidden_size, config.intermediate_size, functional.silu
            )
        self.input_layernorm = Qwen35RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = Qwen35RMSNorm(config.hidden_size, eps, dtype)

    def finish(self, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35StateCacheManager(KVCacheManager):
    """NxDI's KV cache manager for the attention layers (config.num_hidden_layers of
    them), its `past_key_values` followed by every DeltaNet layer's convolution state,
    then every one's recurrent state (float32), one line per sequence slot (see the
    module docstring)."""

    def __init__(
        self,
        config: InferenceConfig,
        num_kv_head: int,
        geometry: StateGeometry,
        conv_dtype: torch.dtype,
        **kwargs: Any,
    ):
        super().__init__(config, num_kv_head=num_kv_head, **kwargs)
        self.kv_layers = config.num_hidden_layers
        self.state_layers = len(geometry.layers)
        slots = self.kv_cache_batch_size + self.kv_cache_padding_size
        for shape, dtype in (
            (geometry.conv_shape, conv_dtype),
            (geometry.recurrent_shape, torch.float32),
        ):
            for _ in range(self.state_layers):
                zeros = torch.zeros((slots, *shape), dtype=dtype)
                self.past_key_values.append(nn.Parameter(zeros, requires_grad=False))

    def _entries(self, index: int) -> tuple[nn.Parameter, nn.Parameter]:
        """(convolution, recurrent) state of DeltaNet layer `index` (its order among them)."""
        first = 2 * self.kv_layers + index
        return self.past_key_values[first], self.past_key_values[first + self.state_layers]

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Module casts (NxDI's load_module to torch_dtype, to_cpu's bfloat16) leave the
        recurrent states float32, as transformers keeps them."""
        found = super()._apply(fn, *args, **kwargs)
        for index in range(self.state_layers):
            recurrent = self._entries(index)[1]
            if recurrent.dtype != torch.float32:
                recurrent.data = recurrent.data.float()
        return found

    def get_cache(
        self, seq_len: int, skip_slice: bool = False, **kwargs: Any
    ) -> list[list[torch.Tensor]]:
        """The attention layers' cached (K, V) (NxDI's get_kv_by_layer_id per layer)."""
        return [
            list(self.get_kv_by_layer_id(idx=i, skip_slice=skip_slice, seq_len=seq_len, **kwargs))
            for i in range(self.kv_layers)
        ]

    def read_state(self, index: int, seq_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeltaNet layer `index`'s (convolution, recurrent) state of the rows' slots."""
        conv, recurrent = self._entries(index)
        return conv[seq_ids], recurrent[seq_ids]

    def write_states(
        self, seq_ids: torch.Tensor, states: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Every state entry with the rows' new states in their slots, in
        `past_key_values` order (each in its entry's dtype: the outputs alias them)."""
        convs, recurrents = [], []
        for index, (conv, recurrent) in enumerate(states):
            old_conv, old_recurrent = self._entries(index)
            convs.append(old_conv.index_put((seq_ids,), conv.to(old_conv.dtype)))
            recurrents.append(
                old_recurrent.index_put((seq_ids,), recurrent.to(old_recurrent.dtype))
            )
        return convs + recurrents


class NeuronQwen35TextModel(NeuronBaseModel):
    """Qwen3_5TextModel on NxDI's NeuronBaseModel (see the module docstring)."""

    def setup_attr_for_model(self, config: InferenceConfig) -> None:
        self.on_device_sampling = config.neuron_config.on_device_sampling_config is not None
        self.tp_degree = config.neuron_config.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size = config.neuron_config.max_batch_size
        self.buckets = config.neuron_config.buckets
        self.geometry = geometry_of(config).sharded(self.tp_degree)  # this core's share
        # a decode row here is a pad row (see the module docstring); without the
        # backend's adjustment, NxDI's longest sequence
        self.pad_position = (
            int(getattr(config, MAX_MODEL_LEN, None) or config.neuron_config.seq_len) - 1
        )

    def init_model(self, config: InferenceConfig) -> None:
        dtype, group = config.neuron_config.torch_dtype, get_tp_group(config)
        text = getattr(config, _TEXT)
        pad = text.get("pad_token_id")
        self.padding_idx = pad
        self.embed_tokens = ParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            pad,
            dtype=dtype,
            shard_across_embedding=True,
            pad=True,
            tensor_model_parallel_group=group,
        )
        self.layers = nn.ModuleList(
            [
                NeuronQwen35DecoderLayer(config, self.geometry, i)
                for i in range(config.num_hidden_layers)
            ]
        )
        eps = float(text.get("rms_norm_eps", 1e-6))
        self.norm = Qwen35RMSNorm(config.hidden_size, eps, dtype)
        self.lm_head = ColumnParallelLinear(
            config.hidden_size,
            config.vocab_size,
            bias=False,
            gather_output=not self.on_device_sampling,
            dtype=dtype,
            pad=True,
            tensor_model_parallel_group=group,
        )

    def decoder_layers(self) -> list[NeuronQwen35DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, NeuronQwen35DecoderLayer)]

    def init_inference_optimization(self, config: InferenceConfig) -> None:
        """NxDI's sampler, and the KV cache manager for the attention layers with the
        DeltaNet states after them."""
        if self.on_device_sampling:
            self.sampler = create_sampler(
                config.neuron_config, self.lm_head.tensor_parallel_group.size()
            )
        attention = next(layer.self_attn for layer in self.decoder_layers() if not layer.linear)
        cache_config = copy.copy(config)
        cache_config.num_hidden_layers = len(self.geometry.attention_layers)
        self.kv_mgr = Qwen35StateCacheManager(
            cache_config,
            attention.num_key_value_heads,
            self.geometry,
            config.neuron_config.torch_dtype,
            global_rank=self.rank_util,
        )

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
        """NeuronBaseModel.get_model_output's contract (hidden states after the final
        norm, every `past_key_values` entry updated) for Qwen3.5's decoder."""
        tokens = input_ids.shape[1]
        assert position_ids is not None and attention_mask is not None
        assert seq_ids is not None
        position_ids = position_ids.view(-1, tokens).long()
        slots = seq_ids.long()
        batch = position_ids.shape[0]
        x = self.embed_tokens(input_ids)
        past = None
        if not is_for_context_encoding:
            past = self.kv_mgr.get_cache(
                seq_ids=seq_ids,
                seq_len=self.n_positions,
                is_for_context_encoding=is_for_context_encoding,
                windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                **kwargs,
            )
        masks = causal_masks(attention_mask, position_ids, tokens, past is not None)
        # the real tokens: a prefill's up to argmax(position_ids) (NxDI's own formula;
        # pads repeat 1, a one-token prompt's 0), a decode's one
        last = torch.argmax(position_ids, dim=1) if past is None else position_ids.new_zeros(batch)
        real = torch.arange(tokens, device=x.device)[None, :] <= last[:, None]
        writes = position_ids[:, -1] != self.pad_position  # a decode's real rows
        new_kv: list[list[torch.Tensor]] = []
        states: list[tuple[torch.Tensor, torch.Tensor]] = []
        geometry = self.geometry
        for layer in self.decoder_layers():
            h = layer.input_layernorm(x)
            if layer.linear:
                index = len(states)
                if past is None:
                    conv = h.new_zeros((batch, *geometry.conv_shape))
                    mixed, new_conv, new_recurrent = layer.linear_attn(h, conv, None, real)
                else:
                    conv, recurrent = self.kv_mgr.read_state(index, slots)
                    mixed, new_conv, new_recurrent = layer.linear_attn(h, conv, recurrent, real)
                    new_conv = torch.where(writes[:, None, None], new_conv.to(conv.dtype), conv)
                    new_recurrent = torch.where(
                        writes[:, None, None, None], new_recurrent.to(recurrent.dtype), recurrent
                    )
                states.append((new_conv, new_recurrent))
            else:
                prior = None if past is None else past[len(new_kv)]
                mixed, kv = layer.self_attn(h, position_ids, masks, prior)
                new_kv.append(list(kv))
            x = layer.finish(x, mixed)
        cache: list[Any] = new_kv
        if update_cache:
            cache = self.kv_mgr.update_cache(
                is_for_context_encoding=is_for_context_encoding,
                seq_ids=seq_ids,
                position_ids=position_ids,
                new_key_values=new_kv,
                seq_len=self.n_positions,
                windowed_context_encoding_window_idx=windowed_context_encoding_window_idx,
                **kwargs,
            ) + self.kv_mgr.write_states(slots, states)
        return self.norm(x), cache


class Qwen35InferenceConfig(InferenceConfig):
    """Qwen3.5's InferenceConfig: config.json's text model keys (`config_loader`), kept
    as `qwen3_5_text`."""

    def add_derived_config(self) -> None:
        self.num_cores_per_group = 1
        text = getattr(self, _TEXT)
        self.head_dim = int(text.get("head_dim") or self.hidden_size // self.num_attention_heads)

    def get_required_attributes(self) -> list[str]:
        return [
            _TEXT,
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "vocab_size",
        ]

    @classmethod
    def get_neuron_config_cls(cls) -> type[NeuronConfig]:
        return NeuronConfig


def _stack_experts(state_dict: dict[str, torch.Tensor], prefix: str, experts: int) -> None:
    """An MoE layer's per-expert projections (`{prefix}{e}.gate_proj.weight` [inner,
    hidden], ...) as `EveryExpert`'s stacked weights: gate and up [experts, hidden,
    inner], down [experts, inner, hidden]."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = [state_dict.pop(f"{prefix}{e}.{name}.weight").t() for e in range(experts)]
        state_dict[f"{prefix}{name}.weight"] = torch.stack(stacked).contiguous()


class NeuronQwen35ForCausalLM(NeuronBaseForCausalLM):
    """Qwen3.5's text model on NxDI (see the module docstring): Qwen3_5ForCausalLM's or
    Qwen3_5MoeForCausalLM's checkpoint (`model.*`) or the language model of their
    multimodal checkpoints (`model.language_model.*`, the vision tower and MTP layers
    left out)."""

    _model_cls = NeuronQwen35TextModel

    @staticmethod
    def config_loader(model_path: str | os.PathLike[str]) -> Callable[[InferenceConfig], None]:
        return json_config_loader(model_path, _check, _TEXT)

    @staticmethod
    def load_hf_model(model_path: str, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "Qwen3.5 has no transformers class in the Neuron SDK's transformers 4.57: "
            "NeuronQwen35ForCausalLM reads the checkpoint's safetensors from its folder"
        )

    @classmethod
    def get_config_cls(cls) -> type[InferenceConfig]:
        return Qwen35InferenceConfig

    @classmethod
    def validate_config(cls, config: InferenceConfig) -> None:
        """NxDI's checks, and what the class does not implement (the plugin refuses it
        before building the class: families.qwen3_5.problems; this guards a direct use)."""
        super().validate_config(config)
        neuron_config = config.neuron_config
        taken = refusals.taken(neuron_config, UNSUPPORTED_KEYS, UNSUPPORTED_DEGREES)
        if neuron_config.is_block_kv_layout:
            taken.append("is_block_kv_layout")
        if taken:
            raise ValueError(
                f"NeuronQwen35ForCausalLM does not implement NeuronConfig {taken} "
                f"(neuron_plugin/backends/nxd/families/qwen3_5/modeling.py); unset them."
            )

    @staticmethod
    def convert_hf_to_neuron_state_dict(
        state_dict: dict[str, torch.Tensor], config: InferenceConfig
    ) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (NxDI took "model." off) as this model names them:
        the language model's alone, each attention layer's q_proj rows ([query | gate]
        per head) split into q_proj and gate_proj, each DeltaNet layer's [q | k | v]
        channels regrouped per rank (`rank_blocks`), an MoE layer's experts stacked."""
        state_dict = language_model_tensors(state_dict)
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith("mtp.")}
        tp = config.neuron_config.tp_degree
        heads, head_dim = config.num_attention_heads, config.head_dim
        geometry = geometry_of(config)
        for i in geometry.attention_layers:
            attn = f"layers.{i}.self_attn."
            both = state_dict.pop(attn + "q_proj.weight").view(heads, 2, head_dim, -1)
            state_dict[attn + "q_proj.weight"] = both[:, 0].reshape(heads * head_dim, -1).clone()
            state_dict[attn + "gate_proj.weight"] = both[:, 1].reshape(heads * head_dim, -1).clone()
            state_dict[attn + "rank_util.rank"] = torch.arange(0, tp, dtype=torch.int32)
        for i in geometry.layers:
            deltanet = f"layers.{i}.linear_attn."
            for name in ("in_proj_qkv.weight", "conv1d.weight"):
                state_dict[deltanet + name] = rank_blocks(state_dict[deltanet + name], geometry, tp)
            for name in ("A_log", "dt_bias"):
                state_dict[f"{deltanet}{name}.weight"] = state_dict.pop(deltanet + name)
        text = getattr(config, _TEXT)
        for i in range(config.num_hidden_layers) if text.get("num_experts") else ():
            _stack_experts(state_dict, f"layers.{i}.mlp.experts.", int(text["num_experts"]))
        if text.get("tie_word_embeddings") or "lm_head.weight" not in state_dict:
            state_dict["lm_head.weight"] = state_dict["embed_tokens.weight"].clone()
        state_dict["rank_util.rank"] = torch.arange(0, tp, dtype=torch.int32)
        return state_dict

    @staticmethod
    def update_state_dict_for_tied_weights(state_dict: dict[str, torch.Tensor]) -> None:
        state_dict["lm_head.weight"] = state_dict["embed_tokens.weight"].clone()
