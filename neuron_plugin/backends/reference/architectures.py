"""What differs between the architectures the reference decoder serves, as data.

One `Architecture` per Hugging Face architecture name says how its layers differ from
Llama's (norm formula, biases, qk-norm, extra norms, MLP kind, sliding-window pattern,
RoPE per layer type); `DecoderSpec.from_hf_config` turns a checkpoint's config.json into
the facts the graph needs. Config keys are read as both transformers 4.57 (the Neuron
SDK's) and 5.x write them (`rope_theta` / `rope_scaling` / `rope_local_base_freq` versus
`rope_parameters`, `num_experts` versus `num_local_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from neuron_plugin.core.checkpoint import text_config

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


class UnsupportedModelError(ValueError):
    """The checkpoint is outside what the reference backend implements."""


def _all_layers(config: dict, layer: int) -> bool:
    return True


def _from_max_window_layers(config: dict, layer: int) -> bool:
    return layer >= config.get("max_window_layers", 0)


def _every_nth_full(config: dict, layer: int) -> bool:
    # Gemma3 before layer_types: sliding_window_pattern (default 6) - 1 local layers, then
    # one global layer.
    return bool((layer + 1) % config.get("sliding_window_pattern", 6))


def _even_layers(config: dict, layer: int) -> bool:
    return layer % 2 == 0


@dataclass(frozen=True)
class Architecture:
    """How one architecture's decoder differs from Llama's."""

    family: str
    # "rms": weight * normed.to(dtype) (Llama); "rms_one_plus": (normed * (1 + weight)),
    # in float32, then to dtype (Gemma); "rms_float": (weight * normed).to(dtype) (gpt-oss).
    norm: str = "rms"
    qk_norm: bool = False
    # "config": q, k, v and o projections have biases when config attention_bias is true;
    # "qkv": q, k and v always, o never (Qwen2); "none": never (Mistral, Mixtral).
    attention_bias: str = "config"
    # Gemma: embeddings times sqrt(hidden_size), norms after attention and after the MLP
    # as well as before, a score scale from query_pre_attn_scalar, local RoPE base.
    gemma: bool = False
    sinks: bool = False  # gpt-oss: a learned per-head logit joins every softmax
    # "dense" (gated MLP), or a MoE kind of `moe.MOE_KINDS`.
    mlp: str = "dense"
    # Which layers slide when the config has a window and no layer_types.
    sliding_layer: Callable[[dict, int], bool] = _all_layers
    reads_layer_types: bool = True  # Mistral and Mixtral ignore config layer_types
    # The window applies only with config use_sliding_window true (Qwen families).
    window_flag: bool = False
    windowed: bool = True  # Llama ignores a sliding_window key (transformers has none)
    default_rope_theta: float = 10000.0
    # A vision-language model (Qwen2-VL family): its text decoder's config is nested in
    # text_config (transformers 5) or flat (4.57), its RoPE is M-RoPE and a vision tower
    # (`vision`) turns images into embeddings that replace placeholder tokens.
    vision: bool = False
    # Qwen3-VL: M-RoPE's frequencies take the temporal, height and width positions in
    # turn (mrope_section interleaved) rather than in three runs.
    mrope_interleaved: bool = False
    # A vision model's decoder with M-RoPE (the Qwen2-VL family) or plain 1-D RoPE (Pixtral)
    mrope: bool = True
    # Llama 4: NoPE layers (config no_rope_layers 0) with attention temperature tuning,
    # the RoPE layers' RoPE on interleaved pairs (transformers' apply_rotary_emb, complex
    # numbers), their keys within attention_chunk_size chunks and, with use_qk_norm, q and
    # k L2-normed after RoPE; the MLP in feed_forward.
    llama4: bool = False
    mlp_module: str = "mlp"  # the MLP's name in a layer


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", windowed=False),
    "MistralForCausalLM": Architecture("mistral", attention_bias="none", reads_layer_types=False),
    "MixtralForCausalLM": Architecture(
        "mixtral", attention_bias="none", mlp="mixtral", reads_layer_types=False
    ),
    "Qwen2ForCausalLM": Architecture(
        "qwen2", attention_bias="qkv", window_flag=True, sliding_layer=_from_max_window_layers
    ),
    "Qwen3ForCausalLM": Architecture(
        "qwen3", qk_norm=True, window_flag=True, sliding_layer=_from_max_window_layers
    ),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe", qk_norm=True, mlp="qwen3_moe", window_flag=True, reads_layer_types=False
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma3",
        norm="rms_one_plus",
        qk_norm=True,
        gemma=True,
        sliding_layer=_every_nth_full,
        default_rope_theta=1_000_000.0,
    ),
    "Qwen2VLForConditionalGeneration": Architecture(
        "qwen2_vl",
        attention_bias="qkv",
        window_flag=True,
        sliding_layer=_from_max_window_layers,
        default_rope_theta=1_000_000.0,
        vision=True,
    ),
    "Qwen2_5_VLForConditionalGeneration": Architecture(
        "qwen2_5_vl",
        attention_bias="qkv",
        window_flag=True,
        sliding_layer=_from_max_window_layers,
        default_rope_theta=1_000_000.0,
        vision=True,
    ),
    "Qwen3VLForConditionalGeneration": Architecture(
        "qwen3_vl",
        qk_norm=True,
        default_rope_theta=500_000.0,
        vision=True,
        mrope_interleaved=True,
    ),
    # Llama 4: its text decoder, and its vision tower in reference/llama4_vision.py
    "Llama4ForConditionalGeneration": Architecture(
        "llama4",
        attention_bias="none",
        windowed=False,
        mlp="llama4",
        default_rope_theta=500_000.0,
        llama4=True,
        mlp_module="feed_forward",
        vision=True,
        mrope=False,
    ),
    # Pixtral in transformers' Llava format: a Mistral decoder (Pixtral's vision tower in
    # reference/pixtral.py)
    "LlavaForConditionalGeneration": Architecture(
        "llava",
        attention_bias="none",
        reads_layer_types=False,
        vision=True,
        mrope=False,
    ),
    "GptOssForCausalLM": Architecture(
        "gpt_oss",
        norm="rms_float",
        sinks=True,
        mlp="gpt_oss",
        sliding_layer=_even_layers,
        default_rope_theta=150_000.0,
    ),
}
FAMILIES = {name: arch.family for name, arch in ARCHITECTURES.items()}


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

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    def chunk(self, layer: int) -> int | None:
        return self.chunks[layer] if self.chunks else None

    @property
    def family(self) -> str:
        return self.arch.family

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
        archs = config.get("architectures") or []
        name = next((a for a in archs if a in ARCHITECTURES), None)
        if name is None:
            raise UnsupportedModelError(
                f"architectures={archs} is not supported by the reference backend "
                f"(supported: {', '.join(ARCHITECTURES)}); use VLLM_NEURON_BACKEND=nxd on a "
                f"Neuron host for other models."
            )
        arch = ARCHITECTURES[name]
        if config.get("mlp_bias"):
            raise UnsupportedModelError(
                f"{name} with mlp_bias=true is not supported by the reference backend"
            )
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layers = config["num_hidden_layers"]
        moe = _moe_fields(arch, config, layers)
        scalar = config.get("query_pre_attn_scalar") if arch.gemma else None
        return cls(
            architecture=name,
            arch=arch,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
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
            mrope_section=_mrope_section(arch, config, head_dim),
            **_llama4_fields(arch, config, layers),
            **moe,
        )


def _llama4_fields(arch: Architecture, config: dict, layers: int) -> dict[str, Any]:
    """Llama 4's per-layer RoPE, chunks, qk-norm and temperature tuning, as
    transformers' Llama4TextConfig derives them (no_rope_layers from
    no_rope_layer_interval where absent or empty; layer_types from no_rope_layers)."""
    if not arch.llama4:
        return {}
    interval = int(config.get("no_rope_layer_interval", 4))
    no_rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    rope_layers = tuple(bool(no_rope[i]) for i in range(layers))
    types = config.get("layer_types") or [CHUNKED if r else FULL for r in rope_layers]
    chunk = config.get("attention_chunk_size")
    if chunk is not None:
        chunk = int(chunk)
    elif CHUNKED in types[:layers]:
        raise UnsupportedModelError(
            f"{arch.family}: layer_types has {CHUNKED!r} layers but attention_chunk_size is "
            f"unset (transformers refuses it too); set attention_chunk_size in config.json"
        )
    tuning = None
    if config.get("attn_temperature_tuning", True):
        tuning = (float(config.get("floor_scale", 8192)), float(config.get("attn_scale", 0.1)))
    return {
        "rope_layers": rope_layers,
        "chunks": tuple(chunk if t == CHUNKED else None for t in types[:layers]),
        "l2_qk_norm": bool(config.get("use_qk_norm", True)),
        "temperature_tuning": tuning,
    }


def _mrope_section(arch: Architecture, config: dict, head_dim: int) -> tuple[int, ...]:
    if not (arch.vision and arch.mrope):
        return ()
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    default = (24, 20, 20) if arch.mrope_interleaved else (16, 24, 24)  # transformers'
    section = tuple(int(n) for n in params.get("mrope_section") or default)
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise UnsupportedModelError(
            f"mrope_section={list(section)} must be three counts (temporal, height, width) "
            f"summing to head_dim / 2 = {head_dim // 2}"
        )
    return section


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
    elif spec.arch.gemma and layer_type == SLIDING:
        params = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    else:
        params = dict(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", spec.arch.default_rope_theta))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "mrope":  # M-RoPE's frequencies are the default ones
        params["rope_type"] = "default"
    return params


def rope_tables(config: dict, spec: DecoderSpec) -> dict[str, tuple[torch.Tensor, float]]:
    """Per layer type in use: (inverse frequencies, attention scaling), as transformers
    computes them."""
    config = text_config(config)
    return {
        kind: _inv_freq(
            config, rope_parameters(config, spec, kind), spec.head_dim, per_type=spec.arch.gemma
        )
        for kind in sorted({spec.rope_kind(i) for i in range(spec.num_layers)})
    }


def _inv_freq(
    config: dict, params: dict, head_dim: int, per_type: bool
) -> tuple[torch.Tensor, float]:
    rope_type, theta = params["rope_type"], params["rope_theta"]
    if rope_type in ("default", "linear"):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        return (inv_freq / params["factor"] if rope_type == "linear" else inv_freq), 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError(
            "rope_type='dynamic' changes frequencies with the sequence length, which a "
            "fixed-shape graph cannot follow; use a checkpoint with static RoPE scaling."
        )
    if per_type:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} on a model with RoPE per layer type is not supported "
            "by the reference backend (default and linear are)."
        )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model(**config)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)
