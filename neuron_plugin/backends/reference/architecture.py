"""How one architecture's decoder differs from Llama's, as data (`Architecture`), with
the rules transformers uses to decide which layers slide. Each family module
(`families/`) holds its architectures' rows; `architectures` reads a checkpoint's
config.json into the facts a graph needs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neuron_plugin.backends.reference.architectures import DecoderSpec
    from neuron_plugin.backends.reference.decoder import DecoderGraph

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


class UnsupportedModelError(ValueError):
    """The checkpoint is outside what the reference backend implements."""


def all_layers(config: dict, layer: int) -> bool:
    return True


def from_max_window_layers(config: dict, layer: int) -> bool:
    return layer >= config.get("max_window_layers", 0)


def every_nth_full(config: dict, layer: int) -> bool:
    # Gemma before layer_types: sliding_window_pattern (default 6) - 1 local layers, then
    # one global layer.
    return bool((layer + 1) % config.get("sliding_window_pattern", 6))


def even_layers(config: dict, layer: int) -> bool:
    return layer % 2 == 0


# (architecture, text config, layers) -> DecoderSpec fields only this family has
SpecFields = Callable[["Architecture", dict, int], dict[str, Any]]
# (spec, lm_head its own tensor) -> the graph's weight inputs: (name, checkpoint tensors)
WeightSources = Callable[["DecoderSpec", bool], list[tuple[str, tuple[str, ...]]]]


@dataclass(frozen=True)
class Architecture:
    """How one architecture's decoder differs from Llama's."""

    family: str
    # "rms": weight * normed.to(dtype) (Llama); "rms_one_plus": (normed * (1 + weight)),
    # in float32, then to dtype (Gemma 3); "rms_float": (weight * normed).to(dtype)
    # (gpt-oss, Gemma 4).
    norm: str = "rms"
    qk_norm: bool = False
    # "config": q, k, v and o projections have biases when config attention_bias is true;
    # "qkv": q, k and v always, o never (Qwen2); "none": never (Mistral, Mixtral).
    attention_bias: str = "config"
    # Gemma: embeddings times sqrt(hidden_size), norms after attention and after the MLP
    # as well as before, a score scale from query_pre_attn_scalar, local RoPE base.
    gemma: bool = False
    sinks: bool = False  # gpt-oss: a learned per-head logit joins every softmax
    # "dense" (gated MLP), or a MoE kind of `mlp.MOE_KINDS`.
    mlp: str = "dense"
    # Which layers slide when the config has a window and no layer_types.
    sliding_layer: Callable[[dict, int], bool] = all_layers
    reads_layer_types: bool = True  # Mistral and Mixtral ignore config layer_types
    # The window applies only with config use_sliding_window true (Qwen families).
    window_flag: bool = False
    windowed: bool = True  # Llama ignores a sliding_window key (transformers has none)
    default_rope_theta: float = 10000.0
    # A vision-language model: its text decoder's config is nested in text_config
    # (transformers 5) or flat (4.57), and a vision tower (its family's `tower`) turns
    # images into embeddings that replace placeholder tokens.
    vision: bool = False
    # Qwen3-VL: M-RoPE's frequencies take the temporal, height and width positions in
    # turn (mrope_section interleaved) rather than in three runs.
    mrope_interleaved: bool = False
    # A vision model's decoder with M-RoPE (the Qwen2-VL family) or plain 1-D RoPE (Pixtral)
    mrope: bool = True
    # Llama 4: NoPE layers with attention temperature tuning, RoPE on interleaved pairs,
    # chunked attention, L2 qk-norm (families/llama4.py).
    llama4: bool = False
    mlp_module: str = "mlp"  # the MLP's name in a layer
    # the family's own DecoderSpec fields (e.g. Llama 4's per-layer RoPE and chunks)
    spec_fields: SpecFields | None = None
    # RoPE parameters per layer type where the config has none (Gemma 4's defaults)
    default_rope: Mapping[str, Mapping[str, Any]] | None = None
    # RoPE rotates this share of each head where the config says no
    # partial_rotary_factor (Qwen3.5's 0.25); None: the config's, or the whole head
    partial_rotary: float | None = None
    # the family's own graph (a decoder.DecoderGraph subclass) and its weight inputs
    # (decoder.weight_sources' form), where its layers are not the generic decoder's
    graph: type[DecoderGraph] | None = None
    weight_sources: WeightSources | None = None
    # What a family's own graph does not take (the backend refuses them by name): LoRA
    # adapter slots, int8 weights, an EAGLE head (a Llama layer over its hidden states).
    refuses: tuple[str, ...] = ()
