"""NeuronQwen3ForCausalLM and Qwen3InferenceConfig with NxDI's class methods."""

from neuronx_distributed_inference._release import QWEN3_FUSES_QKV
from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
from neuronx_distributed_inference.models.llama.modeling_llama import (
    convert_state_dict_to_fused_qkv,
)
from neuronx_distributed_inference.models.model_base import (
    NeuronBaseForCausalLM,
    NeuronBaseModel,
)


class Qwen3InferenceConfig(InferenceConfig):
    def get_required_attributes(self):
        return ["hidden_size", "num_attention_heads", "num_hidden_layers",
                "num_key_value_heads", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "hidden_act"]

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


class NeuronQwen3Model(NeuronBaseModel):
    """The decoder the application traces (ef2731e line 200)."""


class NeuronQwen3ForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronQwen3Model  # ef2731e line 243

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        """Llama's fused-QKV step (ef2731e lines 263-265); 0.7 and 0.8 fuse nothing for
        Qwen3 (QWEN3_FUSES_QKV)."""
        if QWEN3_FUSES_QKV and config.neuron_config.fused_qkv:
            state_dict = convert_state_dict_to_fused_qkv(state_dict, config)
        return state_dict

    @classmethod
    def get_config_cls(cls):
        return Qwen3InferenceConfig
