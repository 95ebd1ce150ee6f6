"""The vision-language models' recipes and writers: Qwen2-VL, Qwen2.5-VL and Qwen3-VL
(`VISION_LANGUAGE`, written by `write_vlm`), Pixtral in transformers' Llava format,
Llama 4, and Gemma 4's multimodal checkpoint (`OWN_WRITERS`), each with its processor's
files as the Hub ships them, written from their documented keys (transformers builds
their image processors only with torchvision, which the CPU test environment lacks)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import replacing_folder
from tiny_models.common import CHAT_TEMPLATE, perturb_constants, train_tokenizer
from tiny_models.text import _SMALL, ARCHITECTURES

# Vision-language models (issue 36): built by `_write_vlm`, not from ARCHITECTURES' flat
# keys. Qwen2-VL: a nested text_config (transformers 5's layout; 4.57 reads it too) with
# M-RoPE over head_dim 32, a two-block vision tower, and a processor whose pixel limits
# keep every image at 16 to 256 patches (4 to 64 placeholder tokens).
VISION_LANGUAGE: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "text_config": {
            **{k: v for k, v in _SMALL.items() if k != "perturb"},
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [4, 6, 6],
                "rope_theta": 1000000.0,
            },
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "depth": 2,
            "embed_dim": 64,
            "num_heads": 4,
            "mlp_ratio": 2,
            "hidden_size": 128,  # the text decoder's
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "processor": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64},
        "processor_class": "Qwen2VLProcessor",
    },
}
# The same Qwen2-VL (the same weights and tokenizer) with its processor saved as
# transformers 5's ProcessorMixin.save_pretrained saves it: processor_config.json holding
# the image and video processors' settings (`size` {shortest_edge, longest_edge}, no
# min_pixels / max_pixels), chat_template.jinja, and no preprocessor_config.json.
VISION_LANGUAGE["qwen2_vl_tf5"] = {
    **VISION_LANGUAGE["qwen2_vl"],
    "model_type": "qwen2_vl",
    "processor_format": "transformers5",
}
# Qwen2.5-VL: the same decoder; a vision tower with RMSNorms, gated MLPs and windows of
# 56 pixels (2x2 merge groups, so the tiny images span several) except in block 1.
VISION_LANGUAGE["qwen2_5_vl"] = {
    **VISION_LANGUAGE["qwen2_vl"],
    "vision_config": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "out_hidden_size": 128,  # the text decoder's
        "hidden_act": "silu",
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "processor_class": "Qwen2_5_VLProcessor",
}
# Qwen3-VL: a Qwen3 decoder (QK-norm) whose M-RoPE interleaves its three axes over head_dim
# 32, and a three-block vision tower with 16-pixel patches, a learned 8x8 position grid
# interpolated to each image, and DeepStack mergers after blocks 0 and 1 whose outputs
# join decoder layers 0 and 1. Its processor's pixel limits are the Hub's `size` keys:
# 16 to 256 patches again.
VISION_LANGUAGE["qwen3_vl"] = {
    "text_config": {
        **VISION_LANGUAGE["qwen2_vl"]["text_config"],
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
            "rope_theta": 5000000.0,
        },
    },
    "vision_config": {
        "depth": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "out_hidden_size": 128,  # the text decoder's
        "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "processor": {"size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64}},
    "processor_class": "Qwen3VLProcessor",
    "image_mean": [0.5, 0.5, 0.5],  # the Hub's Qwen3-VL preprocessor_config.json
    "image_std": [0.5, 0.5, 0.5],
}
# Pixtral as mistral-community/pixtral-12b ships it (transformers' Llava format): a Mistral
# decoder, a two-layer Pixtral vision tower of 16-pixel patches with 2-D RoPE, and a
# processor that scales an image's longest edge to at most 128 pixels (8 x 8 patches).
PIXTRAL: dict[str, Any] = {
    "text_config": {
        "model_type": "mistral",
        **{k: v for k, v in _SMALL.items() if k != "perturb"},
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "initializer_range": 0.08,
    },
    "vision_config": {
        "model_type": "pixtral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "patch_size": 16,
        "image_size": 128,  # the processor's longest_edge: RoPE's rows and columns
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        "initializer_range": 0.08,
    },
}
# Llama 4 (Llama4ForConditionalGeneration, as meta-llama/Llama-4-Scout ships it) with every
# text feature at test lengths: four layers, RoPE in 0-2 and NoPE in 3 (no_rope_layers),
# L2 qk-norm on the RoPE layers, attention temperature tuning on the NoPE layer from
# position 7 on (floor_scale 8), chunked local attention over 16 tokens on the RoPE layers,
# dense MLPs (intermediate_size_mlp) in layers 0 and 2 and MoE (4 experts top-1 as the
# Hub's, fused gate_up_proj, a shared expert) in 1 and 3, llama3 RoPE scaling. Its
# vision tower takes 56-pixel tiles of 14-pixel patches (16 patches, 4 tokens a tile
# after the 0.5 pixel shuffle), at most 4 tiles an image.
LLAMA4: dict[str, Any] = {
    "text_config": {
        **{k: v for k, v in _SMALL.items() if k != "perturb"},
        "num_hidden_layers": 4,
        "intermediate_size": 64,  # each expert's and the shared expert's
        "intermediate_size_mlp": 256,  # the dense layers'
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "no_rope_layers": [1, 1, 1, 0],
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8,
        "attn_scale": 0.5,
        "attention_chunk_size": 16,
        "rope_parameters": {  # all three of llama3's bands in head_dim 32
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 2048,
        },
        "tie_word_embeddings": False,
        "initializer_range": 0.08,
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 128,  # 4 x hidden_size: the pixel shuffle's output width
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "pixel_shuffle_ratio": 0.5,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "vision_output_dim": 64,
        "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": 0.08,
    },
    "max_patches": 4,  # tiles an image
}
LLAMA4_TOKENS = (
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eot|>",
)
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Pixtral's chat template: an image part is one [IMG], which the processor expands to
# the image's rows of [IMG] each closed by [IMG_BREAK] ([IMG_END] after the last).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# CLIP's normalisation, as Qwen2-VL's preprocessor_config.json has it
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
# CHAT_TEMPLATE with content as a string or as OpenAI parts: text parts as their text,
# image parts ({"type": "image"} or "image_url") as Qwen2-VL's placeholder run.
VLM_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('chat template of the tiny models: role ' ~ message['role'] ~ "
    "' is not supported; use system, user or assistant') }}"
    "{%- endif %}"
    "{{- message['role'] ~ '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] in ['image', 'image_url'] %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- else %}{{- raise_exception('chat template of the tiny models: content type ' ~ "
    "part['type'] ~ ' is not supported; use text or image parts') }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- eos_token ~ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant\\n' }}{%- endif %}"
)
PIXTRAL_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "[IMG]"
)
# Llama 4's turns (<|header_start|>role<|header_end|>, the text, <|eot|>, its EOS) with an
# image part as the processor's <|image|>, which it expands to the image's tiles.
LLAMA4_CHAT_TEMPLATE = (
    VLM_CHAT_TEMPLATE.replace(
        "{{- message['role'] ~ '\\n' }}",
        "{{- '<|header_start|>' ~ message['role'] ~ '<|header_end|>\\n\\n' }}",
    )
    .replace("<|vision_start|><|image_pad|><|vision_end|>", "<|image|>")
    .replace("{{- eos_token ~ '\\n' }}", "{{- '<|eot|>' }}")
    .replace("{{- 'assistant\\n' }}", "{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}")
)


def write_vlm(
    arch: str, out: Path, wanted: dict[str, Any], seed: int, vocab_size: int, max_positions: int
) -> None:
    """A vision-language checkpoint: the tiny tokenizer with the vision special tokens
    (the config's token ids point at them), random weights saved with save_pretrained
    (the Hub's tensor names: model.layers.*, visual.*, lm_head; Qwen3-VL's
    model.language_model.*, model.visual.*, lm_head), and the processor's
    files as the Hub's Qwen2-VL ships them (preprocessor_config.json, chat_template.json),
    written from their documented keys: transformers 5 builds a Qwen2VLProcessor only
    with torchvision (its video processor), which the CPU test environment lacks."""
    from transformers import AutoConfig

    recipe_fields = VISION_LANGUAGE[arch]
    tokenizer = _vlm_tokenizer(vocab_size, VLM_CHAT_TEMPLATE, VISION_TOKENS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    text = _vlm_text_config(recipe_fields["text_config"], tokenizer, max_positions)
    config = AutoConfig.for_model(
        recipe_fields.get("model_type", arch),
        text_config=text,
        vision_config=dict(recipe_fields["vision_config"]),
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
        initializer_range=0.08,
    )
    vision = recipe_fields["vision_config"]

    def rope_for_4_57(saved: dict[str, Any]) -> None:
        """transformers 4.57 reads RoPE from rope_theta / rope_scaling ("mrope" is its
        name for M-RoPE's default frequencies; Qwen3-VL's Hub configs say "default" and
        mrope_interleaved)."""
        rope = text["rope_parameters"]
        saved["text_config"]["rope_theta"] = rope["rope_theta"]
        saved["text_config"]["rope_scaling"] = (
            {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope.get("mrope_interleaved")
            else {"type": "mrope", "mrope_section": rope["mrope_section"]}
        )

    with _saving_vlm(out, config, seed, tokenizer, rope_for_4_57) as staging:
        preprocessor = {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": recipe_fields["processor_class"],
            **recipe_fields["processor"],
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"],
            "image_mean": recipe_fields.get("image_mean", IMAGE_MEAN),
            "image_std": recipe_fields.get("image_std", IMAGE_STD),
        }
        if recipe_fields.get("processor_format") == "transformers5":
            _write_transformers5_processor(staging, preprocessor, VLM_CHAT_TEMPLATE)
            (staging / "tiny_model_recipe.json").write_text(json.dumps(wanted, indent=2))
            return
        (staging / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        _write_chat_template_and_recipe(staging, VLM_CHAT_TEMPLATE, wanted)


# What transformers 5's Qwen2VLVideoProcessor saves beside the image processor's settings
# (its class defaults; the class needs torchvision, which the CPU test environment lacks)
QWEN2_VL_VIDEO = {
    "do_sample_frames": False,
    "max_frames": 768,
    "max_video_tokens": 128000,
    "min_frames": 4,
    "return_metadata": False,
    "video_processor_type": "Qwen2VLVideoProcessor",
}


def transformers5_processor_config(preprocessor: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2-VL processor's processor_config.json as transformers 5's
    `ProcessorMixin.save_pretrained` writes it, from the Hub's preprocessor_config.json
    keys: the image processor's settings (its own `to_dict`: transformers' PIL
    Qwen2VLImageProcessor, which folds min_pixels / max_pixels into `size`) and the
    video processor's, under their names."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    skip = ("processor_class", "image_processor_type")
    image = Qwen2VLImageProcessorPil(
        **{k: v for k, v in preprocessor.items() if k not in skip}
    ).to_dict()
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    return {
        "image_processor": image,
        "processor_class": preprocessor["processor_class"],
        "video_processor": {**video, **QWEN2_VL_VIDEO},
    }


def _write_transformers5_processor(
    staging: Path, preprocessor: dict[str, Any], chat_template: str
) -> None:
    """A Qwen2-VL processor's files as transformers 5's `ProcessorMixin.save_pretrained`
    writes them: processor_config.json (`transformers5_processor_config`), the chat
    template in chat_template.jinja, the tokenizer's config naming the processor class;
    no preprocessor_config.json. tests/e2e/test_vision_processor_formats.py checks the
    files equal what transformers 5 saves of the loaded processor."""
    processor = transformers5_processor_config(preprocessor)
    (staging / "processor_config.json").write_text(
        json.dumps(processor, indent=2, sort_keys=True) + "\n"
    )
    (staging / "chat_template.jinja").write_text(chat_template)
    tokenizer_config = json.loads((staging / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    tokenizer_config["processor_class"] = preprocessor["processor_class"]
    (staging / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n"
    )


def _write_pixtral(
    out: Path, wanted: dict[str, Any], seed: int, vocab_size: int, max_positions: int
) -> None:
    """Pixtral in transformers' Llava format (LlavaForConditionalGeneration, a pixtral
    vision_config; saved with the Hub's names: language_model.*, vision_tower.*,
    multi_modal_projector.*) and the files of a PixtralProcessor: the tiny tokenizer with
    Pixtral's image tokens, preprocessor_config.json saved by PixtralImageProcessor's PIL
    variant, processor_config.json and chat_template.json from their documented keys
    (transformers 5 builds a PixtralProcessor only with torchvision, as for Qwen2-VL)."""
    from transformers import AutoConfig
    from transformers.models.pixtral import PixtralImageProcessorPil

    tokenizer = _vlm_tokenizer(vocab_size, PIXTRAL_CHAT_TEMPLATE, PIXTRAL_TOKENS)
    text = {
        **_vlm_text_config(PIXTRAL["text_config"], tokenizer, max_positions),
        "tie_word_embeddings": False,
    }
    vision = PIXTRAL["vision_config"]
    config = AutoConfig.for_model(
        "llava",
        text_config=text,
        vision_config=dict(vision),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        dtype="float32",
        initializer_range=0.08,
    )
    patch = {"height": vision["patch_size"], "width": vision["patch_size"]}
    images = PixtralImageProcessorPil(size={"longest_edge": vision["image_size"]}, patch_size=patch)

    def rope_for_4_57(saved: dict[str, Any]) -> None:
        for part in ("text_config", "vision_config"):  # transformers 4.57's RoPE key
            saved[part]["rope_theta"] = PIXTRAL[part]["rope_parameters"]["rope_theta"]

    with _saving_vlm(out, config, seed, tokenizer, rope_for_4_57) as staging:
        images.save_pretrained(staging)
        preprocessor = json.loads((staging / "preprocessor_config.json").read_text())
        preprocessor["processor_class"] = "PixtralProcessor"
        (staging / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        processor = {
            "processor_class": "PixtralProcessor",
            "patch_size": vision["patch_size"],
            "spatial_merge_size": 1,
            "image_token": PIXTRAL_TOKENS[0],
            "image_break_token": PIXTRAL_TOKENS[1],
            "image_end_token": PIXTRAL_TOKENS[2],
        }
        (staging / "processor_config.json").write_text(json.dumps(processor, indent=2))
        _write_chat_template_and_recipe(staging, PIXTRAL_CHAT_TEMPLATE, wanted)


def _write_llama4(
    out: Path, wanted: dict[str, Any], seed: int, vocab_size: int, max_positions: int
) -> None:
    """Llama 4 (Llama4ForConditionalGeneration, saved with the Hub's names:
    language_model.model.*, language_model.lm_head, vision_model.*,
    multi_modal_projector.*; experts fused as gate_up_proj / down_proj) and the files of a
    Llama4Processor with a Llama4ImageProcessorFast, from their documented keys as the
    Hub's Llama 4 ships them (transformers builds that image processor only with
    torchvision, which the CPU test environment lacks)."""
    from transformers import AutoConfig

    tokenizer = _vlm_tokenizer(vocab_size, LLAMA4_CHAT_TEMPLATE, LLAMA4_TOKENS, eos_token="<|eot|>")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in LLAMA4_TOKENS}
    text = _vlm_text_config(LLAMA4["text_config"], tokenizer, max_positions)
    vision = LLAMA4["vision_config"]
    config = AutoConfig.for_model(
        "llama4",
        text_config=text,
        vision_config=dict(vision),
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],  # the Hub's: the image's features replace these
        tie_word_embeddings=False,
        dtype="float32",
        initializer_range=0.08,
    )

    def rope_for_4_57(saved: dict[str, Any]) -> None:
        """transformers 4.57 reads rope_theta and rope_scaling (Scout's config.json keys)."""
        for part in ("text_config", "vision_config"):
            rope = LLAMA4[part]["rope_parameters"]
            saved[part]["rope_theta"] = rope["rope_theta"]
        rope = LLAMA4["text_config"]["rope_parameters"]
        saved["text_config"]["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}

    with _saving_vlm(out, config, seed, tokenizer, rope_for_4_57) as staging:
        preprocessor = {  # the Hub's Llama 4 preprocessor_config.json, with tiny tiles
            "image_processor_type": "Llama4ImageProcessorFast",
            "processor_class": "Llama4Processor",
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "max_patches": LLAMA4["max_patches"],
            "resample": 2,
            "rescale_factor": 1 / 255,
            "resize_to_max_canvas": False,
            "size": {"height": vision["image_size"], "width": vision["image_size"]},
        }
        (staging / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        processor = {
            "processor_class": "Llama4Processor",
            "fake_image_token": "<|image|>",
            "image_token": "<|image|>",
            "patch_size": vision["patch_size"],
            "pixel_shuffle_ratio": vision["pixel_shuffle_ratio"],
        }
        (staging / "processor_config.json").write_text(json.dumps(processor, indent=2))
        _write_chat_template_and_recipe(staging, LLAMA4_CHAT_TEMPLATE, wanted)


def _write_gemma4_mm(
    out: Path, wanted: dict[str, Any], seed: int, vocab_size: int, max_positions: int
) -> None:
    """Gemma4ForConditionalGeneration with `gemma4`'s text model and no vision or audio
    tower, saved with the Hub's names (model.language_model.*): the multimodal
    checkpoint served text-only (--language-model-only)."""
    from transformers import AutoConfig

    tokenizer = _vlm_tokenizer(vocab_size, CHAT_TEMPLATE, ())
    fields = {k: v for k, v in ARCHITECTURES["gemma4"].items() if k not in ("perturb",)}
    fields.pop("architectures")
    fields["vocab_size_per_layer_input"] = len(tokenizer)
    text = _vlm_text_config(fields, tokenizer, max_positions)
    config = AutoConfig.for_model(
        "gemma4",
        text_config=text,
        vision_config=None,
        audio_config=None,
        tie_word_embeddings=True,
        dtype="float32",
        initializer_range=0.08,
    )
    with _saving_vlm(out, config, seed, tokenizer, lambda saved: None) as staging:
        (staging / "tiny_model_recipe.json").write_text(json.dumps(wanted, indent=2))


def _write_qwen3_5_mm(
    out: Path, wanted: dict[str, Any], seed: int, vocab_size: int, max_positions: int
) -> None:
    """Qwen3_5ForConditionalGeneration, as the Hub ships Qwen3.5's dense models, with
    `qwen3_5`'s text model and a one-block vision tower, saved with the Hub's names
    (model.language_model.*, model.visual.*): served text-only (--language-model-only)."""
    from transformers import AutoConfig

    tokenizer = _vlm_tokenizer(vocab_size, CHAT_TEMPLATE, ())
    fields = {k: v for k, v in ARCHITECTURES["qwen3_5"].items() if k != "perturb"}
    fields.pop("architectures")
    fields["model_type"] = "qwen3_5_text"
    text = _vlm_text_config(fields, tokenizer, max_positions)
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": text["hidden_size"],
        "num_position_embeddings": 64,
    }
    config = AutoConfig.for_model(
        "qwen3_5",
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        dtype="float32",
        initializer_range=0.08,
    )
    with _saving_vlm(out, config, seed, tokenizer, lambda saved: None) as staging:
        (staging / "tiny_model_recipe.json").write_text(json.dumps(wanted, indent=2))


# Architectures with a writer of their own (their config is not a VISION_LANGUAGE recipe).
OWN_WRITERS: dict[str, Callable[[Path, dict[str, Any], int, int, int], None]] = {
    "pixtral": _write_pixtral,
    "llama4": _write_llama4,
    "gemma4_mm": _write_gemma4_mm,
    "qwen3_5_mm": _write_qwen3_5_mm,
}


def _vlm_tokenizer(
    vocab_size: int,
    chat_template: str,
    special_tokens: Sequence[str],
    eos_token: str = "<|endoftext|>",
) -> Any:
    """The tiny tokenizer with a vision-language model's chat template and image tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(vocab_size),
        bos_token="<|bos|>",
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        chat_template=chat_template,
        additional_special_tokens=list(special_tokens),
    )


def _vlm_text_config(base: dict[str, Any], tokenizer: Any, max_positions: int) -> dict[str, Any]:
    """The language model's config: the recipe's, sized and tokened for `tokenizer`."""
    return {
        **base,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": max_positions,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


@contextmanager
def _saving_vlm(
    out: Path,
    config: Any,
    seed: int,
    tokenizer: Any,
    patch_config: Callable[[dict[str, Any]], None],
) -> Iterator[Path]:
    """Random weights of `config` (seeded, constants perturbed) saved with
    save_pretrained into `out`'s staging folder, config.json patched for transformers
    4.57 (the SDK environment's) by `patch_config`, and the tokenizer; the caller adds
    the processor's files before the folder replaces `out`."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    perturb_constants(model, seed)
    with replacing_folder(out) as staging:
        model.save_pretrained(staging)
        saved = json.loads((staging / "config.json").read_text())
        patch_config(saved)
        (staging / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
        tokenizer.save_pretrained(staging, save_jinja_files=False)
        yield staging


def _write_chat_template_and_recipe(
    staging: Path, chat_template: str, wanted: dict[str, Any]
) -> None:
    (staging / "chat_template.json").write_text(
        json.dumps({"chat_template": chat_template}, indent=2)
    )
    (staging / "tiny_model_recipe.json").write_text(json.dumps(wanted, indent=2))
