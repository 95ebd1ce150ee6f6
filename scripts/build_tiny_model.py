"""Build small, deterministic checkpoints of the mapped architectures for tests and the demo.

No model can be downloaded on the machines this project is built on, so the tests, the
demo and the benchmarks use checkpoints made here: random weights from a fixed seed and a
byte-level BPE tokenizer trained on `scripts/corpus/tiny_corpus.txt`. The output is a
normal Hugging Face folder (config.json, model.safetensors, tokenizer files) that both
`transformers` and vLLM load, with a chat template in tokenizer_config.json (as Hugging
Face chat checkpoints ship one) so `/v1/chat/completions` works without
`--chat-template`. Re-running with the same arguments leaves an existing folder
untouched (a stamp file records the recipe).

    python scripts/build_tiny_model.py --arch llama --out models/tiny-llama

With `--train-steps N` the weights are trained on the corpus until they memorise it
(`train_on_corpus`): the speculative-decoding tests and benchmark use such a target and a
one-layer draft trained the same way (`build_speculation_models`), so that
drafts get accepted as they do on real text (random weights accept almost none).

The other architectures the nxd backend maps (mistral, qwen2, mixtral, qwen3_moe, gemma3,
gpt_oss, dbrx) are tiny too: 16-token sliding windows, 4 experts top-2, and the
parameters transformers initialises to constants (norms, biases, sinks) randomised. They
are saved with save_pretrained (the Hub's tensor names, e.g. per-expert MoE weights) and
a config.json that transformers 4.57 and 5.x read alike (tests/e2e/test_architectures.py).
gpt-oss is written as openai ships it: its experts in MXFP4 (`*_blocks` / `*_scales`,
`quantization_config` quant_method mxfp4; neuron_plugin.core.mxfp4),
`initial_context_length`, and a 128-token window (NxDI sizes the window cache in
multiples of 128); gpt_oss_float is one with float experts and a 16-token window. The
variants mistral_wide, qwen3_moe_hub and gemma3_nxdi are shapes the real-NxDI checks
need (see ARCHITECTURES).

Vision-language checkpoints (qwen2_vl, qwen2_5_vl, qwen3_vl) carry their processor too: the tiny
tokenizer with Qwen2-VL's vision special tokens, a chat template that renders image
parts as Qwen2-VL's placeholder run, and preprocessor_config.json / chat_template.json
as the Hub's Qwen2-VL ships them, with pixel limits that keep images tiny (16 to 256
patches):

    python scripts/build_tiny_model.py --arch qwen2_vl --out models/tiny-qwen2_vl

pixtral is Pixtral in transformers' Llava format (as mistral-community/pixtral-12b) with
a PixtralProcessor's files: images up to 128 pixels a side (8 x 8 patches of 16).
llama4 is Llama4ForConditionalGeneration with every text feature at test lengths (NoPE
and RoPE layers, chunked attention over 16 tokens, temperature tuning, dense and MoE
layers; see LLAMA4) and a Llama4Processor's files: 56-pixel tiles, at most 4 an image.

A Qwen3-shaped checkpoint with Qwen3's real vocabulary (151,936 embedding rows; the
tokenizer stays the tiny one, as Qwen3's own 151,669-token tokenizer also leaves padding
rows) and one layer, for measurements where the vocabulary's size matters (sampling,
logits traffic):

    python scripts/build_tiny_model.py --arch qwen3 --layers 1 --model-vocab 151936 \
        --out models/qwen3-vocab151936
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from filelock import FileLock

from neuron_plugin.core.checkpoint import replacing_folder

CORPUS = Path(__file__).resolve().parent / "corpus" / "tiny_corpus.txt"
RECIPE_VERSION = 2  # 2: the tokenizer config carries CHAT_TEMPLATE
# Per-architecture recipe changes (absent: none, so other folders stay valid): gpt-oss 1,
# as openai ships it (MXFP4 experts, initial_context_length, a 128-token window).
REVISIONS = {"gpt_oss": 1}
QWEN3_VOCAB = 151_936  # Qwen3's embedding rows

# One turn per message: the role on its own line, the text, then the end-of-text token,
# which is also the model's EOS, so a generated reply stops at the end of its turn. With
# add_generation_prompt the prompt ends with an open assistant turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('chat template of the tiny models: role ' ~ message['role'] ~ "
    "' is not supported; use system, user or assistant') }}"
    "{%- endif %}"
    "{{- message['role'] ~ '\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant\\n' }}{%- endif %}"
)

_SMALL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "perturb": True,
}
_GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 1024,
}

_GEMMA4 = {
    **_SMALL,
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "sliding_window": 16,
    "global_head_dim": 64,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
}

# Small but structurally faithful: head_dim 64, GQA (2 KV heads for 4 query heads).
ARCHITECTURES: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
    },
    # The other architectures the nxd backend maps, small and fast: head_dim 32, GQA,
    # sliding windows of 16 tokens (test prompts exceed them), MoE with 4 experts top-2.
    # "perturb" (not a config key): transformers initialises norm weights, biases and
    # attention sinks to constants; random values make the tests check they are applied.
    "mistral": {
        **_SMALL,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 16,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        **_SMALL,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    "mixtral": {
        **_SMALL,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        **_SMALL,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "moe_intermediate_size": 128,
        "num_experts": 4,  # the Hub's key (transformers 5 saves num_local_experts)
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],  # one dense layer between MoE layers
        "decoder_sparse_step": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    "gemma3": {
        **_SMALL,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 16,
        "query_pre_attn_scalar": 24,  # not head_dim: the score scale must come from it
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        # transformers 5 reads rope_parameters; 4.57 rope_theta and rope_local_base_freq.
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "gpt_oss": {
        **_SMALL,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        # openai's window, a multiple of 128 as NxDI's window cache needs
        # (gpt_oss_kv_cache_manager.py _init_kv_shape sizes it to the next 128)
        "sliding_window": 128,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        # transformers 5 reads rope_parameters; 4.57 rope_theta and rope_scaling.
        "rope_theta": 150000.0,
        "rope_scaling": dict(_GPT_OSS_YARN),
        "rope_parameters": {**_GPT_OSS_YARN, "rope_theta": 150000.0},
        # openai's config keys: the YaRN base length under its own name (NxDI reads
        # it), and the experts' quantization (written by mxfp4_experts).
        "initial_context_length": _GPT_OSS_YARN["original_max_position_embeddings"],
        "mxfp4": True,  # not a config key: write the experts in MXFP4
    },
    # Variants for the checks against real NxDI (tests/e2e/test_nxdi_architectures.py):
    # Qwen3-MoE without dense layers (NxDI's has none); Mistral with Mistral-7B-v0.1's
    # window, wider than any test sequence; Gemma3 in the
    # shape NxDI 0.9 hard-codes (its vocabulary, every sixth layer global, a linear RoPE
    # factor of 8 on global layers; modeling_gemma3.py Gemma3InferenceConfig).
    "qwen3_moe_hub": {  # every layer MoE, as the Hub's Qwen3-MoE checkpoints
        **_SMALL,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    "mistral_wide": {
        **_SMALL,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "gemma3_nxdi": {
        **_SMALL,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": 262_208,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": 16,
        "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # Gemma 4's text model with every feature of the released configs at test sizes
    # (families/gemma4.py): sliding layers of head_dim 32 and 2 KV heads, full layers of
    # head_dim 64 with proportional RoPE and keys as values over 1 KV head, the last two
    # layers sharing earlier layers' keys and values (with the double-wide MLP),
    # per-layer embeddings, a 16-token window, soft-capped logits; written as the Hub's
    # configs are (global_head_dim, num_global_key_value_heads) beside transformers 5's
    # per_layer_config. "vocab_size_per_layer_input" None: the vocabulary's size.
    "gemma4": {
        **_GEMMA4,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": None,
        "use_double_wide_mlp": True,
    },
    # Gemma 4's MoE form (as 26B-A4B): a MoE block beside every dense MLP, no sharing or
    # per-layer embeddings.
    "gemma4_moe": {
        **_GEMMA4,
        "intermediate_size": 128,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 64,
        "hidden_size_per_layer_input": 0,
    },
    "dbrx": {
        "architectures": ["DbrxForCausalLM"],
        "model_type": "dbrx",
        "d_model": 128,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 4096,
        # transformers 4.57 reads attn_config.rope_theta, 5.x rope_parameters
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 500000.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "ffn_config": {
            "ffn_hidden_size": 128,
            "moe_num_experts": 4,
            "moe_top_k": 2,
            "moe_normalize_expert_weights": 1.0,
        },
        "tie_word_embeddings": False,
        "perturb": True,
    },
}
GPT_OSS_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
# gpt-oss with float experts (as transformers saves a dequantized one) and a 16-token
# window: vLLM serves MXFP4 checkpoints in bfloat16 only (GptOssMxfp4Config), whose
# rounding flips greedy tokens of a tiny random model, so the tests that compare tokens
# served through vLLM with transformers' float32 ones serve this one.
ARCHITECTURES["gpt_oss_float"] = {
    **{k: v for k, v in ARCHITECTURES["gpt_oss"].items() if k != "mxfp4"},
    "sliding_window": 16,
}
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
# transformers 4.x RoPE keys; 5.x takes rope_parameters instead.
LEGACY_KEYS = ("rope_theta", "rope_local_base_freq", "rope_scaling")


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the shipped corpus (deterministic for a fixed corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS)], trainer)
    return tokenizer


def _perturb_constants(model, seed: int) -> None:
    """Random offsets (std 0.1) on the parameters transformers initialises to constants:
    norm weights, biases, attention sinks, Gemma 4's router scales and its layers'
    layer_scalar (a buffer the checkpoint holds)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    constant = ("bias", "sinks", "scale", "per_expert_scale")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(constant):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.add_(0.1 * torch.randn(buffer.shape, generator=generator))


