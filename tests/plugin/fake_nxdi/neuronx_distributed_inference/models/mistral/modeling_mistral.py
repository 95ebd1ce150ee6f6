"""NeuronMistralForCausalLM (in MODEL_TYPES from the ef2731e sync on): Llama's class
methods; the model reads `sliding_window` from its config (modeling_mistral.py line 161),
which the double's graphs honour as a rolling KV cache line (see _nxd_runtime)."""

from neuronx_distributed_inference.models.llama.modeling_llama import (
    LlamaInferenceConfig,
    NeuronLlamaForCausalLM,
)


class MistralInferenceConfig(LlamaInferenceConfig):
    pass


class NeuronMistralForCausalLM(NeuronLlamaForCausalLM):
    @classmethod
    def get_config_cls(cls):
        return MistralInferenceConfig
