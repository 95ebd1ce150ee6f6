"""MODEL_TYPES as in NxDI 0.7, reduced to the text models this double implements
(NxDI 0.7 has no "mistral" entry, which the plugin must report clearly)."""

from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM
from neuronx_distributed_inference.models.qwen3.modeling_qwen3 import NeuronQwen3ForCausalLM

MODEL_TYPES = {
    "llama": {"causal-lm": NeuronLlamaForCausalLM},
    "qwen3": {"causal-lm": NeuronQwen3ForCausalLM},
}
