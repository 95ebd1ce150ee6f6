"""Vision-language models on the nxd backend: NxDI's image-to-text application
(models/image_to_text_model_base.py `NeuronBaseForImageToText`, the same design in 0.8
cd3abf3 and 0.9 ef2731e), built from the plugin's settings and driven with the plugin's
own host-side image work (serving/images.py: encoder cache, placeholders, M-RoPE
positions and decode deltas), never through the models' own `forward`.

- The application holds a text pair (context encoding, token generation) and a vision
  encoder, each with its own NeuronConfig: the text one is the plugin's usual
  (`neuron_config.neuron_config_kwargs`), the vision one has one graph per plugin vision
  bucket (patches per image), batch 1, the text one's TP degree and dtype.
- Every wrapper runs with `pipeline_execution=False` (read at run time only,
  model_wrapper.py ModelWrapper._forward): a text wrapper with pipeline execution and
  `return_ranked_to_cpu` would return only its first output (tokens without logits),
  and the vision embeddings must come back to the host for vLLM's encoder cache.
- What NxDI's image-to-text applications cannot serve is refused before anything is
  built (`refuse_unsupported`).
- Every decode graph returns logits: NxDI's image-to-text text wrappers trace inputs for
  their own two submodels only, so the logits-free split of `graphs` is not made
  (NeuronSettings.token_generation_logits_shapes has no twins for a vision model, and
  core.settings refuses token_generation_logits_buckets for one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from neuron_plugin.backends.nxd import (
    llama4_vision,
    pixtral_vision,
    qwen2_vl_vision,
    qwen3_vl_vision,
)
from neuron_plugin.backends.nxd.families import NxDFamily, Problems, missing_patches
from neuron_plugin.backends.nxd.support import EQUAL, QUANTIZED, REFUSED, Support, by_release
from neuron_plugin.core.settings import NeuronConfigError, NeuronSettings
from neuron_plugin.core.vision import ImageInputs, VisionGeometry
from neuron_plugin.patches import i2t_capture_hook, vision_scatter

# An architecture's image encoding: (vision wrapper, image, vision bucket) -> embeddings
# [tokens, width] in the plugin's layout (core.vision.VisionGeometry.embedding_width).
Encoder = Callable[[Any, ImageInputs, int], np.ndarray]
ENCODERS: dict[str, Encoder] = {
    "Qwen3VLForConditionalGeneration": qwen3_vl_vision.encode,
    "Qwen2VLForConditionalGeneration": qwen2_vl_vision.encode,
    "Qwen2_5_VLForConditionalGeneration": qwen2_vl_vision.encode,
    "LlavaForConditionalGeneration": pixtral_vision.encode,
    "Llama4ForConditionalGeneration": llama4_vision.encode,
}
# The vision NeuronConfig keys an architecture's NxDI weights need: the Qwen3-VL and
# Qwen2-VL converters (Qwen2.5-VL's too) always write the vision attention's fused qkv
# (modeling_qwen3_vl_vision.py / modeling_qwen2_vl_vision.py
# convert_hf_to_neuron_state_dict: `.attn.qkv.` -> `.attn.qkv_proj.Wqkv.`). The Qwen2-VL
# family's encoders of the plugin's own pass their attention a mask, which NxDI's
# flash-attention kernel would take for a causal one (attention_base.py perform_prefill,
# chosen by default from 4096 patches on): the kernel is off.
_QWEN2_VL_VISION = {"fused_qkv": True, "attn_kernel_enabled": False}
VISION_KEYS: dict[str, dict[str, Any]] = {
    "Qwen3VLForConditionalGeneration": {"fused_qkv": True},
    "Qwen2VLForConditionalGeneration": _QWEN2_VL_VISION,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL_VISION,
}
# Patches per unit of NxDI's vision buckets where they are not patches (the plugin's
# unit): Llama 4 buckets its vision encoder by tiles (Llama4VisionModelWrapper).
BUCKET_UNITS: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "Llama4ForConditionalGeneration": lambda vision: llama4_vision.patches_per_tile(
        int(vision["image_size"]), int(vision["patch_size"])
    ),
}


def is_image_to_text(model_cls: Any, base_module: Any) -> bool:
    """Whether NxDI's class for the architecture is an image-to-text application
    (`base_module` None: the installed NxDI ships no such application)."""
    return (
        base_module is not None
        and isinstance(model_cls, type)
        and issubclass(model_cls, base_module.NeuronBaseForImageToText)
    )


def refuse_unsupported(settings: NeuronSettings) -> None:
    """What NxDI's image-to-text applications cannot run, each a clear error: the block
    KV layout and prefix caching (Qwen3VLInferenceConfig raises; the application's
    _get_model_outputs passes empty slot mappings and block tables), chunked prefill
    (refused by NeuronBaseForImageToText.__init__), speculation (fused: refused there;
    n-gram: no speculation submodel is built), LoRA (no adapter ids reach the text
    graphs), prompt logprobs (no prompt-logprob variant of an image-to-text wrapper),
    decode batch buckets (ImageToTextModelWrapper._forward_with_pad pads every decode to
    max_batch_size) and a context-encoding batch above 1 (encoder_utils
    .scatter_by_index_put flattens the batch: one row per call)."""
    name = settings.architecture
    checks: list[tuple[bool, str]] = [
        (
            settings.is_block_layout or settings.is_prefix_caching,
            f"the block KV layout / prefix caching (kv_layout={settings.kv_layout}, "
            f"prefix caching {settings.is_prefix_caching}): NxDI's image-to-text models "
            f"use the contiguous layout only; serve with --no-enable-prefix-caching and "
            f"no --block-size override",
        ),
        (
            settings.is_chunked_prefill,
            "chunked prefill: NeuronBaseForImageToText refuses it; serve with "
            "--no-enable-chunked-prefill (max_num_batched_tokens >= max_model_len)",
        ),
        (
            settings.speculation_method is not None,
            f"speculative decoding (method {settings.speculation_method!r}): NxDI builds "
            f"no speculation submodel for image-to-text models; remove "
            f"--speculative-config",
        ),
        (
            settings.max_loras > 0,
            f"LoRA (max_loras={settings.max_loras}): NxDI's image-to-text forward passes "
            f"no adapter ids to its text graphs; remove --enable-lora",
        ),
        (
            settings.prompt_logprobs is not None,
            f"prompt logprobs (prompt_logprobs={settings.prompt_logprobs}): the nxd "
            f"backend has no prompt-logprob graph for image-to-text models; remove "
            f"additional_config prompt_logprobs",
        ),
        (
            tuple(settings.token_generation_batches) != (settings.max_num_seqs,),
            f"decode batch buckets (token_generation_batches="
            f"{list(settings.token_generation_batches)}): NxDI's image-to-text wrapper "
            f"pads every decode to max_num_seqs; set override_neuron_config "
            f"max_batch_buckets: 1",
        ),
        (
            settings.ctx_batch_size != 1,
            f"ctx_batch_size={settings.ctx_batch_size}: NxDI merges image embeddings "
            f"into one row per context encoding (encoder_utils.scatter_by_index_put); "
            f"set override_neuron_config ctx_batch_size: 1",
        ),
    ]
    found = [why for refused, why in checks if refused]
    if found:
        raise NeuronConfigError(
            f"{name} on the nxd backend (NxDI's image-to-text application) cannot serve "
            + "; ".join(found)
            + "."
        )


def check_vision_fits(settings: NeuronSettings, hf_config: Mapping[str, Any]) -> None:
    """The largest vision bucket's image tokens fit the longest context encoding: an
    image that fills it could never be in a prompt (a graph compiled for nothing), and
    NxDI's Qwen3VLInferenceConfig asserts it (vision seq_len // spatial_merge_size**2 <=
    text max_context_length), an AssertionError otherwise."""
    geometry = VisionGeometry.from_hf_config(dict(hf_config))
    merge = geometry.spatial_merge_size if geometry else 1
    largest = max(settings.vision_buckets, default=0)
    if largest // (merge * merge) > settings.max_context_length:
        raise NeuronConfigError(
            f"override_neuron_config.vision_buckets has {largest} patches, "
            f"{largest // (merge * merge)} image tokens: more than the longest context "
            f"encoding ({settings.max_context_length} tokens) holds, so no image that "
            f"size fits a prompt of {settings.architecture}; use vision buckets of at "
            f"most {settings.max_context_length * merge * merge} patches (and lower the "
            f"processor's max_pixels to match), or raise --max-model-len."
        )


def vision_neuron_config_kwargs(
    settings: NeuronSettings, text_kwargs: dict[str, Any], hf_config: Mapping[str, Any]
) -> dict[str, Any]:
    """The vision encoder's NeuronConfig: one graph per plugin vision bucket (in NxDI's
    unit for the architecture, `BUCKET_UNITS`: patches per image for Qwen3-VL's and
    Pixtral's, which bucket on their sequence length in patches), one image per call,
    the text model's TP degree, dtype and CPU mode."""
    if not settings.vision_buckets:
        raise NeuronConfigError(
            f"{settings.architecture} on the nxd backend needs vision buckets "
            f"(settings.vision_buckets is empty); set override_neuron_config "
            f"vision_buckets, e.g. [256, 1024] (patches per image)."
        )
    unit = BUCKET_UNITS.get(settings.architecture)
    per = unit(hf_config["vision_config"]) if unit else 1
    buckets = sorted(b // per for b in settings.vision_buckets)
    shared = ("tp_degree", "torch_dtype", "on_cpu")
    return {
        **{key: text_kwargs[key] for key in shared if key in text_kwargs},
        "batch_size": 1,
        "seq_len": buckets[-1],
        "enable_bucketing": True,
        "buckets": buckets,
        **VISION_KEYS.get(settings.architecture, {}),
    }


def new_image_to_text(
    model_cls: Any,
    settings: NeuronSettings,
    text_kwargs: dict[str, Any],
    load_config: Callable[..., Any],
    model_dir: str,
    hf_config: Mapping[str, Any],
) -> Any:
    """NxDI's image-to-text application for the settings, every wrapper run eagerly
    on the host side (see the module docstring)."""
    refuse_unsupported(settings)
    neuron_config_cls = model_cls.get_neuron_config_cls()
    text = neuron_config_cls(**text_kwargs)
    vision = neuron_config_cls(**vision_neuron_config_kwargs(settings, text_kwargs, hf_config))
    config = model_cls.get_config_cls()(text, vision, load_config=load_config)
    return model_cls(model_dir, config)


def run_wrappers_on_the_host(model: Any) -> None:
    """pipeline_execution off on every text and vision wrapper (the module docstring)."""
    for wrapper in [*model.text_models, *model.vision_models]:
        wrapper.pipeline_execution = False


def encoder_for(architecture: str) -> Encoder:
    """The image encoding the nxd backend has for `architecture` (ENCODERS)."""
    encoder = ENCODERS.get(architecture)
    if encoder is None:
        raise NeuronConfigError(
            f"{architecture}: the nxd backend drives no vision encoder for it (it does for "
            f"{', '.join(sorted(ENCODERS))}); serve it with VLLM_NEURON_BACKEND=reference."
        )
    return encoder


# The plugin's patches without which no image-to-text application can be driven: it pads
# image positions with vision-scatter-scratch-row's scratch row, and NxDI 0.8's forward
# raises NameError without i2t-capture-hook.
PATCHES = (vision_scatter.NAME, i2t_capture_hook.NAME)
WITHOUT_PATCHES = (
    "NxDI's image merge would overwrite a full context bucket's last token, and NxDI 0.8's "
    "image-to-text forward raises NameError"
)


def family(
    model: str,
    no_blocks: str,
    images: str,
    patches: tuple[str, ...] = (),
    without: str = "",
    more_problems: Problems | None = None,
) -> NxDFamily:
    """The nxd family of a model NxDI serves as an image-to-text application (its
    families/ module's FAMILY): equal to transformers in the contiguous layout with
    `images`, on 0.8 and 0.9; the block layout refused (`no_blocks`: why), and so are
    LoRA and speculation (`refuse_unsupported`). `patches`: the model's own patches
    beside PATCHES, each needed too (`without`: what goes wrong without them);
    `more_problems`: what else it refuses."""
    refused = Support(REFUSED, f"NxDI's {model} takes the contiguous KV layout only ({no_blocks})")
    table = {
        "contiguous": Support(EQUAL, f"text and images ({images})"),
        "block": refused,
        "prefix_hit": refused,
        "on_device_sampling": Support(EQUAL),
        "speculation": Support(REFUSED, "NxDI's image-to-text application has no speculation"),
        "lora": Support(REFUSED, "NxDI's image-to-text forward passes no adapter ids"),
        "quantization": QUANTIZED,
    }
    consequence = f"{without}; {WITHOUT_PATCHES}" if without else WITHOUT_PATCHES
    missing = missing_patches((*patches, *PATCHES), consequence)

    def problems(
        settings: NeuronSettings,
        hf_config: Mapping[str, Any],
        text: Mapping[str, Any],
        release: str,
        patch_status: Mapping[str, str],
    ) -> list[str]:
        found = missing(settings, hf_config, text, release, patch_status)
        if more_problems is not None:
            found += more_problems(settings, hf_config, text, release, patch_status)
        return found

    return NxDFamily(support=by_release(table, table), problems=problems)
