"""A hybrid model's per-sequence state in vLLM's hybrid KV cache manager (Qwen3.5's gated
DeltaNet layers, core.recurrent_state): the KV cache specs the worker reports for its
layers, the groups vLLM makes of them, and each backend call's state slots.

Contiguous KV layout: the attention layers' full-attention specs only. Each request owns
one block, its sequence slot, and its state lives beside its KV cache line (the backend
derives the state slot from seq_id); a preempted request is encoded again from its
first token, its state from zeros.

Block KV layout (prefix caching, chunked prefill): a `MambaSpec` per state layer beside
the attention layers' specs, as vLLM's GPU runner reports Qwen3.5's GDN layers
(model_executor/layers/mamba/abstract.py get_kv_cache_spec): vLLM groups the state
layers (`core.recurrent_state.state_groups`) and allocates each request its state blocks
per group from the one block pool, one per request ('none' mode) or, with prefix
caching, one per `mamba_block_size` positions ('align' mode, a finished block's state
cached with its hash); continuous batching, chunked prefill, preemption and prefix hits
follow from the block ids vLLM hands each step. The pages are padded to one size, so
vLLM's page-size unification changes no block size (v1/core/kv_cache_utils.py
unify_kv_cache_spec_page_size would otherwise grow the attention blocks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
)

from neuron_plugin import plugin_logger
from neuron_plugin.core.errors import NeuronConfigError
from neuron_plugin.core.inputs import state_slots
from neuron_plugin.core.recurrent_state import RECURRENT_DTYPE, StateGeometry
from neuron_plugin.core.settings import NeuronSettings

logger = plugin_logger(__name__)


def attention_layer(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def state_layer(layer: int) -> str:
    return f"model.layers.{layer}.linear_attn"


class StateBlocks:
    """See the module docstring."""

    def __init__(self, settings: NeuronSettings, geometry: StateGeometry):
        self.settings = settings
        self.geometry = geometry
        # block layout, once vLLM has grouped the layers (`bind`): the KV cache group of
        # the attention layers, the state groups, and each state layer's among them
        self.attention_group = 0
        self.state_group_ids: list[int] = []
        self.layer_groups: list[int] = []

    def kv_cache_spec(self, attention: AttentionSpec) -> dict[str, KVCacheSpec]:
        """The attention layers' `attention` spec (listed first: vLLM's first group) and,
        in the block layout, each state layer's `MambaSpec`."""
        layers = self.geometry.attention_layers
        if not self.settings.is_block_layout:
            return {attention_layer(i): attention for i in layers}
        settings = self.settings
        state = MambaSpec(
            shapes=(self.geometry.conv_shape, self.geometry.recurrent_shape),
            dtypes=(getattr(torch, settings.dtype), getattr(torch, RECURRENT_DTYPE)),
            block_size=settings.state_block_size,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode="align" if settings.is_prefix_caching else "none",
        )
        page = max(attention.page_size_bytes, state.page_size_bytes)
        attention = dataclasses.replace(attention, page_size_padded=page)
        state = dataclasses.replace(state, page_size_padded=page)
        return {
            **{attention_layer(i): attention for i in layers},
            **{state_layer(i): state for i in self.geometry.layers},
        }

    def bind(self, kv_cache_config: KVCacheConfig) -> None:
        """Where vLLM put each layer: the attention group and each state layer's group;
        more state groups than the block count was sized for are refused."""
        if not self.settings.is_block_layout:
            return
        group_of = {
            name: g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.attention_group = group_of[attention_layer(self.geometry.attention_layers[0])]
        groups = [group_of[state_layer(i)] for i in self.geometry.layers]
        self.state_group_ids = sorted(set(groups))
        self.layer_groups = [self.state_group_ids.index(g) for g in groups]
        logger.info(
            "state layers %s in vLLM's KV cache groups %s (attention layers: group %d), a "
            "state block per %s (mamba_cache_mode %s)",
            list(self.geometry.layers),
            groups,
            self.attention_group,
            f"{self.settings.state_block_size} positions"
            if self.settings.is_prefix_caching
            else "request",
            "align" if self.settings.is_prefix_caching else "none",
        )
        if len(self.state_group_ids) > self.settings.state_groups:
            raise NeuronConfigError(
                f"vLLM made {len(self.state_group_ids)} KV cache groups of the model's "
                f"{len(self.geometry.layers)} state layers, and the block count "
                f"({self.settings.num_blocks}) holds {self.settings.state_groups} per "
                f"sequence (core.recurrent_state.state_groups); please report this with "
                f"your vLLM version"
            )

    def slots(self, block_ids: Sequence[Sequence[int]], computed: int, end: int) -> np.ndarray:
        """[2, state layers]: a request's state slots for a call computing its tokens
        [computed, end) (core.inputs.state_slots)."""
        return state_slots(
            [block_ids[g] for g in self.state_group_ids],
            self.layer_groups,
            computed,
            end,
            self.settings.state_block_size,
        )
