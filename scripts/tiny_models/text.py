"""The text models' recipes (`ARCHITECTURES`: flat config.json keys per tiny checkpoint)
and their writer: random weights from a fixed seed saved with save_pretrained (the Hub's
tensor names), a config.json transformers 4.57 and 5.x read alike, and gpt-oss's experts
in MXFP4 as openai ships them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neuron_plugin.core.checkpoint import replacing_folder
from tiny_models.common import CHAT_TEMPLATE, perturb_constants, train_tokenizer
from tiny_models.training import train_on_corpus

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

# Qwen3.5's text model (families/qwen3_5.py) at test sizes: six layers, gated DeltaNet
# linear attention (2 key heads, 4 value heads of 32, a 4-tap causal convolution) beside
# gated full attention every third layer (4 query heads with their output gate, 2 KV
# heads, RoPE on a quarter of the head: partial_rotary_factor 0.25), norms of (1 +
# weight). Six layers, two of them full: vLLM groups the state layers two to a group, as
# it groups the Hub's models (16 full, 48 linear in 27B: three state groups of 16).
_QWEN3_5 = {
    **_SMALL,
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
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
    # window, wider than any test sequence, and in Mistral Small 3's shape (heads of 128
    # where hidden / heads is 160); Gemma3 in the
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
    "mistral_small": {  # Mistral Small 3's shape: head_dim apart from hidden / heads
        **_SMALL,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "head_dim": 48,
        "sliding_window": None,
        "rope_theta": 100000000.0,
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
    "qwen3_5": dict(_QWEN3_5),
    # Qwen3.5-MoE (as 35B-A3B): every layer's MLP a MoE block of 4 experts, top 2,
    # renormalised, beside a shared expert scaled by its sigmoid gate.
    "qwen3_5_moe": {
        **{k: v for k, v in _QWEN3_5.items() if k != "intermediate_size"},
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
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
# transformers 4.x RoPE keys; 5.x takes rope_parameters instead.
LEGACY_KEYS = ("rope_theta", "rope_local_base_freq", "rope_scaling")


def write_text(
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
        perturb_constants(model, seed)
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
