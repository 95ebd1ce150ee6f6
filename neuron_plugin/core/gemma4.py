"""Gemma 4's text model as its config.json describes it, read without transformers (the
Neuron SDK's transformers 4.57 has no Gemma 4) in both of the forms checkpoints carry: the
Hub's (`global_head_dim`, `num_global_key_value_heads`) and transformers 5's
(`per_layer_config`, keyed by layer index, zero-padded once saved), flat
(Gemma4ForCausalLM) or nested under `text_config` (Gemma4ForConditionalGeneration).

Pure (core): the nxd backend's class (`backends/nxd/families/gemma4`) and the memory
plan (`core.memory`, the class's packed KV rows) read it. The rules are
transformers 5.19's `Gemma4TextConfig` (configuration_gemma4.py `__post_init__`: layer
types, the last layer forced full, the full layers' head dim and KV heads, default RoPE
per layer type) and `Gemma4TextModel` (modeling_gemma4.py: KV-shared layers read the last
earlier layer of their type, the double-wide MLP of those layers), as the reference
backend reads them (`backends/reference/families/gemma4.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuron_plugin.core.checkpoint import text_config
from neuron_plugin.core.kv_heads import head_sharding

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma4TextConfig's RoPE where config.json has none (configuration_gemma4.py)
DEFAULT_ROPE: Mapping[str, Mapping[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
ROPE_TYPES = ("default", "proportional")
# transformers' ACT2FN names the class computes (F.gelu tanh, F.gelu, F.silu)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
# what a per_layer_config entry may change (the released checkpoints' attributes)
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True)
class Rope:
    """One layer type's RoPE: `default` rotates every pair at theta^(-2j/d); `proportional`
    the first int(partial_rotary_factor * d // 2) pairs at the same frequencies (the
    exponent over the whole head dim) and leaves the rest unrotated; both / factor."""

    kind: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class Gemma4Layout:
    """Every per-layer fact of a Gemma 4 text model (see the module docstring)."""

    hidden_size: int
    num_heads: int
    vocab_size: int
    rms_norm_eps: float
    activation: str
    attention_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int
    kv_heads: tuple[int, ...]  # per layer
    head_dims: tuple[int, ...]  # per layer
    kv_sources: tuple[int, ...]  # the layer whose keys and values each layer attends
    values_from_keys: tuple[bool, ...]  # attention_k_eq_v on a full layer: no v_proj
    mlp_widths: tuple[int, ...]
    per_layer_input: int  # hidden_size_per_layer_input (0: no per-layer embeddings)
    per_layer_vocab: int
    num_experts: int  # 0: no MoE block
    experts_per_token: int
    moe_intermediate_size: int
    rope: Mapping[str, Rope]
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    pad_token_id: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def cache_layers(self) -> int:
        """Layers that write keys and values (the first; the rest share them)."""
        return sum(1 for i, source in enumerate(self.kv_sources) if source == i)

    def owns_kv(self, layer: int) -> bool:
        return self.kv_sources[layer] == layer

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


class Gemma4ConfigError(ValueError):
    """A config.json this class cannot serve as transformers computes it."""


def read_layout(config: Mapping[str, Any]) -> Gemma4Layout:
    """The layout of config.json's text model (flat or under `text_config`)."""
    text = text_config(dict(config))
    problems = config_problems(text)
    if problems:
        raise Gemma4ConfigError("; ".join(problems))
    layers = int(text["num_hidden_layers"])
    types = layer_types(text, layers)
    geometry = layer_geometry(text, types)
    shared = int(text.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    sources = [
        i if i < first_shared else max(j for j in range(first_shared) if types[j] == kind)
        for i, kind in enumerate(types)
    ]
    double = bool(text.get("use_double_wide_mlp")) and shared > 0
    width = int(text["intermediate_size"])
    moe = bool(text.get("enable_moe_block"))
    rope_parameters = text.get("rope_parameters") or DEFAULT_ROPE
    vocab = int(text["vocab_size"])
    return Gemma4Layout(
        hidden_size=int(text["hidden_size"]),
        num_heads=int(text["num_attention_heads"]),
        vocab_size=vocab,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        activation=str(text.get("hidden_activation") or "gelu_pytorch_tanh"),
        attention_bias=bool(text.get("attention_bias")),
        layer_types=tuple(types),
        sliding_window=int(text.get("sliding_window") or 512),
        kv_heads=tuple(h for h, _ in geometry),
        head_dims=tuple(d for _, d in geometry),
        kv_sources=tuple(sources),
        values_from_keys=tuple(bool(text.get("attention_k_eq_v")) and t == FULL for t in types),
        mlp_widths=tuple(
            2 * width if double and i >= first_shared else width for i in range(layers)
        ),
        per_layer_input=int(text.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(text.get("vocab_size_per_layer_input") or vocab),
        num_experts=int(text.get("num_experts") or 0) if moe else 0,
        experts_per_token=int(text.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe else 0,
        rope={kind: _rope(rope_parameters.get(kind) or DEFAULT_ROPE[kind]) for kind in set(types)},
        final_logit_softcapping=(
            None
            if text.get("final_logit_softcapping") is None
            else float(text["final_logit_softcapping"])
        ),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
        pad_token_id=int(text.get("pad_token_id") or 0),
    )


def config_problems(text: Mapping[str, Any]) -> list[str]:
    """What in config.json's text model (`text_config` merged) the class does not compute
    as transformers does: each a setting, its value and why."""
    found = []
    if text.get("use_bidirectional_attention") == "all":
        found.append(
            "use_bidirectional_attention='all' attends in both directions, which a causal "
            "language model server does not serve"
        )
    layers = int(text.get("num_hidden_layers") or 0)
    types = layer_types(text, layers)
    shared = int(text.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    for i in range(max(first_shared, 0), layers):
        if not any(types[j] == types[i] for j in range(max(first_shared, 0))):
            found.append(
                f"num_kv_shared_layers={shared}: layer {i} ({types[i]}) shares the keys and "
                f"values of an earlier {types[i]} layer and there is none before layer "
                f"{first_shared} (transformers fails too)"
            )
            break
    rope_parameters = text.get("rope_parameters") or DEFAULT_ROPE
    for kind in sorted(set(types)):
        params = rope_parameters.get(kind) or DEFAULT_ROPE[kind]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            found.append(
                f"rope_parameters[{kind!r}].rope_type={rope_type!r}: the class computes "
                f"{' and '.join(ROPE_TYPES)} RoPE only"
            )
    activation = text.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in ACTIVATIONS:
        found.append(f"hidden_activation={activation!r}: the class computes {ACTIVATIONS} only")
    per_layer = text.get("per_layer_config")
    if isinstance(per_layer, dict):
        extra = sorted({k for entry in per_layer.values() for k in entry} - set(PER_LAYER_KEYS))
        if extra:
            found.append(
                f"per_layer_config sets {extra} per layer; the class reads {PER_LAYER_KEYS} "
                f"per layer only"
            )
    if text.get("enable_moe_block") and not all(
        text.get(k) for k in ("num_experts", "top_k_experts", "moe_intermediate_size")
    ):
        found.append(
            "enable_moe_block without num_experts, top_k_experts and moe_intermediate_size "
            "(transformers fails too)"
        )
    return found


def layer_types(text: Mapping[str, Any], layers: int) -> list[str]:
    """config.json's layer_types, else every sixth layer full; the last layer full
    (transformers forces it)."""
    types = list(text.get("layer_types") or [])[:layers] or [
        FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)
    ]
    if types:
        types[-1] = FULL
    return types


def layer_geometry(text: Mapping[str, Any], types: list[str]) -> list[tuple[int, int]]:
    """Each layer's (KV heads, head dim): per_layer_config's overrides where config.json
    has them (they win over global_head_dim, as in transformers), else the full layers'
    global_head_dim (default 512) and, with attention_k_eq_v, num_global_key_value_heads."""
    heads, head_dim = int(text["num_key_value_heads"]), int(text.get("head_dim") or 256)
    per_layer = text.get("per_layer_config")
    if isinstance(per_layer, dict):
        overrides = {int(k): dict(v) for k, v in per_layer.items()}
    else:
        full: dict[str, Any] = {"head_dim": text.get("global_head_dim", 512)}
        global_heads = text.get("num_global_key_value_heads")
        if text.get("attention_k_eq_v") and global_heads is not None:
            full["num_key_value_heads"] = global_heads
        overrides = {i: full for i, kind in enumerate(types) if kind == FULL}
    return [
        (
            int(overrides.get(i, {}).get("num_key_value_heads", heads)),
            int(overrides.get(i, {}).get("head_dim", head_dim)),
        )
        for i in range(len(types))
    ]


def _rope(params: Mapping[str, Any]) -> Rope:
    kind = str(params.get("rope_type", params.get("type", "default")))
    return Rope(
        kind,
        float(params.get("rope_theta", DEFAULT_ROPE[SLIDING]["rope_theta"])),
        float(params.get("partial_rotary_factor", 1.0)),
        float(params.get("factor", 1.0)),
    )


def is_gemma4(config: Mapping[str, Any]) -> bool:
    """Whether config.json is a Gemma 4 text model's (flat or nested)."""
    return str(text_config(dict(config)).get("model_type", "")).startswith("gemma4")


def kv_values_per_token(config: Mapping[str, Any], tp_degree: int) -> int:
    """K and V values of one token position on one NeuronCore as the nxd class holds
    them: a packed row per writing layer (`cache_geometry`) over the KV heads NxDI's GQA
    sharding puts on a core per layer type (kv_heads.head_sharding)."""
    layout = read_layout(config)
    rows = cache_geometry(
        [
            (
                head_sharding(tp_degree, layout.num_heads, layout.kv_heads[i]).kv_heads_per_core,
                layout.head_dims[i],
            )
            for i in range(layout.num_layers)
            if layout.owns_kv(i)
        ]
    )
    return 2 * layout.cache_layers * rows[0] * rows[1]


def cache_geometry(layers: list[tuple[int, int]]) -> tuple[int, int]:
    """(heads, head dim) of one KV cache row that holds every writing layer's (KV heads
    per rank, head dim) packed: rows of gcd(head dims) values, as many as the widest layer
    type needs. A layer's keys of h heads x d dims fill its first h * d / head_dim rows
    of the cache's (its heads side by side, each split into d / head_dim rows); the rest
    stay zero and are never read."""
    from math import gcd

    width = 0
    for _, d in layers:
        width = gcd(width, d)
    return max(h * d // width for h, d in layers), width
