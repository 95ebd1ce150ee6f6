"""A hybrid model's per-sequence state: the gated DeltaNet layers of Qwen3.5 / 3.6 (its
`linear_attention` layers) keep, instead of a KV cache that grows with the context, a
causal convolution's last inputs and a recurrent state of fixed size per sequence.

Pure (no vLLM, no torch): read from config.json by every side that sizes or serves it,
the reference backend's graphs (`backends/reference/families/qwen3_5.py`), the block
count (`core.kv_layout`), the memory plan (`core.memory`) and the model runner's state
slots (`core.inputs.state_slots`).

Where the state lives (the design, docs/serving/architectures.md#qwen35):
- contiguous KV layout: one state slot per sequence slot, beside its KV cache line
  (slot = seq_id, the scratch slot max_num_seqs takes padding rows); vLLM schedules the
  model as an attention model (its one block per sequence is the slot);
- block KV layout (prefix caching, chunked prefill): where vLLM's hybrid KV cache
  manager puts it, one `MambaSpec` per state layer beside the attention layers'
  `FullAttentionSpec`: vLLM groups the state layers (`state_groups`) and gives each
  request a block per group ('none' mode) or one per mamba block of positions ('align'
  mode, prefix caching), and the state of a layer lives at its group's block id.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from neuron_plugin.core.checkpoint import text_config

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The recurrent state is kept in float32 whatever the model's dtype: transformers computes
# and keeps it so (torch_chunk_gated_delta_rule), and the Hub's Qwen3.5 configs ask for it
# (mamba_ssm_dtype "float32", which vLLM's Qwen3.5 config hook reads).
RECURRENT_DTYPE = "float32"


@dataclass(frozen=True)
class StateGeometry:
    """The state layers of a hybrid model and the state one sequence holds in each: the
    convolution's last conv_kernel - 1 inputs of its q, k and v channels (in the model's
    dtype) and the recurrent state, a key_dim x value_dim matrix per value head (float32)."""

    layers: tuple[int, ...]  # the decoder layers that keep a state, in order
    num_layers: int  # every decoder layer
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q and k of every key head, v of every
        value head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.value_heads, self.key_dim, self.value_dim)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache (the others keep a state)."""
        return tuple(i for i in range(self.num_layers) if i not in self.layers)

    def layer_bytes(self, dtype: str) -> int:
        """One state layer's state of one sequence."""
        conv = math.prod(self.conv_shape) * DTYPE_BYTES[dtype]
        return conv + math.prod(self.recurrent_shape) * DTYPE_BYTES[RECURRENT_DTYPE]

    def sequence_bytes(self, dtype: str, tp_degree: int = 1) -> int:
        """Every state layer's state of one sequence on one of `tp_degree` cores (the
        heads, and with them the state, split across them as vLLM splits them)."""
        return math.ceil(len(self.layers) * self.layer_bytes(dtype) / tp_degree)

    def sharded(self, tp_degree: int) -> StateGeometry:
        """What one of `tp_degree` cores holds, each a share of the key and of the value
        heads (tp_degree divides both) with their channels and state."""
        return replace(
            self,
            key_heads=self.key_heads // tp_degree,
            value_heads=self.value_heads // tp_degree,
        )

    def groups(self) -> int:
        """The state groups vLLM's hybrid KV cache manager makes of these layers beside
        the attention layers (`state_groups`)."""
        return state_groups(len(self.attention_layers), len(self.layers))


def state_groups(attention_layers: int, state_layers: int) -> int:
    """How many KV cache groups vLLM 0.32 and 0.33 make of `state_layers` state layers
    beside `attention_layers` attention layers of one page size (v1/core/kv_cache_utils.py
    `_get_kv_cache_groups_uniform_page_size`): every group holds as many layers as the
    smaller kind has (as many as the larger where that is under 1.5 times the smaller),
    so each request owns a block per group. Qwen3.5-27B (16 attention, 48 state layers):
    3; the tiny checkpoint (2 and 4): 2. The worker checks vLLM's own grouping against
    this count (`serving.worker`)."""
    if not state_layers:
        return 0
    if not attention_layers:
        return 1
    smaller, larger = sorted((attention_layers, state_layers))
    size = larger if larger < smaller * 1.5 else smaller
    return math.ceil(state_layers / size)


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each layer's type as transformers' Qwen3.5 configs decide it: config layer_types,
    else full attention every full_attention_interval-th layer (default 4)."""
    text = text_config(dict(config))
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types:
        return list(types)[:layers]
    interval = int(text.get("full_attention_interval") or 4)
    return [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]


def state_geometry(config: Mapping[str, Any]) -> StateGeometry | None:
    """The state layers of a checkpoint's config.json, None for a model without any."""
    text = text_config(dict(config))
    if "linear_num_value_heads" not in text and "linear_key_head_dim" not in text:
        return None
    types = layer_types(text)
    layers = tuple(i for i, kind in enumerate(types) if kind == LINEAR_ATTENTION)
    if not layers:
        return None
    return StateGeometry(
        layers=layers,
        num_layers=len(types),
        key_heads=int(text.get("linear_num_key_heads", 16)),
        value_heads=int(text.get("linear_num_value_heads", 32)),
        key_dim=int(text.get("linear_key_head_dim", 128)),
        value_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
    )
