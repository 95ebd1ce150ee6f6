"""Device memory a configuration needs per NeuronCore: weights and KV cache.

An estimate for planning (explain-config) and for sizing the default number of sequence
slots (`SequenceBudget`), from the checkpoint's safetensors headers and the settings,
without loading anything. A hybrid model's state layers (Qwen3.5's gated DeltaNet,
core.recurrent_state) hold no KV cache: their state per sequence, of fixed size whatever
the context, is counted beside it. NxDI shards weights over the tensor-parallel ranks and KV
heads by its own GQA rule (`core.kv_heads`): replicated up to the TP degree where it is a
multiple of the KV heads, else converted to multi-head attention with padded heads (e.g.
Llama-3-8B at TP 12: 3 KV heads per core, not 1). Runtime scratchpad and the compiled
graphs' instruction memory are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import safetensors_shapes
from neuron_plugin.core.gemma4 import is_gemma4, kv_values_per_token
from neuron_plugin.core.kv_heads import head_dim, model_head_sharding
from neuron_plugin.core.neuron_settings import EAGLE3, NeuronSettings
from neuron_plugin.core.recurrent_state import state_geometry

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Share of a core's HBM weights and KV cache may take; the rest is for the compiled
# graphs, their scratchpad and the runtime.
USABLE_FRACTION = 0.9


def checkpoint_parameters(model_dir: str | Path) -> int | None:
    """Parameters in the folder's *.safetensors files (headers only), None when the
    folder holds none (a hub id, or .bin weights)."""
    shapes = safetensors_shapes(model_dir)
    return sum(math.prod(shape) for shape in shapes.values()) if shapes else None


def state_sequences(settings: NeuronSettings) -> int:
    """The sequences' states a hybrid model keeps at once (0 without state layers): one
    per sequence slot, two per sequence with prefix caching (vLLM's 'align' mode writes
    the next block's state while it keeps the last full block's, the cacheable one)."""
    if not settings.state_layers:
        return 0
    return settings.max_num_seqs * (2 if settings.is_prefix_caching else 1)


def kv_cache_slots(settings: NeuronSettings) -> int:
    """Token positions the KV cache holds: batch x seq_len rows in the contiguous layout
    (seq_len reaches the largest token-generation bucket, past max_model_len with
    speculation's lookahead), pa_num_blocks x pa_block_size in the block layout (less
    a hybrid model's state blocks)."""
    if settings.is_block_layout:
        return (settings.num_blocks - settings.state_blocks) * settings.block_size
    return settings.max_num_seqs * max(
        settings.max_model_len, settings.token_generation_buckets[-1]
    )


def eagle_hidden_states(settings: NeuronSettings, hf_config: Mapping[str, Any]) -> int:
    """The bytes of NxDI's EAGLE hidden-state rolling buffer on each core (0 without an
    EAGLE head): max_batch_size x 2 speculation_length positions x the target's hidden
    size, three of them for EAGLE-3's fused layers, in the model dtype (NxDI 0.9
    models/model_base.py NeuronFusedSpecModel.__init__, HiddenStateRollingBuffer in
    modules/eagle/hidden_state.py; every core holds the whole buffer)."""
    if not settings.is_eagle:
        return 0
    text = hf_config.get("text_config") or hf_config
    fused = 3 if settings.speculation_method == EAGLE3 else 1
    positions = 2 * settings.speculation_length
    per_row = positions * fused * int(text["hidden_size"]) * DTYPE_BYTES[settings.dtype]
    return settings.max_num_seqs * per_row


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype: str, tp_degree: int) -> int:
    """K and V of one token position on one NeuronCore, over the layers with a KV cache
    (every layer, but a hybrid model's state layers): the KV heads NxDI puts on a core
    (padding and replicas included) x head_dim x dtype; Gemma 4's packed rows per writing
    layer (core.gemma4, the plugin's class)."""
    if is_gemma4(hf_config):
        return kv_values_per_token(hf_config, tp_degree) * DTYPE_BYTES[dtype]
    text = hf_config.get("text_config") or hf_config
    state = state_geometry(hf_config)
    return (
        2
        * (int(text["num_hidden_layers"]) - (len(state.layers) if state else 0))
        * model_head_sharding(hf_config, tp_degree).kv_heads_per_core
        * head_dim(hf_config)
        * DTYPE_BYTES[dtype]
    )


def weights_per_core(
    parameters: int | None, dtype: str, tp_degree: int, weight_bytes: int | None = None
) -> int | None:
    """The weights' share of one NeuronCore: `weight_bytes` when given (a quantized
    checkpoint, core.quantization.quantized_weight_bytes), else parameters x dtype."""
    if weight_bytes is not None:
        return math.ceil(weight_bytes / tp_degree)
    return None if parameters is None else math.ceil(parameters * DTYPE_BYTES[dtype] / tp_degree)


def state_bytes_per_sequence(hf_config: Mapping[str, Any], dtype: str, tp_degree: int) -> int:
    """A hybrid model's per-sequence state on one NeuronCore (0 for other models): every
    state layer's conv state (dtype) and recurrent state (float32), their heads split
    over the TP ranks."""
    state = state_geometry(hf_config)
    return 0 if state is None else state.sequence_bytes(dtype, tp_degree)


