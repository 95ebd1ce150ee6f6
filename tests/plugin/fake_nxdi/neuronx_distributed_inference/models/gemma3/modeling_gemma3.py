"""models/gemma3/modeling_gemma3.py of NxDI 0.9 (ef2731e) and of 0.8 (cd3abf3, which
ships it without listing it in MODEL_TYPES; 0.7 has no models/gemma3), the parts the
plugin's gemma3 patches meet, with each release's defects:
- NeuronGemma3RMSNorm: 0.9 declares the weight bfloat16 and multiplies by it (lines
  45-59); 0.8 declares it float32 and multiplies by 1 + weight (0.8 lines 44-58);
- get_rmsnorm_cls: 0.9 NeuronGemma3RMSNorm unless asked for the offset norm on the CPU
  (lines 62-66); 0.8 transformers' Gemma3RMSNorm (whose constructor takes `dim`) in NxD's
  CPU mode (`cpu_mode()`: NXD_CPU_MODE > 0, neuronx-distributed 73ab227
  utils/__init__.py lines 6-8), NeuronGemma3RMSNorm otherwise (0.8 lines 61-65);
- get_updated_configs (lines 69-92; 0.8 68-91): every sixth layer global ((i + 1) % 6),
  whatever the checkpoint's layer_types;
- Gemma3InferenceConfig.__init__ (lines 102-140; 0.8 101-138): after loading the
  checkpoint's config, fixed vocab_size, RoPE bases and factor, max_position_embeddings,
  pad_token_id, rms_norm_eps, hidden_act (0.8 lists no query_pre_attn_scalar among its
  attributes);
- NeuronGemma3Attention (lines 153-189; 0.8 151-189): the global or local RoPE by the
  layer config's sliding_window, the window given to NeuronAttentionBase (which then
  keeps no transposed K cache, attention_base.py line 238; 0.8 line 316), 0.9 the
  softmax scale sqrt(query_pre_attn_scalar), 0.8 none (its "TODO: Enable this": scores
  divided by sqrt(head_dim)); the q/k norms built with `hidden_size=`;
- NeuronGemma3DecoderLayer (lines 192-273; 0.8 192-266): the local mask only where the
  model passes one, the embedding scaled in layer 0, four norms, and the attention's
  cos/sin returned (handed to the next layer by model_base.py get_model_output);
- NeuronGemma3TextModel.setup_attr_for_model (lines 278-285; 0.8 271-278): no
  sliding_window;
- NeuronGemma3ForCausalLM.convert_hf_to_neuron_state_dict: 0.9 (lines 358-416) q_norm /
  k_norm renamed, 1 added to every norm weight in the checkpoint's dtype; 0.8 (lines
  321-353) q_norm / k_norm renamed only (its norms add the 1 themselves).
The attention's and the MLP's math run on the device (the double's runtime), not here:
calling them raises."""

import copy
import os

import torch
from torch import nn

from neuronx_distributed_inference._release import RELEASE

if RELEASE == "0.7":
    raise ImportError("NxDI 0.7 has no models/gemma3")

IS_0_8 = RELEASE == "0.8"

from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.model_base import (
    NeuronBaseForCausalLM,
    NeuronBaseModel,
)
from neuronx_distributed_inference.modules.attention.attention_base import NeuronAttentionBase


class NeuronGemma3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        dtype = torch.float32 if IS_0_8 else torch.bfloat16
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * ((1.0 + self.weight.float()) if IS_0_8 else self.weight.float())
        return output.type_as(x)


def cpu_mode():
    """neuronx_distributed.utils.cpu_mode (73ab227 utils/__init__.py lines 6-8)."""
    return int(os.environ.get("NXD_CPU_MODE", "0")) > 0


if IS_0_8:
    def get_rmsnorm_cls():
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

        return Gemma3RMSNorm if cpu_mode() else NeuronGemma3RMSNorm
else:
    def get_rmsnorm_cls(offset: bool = False):
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

        return Gemma3RMSNorm if (cpu_mode() and offset) else NeuronGemma3RMSNorm


def get_updated_configs(config):
    updated_configs = []
    for i in range(config.num_hidden_layers):
        updated_config = copy.deepcopy(config)
        swa_layer = (i + 1) % 6 != 0
        if not swa_layer:
            updated_config.sliding_window = None
        updated_configs.append(updated_config)
    return updated_configs


class Gemma3NeuronConfig(NeuronConfig):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attn_cls = NeuronGemma3Attention