def recipe(
    arch: str,
    seed: int,
    vocab_size: int,
    max_positions: int,
    layers: int | None = None,
    model_vocab: int | None = None,
    train_steps: int = 0,
) -> dict:
    corpus_digest = __import__("hashlib").sha256(CORPUS.read_bytes()).hexdigest()
    shape = {
        k: v
        for k, v in (("layers", layers), ("model_vocab", model_vocab), ("train_steps", train_steps))
        if v
    }  # absent by default, so existing folders stay valid
    if arch in REVISIONS:
        shape["revision"] = REVISIONS[arch]
    return {
        "recipe_version": RECIPE_VERSION,
        "arch": arch,
        "seed": seed,
        "vocab_size": vocab_size,
        "max_positions": max_positions,
        "corpus_sha256": corpus_digest,
        **shape,
    }


def build(
    arch: str,
    out: Path,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    max_positions: int = 4096,
    layers: int | None = None,
    model_vocab: int | None = None,
    train_steps: int = 0,
) -> Path:
    """Write the checkpoint to `out` unless an identical one is already there.
    `vocab_size` sizes the trained tokenizer; `model_vocab` (default: the tokenizer's
    size) the embedding and output rows; `layers` overrides the architecture's depth;
    `train_steps` trains the weights on the corpus (see `train_on_corpus`)."""
    if arch not in ARCHITECTURES and arch not in VISION_LANGUAGE and arch not in OWN_WRITERS:
        known = sorted([*ARCHITECTURES, *VISION_LANGUAGE, *OWN_WRITERS])
        raise ValueError(f"--arch {arch!r} is not known; choose one of {known}")
    wanted = recipe(arch, seed, vocab_size, max_positions, layers, model_vocab, train_steps)
    with building(out, "tiny_model_recipe.json", wanted) as stale:
        if stale and arch in VISION_LANGUAGE:
            _write_vlm(arch, out, wanted, seed, vocab_size, max_positions)
        elif stale and arch in OWN_WRITERS:
            OWN_WRITERS[arch](out, wanted, seed, vocab_size, max_positions)
        elif stale:
            _write(
                arch, out, wanted, seed, vocab_size, max_positions, layers, model_vocab, train_steps
            )
    return out