@dataclass(frozen=True)
class SequenceBudget:
    """The HBM one NeuronCore has for KV cache once the weights are in, and what a token
    position of KV takes there (and a hybrid model's state per sequence): how many
    full-length sequences an engine can hold."""

    free_bytes: int
    kv_bytes_per_token: int
    source: str  # the instance it is computed for
    state_bytes_per_sequence: int = 0

    def sequences(self, max_model_len: int) -> int:
        per_sequence = self.kv_bytes_per_token * max_model_len + self.state_bytes_per_sequence
        return max(0, self.free_bytes // per_sequence)

    def describe(self) -> str:
        return f"{self.free_bytes / GIB:.1f} GiB of HBM per NeuronCore ({self.source})"


def sequence_budget(
    hf_config: Mapping[str, Any],
    parameters: int | None,
    dtype: str,
    tp_degree: int,
    memory_per_core: int,
    source: str,
    weight_bytes: int | None = None,
) -> SequenceBudget | None:
    """None when the weights' size is unknown (not a local safetensors checkpoint);
    `weight_bytes`: a quantized checkpoint's weights."""
    weights = weights_per_core(parameters, dtype, tp_degree, weight_bytes)
    if weights is None:
        return None
    return SequenceBudget(
        int(memory_per_core * USABLE_FRACTION) - weights,
        kv_bytes_per_token(hf_config, dtype, tp_degree),
        source,
        state_bytes_per_sequence(hf_config, dtype, tp_degree),
    )


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int | None
    weights_per_core_bytes: int | None
    kv_cache_per_core_bytes: int
    # K and V of one token position on one core, over the layers (NxDI's heads per core)
    kv_bytes_per_token_per_core: int
    total_per_core_bytes: int | None
    device_memory_per_core_bytes: int
    fraction_of_core_memory: float | None
    # A fused draft model's share (speculative decoding), included in the total.
    draft_weights_per_core_bytes: int | None = 0
    draft_kv_cache_per_core_bytes: int = 0
    # An EAGLE head's input: the target's hidden states kept per row (eagle_hidden_states).
    eagle_hidden_states_per_core_bytes: int = 0
    # A quantized checkpoint (core.quantization): the weights at the model dtype, and
    # what quantization saves of them per core (weights_per_core_bytes is quantized).
    unquantized_weights_per_core_bytes: int | None = None
    quantization_saves_per_core_bytes: int = 0
    # A hybrid model's state layers (core.recurrent_state): one sequence's state on a
    # core, and the states kept at once (`state_sequences`), included in the total.
    state_bytes_per_sequence_per_core: int = 0
    state_per_core_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    parameters: int | None,
    memory_per_core: int,
    draft: tuple[Mapping[str, Any], int | None] | None = None,
    quantized_bytes: tuple[int, int] | None = None,
) -> MemoryEstimate:
    """Weights and KV cache per NeuronCore against the core's share of device HBM; with
    a fused draft model (`draft`: its config and parameter count) its weights and its
    KV cache (the target's slots) too; with a quantized checkpoint (`quantized_bytes`:
    the whole model's weights unquantized and quantized) the quantized weights."""
    slots = kv_cache_slots(settings)
    per_token = kv_bytes_per_token(hf_config, settings.dtype, settings.tp_degree)
    kv = per_token * slots
    weights = weights_per_core(
        parameters, settings.dtype, settings.tp_degree, quantized_bytes and quantized_bytes[1]
    )
    unquantized = None
    if quantized_bytes is not None:
        unquantized = weights_per_core(None, settings.dtype, settings.tp_degree, quantized_bytes[0])
    draft_weights: int | None = 0
    draft_kv = 0
    if draft is not None:
        draft_weights = weights_per_core(draft[1], settings.dtype, settings.tp_degree)
        draft_kv = kv_bytes_per_token(draft[0], settings.dtype, settings.tp_degree) * slots
    eagle_states = eagle_hidden_states(settings, hf_config)
    per_sequence = state_bytes_per_sequence(hf_config, settings.dtype, settings.tp_degree)
    states = per_sequence * state_sequences(settings)
    total = None if weights is None or draft_weights is None else weights + kv + draft_weights
    total = None if total is None else total + draft_kv + eagle_states + states
    return MemoryEstimate(
        parameters=parameters,
        weights_per_core_bytes=weights,
        kv_cache_per_core_bytes=kv,
        kv_bytes_per_token_per_core=per_token,
        total_per_core_bytes=total,
        device_memory_per_core_bytes=memory_per_core,
        fraction_of_core_memory=None if total is None else total / memory_per_core,
        draft_weights_per_core_bytes=draft_weights,
        draft_kv_cache_per_core_bytes=draft_kv,
        eagle_hidden_states_per_core_bytes=eagle_states,
        unquantized_weights_per_core_bytes=unquantized,
        quantization_saves_per_core_bytes=(unquantized or 0) - (weights or 0) if unquantized else 0,
        state_bytes_per_sequence_per_core=per_sequence,
        state_per_core_bytes=states,
    )
