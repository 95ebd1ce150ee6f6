"""NeuronLlamaForCausalLM and LlamaInferenceConfig with NxDI's class methods."""

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


class NeuronLlamaForCausalLM(NeuronBaseForCausalLM):
    _model_cls = NeuronLlamaModel  # ef2731e line 1201

    @classmethod
    def get_config_cls(cls):
        return LlamaInferenceConfig