@contextmanager
def building(out: Path, stamp_name: str, wanted: dict[str, Any]) -> Iterator[bool]:
    """Yields whether `out` must be (re)written: False when its stamp `stamp_name` says
    it holds what `wanted` describes. Builders of one folder take turns (parallel test
    workers share models/): the second finds the first's stamp."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        stamp = out / stamp_name
        yield not (stamp.exists() and json.loads(stamp.read_text()) == wanted)


def _write(
    arch: str,
    out: Path,
    wanted: dict[str, Any],
    seed: int,
    vocab_size: int,
    max_positions: int,
    layers: int | None,
    model_vocab: int | None,
    train_steps: int,
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer_core = train_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_core,
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fields = dict(ARCHITECTURES[arch])
    model_type = fields.pop("model_type")
    perturb = fields.pop("perturb", False)
    quantize = fields.pop("mxfp4", False)
    rows = model_vocab or fields.pop("vocab_size", None)  # the arch's own, if it has one
    if "vocab_size_per_layer_input" in fields and fields["vocab_size_per_layer_input"] is None:
        fields["vocab_size_per_layer_input"] = rows or len(tokenizer)
    # Keys transformers 5 renames or folds when it saves (rope_theta into rope_parameters,
    # num_experts into num_local_experts) are written into config.json as given too, so
    # transformers 4.57 (the Neuron SDK's) reads the same model.
    given = dict(fields)
    if "rope_parameters" in fields:
        for key in LEGACY_KEYS:
            fields.pop(key, None)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if model_vocab is not None and model_vocab < len(tokenizer):
        raise ValueError(
            f"--model-vocab {model_vocab} is below the tokenizer's "
            f"{len(tokenizer)} tokens; pass at least that many rows"
        )
    config = AutoConfig.for_model(
        model_type,
        **fields,
        vocab_size=rows or len(tokenizer),
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        # Larger than the usual 0.02 so greedy choices are well separated and float
        # rounding differences between implementations cannot flip an argmax.
        initializer_range=0.08,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if perturb:
        _perturb_constants(model, seed)
    if train_steps:
        train_on_corpus(model, tokenizer, train_steps, seed)

    with replacing_folder(out) as staging:
        # save_pretrained writes the Hub's tensor names and layout (transformers 5 keeps
        # MoE experts fused in memory and splits them back per expert when saving).
        model.save_pretrained(staging)
        saved = json.loads((staging / "config.json").read_text())
        saved.update({k: v for k, v in given.items() if k not in saved})
        if quantize:
            mxfp4_experts(staging)
            saved["quantization_config"] = dict(GPT_OSS_QUANTIZATION)
        if arch == "dbrx":  # as transformers 4.57 reads it (5.x reads it too)
            saved["attn_config"].setdefault("rope_theta", given["attn_config"]["rope_theta"])
            saved["ffn_config"].pop("hidden_size", None)  # 4.57 refuses the key
        (staging / "config.json").write_text(json.dumps(saved, indent=2) + "\n")
        # In tokenizer_config.json, where most Hugging Face checkpoints keep it.
        tokenizer.save_pretrained(staging, save_jinja_files=False)
        (staging / "tiny_model_recipe.json").write_text(json.dumps(wanted, indent=2))


def _write_vlm(
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
        arch,
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
        (staging / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        _write_chat_template_and_recipe(staging, VLM_CHAT_TEMPLATE, wanted)


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


# Architectures with a writer of their own (their config is not a VISION_LANGUAGE recipe).
OWN_WRITERS: dict[str, Callable[[Path, dict[str, Any], int, int, int], None]] = {
    "pixtral": _write_pixtral,
    "llama4": _write_llama4,
    "gemma4_mm": _write_gemma4_mm,
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
    _perturb_constants(model, seed)
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


def mxfp4_experts(folder: Path) -> None:
    """Replace the float expert weights in `folder`'s model.safetensors by openai's MXFP4
    `*_blocks` / `*_scales` (biases stay float), as gpt-oss checkpoints ship."""
    from safetensors.torch import load_file, save_file

    from neuron_plugin.core import mxfp4

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name))
        tensors[name + mxfp4.BLOCKS], tensors[name + mxfp4.SCALES] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})


def train_on_corpus(model, tokenizer, steps: int, seed: int) -> None:
    """Train `model` (next-token loss, AdamW) on random 64-token windows of the corpus.
    The corpus is small, so the model memorises it: its greedy continuation of corpus
    text is the corpus. That makes a stand-in for the workloads speculative decoding is
    for (an edit that copies most of its input, for prompt lookup; a draft model that
    agrees with the target) where random weights would accept almost no draft."""
    import torch

    ids = torch.tensor(tokenizer(CORPUS.read_text())["input_ids"])
    window, batch = 64, 16
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window, (batch,), generator=generator)
        inputs = torch.stack([ids[s : s + window] for s in starts.tolist()])
        model(inputs, labels=inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_speculation_models(models: Path) -> tuple[Path, Path]:
    """The speculative-decoding tests' and benchmark's target and one-layer draft, in
    `models`/tiny-mistral-{trained,draft}: Mistral's 16-token sliding window means the
    64-token training windows cover every attention distance, so the memorised
    continuation holds at any prompt length."""
    return (
        build("mistral", models / "tiny-mistral-trained", train_steps=80),
        build("mistral", models / "tiny-mistral-draft", seed=1, layers=1, train_steps=80),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", choices=sorted([*ARCHITECTURES, *VISION_LANGUAGE, *OWN_WRITERS]), default="llama"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the arch's)")
    parser.add_argument(
        "--model-vocab",
        type=int,
        help=f"embedding/output rows, e.g. {QWEN3_VOCAB} (Qwen3's); default: the tokenizer's size",
    )
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train on the corpus for this many steps (memorises it; see train_on_corpus)",
    )
    args = parser.parse_args(argv)
    path = build(
        args.arch,
        args.out,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_positions=args.max_positions,
        layers=args.layers,
        model_vocab=args.model_vocab,
        train_steps=args.train_steps,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