class Gemma3InferenceConfig(InferenceConfig):
    def __init__(self, neuron_config, fused_spec_config=None, load_config=None):
        self.attributes = ["head_dim", "hidden_size", "intermediate_size",
                           "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                           "query_pre_attn_scalar", "sliding_window"]
        if IS_0_8:
            self.attributes.remove("query_pre_attn_scalar")
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        text_config = getattr(self, "text_config", None)
        if text_config is not None:
            for attribute in self.attributes:
                setattr(self, attribute, getattr(text_config, attribute))
        self.max_position_embeddings = 131072
        self.local_rope_theta = 10000.0
        self.rope_scaling = 8.0
        self.global_rope_theta = 1000000.0
        self.vocab_size = 262208
        self.pad_token_id = 0
        self.rms_norm_eps = 1e-06
        self.hidden_act = "gelu_pytorch_tanh"
        self.add_derived_config()
        self.validate_config()

    def add_derived_config(self):
        self.num_cores_per_group = 1

    def get_required_attributes(self):
        return self.attributes

    @classmethod
    def get_neuron_config_cls(cls):
        return Gemma3NeuronConfig


class RotaryEmbedding:
    """modules/attention/utils.py RotaryEmbedding's constructor: a linear factor divides
    the inverse frequencies."""

    def __init__(self, dim, max_position_embeddings=2048, base=10000, factor=None):
        self.dim, self.base, self.factor = dim, base, factor


class NeuronGemma3Attention(NeuronAttentionBase):
    def __init__(self, config):
        head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        local_rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings,
                                           base=config.local_rope_theta)
        global_rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings,
                                            base=config.global_rope_theta,
                                            factor=config.rope_scaling)
        sliding_window = config.sliding_window
        scale = {} if IS_0_8 else {"softmax_scale": config.query_pre_attn_scalar ** 0.5}
        super().__init__(
            num_key_value_groups=config.num_attention_heads // config.num_key_value_heads,
            head_dim=head_dim, **scale,
            k_cache_transposed=bool(getattr(config.neuron_config, "k_cache_transposed", False))
            and sliding_window is None)
        self.rotary_emb = global_rotary_emb if sliding_window is None else local_rotary_emb
        self.sliding_window = sliding_window
        self.attn_kernel_enabled = getattr(config.neuron_config, "attn_kernel_enabled", None)
        self.q_layernorm = get_rmsnorm_cls()(hidden_size=head_dim, eps=config.rms_norm_eps)
        self.k_layernorm = get_rmsnorm_cls()(hidden_size=head_dim, eps=config.rms_norm_eps)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("the double's attention math runs in its device runtime")


class _DeviceMLP(nn.Module):
    """NeuronLlamaMLP(config): its math runs on the device (the double's runtime)."""

    def forward(self, *args, **kwargs):
        raise NotImplementedError("the double's MLP math runs in its device runtime")


class NeuronGemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.is_sliding_window_attention = config.sliding_window is not None
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.query_pre_attn_scalar = config.query_pre_attn_scalar
        self.self_attn = NeuronGemma3Attention(config)
        self.mlp = _DeviceMLP()
        self.input_layernorm = get_rmsnorm_cls()(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = get_rmsnorm_cls()(config.hidden_size,
                                                          eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = get_rmsnorm_cls()(config.hidden_size,
                                                           eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = get_rmsnorm_cls()(config.hidden_size,
                                                            eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, local_mask=None, position_ids=None,
                past_key_value=None, adapter_ids=None, **kwargs):
        mask = local_mask
        if not self.is_sliding_window_attention or local_mask is None:
            mask = attention_mask
        if self.layer_idx == 0:
            hidden_states = hidden_states * (self.hidden_size ** 0.5)
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, present_key_value, cos_cache, sin_cache = self.self_attn(
            hidden_states=hidden_states, attention_mask=mask, position_ids=position_ids,
            past_key_value=past_key_value, adapter_ids=adapter_ids, **kwargs)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)[0]
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states, present_key_value, cos_cache, sin_cache, None)


class NeuronGemma3TextModel(NeuronBaseModel):
    def setup_attr_for_model(self, config):
        self.on_device_sampling = config.neuron_config.on_device_sampling_config is not None
        self.tp_degree = config.neuron_config.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size = config.neuron_config.max_batch_size
        self.buckets = config.neuron_config.buckets

    def init_model(self, config):
        self.layers = nn.ModuleList([NeuronGemma3DecoderLayer(conf, idx)
                                     for idx, conf in enumerate(get_updated_configs(config))])
        self.norm = get_rmsnorm_cls()(config.hidden_size, eps=config.rms_norm_eps)


class NeuronGemma3ForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronGemma3TextModel

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        if IS_0_8:
            for i in range(config.num_hidden_layers):
                prefix = f"layers.{i}.self_attn."
                state_dict[prefix + "q_layernorm.weight"] = (
                    state_dict.pop(prefix + "q_norm.weight").detach().clone())
                state_dict[prefix + "k_layernorm.weight"] = (
                    state_dict.pop(prefix + "k_norm.weight").detach().clone())
            return state_dict
        if "model.norm.weight" in state_dict.keys():
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        state_dict["norm.weight"] += 1.0
        for i in range(config.num_hidden_layers):
            prefix = f"layers.{i}."
            state_dict[prefix + "self_attn.q_layernorm.weight"] = (
                state_dict.pop(prefix + "self_attn.q_norm.weight").detach().clone())
            state_dict[prefix + "self_attn.k_layernorm.weight"] = (
                state_dict.pop(prefix + "self_attn.k_norm.weight").detach().clone())
            for norm in ("self_attn.k_layernorm", "self_attn.q_layernorm", "input_layernorm",
                         "post_attention_layernorm", "post_feedforward_layernorm",
                         "pre_feedforward_layernorm"):
                state_dict[f"{prefix}{norm}.weight"] += 1.0
        return state_dict

    @classmethod
    def get_config_cls(cls):
        return Gemma3InferenceConfig
