"""Device memory a configuration needs per NeuronCore: weights and KV cache.

An estimate for planning (explain-config), from the checkpoint's safetensors headers and
the resolved settings, without loading anything. NxDI shards weights and KV heads over
the tensor-parallel ranks; with more ranks than KV heads each rank holds one replicated
KV head. Runtime scratchpad and the compiled graphs' instruction memory are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import safetensors_shapes
from neuron_plugin.core.settings import NeuronSettings

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_parameters(model_dir: str | Path) -> int | None:
    """Parameters in the folder's *.safetensors files (headers only), None when the
    folder holds none (a hub id, or .bin weights)."""
    shapes = safetensors_shapes(model_dir)
    return sum(math.prod(shape) for shape in shapes.values()) if shapes else None


def kv_heads_per_core(num_kv_heads: int, tp_degree: int) -> int:
    """KV heads one rank holds: an even share, or one replicated head."""
    return max(1, math.ceil(num_kv_heads / tp_degree))


def kv_cache_slots(settings: NeuronSettings) -> int:
    """Token positions the KV cache holds: batch x seq_len rows in the contiguous layout,
    pa_num_blocks x pa_block_size in the block layout."""
    if settings.is_block_layout:
        return settings.num_blocks * settings.block_size
    return settings.max_num_seqs * settings.max_model_len


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int | None
    weights_per_core_bytes: int | None
    kv_cache_per_core_bytes: int
    total_per_core_bytes: int | None
    device_memory_per_core_bytes: int
    fraction_of_core_memory: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(settings: NeuronSettings, hf_config: Mapping[str, Any], parameters: int | None,
             memory_per_core: int) -> MemoryEstimate:
    """Weights and KV cache per NeuronCore against the core's share of device HBM."""
    text = hf_config.get("text_config", hf_config)
    width = DTYPE_BYTES[settings.dtype]
    tp = settings.tp_degree
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", text["num_attention_heads"])
    kv = (2 * text["num_hidden_layers"] * kv_heads_per_core(kv_heads, tp) * head_dim * width
          * kv_cache_slots(settings))
    weights = None if parameters is None else math.ceil(parameters * width / tp)
    total = None if weights is None else weights + kv
    return MemoryEstimate(
        parameters=parameters,
        weights_per_core_bytes=weights,
        kv_cache_per_core_bytes=kv,
        total_per_core_bytes=total,
        device_memory_per_core_bytes=memory_per_core,
        fraction_of_core_memory=None if total is None else total / memory_per_core,
    )
