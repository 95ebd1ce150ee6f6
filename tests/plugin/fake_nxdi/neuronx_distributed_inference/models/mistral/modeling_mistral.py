"""NeuronMistralForCausalLM (in MODEL_TYPES from the ef2731e sync on): Llama's class
methods; the model reads `sliding_window` from its config (modeling_mistral.py line 161),
which the double's graphs honour as a rolling KV cache line (see _nxd_runtime)."""

from neuronx_distributed_inference.models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
)
from neuronx_distributed_inference.models.model_base import NeuronBaseModel


class NeuronMistralModel(NeuronBaseModel):
    """The decoder the application traces (ef2731e line 151)."""


class MistralInferenceConfig(LlamaInferenceConfig):
    pass


class NeuronMistralForCausalLM(NeuronLlamaForCausalLM):
    _model_cls = NeuronMistralModel  # ef2731e line 195

    @classmethod
    def get_config_cls(cls):
        return MistralInferenceConfig
