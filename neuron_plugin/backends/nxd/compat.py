"""What the nxd backend serves per architecture and feature, and the configurations it
refuses before anything compiles.

The evidence is real NxD Inference in its CPU mode, each release of
`core.nxdi_releases.CHECKED` (0.8.0 cd3abf3, the release inf2/trn1 run, and 0.9.0
ef2731e), driven through this backend against transformers' greedy tokens and logits on
a tiny checkpoint of each architecture (`tests/e2e/test_nxdi_architectures.py`, `pytest
-m nxdi`, once per release): contiguous and block layout at batch 1 and 2, a 128-token
prefix-cache hit, on-device sampling. `SUPPORT` is per release. The
reference backend follows transformers, so an architecture it serves is no evidence
for nxd. Every feature of an architecture is one of: equal to transformers on real NxDI,
refused (why, what to use instead), or untested (why).

`problems` refuses, naming architecture, NxDI release, feature and fix, what NxDI's
modelling code computes differently from transformers (measured, or read in its source:
file and function named) where no patch of `neuron_plugin.patches` makes it equal:
- sliding windows NxDI's model does not apply the way transformers does, once a
  sequence can pass them; Qwen3-MoE's dense layers (NxDI's are all MoE);
- NxDI's windowed attention (Mistral, Llama with a window) in the block layout:
  `windowed_attention_forward` keeps the last window - 1 keys of a prefill
  (attention_base.py get_last_kv_window), which `BlockKVCacheManager.update_cache`
  cannot write; with max_model_len <= the window no key ever leaves it, so the backend
  gives NxDI the config without one (`config_adjustments`), as transformers computes;
- gpt-oss: the block layout (its own KV cache manager, a prefix-cache hit fails),
  experts other than MXFP4, the config keys it hard-codes or requires;
- Gemma3 without the plugin's gemma3 patches, or with keys NxDI does not implement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from neuron_plugin.core import nxdi_releases
from neuron_plugin.core.checkpoint import text_config
from neuron_plugin.core.settings import NeuronSettings
from neuron_plugin.patches import gemma3

EQUAL = "equal to transformers on real NxDI"
REFUSED = "refused"
UNTESTED = "untested"
FEATURES = (
    "contiguous",
    "block",
    "prefix_hit",
    "on_device_sampling",
    "speculation",
    "lora",
    "quantization",
)
GEMMA3_PATCHES = tuple(patch.name for patch in gemma3.PATCHES)
# Architectures whose NxDI model and attention read config.sliding_window for every
# layer (modeling_llama.py NeuronLlamaAttention / NeuronLlamaModel.setup_attr_for_model,
# modeling_mistral.py NeuronMistralAttention / setup_attr_for_model).
WINDOW_FROM_CONFIG = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class Support:
    """One feature of one architecture on the nxd backend."""

    state: str  # EQUAL, REFUSED or UNTESTED
    note: str = ""

    def describe(self) -> str:
        return f"{self.state}: {self.note}" if self.note else self.state


_SPECULATION = Support(UNTESTED, "NxDI's CPU mode runs no speculation (application_base.py to_cpu)")
_WINDOWED_SPECULATION = Support(
    REFUSED,
    "sliding-window attention: NxDI verifies drafts for it only with a token-generation "
    "kernel its speculation model lacks",
)
_LORA = Support(UNTESTED, "NxDI's CPU mode cannot run LoRA (model_base.py _copy_past_key_values)")
_QUANTIZED = Support(
    UNTESTED,
    "NxDI's CPU mode loads quantized weights without converting them (application_base.py to_cpu)",
)
_COMMON = {
    "contiguous": Support(EQUAL),
    "block": Support(EQUAL),
    "prefix_hit": Support(EQUAL),
    "on_device_sampling": Support(EQUAL),
    "speculation": _SPECULATION,
    "lora": _LORA,
    "quantization": _QUANTIZED,
}
_WINDOW_BLOCK = Support(
    EQUAL,
    "with max_model_len <= sliding_window (served as full attention); refused below it: "
    "NxDI's windowed attention keeps window - 1 keys that its block KV cache cannot write",
)
_GPT_OSS_BLOCK = Support(
    REFUSED,
    "NxDI's gpt-oss keeps its own per-sequence KV cache in any layout "
    "(GptOssKVCacheManager) and fails on a prefix-cache hit; serve it in the contiguous "
    "layout",
)
_SUPPORT_0_9: dict[str, dict[str, Support]] = {
    "LlamaForCausalLM": _COMMON,
    "Qwen2ForCausalLM": _COMMON,
    "Qwen3ForCausalLM": _COMMON,
    "MixtralForCausalLM": _COMMON,
    "DbrxForCausalLM": _COMMON,
    "Qwen3MoeForCausalLM": {
        **_COMMON,
        "contiguous": Support(
            EQUAL,
            "every layer MoE (a dense layer, mlp_only_layers, is refused); NxD's "
            "layer-boundary marker is the identity on the CPU",
        ),
    },
    "MistralForCausalLM": {
        **_COMMON,
        "block": _WINDOW_BLOCK,
        "prefix_hit": _WINDOW_BLOCK,
        "speculation": _WINDOWED_SPECULATION,
    },
    "Gemma3ForCausalLM": {
        **_COMMON,
        "contiguous": Support(EQUAL, "with the plugin's patches " + ", ".join(GEMMA3_PATCHES)),
        "speculation": _WINDOWED_SPECULATION,
    },
    "GptOssForCausalLM": {
        **_COMMON,
        "speculation": _WINDOWED_SPECULATION,
        "block": _GPT_OSS_BLOCK,
        "prefix_hit": _GPT_OSS_BLOCK,
        "quantization": Support(
            EQUAL, "openai's MXFP4 experts (NxDI dequantizes them at load); others untested"
        ),
    },
}


# NxDI 0.8 lists neither (utils/constants.py MODEL_TYPES; models.LISTED_FROM), and its
# LoraModelManager.add_adapter loads nothing (lora.py NxDILora.streams_adapters).
_NOT_LISTED_0_8 = Support(
    REFUSED, "not in NxDI 0.8's MODEL_TYPES (listed from 0.9, which supports Trn2 and newer only)"
)
_LORA_0_8 = Support(
    UNTESTED,
    "NxDI's CPU mode cannot run LoRA; NxDI 0.8 loads no adapter at run time (start "
    "adapters, lora_ckpt_paths, only)",
)
_SUPPORT_0_8 = {
    name: dict.fromkeys(FEATURES, _NOT_LISTED_0_8)
    if name in ("MistralForCausalLM", "Gemma3ForCausalLM")
    else {**table, "lora": _LORA_0_8}
    for name, table in _SUPPORT_0_9.items()
}
# release -> architecture -> feature -> status, each measured on that release.
SUPPORT: dict[str, dict[str, dict[str, Support]]] = {
    nxdi_releases.NXDI_0_8.release: _SUPPORT_0_8,
    nxdi_releases.NXDI_0_9.release: _SUPPORT_0_9,
}


def support(architecture: str, release: nxdi_releases.NxDIRelease) -> dict[str, str]:
    """Feature -> its status on the nxd backend with `release`, for the report of
    `architecture` (an architecture outside the table, e.g. a contrib model's:
    untested)."""
    unmapped = Support(UNTESTED, "not an architecture this plugin maps")
    table = SUPPORT[release.release].get(architecture, dict.fromkeys(FEATURES, unmapped))
    return {feature: table[feature].describe() for feature in FEATURES}


def explain(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    environ: Mapping[str, str],
    release: nxdi_releases.NxDIRelease,
) -> tuple[dict[str, str], list[str]]:
    """(the architecture's support table, this configuration's problems) with `release`
    (the instance family's), for `neuron-plugin explain-config`, without NxDI: the
    patches count as applied unless VLLM_NEURON_DISABLE_PATCHES switches them off."""
    from neuron_plugin.patches import disabled_patches

    status = dict.fromkeys(disabled_patches(environ), "disabled")
    found = problems(settings, hf_config, release.describe().removeprefix("NxDI "), status)
    table = SUPPORT[release.release].get(settings.architecture, {})
    if table.get("contiguous") is _NOT_LISTED_0_8:
        found.insert(
            0,
            f"{settings.architecture} on {release.describe()}: {_NOT_LISTED_0_8.note}; serve "
            f"it on trn2 with {nxdi_releases.NXDI_0_9.describe()}, or on the reference "
            f"backend (VLLM_NEURON_BACKEND=reference).",
        )
    return support(settings.architecture, release), found


def _layers(text: Mapping[str, Any]) -> int:
    return int(text.get("num_hidden_layers") or text.get("n_layers") or 0)


def transformers_windows(architecture: str, text: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it (None: full attention),
    from the reference backend's reading of transformers' rules."""
    from neuron_plugin.backends.reference.architectures import ARCHITECTURES, layer_windows

    layers = _layers(text)
    arch = ARCHITECTURES.get(architecture)
    return (None,) * layers if arch is None else layer_windows(arch, dict(text), layers)


def window_dropped(architecture: str, text: Mapping[str, Any], max_model_len: int) -> bool:
    """Whether the backend gives NxDI the config without its sliding window: the model
    reads one window for every layer and no sequence can be longer than it, so full
    attention is what transformers computes."""
    window = text.get("sliding_window")
    return architecture in WINDOW_FROM_CONFIG and window is not None and max_model_len <= window


def config_adjustments(settings: NeuronSettings, hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """InferenceConfig attributes the backend sets after NxDI built it (see
    `window_dropped`)."""
    text = text_config(dict(hf_config))
    if window_dropped(settings.architecture, text, settings.max_model_len):
        return {"sliding_window": None}
    return {}


def nxdi_windows(
    architecture: str, text: Mapping[str, Any], max_model_len: int
) -> tuple[int | None, ...]:
    """Each layer's sliding window as NxDI 0.9's model applies it (with the plugin's
    patches and adjustments): Llama and Mistral read config.sliding_window for every
    layer; gpt-oss windows its even layers (modeling_gpt_oss.py get_updated_configs);
    Gemma3 follows the checkpoint's layer types (patch gemma3-config); the attention of
    Mixtral, Qwen2, Qwen3, Qwen3-MoE and DBRX has no window."""
    layers = _layers(text)
    window = text.get("sliding_window")
    if architecture in WINDOW_FROM_CONFIG:
        dropped = window_dropped(architecture, text, max_model_len)
        return (None if dropped else window,) * layers
    if architecture == "GptOssForCausalLM":
        return tuple(window if i % 2 == 0 else None for i in range(layers))
    if architecture == "Gemma3ForCausalLM":
        return transformers_windows(architecture, text)
    return (None,) * layers


def problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    nxdi_version: str | None,
    patch_status: Mapping[str, str],
) -> list[str]:
    """Every reason this configuration would not give transformers' tokens on NxDI
    (see the module docstring); `patch_status` maps patch names to their outcome
    ("applied", "already applied", "not needed", "disabled")."""
    text = text_config(dict(hf_config))
    release = f"NxDI {nxdi_version or '(unknown version)'}"
    found = _window_problems(settings, text, release) + _windowed_block_problems(
        settings, text, release
    )
    if settings.architecture == "Qwen3MoeForCausalLM":
        found += _qwen3_moe_problems(text, release)
    if settings.architecture == "GptOssForCausalLM":
        found += _gpt_oss_problems(settings, hf_config, text, release)
    if settings.architecture == "Gemma3ForCausalLM":
        found += _gemma3_problems(settings, text, release, patch_status)
    return found


def _window_problems(settings: NeuronSettings, text: Mapping[str, Any], release: str) -> list[str]:
    theirs = transformers_windows(settings.architecture, text)
    ours = nxdi_windows(settings.architecture, text, settings.max_model_len)
    differ = [
        i
        for i, (t, n) in enumerate(zip(theirs, ours, strict=True))
        if t != n and min(w for w in (t, n) if w is not None) < settings.max_model_len
    ]
    if not differ:
        return []
    shortest = min(w for i in differ for w in (theirs[i], ours[i]) if w is not None)
    return [
        f"{settings.architecture} on {release}: layers {differ} have sliding windows "
        f"{[theirs[i] for i in differ]} in transformers but {[ours[i] for i in differ]} in "
        f"NxDI's model (None: all positions), so tokens differ once a sequence is longer "
        f"than {shortest} tokens; serve with --max-model-len {shortest} or less, or on the "
        f"reference backend (VLLM_NEURON_BACKEND=reference)."
    ]


def _windowed_block_problems(
    settings: NeuronSettings, text: Mapping[str, Any], release: str
) -> list[str]:
    if not settings.is_block_layout or settings.architecture not in WINDOW_FROM_CONFIG:
        return []
    window = nxdi_windows(settings.architecture, text, settings.max_model_len)[0]
    if window is None:
        return []
    return [
        f"{settings.architecture} with sliding_window={window} below max_model_len="
        f"{settings.max_model_len} in the block KV layout ({settings.kv_layout_reason}) on "
        f"{release}: its windowed attention keeps the last {window - 1} keys of a prefill "
        f"(attention_base.py windowed_attention_forward, get_last_kv_window), which "
        f"BlockKVCacheManager.update_cache cannot write (it fails for every prompt); serve "
        f"without --enable-prefix-caching and chunked prefill (contiguous layout), or with "
        f"--max-model-len {window} or less (then no key leaves the window and NxDI gets the "
        f"config without it)."
    ]


def _qwen3_moe_problems(text: Mapping[str, Any], release: str) -> list[str]:
    """transformers' Qwen3-MoE has a dense MLP in `mlp_only_layers` and off the
    `decoder_sparse_step` (Qwen3MoeDecoderLayer); NxDI's makes every layer a MoE layer."""
    step = text.get("decoder_sparse_step") or 1
    only = set(text.get("mlp_only_layers") or [])
    dense = [i for i in range(_layers(text)) if i in only or (i + 1) % step]
    if not dense:
        return []
    return [
        f"Qwen3MoeForCausalLM on {release}: layers {dense} have a dense MLP in transformers "
        f"(mlp_only_layers={sorted(only)}, decoder_sparse_step={step}), but NxDI's model "
        f"makes every layer a MoE layer and reads a router for each (modeling_qwen3_moe.py "
        f"convert_qwen3_moe_hf_to_neuron_state_dict): serve this checkpoint on the "
        f"reference backend (VLLM_NEURON_BACKEND=reference)."
    ]


# gpt-oss config values NxDI 0.9 hard-codes (modeling_gpt_oss.py GptOssInferenceConfig
# __init__, NeuronGptOssMoE.__init__), with transformers' defaults where the key is absent.
GPT_OSS_FIXED = {"rms_norm_eps": 1e-5, "swiglu_limit": 7.0}


def _gpt_oss_problems(
    settings: NeuronSettings,
    hf_config: Mapping[str, Any],
    text: Mapping[str, Any],
    release: str,
) -> list[str]:
    name = f"GptOssForCausalLM on {release}"
    found = []
    if settings.is_block_layout:
        found.append(
            f"{name} in the block KV layout ({settings.kv_layout_reason}): NxDI keeps its "
            f"own per-sequence KV cache whatever the layout (modeling_gpt_oss.py "
            f"NeuronGptOssModel.init_inference_optimization, GptOssKVCacheManager), so "
            f"block tables are never read, and a prefill over a cached prefix runs "
            f"token-generation attention (attention_base.py windowed_attention_forward: "
            f"is_token_gen = past_key_value is not None) and fails; serve without "
            f"--enable-prefix-caching and chunked prefill (contiguous layout)."
        )
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method != "mxfp4":
        found.append(
            f"{name}: the checkpoint's experts are not MXFP4 (quantization_config "
            f"quant_method {method!r}); NxDI reads them only as openai ships them, "
            f"`*_blocks` / `*_scales` (modeling_gpt_oss.py "
            f"convert_hf_format_state_dict_bf16_compute): serve openai's checkpoint, or "
            f"this one on the reference backend."
        )
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if rope.get("rope_type") != "yarn":
        found.append(
            f"{name}: rope type {rope.get('rope_type')!r}; NxDI computes gpt-oss's RoPE as "
            f"YaRN from rope_scaling (GptOssRotaryEmbedding): use openai's config."
        )
    initial = text.get("initial_context_length")
    if initial is None or initial != rope.get("original_max_position_embeddings"):
        found.append(
            f"{name}: initial_context_length={initial!r}, which NxDI's YaRN uses where "
            f"transformers uses rope_scaling.original_max_position_embeddings="
            f"{rope.get('original_max_position_embeddings')!r} (GptOssRotaryEmbedding); set "
            f"it to that value in config.json (openai's checkpoints have both equal)."
        )
    window = text.get("sliding_window")
    if window is not None and window % 128:
        found.append(
            f"{name}: sliding_window={window}; NxDI sizes the window's KV cache to the next "
            f"multiple of 128 and fails to load any other (gpt_oss_kv_cache_manager.py "
            f"_init_kv_shape, get_kernel_cache_size_bucket): use a window that is a "
            f"multiple of 128 (openai's is 128)."
        )
    for key, value in GPT_OSS_FIXED.items():
        if text.get(key, value) != value:
            found.append(
                f"{name}: {key}={text[key]!r}, which NxDI hard-codes as {value} "
                f"(modeling_gpt_oss.py); serve this checkpoint on the reference backend."
            )
    return found


def _gemma3_problems(
    settings: NeuronSettings,
    text: Mapping[str, Any],
    release: str,
    patch_status: Mapping[str, str],
) -> list[str]:
    name = f"Gemma3ForCausalLM on {release}"
    found = []
    disabled = [p for p in GEMMA3_PATCHES if patch_status.get(p) == "disabled"]
    if disabled:
        found.append(
            f"{name} without the plugin's patches {', '.join(disabled)} "
            f"(VLLM_NEURON_DISABLE_PATCHES): NxDI's Gemma3 then hard-codes the vocabulary, "
            f"RoPE and layer pattern (modeling_gemma3.py Gemma3InferenceConfig), reuses the "
            f"local layers' RoPE in global layers, attends all positions in local layers "
            f"and rounds norm weights to bfloat16, so its tokens are wrong; remove them "
            f"from VLLM_NEURON_DISABLE_PATCHES."
        )
    if settings.is_block_layout and patch_status.get("prefix-prefill-mask") == "disabled":
        found.append(
            f"{name} in the block KV layout without the prefix-prefill-mask patch: a "
            f"prefix-cache hit's local layers see their window only through that patch's "
            f"masked prefill; remove it from VLLM_NEURON_DISABLE_PATCHES."
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            found.append(
                f"{name}: {key}={text[key]!r}, which NxDI's Gemma3 does not apply "
                f"(modeling_gemma3.py); serve it on the reference backend."
            )
    rope = text.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type")) != "linear":
        found.append(
            f"{name}: rope_scaling {dict(rope)}; NxDI's Gemma3 scales RoPE linearly only "
            f"(RotaryEmbedding factor); serve it on the reference backend."
        )
    return found
