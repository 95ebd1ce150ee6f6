"""NeuronLlamaForCausalLM and LlamaInferenceConfig with NxDI's class methods, and the
state-dict conversion the double reproduces (fused QKV)."""

import torch

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import (
    NeuronBaseForCausalLM,
    NeuronBaseModel,
)


class LlamaInferenceConfig(InferenceConfig):
    def get_required_attributes(self):
        return ["hidden_size", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "pad_token_id", "vocab_size",
                "max_position_embeddings", "rms_norm_eps", "hidden_act"]

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class NeuronLlamaModel(NeuronBaseModel):
    """The decoder the application traces (ef2731e line 1091)."""


def _concat_and_delete_qkv(state_dict, layer, attr):
    """_helper_concat_and_delete_qkv (ef2731e lines 171-188, cd3abf3 222-239): q, k and v
    concatenated into Wqkv, then deleted; a missing one raises KeyError."""
    names = [f"layers.{layer}.self_attn.{p}_proj.{attr}" for p in "qkv"]
    state_dict[f"layers.{layer}.self_attn.Wqkv.{attr}"] = torch.cat(
        [state_dict[name] for name in names])
    for name in names:
        del state_dict[name]


def convert_state_dict_to_fused_qkv(state_dict, cfg):
    """convert_state_dict_to_fused_qkv (ef2731e lines 191-205, cd3abf3 242-256): every
    layer's weights, and its scales where quantized (or quantized_mlp_kernel_enabled)
    unless the exact string f"layers.{l}.self_attn" is an element of
    modules_to_not_convert (a list lookup, not the substring match of quantize.convert)."""
    keep = getattr(cfg.neuron_config, "modules_to_not_convert", None) or []
    scaled = cfg.neuron_config.quantized_mlp_kernel_enabled or cfg.neuron_config.quantized
    for layer in range(cfg.num_hidden_layers):
        _concat_and_delete_qkv(state_dict, layer, "weight")
        if scaled and f"layers.{layer}.self_attn" not in keep:
            _concat_and_delete_qkv(state_dict, layer, "scale")
    return state_dict


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronLlamaModel  # ef2731e line 1201

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        """The fused-QKV step of ef2731e lines 1259-1260 (cd3abf3 1505-1506); the rest
        (rank_util tensors, gamma folding) the double does not reproduce."""
        if config.neuron_config.fused_qkv:
            state_dict = convert_state_dict_to_fused_qkv(state_dict, config)
        return state_dict

    @classmethod
    def get_config_cls(cls):
        return LlamaInferenceConfig
