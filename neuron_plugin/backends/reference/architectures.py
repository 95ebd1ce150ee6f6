"""A checkpoint's config.json read into the facts a reference graph needs.

One `Architecture` per Hugging Face architecture name, in its family's module
(`families/`, the room `models.table` names), says how its layers differ from Llama's
(norm formula, biases, qk-norm, extra norms, MLP kind, sliding-window pattern, RoPE per
layer type, the family's own fields); `DecoderSpec.from_hf_config` turns a checkpoint's
config.json into the facts the graph needs. Config keys are read as both transformers
4.57 (the Neuron SDK's) and 5.x write them (`rope_theta` / `rope_scaling` /
`rope_local_base_freq` versus `rope_parameters`, `num_experts` versus
`num_local_experts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from neuron_plugin.backends.reference.architecture import (
    CHUNKED,
    FULL,
    SLIDING,
    Architecture,
    UnsupportedModelError,
)
from neuron_plugin.core.checkpoint import text_config
from neuron_plugin.core.recurrent_state import StateGeometry

__all__ = [
    "CHUNKED",
    "FULL",
    "SLIDING",
    "Architecture",
    "DecoderSpec",
    "UnsupportedModelError",
]


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture facts the graph needs, read from a checkpoint's config.json."""

    architecture: str
    arch: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    activation: str
    score_scale: float
    layer_types: tuple[str, ...]  # per layer: FULL or SLIDING
    windows: tuple[int | None, ...]  # per layer: sliding window, or None (full)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # M-RoPE (vision-language models): how many of the head_dim / 2 rotary frequencies
    # follow the temporal, height and width position, in that order; empty: plain RoPE.
    mrope_section: tuple[int, ...] = ()
    # Llama 4 (`Architecture.llama4`), per layer: whether it has RoPE (else NoPE) and its
    # attention chunk (keys in the query's chunk of this many positions only; None: all)
    rope_layers: tuple[bool, ...] = ()
    chunks: tuple[int | None, ...] = ()
    l2_qk_norm: bool = False  # Llama 4's use_qk_norm: q and k of the RoPE layers
    # Llama 4's attn_temperature_tuning of the NoPE layers' queries: (floor_scale,
    # attn_scale), the query at position p times 1 + attn_scale log(1 + floor((p + 1) /
    # floor_scale)); None: off
    temperature_tuning: tuple[float, float] | None = None
    # Gemma 4, per layer: (kv heads, head dim) where layer types differ (empty: every
    # layer num_kv_heads x head_dim), and the KV cache row it reads (a KV-shared layer
    # reads its source's and writes none; empty: its own)
    layer_geometry: tuple[tuple[int, int], ...] = ()
    kv_rows: tuple[int, ...] = ()
    per_layer_input: int = 0  # Gemma 4's per-layer embeddings' width (0: none)
    values_from_keys: tuple[bool, ...] = ()  # Gemma 4's attention_k_eq_v, per layer
    # A hybrid model's state layers (Qwen3.5's gated DeltaNet, core.recurrent_state);
    # None: every layer attends over a KV cache
    state: StateGeometry | None = None

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def chunk(self, layer: int) -> int | None:
        return self.chunks[layer] if self.chunks else None

    @property
    def family(self) -> str:
        return self.arch.family

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_geometry[layer][0] if self.layer_geometry else self.num_kv_heads

    def head_dim_of(self, layer: int) -> int:
        return self.layer_geometry[layer][1] if self.layer_geometry else self.head_dim

    def kv_row(self, layer: int) -> int:
        return self.kv_rows[layer] if self.kv_rows else layer

    def owns_kv(self, layer: int) -> bool:
        """Whether the layer writes keys and values (a KV-shared layer reads another's)."""
        return self.kv_row(layer) == layer

    @property
    def cache_geometry(self) -> tuple[int, int, int]:
        """(rows, kv heads, head dim) of the KV cache: a row per layer that writes one;
        where layers differ, lines of the widest head dim holding the widest layer."""
        rows = len({self.kv_row(i) for i in range(self.num_layers)})
        head_dim = max(self.head_dim_of(i) for i in range(self.num_layers))
        widest = max(self.kv_heads_of(i) * self.head_dim_of(i) for i in range(self.num_layers))
        return rows, -(-widest // head_dim), head_dim

    @property
    def qk_norm(self) -> bool:
        return self.arch.qk_norm

    @property
    def biased_projections(self) -> str:
        """Which of the q, k, v and o projections have a bias."""
        rule = self.arch.attention_bias
        if rule == "config":
            return "qkvo" if self.attention_bias else ""
        return "" if rule == "none" else rule

    def rope_kind(self, layer: int) -> str:
        """The key of the layer's RoPE table: its layer type where RoPE differs by type
        (Gemma3: local layers have their own base, whether or not a window applies)."""
        return self.layer_types[layer] if self.arch.gemma else FULL

    @property
    def vision(self) -> bool:
        return self.arch.vision

    @classmethod
    def from_hf_config(cls, config: dict) -> DecoderSpec:
        config = text_config(config)
        from neuron_plugin.backends.reference.families import ARCHITECTURES, family_module

        archs = config.get("architectures") or []
        name = next((a for a in archs if a in ARCHITECTURES), archs[0] if archs else "")
        family_module(name)  # refuses what no family serves, naming what is served
        arch = ARCHITECTURES[name]
        if config.get("mlp_bias"):
            raise UnsupportedModelError(
                f"{name} with mlp_bias=true is not supported by the reference backend"
            )
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layers = config["num_hidden_layers"]
        scalar = config.get("query_pre_attn_scalar") if arch.gemma else None
        fields: dict[str, Any] = dict(
            architecture=name,
            arch=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=int(config.get("intermediate_size") or 0),  # none: MoE only
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=config["rms_norm_eps"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", arch.gemma)),
            attention_bias=bool(config.get("attention_bias", False)),
            activation=(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
            score_scale=float((scalar or head_dim) ** -0.5),
            layer_types=layer_types(arch, config, layers),
            windows=layer_windows(arch, config, layers),
            attn_softcap=config.get("attn_logit_softcapping") if arch.gemma else None,
            final_softcap=config.get("final_logit_softcapping") if arch.gemma else None,
            **_moe_fields(arch, config, layers),
        )
        if arch.spec_fields:  # the family's own, over the common reading
            fields.update(arch.spec_fields(arch, config, layers))
        return cls(**fields)


def layer_types(arch: Architecture, config: dict, layers: int) -> tuple[str, ...]:
    """Each layer's type (full_attention / sliding_attention), as transformers decides it."""
    types = config.get("layer_types") if arch.reads_layer_types else None
    if types:
        return tuple(types[:layers])
    window = config.get("sliding_window") is not None
    return tuple(
        SLIDING if window and arch.sliding_layer(config, i) else FULL for i in range(layers)
    )


def layer_windows(arch: Architecture, config: dict, layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers decides it."""
    value = config.get("sliding_window")
    if value is None or not arch.windowed:
        return (None,) * layers
    if arch.window_flag and not config.get("use_sliding_window", False):
        return (None,) * layers
    return tuple(int(value) if t == SLIDING else None for t in layer_types(arch, config, layers))


def _moe_fields(arch: Architecture, config: dict, layers: int) -> dict[str, Any]:
    if arch.mlp == "dense":
        return {"moe_layers": (False,) * layers}
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if arch.mlp == "llama4":  # moe_layers, or every interleave_moe_layer_step-th layer
        step = int(config.get("interleave_moe_layer_step", 1))
        listed = config.get("moe_layers")
        chosen = set(listed if listed is not None else range(step - 1, layers, step))
        moe_layers = tuple(i in chosen for i in range(layers))
    elif arch.mlp == "qwen3_moe":
        only_dense = set(config.get("mlp_only_layers") or [])
        step = config.get("decoder_sparse_step", 1) or 1
        moe_layers = tuple(
            i not in only_dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
    else:
        moe_layers = (True,) * layers
    return {
        "moe_layers": moe_layers,
        "num_experts": experts,
        "experts_per_token": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(
            config.get("moe_intermediate_size") or config["intermediate_size"]
        ),
        "norm_topk_prob": bool(config.get("norm_topk_prob", arch.mlp == "mixtral")),
        "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
    }


# -- RoPE ---------------------------------------------------------------------------------
def rope_parameters(config: dict, spec: DecoderSpec, layer_type: str) -> dict[str, Any]:
    """`layer_type`'s RoPE parameters (rope_type, rope_theta, scaling keys) from either
    transformers major's keys. Gemma3's local layers have their own base and no scaling."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])  # per layer type (Gemma3, transformers 5)
    elif isinstance(params, dict) and params:
        params = dict(params)
    elif spec.arch.default_rope:  # the family's defaults per layer type (Gemma 4)
        params = dict(spec.arch.default_rope[layer_type])
    elif spec.arch.gemma and layer_type == SLIDING:
        params = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    else:
        params = dict(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", spec.arch.default_rope_theta))
    if spec.arch.partial_rotary is not None:  # RoPE on the head's first share (Qwen3.5)
        params.setdefault(
            "partial_rotary_factor", config.get("partial_rotary_factor", spec.arch.partial_rotary)
        )
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "mrope":  # M-RoPE's frequencies are the default ones
        params["rope_type"] = "default"
    return params


def rope_tables(config: dict, spec: DecoderSpec) -> dict[str, tuple[torch.Tensor, float]]:
    """Per layer type in use: (inverse frequencies, attention scaling), as transformers
    computes them."""
    config = text_config(config)
    kinds = {spec.rope_kind(i): i for i in reversed(range(spec.num_layers))}
    return {
        kind: _inv_freq(
            config,
            rope_parameters(config, spec, kind),
            spec.head_dim_of(kinds[kind]),  # Gemma 4's layer types differ in head dim
            per_type=spec.arch.gemma,
        )
        for kind in sorted(kinds)
    }


def _inv_freq(
    config: dict, params: dict, head_dim: int, per_type: bool
) -> tuple[torch.Tensor, float]:
    rope_type, theta = params["rope_type"], params["rope_theta"]
    if rope_type in ("default", "linear"):
        # the rotary share of the head (transformers' default RoPE with
        # partial_rotary_factor: frequencies over that width only)
        head_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        return (inv_freq / params["factor"] if rope_type == "linear" else inv_freq), 1.0
    if rope_type == "proportional":  # Gemma 4: modeling_rope_utils' proportional RoPE
        # the first partial_rotary_factor of the pairs rotate at frequencies over the
        # whole head_dim; the rest stay (frequency 0)
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
        rotated = 1.0 / (theta**exponents)
        inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
        return inv_freq / params.get("factor", 1.0), 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError(
            "rope_type='dynamic' changes frequencies with the sequence length, which a "
            "fixed-shape graph cannot follow; use a checkpoint with static RoPE scaling."
        )
    if per_type:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} on a model with RoPE per layer type is not supported "
            "by the reference backend (default, linear and proportional are)."
        )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model(**config)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)
