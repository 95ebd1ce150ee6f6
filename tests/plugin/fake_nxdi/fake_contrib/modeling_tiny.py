"""A contrib model class: an NxDI application class outside NxDI's MODEL_TYPES."""

from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM


class NeuronTinyContribForCausalLM(NeuronLlamaForCausalLM):
    """Served for the architecture name the entry point registers."""


class NotAModel:
    """What a mistaken entry point might name."""
